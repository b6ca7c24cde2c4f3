//! Building a [`TransferEngine`]: settings, then start-up of the RPC server and transports.

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use tern_memreg::{MemoryRegistry, PretouchPolicy};
use tern_metadata::auth::ClusterSecret;
use tern_metadata::net::{self, PortChoice};
use tern_metadata::rpc::{RpcClientConfig, RpcServer, RpcServerConfig, RpcType};
use tern_metadata::{RpcMeta, SegmentDesc, StoreOptions, open_store};

use crate::batch::Helpers;
use crate::engine::{EngineInner, TransferEngine};
use crate::error::EngineError;
use crate::rpc::handle_rpc;
use crate::segments::{SegmentTable, handle_event};
use crate::slicing::SliceSize;
use crate::stats::EngineCounters;
use crate::transport::{PeerSegment, Transport};
use crate::types::SegmentId;

/// Environment variable with the default transfer deadline in seconds (as Mooncake's Python
/// layer).
pub const TRANSFER_TIMEOUT_ENV: &str = "MC_TRANSFER_TIMEOUT";

/// Environment variable that turns [`TransferEngineBuilder::metrics`] off with `0`.
pub const METRICS_ENV: &str = "TERN_METRICS";
/// Environment variable with [`TransferEngineBuilder::wait_spin`] in microseconds.
pub const WAIT_SPIN_ENV: &str = "TERN_WAIT_SPIN_US";

/// Builds a [`TransferEngine`].
pub struct TransferEngineBuilder {
    local_server_name: Option<String>,
    metadata: String,
    advertise: Option<String>,
    rpc_ports: PortChoice,
    transports: Vec<Arc<dyn Transport>>,
    transfer_timeout: Option<Duration>,
    wait_spin: Duration,
    pretouch: PretouchPolicy,
    metrics: bool,
    merge_requests: bool,
    /// Store settings, including the handshake RPC client's timeouts.
    store: StoreOptions,
    /// From [`Self::cluster_secret`] or the environment; a bad one fails `build`.
    cluster_secret: Result<Option<ClusterSecret>, String>,
}

