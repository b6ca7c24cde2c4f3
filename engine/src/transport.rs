//! The contract between the engine and a transport.
//!
//! The engine checks and slices every request; a transport only moves slices and reports
//! each one's outcome, from whatever thread it likes. Transports never publish metadata:
//! they describe their part of the local descriptor when asked, and ask the engine to
//! publish again when that part changes.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tern_memreg::{MemoryRegistry, RegionInfo, RegionPin};
use tern_metadata::auth::ClusterSecret;
use tern_metadata::rpc::{self, RpcClientConfig, RpcError, RpcType};
use tern_metadata::{BufferDesc, RpcMeta, SegmentDesc};

use crate::batch::SliceCompletion;
use crate::error::TransferError;
use crate::stats::TransportReport;
use crate::types::{Opcode, SegmentId};

/// Asks the engine to rebuild and publish the local descriptor.
type Republish = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// What a transport is given when the engine starts it.
#[derive(Clone)]
pub struct TransportContext {
    /// The engine's registered memory; inbound requests must be checked against it
    /// ([`MemoryRegistry::pin_remote`]) before a byte moves.
    pub registry: Arc<MemoryRegistry>,
    /// The address this node advertises; listeners bind here.
    pub advertised_ip: IpAddr,
    /// The name this node was configured with.
    pub local_server_name: String,
    /// The name peers open this node's segment by (`ip:port` in P2P mode); RDMA NIC paths
    /// are `<segment_name>@<device>`.
    pub segment_name: String,
    pub(crate) rpc_client: RpcClientConfig,
    pub(crate) republish: Republish,
}

impl std::fmt::Debug for TransportContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportContext")
            .field("advertised_ip", &self.advertised_ip)
            .field("local_server_name", &self.local_server_name)
            .field("segment_name", &self.segment_name)
            .finish_non_exhaustive()
    }
}

impl TransportContext {
    /// Calls a peer's handshake RPC (one short connection, the engine's timeouts, or
    /// `connect_timeout` for connecting) and returns the reply body.
    pub fn call_peer(
        &self,
        peer: &PeerSegment,
        ty: RpcType,
        body: &[u8],
        connect_timeout: Option<Duration>,
    ) -> Result<Vec<u8>, RpcError> {
        let mut config = self.rpc_client.clone();
        if let Some(timeout) = connect_timeout {
            config.connect_timeout = timeout;
        }
        rpc::call_segment(&peer.rpc.endpoint(), &peer.desc.name, ty, body, &config)
    }

    /// The engine's cluster secret, if it has one: a transport with connections of its own
    /// must open each of them with [`tern_metadata::auth`]'s exchange, both ways. (RPCs made
    /// through [`call_peer`](Self::call_peer) already do.)
    pub fn cluster_secret(&self) -> Option<&ClusterSecret> {
        self.rpc_client.secret.as_ref()
    }

    /// Asks the engine to rebuild the local descriptor (calling every transport's
    /// [`Transport::describe`]) and publish it. Must not be called while holding a lock that
    /// `describe` takes.
    pub fn republish(&self) -> Result<(), String> {
        (self.republish)()
    }
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

/// Mooncake's keyless buffer form (TCP): named by the segment, no rkeys or lkeys.
pub fn keyless_buffer(region: &RegionInfo, segment_name: &str) -> BufferDesc {
    BufferDesc {
        addr: region.addr as u64,
        length: region.len as u64,
        lkey: None,
        name: segment_name.to_owned(),
        rkey: None,
    }
}

/// A way to move bytes. Implementations live in their own crates (`tern-transport-tcp`,
/// `tern-transport-rdma`); `tern_engine::conformance` (feature `conformance`) checks them.
pub trait Transport: Send + Sync + 'static {
    /// The protocol name published in descriptors (`tcp`, `rdma`).
    fn protocol(&self) -> &'static str;

    /// Among the installed transports that can reach a peer, the one with the highest
    /// priority moves its slices and describes the local buffers (RDMA over TCP).
    fn priority(&self) -> u8 {
        0
    }

    /// Whether this transport can reach a peer with this descriptor. The default: the peer
    /// speaks this transport's protocol.
    fn can_reach(&self, peer: &SegmentDesc) -> bool {
        peer.speaks(self.protocol())
    }

    /// Starts listeners and workers. Called once, before any other method but `protocol`
    /// and `priority`.
    fn start(&self, context: TransportContext) -> Result<(), TransportError>;

    /// A region was registered: make it reachable (e.g. register it on every NIC).
    fn register_memory(&self, _region: &RegionInfo) -> Result<(), TransportError> {
        Ok(())
    }

    /// A region is being unregistered.
    fn unregister_memory(&self, _region: &RegionInfo) {}

    /// Fills this transport's fields of the local descriptor (ports, versions, devices).
    /// `desc.buffers` arrives in the keyless form, one entry per region of `regions` (the
    /// remote-accessible ones, in address order); a transport with per-NIC keys replaces
    /// them. Transports are asked in ascending [`priority`](Transport::priority), so the
    /// highest-priority transport has the last word.
    fn describe(&self, desc: &mut SegmentDesc, regions: &[RegionInfo]);

    /// Largest slice the engine should hand over.
    fn max_slice_size(&self) -> usize;

    /// A request's last piece shorter than this is merged into the piece before it
    /// (Mooncake: 16 KiB for 64 KiB slices), so no slice is tiny.
    fn merge_tail_below(&self) -> usize {
        0
    }

    /// Answers a handshake RPC of type Connection (RDMA QP exchange): `Some(reply body)`
    /// if this transport handles them, `None` to let another transport answer.
    fn handle_connection(&self, _body: &[u8]) -> Option<Vec<u8>> {
        None
    }

    /// Takes slices to move. Must not block on I/O: outcomes are reported later through
    /// [`Slice::complete`] / [`Slice::fail`], typically from worker threads.
    fn submit(&self, slices: Vec<Slice>);

    /// What only the transport knows of its work: retries and its peers' state. The engine
    /// counts bytes, slices and failures itself. Called off the data path, when a user asks.
    fn report(&self) -> TransportReport {
        TransportReport::default()
    }

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
        self.release().succeed(len);
    }

    /// The slice failed; its task fails with `error`.
    pub fn fail(self, error: TransferError) {
        self.release().fail(error);
    }

    /// The slice was skipped because its task had already ended (canceled, timed out or
    /// failed); nothing is recorded.
    pub fn abandon(self) {
        self.release().skip();
    }

    /// Drops the slice's pin and gives back what reports its outcome: the pin goes first, so
    /// that whoever learns the task ended can unregister its memory at once.
    fn release(self) -> SliceCompletion {
        let Self {
            local, completion, ..
        } = self;
        drop(local);
        completion
    }
}
