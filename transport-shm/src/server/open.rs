//! Answering an Open: the registered, remote-accessible buffer holding the range, with its
//! memfd attached when it has one, or the device memory's chunks.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Weak;

use tern_memreg::shm::send_with_fds;

use super::device::share_device;
use super::{Conn, Owner};
use crate::pin::pin_range;
use crate::wire::{self, Frame, Opened};

/// Answers an Open: the region holding the range, with its memfd attached when it has one,
/// or, for device memory, the chunks of it the range touches with their IPC handles or
/// descriptors. The registry is read and the answer sent under the connection's lock, so a
/// revocation of the same buffer is ordered after it.
pub(super) fn open(owner: &Owner, conn: &Conn, id: u64, addr: u64, len: u64) -> Result<(), String> {
    let mut state = conn.state.lock();
    let found = pin_range(&owner.registry, addr, len);
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut memfd = None;
    let outcome = match &found {
        Err(reason) => Opened::Rejected(reason.clone()),
        Ok(pin) if pin.is_device() => match share_device(pin, addr, len) {
            Ok((outcome, chunk_fds)) => {
                fds = chunk_fds;
                outcome
            }
            Err(reason) => Opened::Declined {
                addr: pin.info().addr as u64,
                len: pin.info().len as u64,
                reason,
            },
        },
        Ok(pin) => {
            let info = pin.info();
            memfd = owner
                .memfds
                .lock()
                .get(&info.addr)
                .and_then(Weak::upgrade)
                .filter(|m| m.len() >= info.len);
            match &memfd {
                Some(memfd) => Opened::Memfd {
                    addr: info.addr as u64,
                    len: info.len as u64,
                    map_len: memfd.len() as u64,
                },
                None => Opened::Plain {
                    addr: info.addr as u64,
                    len: info.len as u64,
                },
            }
        }
    };
    let handed_out = memfd.is_some() || matches!(outcome, Opened::Device { .. });
    let bytes = Frame::Opened { id, outcome }.encode();
    let mut attached: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
    if let Some(memfd) = &memfd {
        attached.push(memfd.as_fd());
    }
    let sent = if attached.is_empty() {
        wire::send(&conn.stream, &bytes)
    } else {
        send_with_fds(&conn.stream, &bytes, &attached).and_then(|n| {
            if n < bytes.len() {
                wire::send(&conn.stream, &bytes[n..])
            } else {
                Ok(())
            }
        })
    };
    sent.map_err(|e| format!("opened: {e}"))?;
    if let (true, Ok(pin)) = (handed_out, &found) {
        state.mapped.insert(pin.info().addr);
    }
    Ok(())
}
