//! Metadata stores: where descriptors are published and found.

use serde::{Deserialize, Serialize};

use crate::desc::SegmentDesc;
use crate::error::MetadataError;
use crate::net::split_host_port;
use crate::rpc::{self, RpcClientConfig, RpcType};

/// A parsed metadata connection string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetadataConn {
    /// `P2PHANDSHAKE`: no server; descriptors are fetched from peers over the handshake RPC.
    P2pHandshake,
    /// `etcd://h1:2379,h2:2379` or a bare `h1:2379`.
    Etcd(Vec<String>),
    /// `http://host:port/path` or `https://..`: Mooncake's HTTP metadata protocol.
    Http(String),
    /// `redis://host:port`.
    Redis(String),
}

impl MetadataConn {
    /// Parses a connection string as Mooncake does: split on `://`, no scheme means etcd.
    pub fn parse(conn: &str) -> Result<Self, MetadataError> {
        let bad = || MetadataError::BadConnectionString(conn.to_owned());
        let conn = conn.trim();
        if conn == "P2PHANDSHAKE" {
            return Ok(Self::P2pHandshake);
        }
        let (scheme, rest) = conn.split_once("://").unwrap_or(("etcd", conn));
        if rest.is_empty() {
            return Err(bad());
        }
        match scheme {
            "etcd" => {
                let endpoints: Vec<String> = rest
                    .split([',', ';'])
                    .map(str::trim)
                    .filter(|e| !e.is_empty())
                    .map(str::to_owned)
                    .collect();
                if endpoints.is_empty() || endpoints.iter().any(|e| split_host_port(e).is_none()) {
                    return Err(bad());
                }
                Ok(Self::Etcd(endpoints))
            }
            "http" | "https" => Ok(Self::Http(conn.to_owned())),
            "redis" => Ok(Self::Redis(conn.to_owned())),
            _ => Err(bad()),
        }
    }

    /// The store kind's short name.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::P2pHandshake => "p2p",
            Self::Etcd(_) => "etcd",
            Self::Http(_) => "http",
            Self::Redis(_) => "redis",
        }
    }
}

/// Where a server's handshake RPC listens: the value under `rpc_meta/<server>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RpcMeta {
    /// IP address or host name.
    pub ip_or_host_name: String,
    /// Handshake RPC port.
    pub rpc_port: u16,
}

impl RpcMeta {
    /// `host:port`, bracketing IPv6 addresses.
    pub fn endpoint(&self) -> String {
        if self.ip_or_host_name.contains(':') {
            format!("[{}]:{}", self.ip_or_host_name, self.rpc_port)
        } else {
            format!("{}:{}", self.ip_or_host_name, self.rpc_port)
        }
    }
}

/// A change seen by a store that watches (etcd): what a cache of remote segments needs to
/// stay fresh.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetadataEvent {
    /// A segment's descriptor was written (`Some`) or withdrawn (`None`).
    Segment {
        /// The segment's name.
        name: String,
        /// The new descriptor, already checked against Mooncake's rules.
        desc: Option<SegmentDesc>,
    },
    /// A server's RPC location was written (`Some`) or withdrawn (`None`).
    RpcMeta {
        /// The server's name.
        server: String,
        /// The new location.
        meta: Option<RpcMeta>,
    },
    /// The watch was interrupted (the store was unreachable) and is back: changes may have
    /// been missed, so every cached segment should be fetched again.
    Resync,
}

/// Receives [`MetadataEvent`]s, on the store's own thread: it must not block on the store.
pub type MetadataListener = std::sync::Arc<dyn Fn(MetadataEvent) + Send + Sync>;

/// A place where segment descriptors and RPC locations are published and looked up.
pub trait MetadataStore: Send + Sync {
    /// The store kind (`p2p`, `etcd`, `http`).
    fn kind(&self) -> &'static str;

    /// The name under which a node is known: P2P renames it to `ip:rpc_port`, central
    /// stores keep `local_server_name`.
    fn segment_name(&self, local_server_name: &str, advertised: &RpcMeta) -> String;

    /// Publishes (or replaces) a descriptor.
    fn publish_segment(&self, name: &str, desc: &SegmentDesc) -> Result<(), MetadataError>;

    /// Withdraws a descriptor.
    fn remove_segment(&self, name: &str) -> Result<(), MetadataError>;

