//! The link's reader: the one thread that reads the peer's frames, in order. It settles each
//! answer (checked against what was asked and what the peer published) before its waiter
//! sees it, confirms revocations once the buffer is unmapped, and ends the link when the
//! socket does.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use super::Link;
use super::request::{Pending, Reply};
use crate::declines::DEVICE_PEER_DECLINED;
use crate::wire::{self, Frame, FrameReader, Opened};

impl Link {
    pub(super) fn read_loop(self: &Arc<Self>, stream: &UnixStream, mut reader: FrameReader) {
        let why = loop {
            match reader.next(stream) {
                Ok(Some(Frame::Revoke { id, addr })) => {
                    self.unmap(addr);
                    let _send = self.send.lock();
                    if let Err(e) = wire::send(&self.stream, &Frame::Revoked { id }.encode()) {
                        break format!("confirming a revocation: {e}");
                    }
                }
                Ok(Some(Frame::Opened { id, outcome })) => {
                    let fds = (0..outcome.descriptors())
                        .map_while(|_| reader.take_fd())
                        .collect();
                    self.opened(id, outcome, fds);
                }
                Ok(Some(Frame::Leased { id, granted })) => {
                    if let Some(pending) = self.pending.lock().remove(&id) {
                        let _ = pending.reply.send(Reply::Leased(granted));
                    }
                }
                Ok(Some(Frame::Refused { reason })) => {
                    break format!("the peer refused us: {reason}");
                }
                Ok(Some(other)) => break format!("the peer sent {other:?} out of turn"),
                Ok(None) => break "the peer closed its socket (it exited or shut down)".into(),
                Err(e) => break format!("its socket failed: {e}"),
            }
        };
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.end(&why);
    }

    /// Settles an Opened answer: checks it against what was asked and what the peer
    /// published, adopts and maps a memfd, and tells the waiter.
    fn opened(&self, id: u64, outcome: Opened, mut fds: Vec<OwnedFd>) {
        let Some(Pending {
            reply,
            open: Some(check),
        }) = self.pending.lock().remove(&id)
        else {
            return;
        };
        let answer = match outcome {
            Opened::Rejected(reason) => Reply::Rejected(reason),
            Opened::Declined { addr, len, reason } => {
                // Once per buffer (its later slices find it declined): the peer's words say
                // what its driver refused, a handle type, say.
                tracing::warn!(
                    "shm peer {}: {DEVICE_PEER_DECLINED} [{addr:#x}, +{len}): {reason}",
                    self.peer
                );
                self.declined.lock().push((addr, len, DEVICE_PEER_DECLINED));
                Reply::Declined(reason)
            }
            Opened::Device {
                addr, len, chunks, ..
            } if !check.admits(addr, len) || chunks.is_empty() => Reply::Refused(format!(
                "the peer offered device memory [{addr:#x}, +{len}) in {} chunks, which is not \
                 a buffer it published holding [{:#x}, +{}]",
                chunks.len(),
                check.addr,
                check.len
            )),
            Opened::Device {
                addr,
                len,
                bus_id,
                chunks,
            } => self.map_device(addr, len, &bus_id, chunks, fds),
            Opened::Plain { addr, len } if check.admits(addr, len) => {
                self.plain.lock().push((addr, len));
                Reply::Plain
            }
            Opened::Plain { addr, len } => Reply::Refused(format!(
                "the peer offered [{addr:#x}, +{len}), which is not a buffer it published \
                 holding [{:#x}, +{})",
                check.addr, check.len
            )),
            Opened::Memfd { addr, len, map_len } => match fds.pop() {
                None => Reply::Refused("the peer sent a memfd answer without a descriptor".into()),
                Some(_) if !check.admits(addr, len) || map_len < len => Reply::Refused(format!(
                    "the peer offered a memfd for [{addr:#x}, +{len}) ({map_len} bytes), which \
                     is not a buffer it published holding [{:#x}, +{}]",
                    check.addr, check.len
                )),
                Some(fd) => self.map(addr, len, fd),
            },
        };
        let _ = reply.send(answer);
    }
}
