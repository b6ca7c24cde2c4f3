//! Cutting off the slices of ended tasks that a lane holds.

use std::collections::VecDeque;
use std::net::{Shutdown, TcpStream};

use super::pool::PoolShared;
use super::window::Window;

impl Window {
    /// Gives back the slices of ended tasks: those queued at once; if one is on the wire,
    /// the connection goes (its replies would land in that slice's memory, and a write's
    /// body is read from it), and the live slices that were on it are queued again for a
    /// new one. Returns whether the connection is still good.
    pub(super) fn cut_off(&mut self, shared: &PoolShared, lane: usize, stream: &TcpStream) -> bool {
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
        let dead_on_the_wire = self.sending.as_ref().is_some_and(|s| !s.slice.is_live())
            || self.awaiting.iter().any(|a| !a.slice.is_live());
        if !dead_on_the_wire {
            return true;
        }
        let _ = stream.shutdown(Shutdown::Both);
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
        false
    }
}
