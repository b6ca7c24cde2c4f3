//! Segments as transports see them: a peer's, resolved, and the keyless form of a local
//! buffer.

use std::sync::OnceLock;

use tern_memreg::RegionInfo;
use tern_metadata::{BufferDesc, RpcMeta, SegmentDesc};

use super::routes::Routes;
use crate::types::SegmentId;

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
    /// The installed transports that reach it, found on the first submit to it.
    pub(crate) routes: KeptRoutes,
}

/// A peer's routes, worked out once per descriptor rather than in every submit (asking each
/// transport whether it reaches the peer). A clone, which may change the descriptor, starts
/// without them.
#[derive(Debug, Default)]
pub(crate) struct KeptRoutes(OnceLock<Routes>);

impl KeptRoutes {
    pub(crate) fn get_or_init(&self, find: impl FnOnce() -> Routes) -> Routes {
        *self.0.get_or_init(find)
    }
}

impl Clone for KeptRoutes {
    fn clone(&self) -> Self {
        Self::default()
    }
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
