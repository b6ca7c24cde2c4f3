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
    /// A value under a key is not what Mooncake writes there (bad JSON, or a descriptor that
    /// breaks the rules). Other keys are unaffected; fix or delete this one.
    #[error("value under key {key:?}: {source}")]
    MalformedValue {
        /// The key.
        key: String,
        /// What was wrong.
        source: DescriptorError,
    },
    /// No server name → RPC location is published for this server.
    #[error("no rpc_meta published for server {0:?}")]
    RpcMetaNotFound(String),
    /// The store could not be reached (or answered with an error); the message names the
    /// endpoints. Check that it runs and is reachable from here.
    #[error("metadata store {endpoint}: {message}")]
    Store {
        /// The store's endpoint(s).
        endpoint: String,
        /// What happened.
        message: String,
    },
    /// The etcd TLS or login settings are incomplete or unreadable (a certificate without its
    /// key, a CA file that cannot be read, a user without a password); the message names the
    /// setting to fix.
    #[error("etcd settings: {0}")]
    EtcdSettings(String),
    /// The handshake RPC to a peer failed.
    #[error(transparent)]
    Rpc(#[from] RpcError),
    /// A value in the store failed its cluster-secret check (or could not be sealed): it was
    /// written without the secret, altered, or moved from another key. With a secret set, a
    /// node uses only values another holder of the secret wrote.
    #[error("value under key {key:?}: {source}")]
    Seal {
        /// The key.
        key: String,
        /// What is wrong with it.
        source: crate::seal::SealError,
    },
}
