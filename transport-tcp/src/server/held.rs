//! Held status frames, a speed trick apart from admission: a write's status frame waits for
//! the next request's while that request is a short write already arriving, so that the
//! client, busy sending it, gets both frames in one packet and one wake-up instead of two.
//! A frame is never held while the server would wait for the client.
//!
//! The request path only writes its status frames ([`Deadlined`]'s `Write` holds them here);
//! the connection loop sends them after each request unless they may wait
//! ([`Deadlined::send_held_unless_paired`]), and anything else sent goes after them.

use std::io;
use std::os::fd::AsFd;

use tern_memreg::recv_now;

use super::deadlined::Deadlined;
use crate::wire::{FRAME_ALIGN, HEADER_LEN, Header, OP_WRITE};

/// Status frames of writes a connection holds back at most, to send with the next.
const HELD_STATUSES: usize = 4;

/// A write's status is held back only while the request behind it, already arrived, is a
/// write at most this long: it delays the held status by that write's body.
const HOLD_BEHIND: u64 = 256 << 10;

/// Status frames of writes that the connection has not sent yet, oldest first.
#[derive(Debug, Default)]
pub(super) struct Held {
    bytes: Vec<u8>,
    frames: usize,
}

impl Held {
    /// Holds one status frame.
    pub(super) fn hold(&mut self, frame: &[u8]) {
        if !frame.is_empty() {
            self.bytes.extend_from_slice(frame);
            self.frames += 1;
        }
    }
}

impl Deadlined<'_> {
    /// Sends the held status frames, if any.
    pub(super) fn send_held(&mut self) -> io::Result<()> {
        if self.held.frames == 0 {
            return Ok(());
        }
        let bytes = std::mem::take(&mut self.held.bytes);
        let sent = self.write_through(&bytes);
        self.held.bytes = bytes;
        self.held.bytes.clear();
        self.held.frames = 0;
        sent
    }

    /// After a request: sends the held status frames unless they may wait for the next
    /// request's ([`keep_holding`](Self::keep_holding)).
    pub(super) fn send_held_unless_paired(&mut self) -> io::Result<()> {
        if self.held.frames == 0 || self.keep_holding() {
            return Ok(());
        }
        self.send_held()
    }

    /// Whether the status frames held (a write's, just applied) may wait for the next
    /// request's: only if that request is a short write already arriving (see the module).
    /// Each status frame sent alone costs the client a wake-up.
    fn keep_holding(&mut self) -> bool {
        if self.held.frames >= HELD_STATUSES {
            return false;
        }
        let staged = &mut *self.staged;
        // Room for the longest header and a byte of its body.
        if staged.len() <= FRAME_ALIGN {
            staged.compact();
            if let Ok(got) = recv_now(self.stream.as_fd(), staged.spare()) {
                staged.filled(got);
            }
        }
        if staged.len() < HEADER_LEN {
            return false;
        }
        // The next write's body has begun to arrive: a client sends a write's body with its
        // header, not after the status of the write before.
        let next = Header::decode(staged.peek_header());
        next.operation() == OP_WRITE
            && next.is_v2()
            && staged.len() > next.frame_len()
            && next.size <= HOLD_BEHIND
    }
}
