//! What work requests are made of: scatter/gather elements, operations, and the guards that
//! keep a tracked request's memory valid until its completion has been retrieved.

use std::sync::Arc;

use crate::mr::MemoryRegion;

/// A value that keeps some memory valid for as long as it lives: what a work request hands
/// the queue pair so that the memory its SGE names outlives the request.
///
/// # Safety
///
/// While the value lives, the bytes `[span().0, span().0 + span().1)` must stay mapped and
/// valid for the device to read and write, must not be freed or reused, and nothing may rely
/// on Rust's aliasing guarantees for them (the device writes them at any time). `span` must
/// return the same range every time it is called.
pub unsafe trait MemoryGuard: Send + 'static {
    /// Start address and length of the memory kept valid.
    fn span(&self) -> (usize, usize);
}

// SAFETY: `MemoryRegion::register`'s contract is that the registered range stays valid until
// the region is dropped; the Arc keeps the region, so the range, alive.
unsafe impl MemoryGuard for Arc<MemoryRegion> {
    fn span(&self) -> (usize, usize) {
        (self.addr(), self.len())
    }
}

/// One scatter/gather element: a piece of registered local memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Start address (inside an MR of the QP's PD).
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// The MR's lkey.
    pub lkey: u32,
}

/// What a send work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Local SGEs → remote memory.
    Write {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// Local SGEs → remote memory, then an immediate value delivered to a posted receive.
    WriteWithImm {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// The immediate value (host order; sent big-endian).
        imm: u32,
    },
    /// Remote memory → local SGEs.
    Read {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// Local SGEs → the peer's next posted receive.
    Send,
}

/// A send work request for
/// [`QueuePair::post_send_unchecked`](super::QueuePair::post_send_unchecked).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendRequest {
    /// Returned in the completion; must not have [`TRACKED_BIT`](crate::ledger::TRACKED_BIT)
    /// set.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// The local memory.
    pub sges: Vec<Sge>,
    /// Whether to produce a completion on success.
    pub signaled: bool,
}

/// A tracked send work request: one local SGE, the guard that keeps its memory valid until
/// the request's completion has been retrieved, and the caller's value.
#[derive(Debug)]
pub struct SendWork<G, U> {
    /// What to do.
    pub op: SendOp,
    /// The local memory; must lie inside `guard`'s span.
    pub local: Sge,
    /// Keeps `local` valid; dropped once the request is retired.
    pub guard: G,
    /// Handed back with the request's outcome.
    pub user: U,
}

/// A tracked receive work request (for SEND and WRITE_WITH_IMM from the peer).
#[derive(Debug)]
pub struct RecvWork<G, U> {
    /// Where a received message lands; must lie inside `guard`'s span.
    pub local: Sge,
    /// Keeps `local` valid; dropped once the request is retired.
    pub guard: G,
    /// Handed back with the request's outcome.
    pub user: U,
}
