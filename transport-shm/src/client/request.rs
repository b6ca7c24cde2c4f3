//! Requests on a link and their answers: a request is sent with an ID and waits, bounded by
//! the I/O timeout, for the reader to settle its answer; an Open asks how the peer's buffer
//! holding a range is reached.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crossbeam_channel::{Receiver, Sender, bounded};
use tern_engine::{Slice, TransferError};

use super::mapping::Mapped;
use super::{Link, inside};
use crate::declines::DEVICE_PEER_DECLINED;
use crate::wire::{self, Frame};

/// What a request's waiter is told, decided by the reader thread in the order the frames
/// came (so a revocation that follows an open always finds its mapping).
#[derive(Debug)]
pub(super) enum Reply {
    Mapped(Arc<Mapped>),
    Plain,
    Rejected(String),
    /// The peer's answer is refused: the slice goes to the next transport.
    Refused(String),
    /// The peer's buffer is memory this transport does not carry: this slice goes to the
    /// next transport; the link stays good for other buffers.
    Declined(String),
    /// The peer's device buffer: its chunks are mapped.
    Device,
    Leased(Vec<bool>),
}

/// A request waiting for its reply: an open carries what its answer must satisfy.
#[derive(Debug)]
pub(super) struct Pending {
    pub(super) reply: Sender<Reply>,
    pub(super) open: Option<OpenCheck>,
}

/// What an Opened answer must satisfy: a buffer the peer published, holding the range.
#[derive(Debug)]
pub(super) struct OpenCheck {
    pub(super) addr: u64,
    pub(super) len: u64,
    published: Vec<(u64, u64)>,
}

impl OpenCheck {
    /// Whether the answered buffer `[addr, addr + len)` is one the peer published and holds
    /// the range asked for.
    pub(super) fn admits(&self, addr: u64, len: u64) -> bool {
        inside(self.addr, self.len, addr, len) && self.published.contains(&(addr, len))
    }
}

/// How an Open found the peer's buffer is reached.
pub(super) enum Way {
    Mapped(Arc<Mapped>),
    Plain,
    Device,
}

/// Why an Open did not give a way to the bytes.
pub(super) enum Refusal {
    Fail(TransferError),
    Decline(String),
    /// The peer's buffer is device memory this link cannot reach: why (for the stats), and
    /// the detail.
    Device(&'static str, String),
}

impl Link {
    /// Sends `frame` (whose ID is `id`) and returns a receiver for its reply.
    pub(super) fn ask(
        &self,
        id: u64,
        frame: &Frame,
        open: Option<OpenCheck>,
    ) -> Result<Receiver<Reply>, TransferError> {
        if !self.alive.load(Ordering::Acquire) {
            return Err(self.gone());
        }
        let (tx, rx) = bounded(1);
        self.pending.lock().insert(id, Pending { reply: tx, open });
        let sent = {
            let _send = self.send.lock();
            wire::send(&self.stream, &frame.encode())
        };
        if let Err(e) = sent {
            self.pending.lock().remove(&id);
            return Err(TransferError::Connection {
                peer: self.peer.clone(),
                message: format!("writing to its socket: {e}"),
            });
        }
        Ok(rx)
    }

    pub(super) fn wait(&self, id: u64, rx: &Receiver<Reply>) -> Result<Reply, TransferError> {
        rx.recv_timeout(self.io_timeout).map_err(|_| {
            // No answer in time, or the link ended: forget the request.
            self.pending.lock().remove(&id);
            if self.alive.load(Ordering::Acquire) {
                TransferError::Connection {
                    peer: self.peer.clone(),
                    message: format!("no answer on its socket within {:?}", self.io_timeout),
                }
            } else {
                self.gone()
            }
        })
    }

    /// Asks the peer how to reach the buffer holding `[addr, addr + len)` (the slice's
    /// range, or the rest of it): a mapping (memfd), plain memory, device memory (its chunks
    /// now mapped), or a refusal.
    pub(super) fn open(&self, slice: &Slice, addr: u64, len: u64) -> Result<Way, Refusal> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let check = OpenCheck {
            addr,
            len,
            published: slice
                .peer()
                .desc
                .buffers
                .iter()
                .map(|b| (b.addr, b.length))
                .collect(),
        };
        let rx = self
            .ask(id, &Frame::Open { id, addr, len }, Some(check))
            .map_err(Refusal::Fail)?;
        match self.wait(id, &rx).map_err(Refusal::Fail)? {
            Reply::Mapped(mapped) => Ok(Way::Mapped(mapped)),
            Reply::Plain => Ok(Way::Plain),
            Reply::Device => Ok(Way::Device),
            Reply::Rejected(reason) => {
                tracing::debug!("shm peer {} rejected a range: {reason}", self.peer);
                Err(Refusal::Fail(TransferError::RemoteRejected {
                    peer: self.peer.clone(),
                    addr,
                    len: len as usize,
                }))
            }
            Reply::Refused(why) => {
                tracing::warn!("shm peer {}: {why}", self.peer);
                *self.refusal.lock() = Some(why.clone());
                Err(Refusal::Decline(why))
            }
            Reply::Declined(why) => {
                let reason = self.declined_why(addr, len).unwrap_or(DEVICE_PEER_DECLINED);
                Err(Refusal::Device(reason, why))
            }
            Reply::Leased(_) => Err(Refusal::Decline(
                "the peer answered an open with a lease".into(),
            )),
        }
    }

    /// Settles a slice whose Open was refused: failed, declined to the next transport, or
    /// declined and counted as device memory this link cannot reach.
    pub(super) fn refused(&self, slice: Slice, refusal: Refusal) {
        match refusal {
            Refusal::Fail(e) => slice.fail(e),
            Refusal::Decline(why) => slice.decline(&why),
            Refusal::Device(reason, why) => {
                self.device_declines.decline(slice, reason, Some(&why));
            }
        }
    }
}
