//! [`TransportContext`]: what a transport is given when the engine starts it.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tern_memreg::MemoryRegistry;
use tern_metadata::auth::ClusterSecret;
use tern_metadata::rpc::{self, RpcClientConfig, RpcError, RpcType};

use super::segment::PeerSegment;

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
    /// [`Transport::describe`](super::Transport::describe)) and publish it. Must not be
    /// called while holding a lock that `describe` takes.
    pub fn republish(&self) -> Result<(), String> {
        (self.republish)()
    }
}
