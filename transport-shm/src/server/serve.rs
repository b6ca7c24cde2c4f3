//! The frames of an admitted peer: the welcome, then its Opens, Leases, Releases and the
//! confirmations of revocations, until it leaves.

use std::os::unix::net::UnixStream;

use tern_metadata::net::Served;

use super::admit::{Admitted, admit};
use super::lease::Leases;
use super::{Conn, Owner, open};
use crate::identity::VERSION;
use crate::wire::{self, Frame, NONCE_LEN};

/// Serves one peer until it leaves (`Ok`) or misbehaves (`Err(reason)`, which it is told).
pub(super) fn serve(owner: &Owner, conn: &Conn, served: &Served<UnixStream>) -> Result<(), String> {
    let Some(Admitted { mut reader, nonce }) = admit(owner, conn, served)? else {
        return Ok(());
    };
    let stream = &served.stream;
    // The peer reads the nonce back from here by cross-memory attach, if the kernel lets
    // it: that proves which process it reached. It lives as long as the connection.
    let probe: Box<[u8; NONCE_LEN]> = Box::new(nonce);
    let welcome = Frame::Welcome {
        version: VERSION as u16,
        probe_addr: probe.as_ptr() as u64,
        segment: owner.segment.clone(),
    };
    {
        let _state = conn.state.lock();
        wire::send(&conn.stream, &welcome.encode()).map_err(|e| format!("welcome: {e}"))?;
    }
    stream
        .set_read_timeout(None)
        .map_err(|e| format!("setting up the connection: {e}"))?;
    let mut leases = Leases::new(owner.max_leases);
    loop {
        let frame = match reader.next(stream) {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(e) => return Err(e.to_string()),
        };
        match frame {
            Frame::Open { id, addr, len } => open::open(owner, conn, id, addr, len)?,
            Frame::Lease { id, ranges } => {
                let granted = leases.grant(&owner.registry, id, &ranges)?;
                let _state = conn.state.lock();
                wire::send(&conn.stream, &Frame::Leased { id, granted }.encode())
                    .map_err(|e| format!("leased: {e}"))?;
            }
            Frame::Release { id } => {
                leases.release(id);
            }
            Frame::Revoked { id } => {
                let mut state = conn.state.lock();
                state.revoking.remove(&id);
                conn.changed.notify_all();
            }
            other => return Err(format!("unexpected frame {other:?}")),
        }
    }
    drop(probe);
    Ok(())
}
