//! What one lane has taken on, how much it may, and the loop that runs it over a connection.

use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TryRecvError};
use tern_engine::{Opcode, Slice, TransferError};
use tern_memreg::{Stage, wait_ready};

use super::cut_off::CutOff;
use super::marks::ShortCalls;
use super::pool::PoolShared;
use super::receive::Awaiting;
use super::send::{Framed, Sending};

/// Most requests one lane has on its connection at once.
pub(super) const PIPELINE_SLICES: usize = 32;
/// Most bytes one lane has on its connection at once (but two requests, whatever their
/// size): bytes in flight wait in the socket buffers, and beyond what keeps the connection
/// busy they only fall out of cache. Tuned by alternating runs; the README says how.
const PIPELINE_BYTES: usize = 2 << 20;
/// Most bytes of writes one lane has on its connection at once (but two writes, whatever
/// their size). A write's bytes wait in the two socket buffers on their way, and fewer of
/// them in flight keeps them in cache. Reads keep the deeper pipeline: their headers go out
/// together, and a shallower one cost them. 1 MiB, not 512 KiB: merged runs of KV pages are
/// 128 KiB writes, and with four of them in flight a lane waited on round trips (KV-shaped
/// pages in runs of 8 over TCP, six paired rounds each: 0.84 of the 1 MiB requests' speed
/// with 512 KiB, 0.94 with 1 MiB; 64 KiB writes at batch 128 moved 4.27 and 4.26 GB/s).
const WRITE_PIPELINE_BYTES: usize = 1 << 20;

/// Longest a lane waits in poll(2) before it looks whether it was asked to cut off slices of
/// ended tasks: the bound on how long a cut-off takes to reach a lane waiting on a peer that
/// sends nothing.
pub(super) const CUT_CHECK: Duration = Duration::from_millis(5);

/// What one lane has taken on: requests to send, the one being sent, and those awaiting
/// replies, oldest first.
#[derive(Debug, Default)]
pub(super) struct Window {
    pub(super) queued: VecDeque<Slice>,
    /// Headers of reads that await replies, not all on the wire yet (kept for reuse).
    pub(super) read_headers: Vec<u8>,
    pub(super) read_headers_sent: usize,
    pub(super) sending: Option<Sending>,
    pub(super) awaiting: VecDeque<Awaiting>,
    pub(super) bytes: usize,
    /// Writes in the window, and their bytes.
    pub(super) writes: usize,
    pub(super) write_bytes: usize,
    /// The directions in which a call could now only say `WouldBlock` (see `marks`).
    pub(super) marks: ShortCalls,
    /// The pool's cut-off count this lane last acted on.
    pub(super) seen_cut: u64,
    /// How many of the slices at the front of `queued` were on a connection a cut-off
    /// dropped: bytes of such a write may have left.
    pub(super) resent: usize,
    /// Pinned buffers through which device memory reaches the socket.
    pub(super) stage: Stage,
    /// Headers of the queued writes gathered behind the one being sent (kept for reuse).
    pub(super) gathered: Vec<Framed>,
}

/// How a lane's run over its connection ended.
pub(super) enum RunEnd {
    /// The window emptied; the connection is still good.
    Emptied,
    /// The connection broke; what was on it failed.
    Broken,
    /// The connection was dropped to cut off slices of ended tasks.
    CutOff(CutOff),
}

/// How one pass over the connection went.
pub(super) enum Step {
    /// Something moved.
    Moved,
    /// Nothing could move without waiting.
    Blocked,
}

impl Window {
    pub(super) fn is_empty(&self) -> bool {
        self.queued.is_empty() && self.sending.is_none() && self.awaiting.is_empty()
    }

    pub(super) fn count(&self) -> usize {
        self.queued.len() + usize::from(self.sending.is_some()) + self.awaiting.len()
    }

    fn room(&self) -> bool {
        let count = self.count();
        count < PIPELINE_SLICES
            && (self.bytes < PIPELINE_BYTES || count < 2)
            && (self.write_bytes < WRITE_PIPELINE_BYTES || self.writes < 2)
    }

    /// A slice leaves the window (moved, failed or abandoned).
    pub(super) fn leave(&mut self, slice: &Slice) {
        self.bytes -= slice.len;
        if slice.opcode() == Opcode::Write {
            self.writes -= 1;
            self.write_bytes -= slice.len;
        }
    }

    /// Takes a slice into the window (or settles it at once if it should not run).
    pub(super) fn take(&mut self, shared: &PoolShared, slice: Slice) {
        if shared.stop.load(Ordering::Acquire) {
            slice.fail_unsent(TransferError::Dropped("TCP transport shut down".into()));
        } else if slice.is_live() {
            self.bytes += slice.len;
            if slice.opcode() == Opcode::Write {
                self.writes += 1;
                self.write_bytes += slice.len;
            }
            self.queued.push_back(slice);
        } else {
            slice.abandon();
        }
    }

