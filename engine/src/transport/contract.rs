//! The [`Transport`] trait: what the engine asks of a way to move bytes.

use tern_memreg::{AlignedBuffer, RegionInfo};
use tern_metadata::SegmentDesc;

use super::context::TransportContext;
use super::error::TransportError;
use super::slice::Slice;
use crate::stats::TransportReport;

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
    /// speaks this transport's protocol. Asked once per descriptor, on the first submit to the
    /// peer after the transport started, and the answer kept until the descriptor is fetched
    /// again: it must follow from the descriptor and what the transport knew at start.
    fn can_reach(&self, peer: &SegmentDesc) -> bool {
        peer.speaks(self.protocol())
    }

    /// Starts listeners and workers. Called once, before any other method but `protocol`,
    /// `priority` and `offers_help`.
    fn start(&self, context: TransportContext) -> Result<(), TransportError>;

    /// A region was registered: make it reachable (e.g. register it on every NIC).
    fn register_memory(&self, _region: &RegionInfo) -> Result<(), TransportError> {
        Ok(())
    }

    /// A region is being unregistered.
    fn unregister_memory(&self, _region: &RegionInfo) {}

    /// Fills this transport's Mooncake fields of the local descriptor (ports, versions,
    /// devices). `desc.buffers` arrives in the keyless form, one entry per region of
    /// `regions` (the remote-accessible ones, in address order); only a transport that
    /// [`owns_buffer_keys`](Transport::owns_buffer_keys) may change them — the engine puts
    /// back what any other one changes. Transports are asked in ascending
    /// [`priority`](Transport::priority).
    fn describe(&self, desc: &mut SegmentDesc, regions: &[RegionInfo]);

    /// Whether this transport's [`describe`](Transport::describe) fills the buffers' keys
    /// (RDMA's per-NIC `lkey`/`rkey`).
    fn owns_buffer_keys(&self) -> bool {
        false
    }

    /// This transport's own part of the local descriptor, published under
    /// `tern.<protocol>` (a field Mooncake peers ignore), so a transport adds what it needs
    /// without a field of its own in [`SegmentDesc`] and without reach into another's.
    fn extension(&self, _regions: &[RegionInfo]) -> Option<serde_json::Value> {
        None
    }

    /// Memory for [`TransferEngine::allocate`](crate::TransferEngine::allocate) to hand out,
    /// if this transport wants buffers of its own kind (shared-memory mappings, say); the
    /// highest-priority transport that offers one wins. `None`: ordinary memory.
    fn allocate(&self, _len: usize) -> Option<Result<AlignedBuffer, TransportError>> {
        None
    }

    /// Largest slice the engine should hand over; asked once, when the engine is built.
    fn max_slice_size(&self) -> usize;

    /// A request's last piece shorter than this is merged into the piece before it
    /// (Mooncake: 16 KiB for 64 KiB slices), so no slice is tiny; asked once, when the
    /// engine is built.
    fn merge_tail_below(&self) -> usize {
        0
    }

    /// Answers a handshake RPC of type Connection (RDMA QP exchange): `Some(reply body)`
    /// if this transport handles them, `None` to let another transport answer.
    fn handle_connection(&self, _body: &[u8]) -> Option<Vec<u8>> {
        None
    }

    /// Takes slices to move, out of `slices`: drain it, or take the whole list. The list
    /// stays the engine's, whose next submit reuses its room (a transport that takes the
    /// whole list costs that submit an allocation); a slice left in it fails as dropped.
    /// Must not block on I/O: outcomes are reported later through [`Slice::complete`] /
    /// [`Slice::fail`], typically from worker threads. A slice this transport cannot carry
    /// goes back with [`Slice::decline`], and the engine offers it to the next transport
    /// that reaches the peer.
    fn submit(&self, slices: &mut Vec<Slice>);

    /// Whether a thread waiting for a batch may lend this transport a hand
    /// ([`help`](Transport::help)): for transports whose work is CPU work anyone can do
    /// (copies in shared memory), so that the waiter copies instead of spinning.
    fn offers_help(&self) -> bool {
        false
    }

    /// Does one piece of this transport's queued work on the calling thread, a waiter with
    /// nothing else to do; true if there was some. Takes only work queued now (never waits
    /// for more), and runs it as the transport's own threads would.
    fn help(&self) -> bool {
        false
    }

    /// What only the transport knows of its work: retries and its peers' state. The engine
    /// counts bytes, slices and failures itself. Called off the data path, when a user asks.
    fn report(&self) -> TransportReport {
        TransportReport::default()
    }

    /// Cuts off, as soon as it can, every slice it holds whose task has ended
    /// ([`Slice::is_live`] false): one not started is abandoned, one on the wire stops
    /// touching its local memory and goes back through [`Slice::cut_off`] (or fails). The
    /// engine calls it from a waiting or status-reading thread when tasks ended (deadline,
    /// cancel, a failed slice) while slices of them were out, and again while they are:
    /// it must not block. A task ended that way is shown ended only once all its slices are
    /// back. The default does nothing: the transport's slices end on their own.
    fn cut_off(&self) {}

    /// Stops listeners and workers; slices still queued are failed.
    fn shutdown(&self);
}
