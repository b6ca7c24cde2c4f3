//! Cutting off the slices of ended tasks that a lane holds, and the close a dropped
//! connection must reach before the writes that were on it go again.
//!
//! Why the wait: a write's bytes that left on a connection can still reach the target after
//! the connection is dropped (in the send queue after the FIN, in flight, in the server's
//! receive buffer, in a server thread that lags), and be written into its memory then. A
//! write sent again on a new connection and reported Completed must not be overwritten by
//! an older copy of itself after the caller reused the range. The server closes a
//! connection only after its last write into memory from it (Tern's server returns from
//! the connection's thread first; Mooncake's closes the session once its read of the body
//! ended), so once the lane reads the end of the dropped connection, no byte sent on it can
//! land any more. Until then the writes that were on it wait; if the end does not come
//! within [`DRAIN`], they fail, and their tasks say that the peer's memory may still change.

use std::collections::VecDeque;
use std::io::{self, Read};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::Instant;

use tern_engine::{DRAIN, Opcode, TransferError};
use tern_memreg::wait_ready;

use super::pool::PoolShared;
use super::window::{CUT_CHECK, Window};

/// How a cut-off left the lane's connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CutOff {
    /// No slice of an ended task was on the wire: the connection goes on.
    Kept,
    /// Dropped; nothing that was on it goes again but reads and unsent requests.
    Dropped,
    /// Dropped while writes that were on it are queued to go again: they wait for its end
    /// ([`Window::await_close`]).
    Closing,
}

impl Window {
    /// Gives back the slices of ended tasks: those queued at once; if one is on the wire,
    /// the connection goes (its replies would land in that slice's memory, and a write's
    /// body is read from it), and the live slices that were on it are queued again for a
    /// new one.
    pub(super) fn cut_off(
        &mut self,
        shared: &PoolShared,
        lane: usize,
        stream: &TcpStream,
    ) -> CutOff {
        self.give_back_queued();
        let dead_on_the_wire = self.sending.as_ref().is_some_and(|s| !s.slice.is_live())
            || self.awaiting.iter().any(|a| !a.slice.is_live());
        if !dead_on_the_wire {
            return CutOff::Kept;
        }
        // The write side only: what the server still sends is read (and thrown away) until
        // it closes, which tells the lane that nothing sent on the connection lands later.
        let _ = stream.shutdown(Shutdown::Write);
        if let Some(open) = shared.open.lock().get_mut(lane) {
            *open = None;
        }
        self.settle();
        // Oldest first: those awaiting replies, the one being sent, then the queue.
        let mut again = VecDeque::with_capacity(self.count());
        let awaiting = std::mem::take(&mut self.awaiting);
        for awaiting in awaiting {
            if awaiting.slice.is_live() {
                again.push_back(awaiting.slice);
            } else {
                self.leave(&awaiting.slice);
                // A write awaiting its status has sent its body whole.
                awaiting.slice.cut_off(true);
            }
        }
        if let Some(sending) = self.sending.take() {
            if sending.slice.is_live() {
                again.push_back(sending.slice);
            } else {
                self.leave(&sending.slice);
                let body_left = sending.sent > sending.header.len;
                sending.slice.cut_off(body_left);
            }
        }
        self.resent += again.len();
        again.append(&mut self.queued);
        self.queued = again;
        self.read_headers.clear();
        self.read_headers_sent = 0;
        tracing::debug!(
            "TCP lane {lane} to {}: connection dropped to cut off slices of ended tasks",
            shared.endpoint
        );
        if self.resent_writes() {
            CutOff::Closing
        } else {
            let _ = stream.shutdown(Shutdown::Both);
            CutOff::Dropped
        }
    }

    /// Gives back the queued slices of ended tasks: those that were on a dropped connection
    /// as cut off (a write's bytes may have left), the others as never started.
    fn give_back_queued(&mut self) {
        let queued = std::mem::take(&mut self.queued);
        let resent = std::mem::take(&mut self.resent);
        let mut kept_resent = 0;
        for (i, slice) in queued.into_iter().enumerate() {
            if slice.is_live() {
                kept_resent += usize::from(i < resent);
                self.queued.push_back(slice);
            } else {
                self.leave(&slice);
                if i < resent {
                    slice.cut_off(true);
                } else {
                    slice.abandon();
                }
            }
        }
        self.resent = kept_resent;
    }

    /// Whether a write that was on a dropped connection is queued to go again.
    fn resent_writes(&self) -> bool {
        self.queued
            .iter()
            .take(self.resent)
            .any(|slice| slice.opcode() == Opcode::Write)
    }

    /// Waits, within [`DRAIN`], for the server to close `stream`, which [`cut_off`]
    /// dropped, reading and throwing away what it still sends, while the writes that were on
    /// it are queued to go again (see the module's doc). Then those writes go like any
    /// other; if the end did not come, they fail (their bytes may still land). Writes whose
    /// tasks end meanwhile are cut off.
    ///
    /// [`cut_off`]: Window::cut_off
    pub(super) fn await_close(&mut self, shared: &PoolShared, lane: usize, stream: &mut TcpStream) {
        let until = Instant::now() + DRAIN;
        let mut thrown_away = [0u8; 16 << 10];
        let closed = loop {
            if shared.stop.load(Ordering::Acquire) {
                break Err("the TCP transport shut down");
            }
            let cut = shared.cut.load(Ordering::Acquire);
            if cut != self.seen_cut {
                self.seen_cut = cut;
                self.give_back_queued();
            }
            if !self.resent_writes() {
                // Nothing waits for the end any more: reads and requests never sent go on.
                break Ok(false);
            }
            match stream.read(&mut thrown_away) {
                Ok(0) => break Ok(true),
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                // Reset: the server's socket is gone, with its thread.
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => break Ok(true),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => break Err("reading its end failed"),
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break Err("the server did not close it in time");
            }
            if let Err(e) = wait_ready(stream.as_fd(), true, false, Some(left.min(CUT_CHECK))) {
                tracing::debug!("TCP lane {lane}: waiting for a dropped connection's end: {e}");
                break Err("waiting for its end failed");
            }
        };
        let _ = stream.shutdown(Shutdown::Both);
        match closed {
            // Nothing sent on it lands any more: what goes again is as if never sent.
            Ok(true) => self.resent = 0,
            Ok(false) => {}
            Err(why) => self.fail_resent_writes(shared, lane, why),
        }
    }

    /// Fails the writes queued to go again after a dropped connection whose end did not
    /// come: bytes of theirs may still land. Reads that were on it still go again.
    fn fail_resent_writes(&mut self, shared: &PoolShared, lane: usize, why: &str) {
        let queued = std::mem::take(&mut self.queued);
        let resent = std::mem::take(&mut self.resent);
        let mut failed = 0;
        for (i, slice) in queued.into_iter().enumerate() {
            if i < resent && slice.opcode() == Opcode::Write {
                self.leave(&slice);
                failed += 1;
                slice.fail(TransferError::Connection {
                    peer: shared.endpoint.clone(),
                    message: format!(
                        "a connection dropped to cut off another transfer could not be \
                         confirmed closed within {DRAIN:?} ({why}); bytes of this write sent \
                         on it may still land"
                    ),
                });
            } else {
                self.resent += usize::from(i < resent);
                self.queued.push_back(slice);
            }
        }
        tracing::warn!(
            "TCP lane {lane} to {}: {failed} write(s) failed: a dropped connection was not \
             confirmed closed ({why})",
            shared.endpoint
        );
    }
}
