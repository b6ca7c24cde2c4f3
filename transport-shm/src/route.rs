//! The admission path of one job, whichever hand runs it: each peer's slices go to its link,
//! made and confirmed on first use (or, for this engine's own segment, to its registry),
//! which pins or maps the peer's ranges and copies; a peer that is not same-host has its
//! slices declined to the next transport, one that is gone has them failed.

use std::sync::Arc;

use tern_engine::{SegmentId, Slice, TransferError};
use tern_memreg::MemoryRegistry;

use crate::client::{self, Links, Reach};

/// Moves the slices of one job (a submit, or part of one), on a copy thread or a waiter.
pub(crate) fn run(mut slices: Vec<Slice>, links: &Links) {
    while !slices.is_empty() {
        // The slices of one peer, in order: a submit usually has one, and then the job's
        // list is the group, with no list of its own to allocate (a copy thread frees what
        // a waiter allocates, and the allocator's lock between them costs a waiter a sleep).
        let peer = slices[0].peer().clone();
        let same = slices
            .iter()
            .position(|s| !Arc::ptr_eq(s.peer(), &peer))
            .unwrap_or(slices.len());
        let rest = slices.split_off(same);
        let group = std::mem::replace(&mut slices, rest);
        if peer.id == SegmentId::LOCAL {
            local(group, links.registry());
            continue;
        }
        match links.reach(&peer) {
            Reach::Up(link) => link.carry(group),
            Reach::Decline(why) => {
                for slice in group {
                    slice.decline(&why);
                }
            }
            Reach::Gone(why) => {
                for slice in group {
                    slice.fail(TransferError::Connection {
                        peer: peer.name.clone(),
                        message: why.clone(),
                    });
                }
            }
        }
    }
}

/// Slices to this engine's own segment: copies between two pinned regions of its registry.
fn local(slices: Vec<Slice>, registry: &MemoryRegistry) {
    for slice in slices {
        if !slice.is_live() {
            slice.abandon();
            continue;
        }
        client::copy_in_registry(registry, slice, Slice::complete);
    }
}