    /// Fetches a descriptor, checked against Mooncake's rules.
    fn fetch_segment(&self, name: &str) -> Result<SegmentDesc, MetadataError>;

    /// Publishes where `server`'s handshake RPC listens.
    fn publish_rpc_meta(&self, server: &str, meta: &RpcMeta) -> Result<(), MetadataError>;

    /// Withdraws `server`'s RPC location.
    fn remove_rpc_meta(&self, server: &str) -> Result<(), MetadataError>;

    /// Where `server`'s handshake RPC listens.
    fn rpc_meta(&self, server: &str) -> Result<RpcMeta, MetadataError>;

    /// Registers a listener for changes; stores that cannot watch ignore it.
    fn subscribe(&self, _listener: MetadataListener) {}

    /// Withdraws everything this node published and stops background work.
    fn shutdown(&self) {}
}

/// TLS to etcd. etcd's server certificate is checked against `ca` (etcd is normally run with
/// a private CA, so there is no fallback to the system's roots); `cert` and `key` are this
/// node's client certificate for an etcd started with `--client-cert-auth`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdTls {
    /// PEM file of the CA that signed etcd's certificate (`TERN_ETCD_CA`); required.
    pub ca: Option<std::path::PathBuf>,
    /// PEM file of this node's client certificate (`TERN_ETCD_CERT`); needs `key`.
    pub cert: Option<std::path::PathBuf>,
    /// PEM file of the client certificate's private key (`TERN_ETCD_KEY`); needs `cert`.
    pub key: Option<std::path::PathBuf>,
    /// The name etcd's certificate must carry (`TERN_ETCD_DOMAIN`; default: each
    /// endpoint's host, an IP address included).
    pub domain: Option<String>,
}

/// An etcd user for an etcd with authentication enabled (`etcdctl auth enable`).
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdCredentials {
    /// User name (`TERN_ETCD_USER`).
    pub user: String,
    /// Password (`TERN_ETCD_PASSWORD`); never printed.
    pub password: String,
}

impl std::fmt::Debug for EtcdCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdCredentials")
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

/// Settings that override the environment when a store is opened.
#[derive(Debug, Clone, Default)]
pub struct StoreOptions {
    /// Client timeouts of P2P Metadata RPCs.
    pub rpc_client: RpcClientConfig,
    /// Cluster ID scoping every key (else `MC_METADATA_CLUSTER_ID`).
    pub cluster_id: Option<String>,
    /// etcd lease TTL (else `TERN_ETCD_TTL_SECS`, else 10 s).
    pub ttl: Option<std::time::Duration>,
    /// How long to retry an unreachable etcd at start (else `TERN_ETCD_START_RETRY_SECS`, else
    /// fail at once).
    pub start_retry: Option<std::time::Duration>,
    /// TLS to etcd (else `TERN_ETCD_CA`, `TERN_ETCD_CERT`, `TERN_ETCD_KEY`,
    /// `TERN_ETCD_DOMAIN`; else plain HTTP/2).
    pub etcd_tls: Option<EtcdTls>,
    /// The etcd user to log in as (else `TERN_ETCD_USER` and `TERN_ETCD_PASSWORD`; else none).
    pub etcd_credentials: Option<EtcdCredentials>,
}

/// Opens the store a connection string names.
pub fn open_store(
    conn: &str,
    options: StoreOptions,
) -> Result<Box<dyn MetadataStore>, MetadataError> {
    match MetadataConn::parse(conn)? {
        MetadataConn::P2pHandshake => Ok(Box::new(P2pStore::new(options.rpc_client))),
        MetadataConn::Http(url) => {
            let mut store = crate::http::HttpStore::new(&url)?;
            if options.cluster_id.is_some() {
                store.set_cluster_id(options.cluster_id);
            }
            store.set_secret(options.rpc_client.secret);
            Ok(Box::new(store))
        }
        #[cfg(feature = "etcd")]
        MetadataConn::Etcd(endpoints) => {
            let mut config = crate::etcd::EtcdConfig::from_env(endpoints)?;
            if options.cluster_id.is_some() {
                config.cluster_id = options.cluster_id;
            }
            if options.etcd_tls.is_some() {
                config.tls = options.etcd_tls;
            }
            if options.etcd_credentials.is_some() {
                config.credentials = options.etcd_credentials;
            }
            config.ttl = options.ttl.unwrap_or(config.ttl);
            config.start_retry = options.start_retry.unwrap_or(config.start_retry);
            Ok(Box::new(crate::etcd::EtcdStore::connect_sealed(
                config,
                options.rpc_client.secret,
            )?))
        }
        other => Err(MetadataError::Unsupported {
            kind: other.kind(),
            conn: conn.to_owned(),
        }),
    }
}

