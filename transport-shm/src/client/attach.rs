//! A peer's plain buffers (not memfds, not device memory): cross-memory attach into its
//! process, under a lease. The owner pins the ranges first and says which it granted; only
//! those are touched, and the lease is released on every way out.

use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tern_engine::{Opcode, Slice, TransferError};
use tern_memreg::MemoryRegistry;
use tern_memreg::shm::{AttachFailure, PeerProcess};

use super::Link;
use super::request::Reply;
use crate::wire::{self, Frame, MAX_LEASE_RANGES};

/// How a peer's plain (not memfd) buffers are reached.
#[derive(Debug)]
pub(super) enum Attach {
    /// By cross-memory attach into its process.
    Process(PeerProcess),
    /// It is this process (another engine in it): through its registry.
    SameProcess(Arc<MemoryRegistry>),
    /// Not at all, for this reason.
    Refused(String),
}

impl Link {
    /// Cross-memory attach for slices into plain buffers: one lease for all of them (in
    /// chunks of at most [`MAX_LEASE_RANGES`]), the copies, then the release.
    pub(super) fn attach(&self, mut slices: Vec<Slice>) {
        let process = match &self.attach {
            Attach::Process(process) => *process,
            Attach::SameProcess(registry) => return self.in_process(registry, slices),
            Attach::Refused(why) => {
                let why = format!("no cross-memory attach into {}: {why}", self.peer);
                for slice in slices {
                    slice.decline(&why);
                }
                return;
            }
        };
        while !slices.is_empty() {
            let rest = slices.split_off(slices.len().min(MAX_LEASE_RANGES));
            self.attach_chunk(process, slices);
            slices = rest;
        }
    }

    /// One lease: the owner pins the slices' ranges and says which it granted; each granted
    /// slice moves, each other one is rejected; then the lease is released.
    fn attach_chunk(&self, process: PeerProcess, slices: Vec<Slice>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        // Released on every way out, the wait's timeout included: an owner that grants late
        // (after this side stopped waiting) still holds the pins until it reads the release.
        let _lease = LeaseRelease { link: self, id };
        let ranges = slices
            .iter()
            .map(|s| (s.remote_addr, s.len as u64))
            .collect();
        let granted = self
            .ask(id, &Frame::Lease { id, ranges }, None)
            .and_then(|rx| self.wait(id, &rx));
        let granted = match granted {
            Ok(Reply::Leased(granted)) if granted.len() == slices.len() => granted,
            Ok(_) => {
                for slice in slices {
                    slice.decline("the peer answered a lease wrongly");
                }
                return;
            }
            Err(e) => {
                for slice in slices {
                    slice.fail(e.clone());
                }
                return;
            }
        };
        // What moves at once is settled there; the rest goes one by one.
        for (slice, granted) in self.attach_at_once(process, slices, granted) {
            if !granted {
                self.reject(slice);
                continue;
            }
            let moved = slice
                .local()
                .slice(slice.local_addr, slice.len)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
                .and_then(|local| match slice.opcode() {
                    Opcode::Write => process.write_from(slice.remote_addr, local),
                    Opcode::Read => process.read_into(slice.remote_addr, local),
                });
            match moved {
                Ok(()) => self.completed(slice),
                // Permission withdrawn since the probe (the peer made itself undumpable).
                Err(e) if AttachFailure::of(&e) == AttachFailure::Refused => {
                    slice.decline(&format!("cross-memory attach refused: {e}"))
                }
                Err(e) if AttachFailure::of(&e) == AttachFailure::Gone => {
                    slice.fail(TransferError::Connection {
                        peer: self.peer.clone(),
                        message: format!("its process is gone: {e}"),
                    })
                }
                Err(e) => slice.fail(TransferError::Protocol {
                    peer: self.peer.clone(),
                    message: format!("cross-memory attach: {e}"),
                }),
            }
        }
    }
}

/// Sends the release of lease `id` when dropped. The owner reads frames in order, so a
/// release always follows its lease there, and one for a lease it refused is nothing to it.
struct LeaseRelease<'a> {
    link: &'a Link,
    id: u64,
}

impl Drop for LeaseRelease<'_> {
    fn drop(&mut self) {
        let _send = self.link.send.lock();
        let _ = wire::send(&self.link.stream, &Frame::Release { id: self.id }.encode());
    }
}