impl std::fmt::Debug for TransferEngineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngineBuilder")
            .field("local_server_name", &self.local_server_name)
            .field("metadata", &self.metadata)
            .field(
                "transports",
                &self
                    .transports
                    .iter()
                    .map(|t| t.protocol())
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Default for TransferEngineBuilder {
    fn default() -> Self {
        let timeout_secs = std::env::var(TRANSFER_TIMEOUT_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(30);
        Self {
            local_server_name: None,
            metadata: "P2PHANDSHAKE".to_owned(),
            advertise: None,
            rpc_ports: PortChoice::default(),
            transports: Vec::new(),
            transfer_timeout: Some(Duration::from_secs(timeout_secs)),
            wait_spin: Duration::from_micros(
                std::env::var(WAIT_SPIN_ENV)
                    .ok()
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .unwrap_or(200)
                    .min(100_000),
            ),
            pretouch: PretouchPolicy::default(),
            metrics: std::env::var(METRICS_ENV).map_or(true, |v| v.trim() != "0"),
            merge_requests: true,
            store: StoreOptions::default(),
            cluster_secret: ClusterSecret::from_env().map_err(|e| e.to_string()),
        }
    }
}

impl TransferEngineBuilder {
    /// The name others open this node by (P2P mode replaces it with `ip:rpc_port`). Defaults
    /// to the advertised address.
    pub fn local_server_name(mut self, name: impl Into<String>) -> Self {
        self.local_server_name = Some(name.into());
        self
    }

    /// The metadata connection string: `P2PHANDSHAKE` (default), `etcd://..`, `http://..`.
    pub fn metadata(mut self, conn: impl Into<String>) -> Self {
        self.metadata = conn.into();
        self
    }

    /// The IP address to advertise and bind to (else `MC_TCP_BIND_ADDRESS`, else the host of
    /// the server name if it is an address, else the first non-loopback interface).
    pub fn advertise_address(mut self, ip: impl Into<String>) -> Self {
        self.advertise = Some(ip.into());
        self
    }

    /// Where the handshake RPC listens (default: a free port in 15000–17000).
    pub fn rpc_ports(mut self, ports: PortChoice) -> Self {
        self.rpc_ports = ports;
        self
    }

    /// Installs a transport. Every registered region is offered to every transport.
    pub fn transport(mut self, transport: impl Transport) -> Self {
        self.transports.push(Arc::new(transport));
        self
    }

    /// Default deadline of a batch, counted from its first submit (`None`: no deadline).
    /// Defaults to `MC_TRANSFER_TIMEOUT` seconds, else 30 s.
    pub fn transfer_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.transfer_timeout = timeout;
        self
    }

    /// How long [`Batch::wait`](crate::Batch::wait) polls for completion before it sleeps (default 200 µs, or
    /// `TERN_WAIT_SPIN_US`): a short transfer is then seen done at once instead of after a
    /// wake-up, at the price of that much CPU per wait. With one task left it polls memory;
    /// with more it yields its core between looks, to threads that may be doing the work.
    pub fn wait_spin(mut self, spin: Duration) -> Self {
        self.wait_spin = spin;
        self
    }

    /// Timeouts of outgoing handshake RPCs.
    pub fn rpc_client(mut self, config: RpcClientConfig) -> Self {
        self.store.rpc_client = config;
        self
    }

    /// Metadata store settings that override the environment: cluster ID, etcd lease TTL,
    /// start-up retry.
    pub fn store_options(mut self, options: StoreOptions) -> Self {
        let rpc_client = std::mem::take(&mut self.store.rpc_client);
        self.store = StoreOptions {
            rpc_client,
            ..options
        };
        self
    }

    /// The secret every node of the cluster shares (default: `TERN_CLUSTER_SECRET`, or the file
    /// named by `TERN_CLUSTER_SECRET_FILE`; else none). With it, the handshake RPC and every
    /// TCP data connection open with a challenge–response in which both sides prove they know
    /// it ([`tern_metadata::auth`]); a peer that cannot is refused before anything is read or
    /// served. Without it, this node speaks plain Mooncake. An empty secret fails `build`.
    pub fn cluster_secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.cluster_secret = ClusterSecret::new(secret.as_ref())
            .map(Some)
            .map_err(|e| e.to_string());
        self
    }

    /// Whether the engine counts what its transports move and times each transfer (default:
    /// on, unless `TERN_METRICS=0`). Counting is per thread and costs no atomic
    /// read-modify-write; timing is two clock reads per task. Off, [`TransferEngine::stats`]
    /// reports no bytes, slices, failures or latencies of its own (transports' peer and NIC
    /// figures remain).
    pub fn metrics(mut self, on: bool) -> Self {
        self.metrics = on;
        self
    }

    /// Whether [`TransferEngine::submit`] moves neighbouring requests of one call (same peer
    /// and opcode, contiguous on both sides, within one region and one remote buffer) as one
    /// run of slices (default: on). A serving stack's one request per page then costs about
    /// what one large request does; off, each request is cut on its own, which is there to
    /// measure what merging gains.
    pub fn merge_requests(mut self, on: bool) -> Self {
        self.merge_requests = on;
        self
    }

    /// When [`TransferEngine::allocate`] pre-touches its buffers.
    pub fn pretouch(mut self, policy: PretouchPolicy) -> Self {
        self.pretouch = policy;
        self
    }

    /// Starts the handshake RPC server and the transports, and publishes this node.
    pub fn build(mut self) -> Result<TransferEngine, EngineError> {
        if self.transports.is_empty() {
            return Err(EngineError::InvalidArgument(
                "install at least one transport".into(),
            ));
        }
        let secret = self
            .cluster_secret
            .map_err(|e| EngineError::InvalidArgument(format!("cluster secret: {e}")))?
            .or_else(|| self.store.rpc_client.secret.clone());
        self.store.rpc_client.secret = secret.clone();
        let rpc_client = self.store.rpc_client.clone();
        let store = open_store(&self.metadata, self.store)?;
        let configured = self
            .advertise
            .clone()
            .or_else(|| std::env::var(net::BIND_ADDRESS_ENV).ok());
        let requested_name = self.local_server_name.clone().unwrap_or_default();
        let advertised_ip =
            net::advertised_ip(configured.as_deref(), &requested_name).map_err(|source| {
                EngineError::Io {
                    context: "choosing the advertised address".into(),
                    source,
                }
            })?;
        let local_server_name = if requested_name.is_empty() {
            advertised_ip.to_string()
        } else {
            requested_name
        };
        let listener = net::bind_listener(advertised_ip, self.rpc_ports).map_err(|source| {
            EngineError::Io {
                context: format!("binding the handshake RPC on {advertised_ip}"),
                source,
            }
        })?;
        let rpc_port = listener
            .local_addr()
            .map_err(|source| EngineError::Io {
                context: "reading the handshake RPC address".into(),
                source,
            })?
            .port();
        let rpc_meta = RpcMeta {
            ip_or_host_name: advertised_ip.to_string(),
            rpc_port,
        };
        let segment_name = store.segment_name(&local_server_name, &rpc_meta);
        let mut rpc_client = rpc_client;
        rpc_client.local_segment = segment_name.clone();
        let server_segment = segment_name.clone();
        let mut serve_error = None;

        let inner = Arc::new_cyclic(|weak: &Weak<EngineInner>| EngineInner {
            weak: weak.clone(),
            stream_watcher: Default::default(),
            kept: Arc::default(),
            local_server_name,
            segment_name,
            advertised_ip,
            rpc_meta,
            registry: Arc::new(MemoryRegistry::new()),
            counters: Arc::new(EngineCounters::new(self.transports.len(), self.metrics)),
            helpers: Helpers::of(&self.transports),
            slice_sizes: self
                .transports
                .iter()
                .map(|transport| SliceSize::of(transport.as_ref()))
                .collect(),
            transports: self.transports,
            store,
            local: RwLock::new(Arc::new(PeerSegment {
                id: SegmentId::LOCAL,
                name: String::new(),
                desc: SegmentDesc::new("", "tcp"),
                rpc: RpcMeta {
                    ip_or_host_name: String::new(),
                    rpc_port: 0,
                },
                routes: Default::default(),
            })),
            local_json: RwLock::new(Arc::new(String::new())),
            segments: RwLock::new(SegmentTable::default()),
            next_segment: AtomicU64::new(1),
            notifies: Mutex::new(VecDeque::new()),
            change: Mutex::new(()),
            transfer_timeout: self.transfer_timeout,
            wait_spin: self.wait_spin,
            merge_requests: self.merge_requests,
            rpc_client,
            pretouch: self.pretouch,
            rpc_server: Mutex::new({
                let weak = weak.clone();
                let handler = move |ty: RpcType, body: &[u8]| handle_rpc(&weak, ty, body);
                let config = RpcServerConfig {
                    secret,
                    segment: server_segment,
                    ..RpcServerConfig::default()
                };
                RpcServer::serve(listener, config, Arc::new(handler))
                    .map_err(|e| serve_error = Some(e))
                    .ok()
            }),
        });
        if let Some(source) = serve_error {
            return Err(EngineError::Io {
                context: "starting the handshake RPC server".into(),
                source,
            });
        }
        let engine = TransferEngine::owning(inner);
        engine.start()?;
        let weak = Arc::downgrade(&engine.inner);
        engine
            .inner
            .store
            .subscribe(Arc::new(move |event| handle_event(&weak, event)));
        Ok(engine)
    }
}
