//! The contract between the engine and a transport.
//!
//! The engine checks and slices every request; a transport only moves slices and reports
//! each one's outcome, from whatever thread it likes. Transports never publish metadata:
//! they describe their part of the local descriptor when asked.

use std::net::IpAddr;
use std::sync::Arc;

use tern_memreg::{MemoryRegistry, RegionInfo, RegionPin};
use tern_metadata::{BufferDesc, RpcMeta, SegmentDesc};

use crate::batch::SliceCompletion;
use crate::error::TransferError;
use crate::types::{Opcode, SegmentId};

/// What a transport is given when the engine starts it.
#[derive(Debug, Clone)]
pub struct TransportContext {
    /// The engine's registered memory; inbound requests must be checked against it
    /// ([`MemoryRegistry::pin_remote`]) before a byte moves.
    pub registry: Arc<MemoryRegistry>,
    /// The address this node advertises; listeners bind here.
    pub advertised_ip: IpAddr,
    /// The name this node was configured with.
    pub local_server_name: String,
}

/// A transport failure outside any one transfer (start-up, registration).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TransportError(pub String);

/// A segment as the engine resolved it: its descriptor and where its node listens.
#[derive(Debug, Clone)]
pub struct PeerSegment {
    /// The engine's ID for it.
    pub id: SegmentId,
    /// Its name.
    pub name: String,
    /// Its descriptor.
    pub desc: SegmentDesc,
    /// Where its handshake RPC listens; its host is the peer's data address too.
    pub rpc: RpcMeta,
}

/// A way to move bytes. Implementations live in their own crates (`tern-transport-tcp`,
/// `tern-transport-rdma`); `tern_engine::conformance` (feature `conformance`) checks them.
pub trait Transport: Send + Sync + 'static {
    /// The protocol name published in descriptors (`tcp`, `rdma`).
    fn protocol(&self) -> &'static str;

    /// Starts listeners and workers. Called once, before any other method but `protocol`.
    fn start(&self, context: TransportContext) -> Result<(), TransportError>;

    /// A region was registered: make it reachable (e.g. register it on every NIC).
    fn register_memory(&self, _region: &RegionInfo) -> Result<(), TransportError> {
        Ok(())
    }

    /// A region is being unregistered.
    fn unregister_memory(&self, _region: &RegionInfo) {}

    /// Fills this transport's fields of the local descriptor (ports, versions, devices).
    fn describe(&self, desc: &mut SegmentDesc);

    /// How a registered, remote-accessible region appears in the local descriptor. The
    /// default is Mooncake's keyless form (TCP): named by the segment, no rkeys or lkeys;
    /// transports with per-NIC keys override it.
    fn describe_buffer(&self, region: &RegionInfo, segment_name: &str) -> BufferDesc {
        BufferDesc {
            addr: region.addr as u64,
            length: region.len as u64,
            lkey: None,
            name: segment_name.to_owned(),
            rkey: None,
        }
    }

    /// Largest slice the engine should hand over.
    fn max_slice_size(&self) -> usize;

    /// Takes slices to move. Must not block on I/O: outcomes are reported later through
    /// [`Slice::complete`] / [`Slice::fail`], typically from worker threads.
    fn submit(&self, slices: Vec<Slice>);

    /// Stops listeners and workers; slices still queued are failed.
    fn shutdown(&self);
}

/// One piece of a task: a contiguous range moved in one operation.
#[derive(Debug)]
pub struct Slice {
    /// Read or write.
    pub opcode: Opcode,
    /// The local region, pinned for as long as the slice lives.
    pub local: RegionPin,
    /// Local start address (inside `local`).
    pub local_addr: usize,
    /// Bytes.
    pub len: usize,
    /// The other side.
    pub peer: Arc<PeerSegment>,
    /// Remote start address.
    pub remote_addr: u64,
    pub(crate) completion: SliceCompletion,
}

impl Slice {
    /// Whether the slice should still run (its task is pending and within its deadline).
    /// A transport checks this before starting I/O and calls [`Slice::abandon`] if not.
    pub fn is_live(&self) -> bool {
        self.completion.live()
    }

    /// The slice moved all its bytes.
    pub fn complete(self) {
        let len = self.len as u64;
        self.completion.succeed(len);
    }

    /// The slice failed; its task fails with `error`.
    pub fn fail(self, error: TransferError) {
        self.completion.fail(error);
    }

    /// The slice was skipped because its task had already ended (canceled, timed out or
    /// failed); nothing is recorded.
    pub fn abandon(self) {
        self.completion.succeed(0);
    }
}