    /// Takes queued slices while there is room.
    pub(super) fn fill(&mut self, shared: &PoolShared, receiver: &Receiver<Slice>) {
        while self.room() {
            match receiver.try_recv() {
                Ok(slice) => self.take(shared, slice),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
    }

    /// The front of the queue, to send now; a slice of an ended task is given back instead
    /// (None then, with the queue not empty).
    pub(super) fn pop_queued(&mut self) -> Option<Option<Slice>> {
        let resent = self.resent > 0;
        self.resent = self.resent.saturating_sub(1);
        let slice = self.queued.pop_front()?;
        if slice.is_live() {
            return Some(Some(slice));
        }
        self.leave(&slice);
        if resent {
            // It was on a connection a cut-off dropped: a write's bytes may have left.
            slice.cut_off(true);
        } else {
            slice.abandon();
        }
        Some(None)
    }

    pub(super) fn fail_all(&mut self, error: impl Fn() -> TransferError) {
        self.settle();
        let sending = self.sending.take().map(|s| s.slice);
        let awaiting = self.awaiting.drain(..).map(|a| a.slice);
        let resent = std::mem::take(&mut self.resent).min(self.queued.len());
        let on_the_wire = awaiting
            .chain(sending)
            .chain(self.queued.drain(..resent))
            .collect::<Vec<_>>();
        for slice in on_the_wire {
            slice.fail(error());
        }
        for slice in self.queued.drain(..) {
            slice.fail_unsent(error());
        }
        self.read_headers.clear();
        self.read_headers_sent = 0;
        self.bytes = 0;
        self.writes = 0;
        self.write_bytes = 0;
    }

    /// Runs the window over `stream` until it is empty (taking more slices as room frees up),
    /// the connection breaks, or a cut-off drops it.
    pub(super) fn run(
        &mut self,
        shared: &PoolShared,
        lane: usize,
        stream: &mut TcpStream,
        receiver: &Receiver<Slice>,
    ) -> RunEnd {
        let io_timeout = shared.config.io_timeout;
        let mut last_progress = Instant::now();
        self.marks.clear();
        while !self.is_empty() {
            let cut = shared.cut.load(Ordering::Acquire);
            if cut != self.seen_cut {
                self.seen_cut = cut;
                match self.cut_off(shared, lane, stream) {
                    CutOff::Kept => continue,
                    dropped => return RunEnd::CutOff(dropped),
                }
            }
            let outcome = self.send(shared, stream).and_then(|sent| {
                let received = self.receive(shared, lane, stream)?;
                Ok(matches!(sent, Step::Moved) || matches!(received, Step::Moved))
            });
            match outcome {
                Ok(true) => {
                    last_progress = Instant::now();
                    self.fill(shared, receiver);
                }
                Ok(false) => {
                    let left = io_timeout.saturating_sub(last_progress.elapsed());
                    if left.is_zero() {
                        return self.broken(
                            shared,
                            lane,
                            "no progress within the I/O timeout".into(),
                        );
                    }
                    let want_write = self.sending.is_some()
                        || !self.queued.is_empty()
                        || self.read_headers_sent < self.read_headers.len();
                    let want_read = !self.awaiting.is_empty();
                    let nap = left.min(CUT_CHECK);
                    match wait_ready(stream.as_fd(), want_read, want_write, Some(nap)) {
                        Ok(ready) => self.marks.polled(ready),
                        Err(e) => return self.broken(shared, lane, e.to_string()),
                    }
                }
                Err(Failure::Protocol(message)) => {
                    if let Some(front) = self.awaiting.pop_front() {
                        self.leave(&front.slice);
                        front.slice.fail(TransferError::Protocol {
                            peer: shared.endpoint.clone(),
                            message,
                        });
                    }
                    return self.broken(shared, lane, "protocol error".into());
                }
                Err(Failure::Io(e)) => {
                    return self.broken(shared, lane, format!("{e} (mid-transfer)"));
                }
            }
        }
        RunEnd::Emptied
    }

    /// Waits for the device copies of the slices on the wire, before any is given back.
    pub(super) fn settle(&mut self) {
        if let Err(e) = self.stage.settle() {
            tracing::warn!("TCP lane: waiting for device copies: {e}");
        }
    }

    /// Fails everything in the window after the connection broke. The lane's connection
    /// leaves the stats first, so whoever sees a failed slice also sees the peer's loss.
    fn broken(&mut self, shared: &PoolShared, lane: usize, message: String) -> RunEnd {
        if let Some(open) = shared.open.lock().get_mut(lane) {
            *open = None;
        }
        *shared.last_error.lock() = Some(message.clone());
        self.fail_all(|| TransferError::Connection {
            peer: shared.endpoint.clone(),
            message: message.clone(),
        });
        RunEnd::Broken
    }
}

pub(super) enum Failure {
    Protocol(String),
    Io(io::Error),
}
