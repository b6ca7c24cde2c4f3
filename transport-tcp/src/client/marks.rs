//! Short-call marks, a speed trick apart from what a lane sends and takes: after the socket
//! takes less than it was given, or gives less than was asked, another call that way could
//! only say `WouldBlock`, so the lane does not make it and waits in `poll(2)` for that
//! direction instead. A mark is set by a short call (or a `WouldBlock`) and cleared when
//! `poll(2)` reports the direction ready, and at the start of each run on a connection.

use tern_memreg::Ready;

/// Which directions of a lane's socket a call would now only meet `WouldBlock` in.
#[derive(Debug, Default)]
pub(super) struct ShortCalls {
    /// The socket took less than it was given (its send buffer is full) and has not been
    /// reported writable since.
    send_full: bool,
    /// The socket gave less than was asked (nothing more had arrived) and has not been
    /// reported readable since.
    drained: bool,
}

impl ShortCalls {
    /// A new run on a connection: both directions are worth a call.
    pub(super) fn clear(&mut self) {
        *self = Self::default();
    }

    /// Whether a send now could only say `WouldBlock`.
    pub(super) fn send_full(&self) -> bool {
        self.send_full
    }

    /// Whether a receive now could only say `WouldBlock`.
    pub(super) fn drained(&self) -> bool {
        self.drained
    }

    /// A send was given `given` bytes and the socket took `took`.
    pub(super) fn sent(&mut self, took: usize, given: usize) {
        self.send_full = took < given;
    }

    /// A receive asked for `asked` bytes and the socket gave `got`.
    pub(super) fn received(&mut self, got: usize, asked: usize) {
        self.drained = got < asked;
    }

    /// A send said `WouldBlock`.
    pub(super) fn send_blocked(&mut self) {
        self.send_full = true;
    }

    /// A receive said `WouldBlock`.
    pub(super) fn receive_blocked(&mut self) {
        self.drained = true;
    }

    /// What `poll(2)` reported: a direction ready (or failed) is worth a call again.
    pub(super) fn polled(&mut self, ready: Ready) {
        self.send_full &= !(ready.write || ready.failed);
        self.drained &= !(ready.read || ready.failed);
    }
}
