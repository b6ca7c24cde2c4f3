use crate::desc::DescriptorError;
use crate::rpc::RpcError;

/// What went wrong talking to, or reading from, a metadata store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MetadataError {
    /// The connection string was not understood; use `P2PHANDSHAKE`, `etcd://host:port[,..]`,
    /// `host:port` or `http://host:port/path`.
    #[error("metadata connection string {0:?} is not understood")]
    BadConnectionString(String),
    /// The store named by the connection string is not built into this binary.
    #[error("metadata store {kind:?} ({conn}) is not available in this build")]
    Unsupported {
        /// Store kind (`etcd`, `http`, `redis`).
        kind: &'static str,
        /// The connection string.
        conn: String,
    },
    /// No descriptor is published under this segment name; check the name, or whether the
    /// peer is up.
    #[error("segment {0:?} not found")]
    SegmentNotFound(String),
    /// A segment name that must be `host:port` (P2P mode) is not.
    #[error("segment name {0:?} is not host:port")]
    BadSegmentName(String),
    /// A descriptor could not be read or broke Mooncake's rules.
    #[error("descriptor of segment {segment:?}: {source}")]
    Descriptor {
        /// The segment whose descriptor was bad.
        segment: String,
        /// What was wrong with it.
        source: DescriptorError,
    },
    /// The handshake RPC to a peer failed.
    #[error(transparent)]
    Rpc(#[from] RpcError),
}
