//! Tern's RDMA transport: topology, one context per NIC, endpoints made by handshake, slices
//! striped over NICs and QPs, pinned worker threads that post and poll.
//!
//! It must not call libibverbs directly (that is `tern-verbs`), must not publish metadata
//! itself (it hands its part of the descriptor to the engine), and must not own deadlines or
//! cancellation (the engine does).
//!
//! At this stage the crate holds the descriptor rules the RDMA path must keep; the transport
//! itself builds on `tern-verbs` and `tern-memreg` once those are tested on Soft-RoCE.
#![forbid(unsafe_code)]

use tern_metadata::SegmentDesc;

/// The protocol name an RDMA node publishes in its segment descriptor.
pub const PROTOCOL: &str = "rdma";

/// Whether `desc` is an RDMA segment this transport could address: protocol `rdma` and every
/// remote-accessible buffer carrying one rkey per device.
pub fn is_addressable(desc: &SegmentDesc) -> bool {
    desc.protocols().iter().any(|p| p == PROTOCOL)
        && desc.buffers.iter().all(|b| {
            b.rkey
                .as_ref()
                .is_none_or(|k| k.is_empty() || k.len() == desc.devices.len())
        })
}
