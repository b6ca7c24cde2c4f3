//! Revoking a memfd buffer from the peers that mapped it, before unregistering returns.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{Conn, Owner};
use crate::wire::{self, Frame};

/// How many unconfirmed revocations an owner keeps for its report.
const MAX_UNCONFIRMED_KEPT: usize = 16;

/// A revocation a peer did not confirm in time.
#[derive(Debug, Clone)]
pub(crate) struct Unconfirmed {
    /// The peer's segment, as it said in its hello.
    pub(crate) peer: String,
    /// What happened.
    pub(crate) message: String,
}

impl Owner {
    /// The buffer at `addr` (`len` bytes) is being unregistered: forget its memfd, tell every
    /// peer that mapped it to stop, and wait (up to the revoke timeout) until each has
    /// confirmed that nothing of it copies into the buffer any more. A peer that does not
    /// confirm in time is cut off (its socket is shut down), but nothing here can unmap its
    /// mapping: it goes only once that peer reads the close and its copies finish. Such
    /// peers are returned, each with what happened, and remembered for the report.
    pub(crate) fn revoke(&self, addr: usize) -> Vec<Unconfirmed> {
        self.memfds.lock().remove(&addr);
        let conns: Vec<Arc<Conn>> = self.conns.lock().clone();
        let mut waits = Vec::new();
        for conn in conns {
            let mut state = conn.state.lock();
            if state.closed || !state.mapped.remove(&addr) {
                continue;
            }
            let id = self.next_revoke.fetch_add(1, Ordering::Relaxed);
            let frame = Frame::Revoke {
                id,
                addr: addr as u64,
            };
            if wire::send(&conn.stream, &frame.encode()).is_ok() {
                state.revoking.insert(id);
                drop(state);
                waits.push((conn, id));
            }
        }
        let deadline = Instant::now() + self.revoke_timeout;
        let mut unconfirmed_now = Vec::new();
        for (conn, id) in waits {
            let mut state = conn.state.lock();
            let left = deadline.saturating_duration_since(Instant::now());
            conn.changed.wait_while_for(
                &mut state,
                |s| s.revoking.contains(&id) && !s.closed,
                left,
            );
            if state.revoking.contains(&id) && !state.closed {
                let unconfirmed = Unconfirmed {
                    peer: state.peer.clone(),
                    message: format!(
                        "did not confirm unmapping the buffer at {addr:#x} within {:?}: cut \
                         off, but it may keep the buffer's pages mapped until it reads the close",
                        self.revoke_timeout
                    ),
                };
                tracing::warn!("shm peer {}: {}", unconfirmed.peer, unconfirmed.message);
                let _ = conn.stream.shutdown(std::net::Shutdown::Both);
                unconfirmed_now.push(unconfirmed);
            }
        }
        if !unconfirmed_now.is_empty() {
            let mut kept = self.unconfirmed.lock();
            kept.extend(unconfirmed_now.iter().cloned());
            let excess = kept.len().saturating_sub(MAX_UNCONFIRMED_KEPT);
            kept.drain(..excess);
        }
        unconfirmed_now
    }
}