/// `P2PHANDSHAKE`: nothing is published; a segment's name is its `ip:rpc_port`, and its
/// descriptor is fetched from it with a Metadata RPC.
#[derive(Debug, Clone, Default)]
pub struct P2pStore {
    client: RpcClientConfig,
}

impl P2pStore {
    /// A P2P store using `client` timeouts for Metadata RPCs.
    pub fn new(client: RpcClientConfig) -> Self {
        Self { client }
    }
}

impl MetadataStore for P2pStore {
    fn kind(&self) -> &'static str {
        "p2p"
    }

    fn segment_name(&self, _local_server_name: &str, advertised: &RpcMeta) -> String {
        advertised.endpoint()
    }

    fn publish_segment(&self, _name: &str, _desc: &SegmentDesc) -> Result<(), MetadataError> {
        Ok(())
    }

    fn remove_segment(&self, _name: &str) -> Result<(), MetadataError> {
        Ok(())
    }

    fn fetch_segment(&self, name: &str) -> Result<SegmentDesc, MetadataError> {
        let endpoint = self.rpc_meta(name)?.endpoint();
        let reply = rpc::call(&endpoint, RpcType::Metadata, b"{}", &self.client)?;
        if reply.iter().all(u8::is_ascii_whitespace) {
            return Err(MetadataError::SegmentNotFound(name.to_owned()));
        }
        SegmentDesc::from_json(&reply).map_err(|source| MetadataError::Descriptor {
            segment: name.to_owned(),
            source,
        })
    }

    fn publish_rpc_meta(&self, _server: &str, _meta: &RpcMeta) -> Result<(), MetadataError> {
        Ok(())
    }

    fn remove_rpc_meta(&self, _server: &str) -> Result<(), MetadataError> {
        Ok(())
    }

    fn rpc_meta(&self, server: &str) -> Result<RpcMeta, MetadataError> {
        let (host, port) = split_host_port(server)
            .ok_or_else(|| MetadataError::BadSegmentName(server.to_owned()))?;
        Ok(RpcMeta {
            ip_or_host_name: host.to_owned(),
            rpc_port: port,
        })
    }
}

/// Reads a descriptor stored under `key`.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_strings_parse_as_mooncake_does() {
        assert_eq!(
            MetadataConn::parse("P2PHANDSHAKE").unwrap(),
            MetadataConn::P2pHandshake
        );
        assert_eq!(
            MetadataConn::parse("etcd://h1:2379,h2:2379").unwrap(),
            MetadataConn::Etcd(vec!["h1:2379".into(), "h2:2379".into()])
        );
        assert_eq!(
            MetadataConn::parse("10.0.0.1:2379").unwrap(),
            MetadataConn::Etcd(vec!["10.0.0.1:2379".into()])
        );
        assert_eq!(
            MetadataConn::parse("http://127.0.0.1:8080/metadata").unwrap(),
            MetadataConn::Http("http://127.0.0.1:8080/metadata".into())
        );
        for bad in ["", "etcd://", "ftp://x", "nohostport", "etcd://h1:notaport"] {
            assert!(MetadataConn::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn p2p_names_are_endpoints() {
        let store = P2pStore::default();
        let meta = RpcMeta {
            ip_or_host_name: "127.0.0.1".into(),
            rpc_port: 15123,
        };
        assert_eq!(store.segment_name("ignored", &meta), "127.0.0.1:15123");
        assert_eq!(store.rpc_meta("127.0.0.1:15123").unwrap(), meta);
        assert!(matches!(
            store.rpc_meta("node-a"),
            Err(MetadataError::BadSegmentName(_))
        ));
        let v6 = RpcMeta {
            ip_or_host_name: "::1".into(),
            rpc_port: 1,
        };
        assert_eq!(v6.endpoint(), "[::1]:1");
    }
}
