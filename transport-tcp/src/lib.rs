//! Tern's TCP transport, speaking Mooncake's TCP data protocol (v2, with v1 fallback) and,
//! to Tern peers, v3: v2 with frames padded to a cache line.
//!
//! Wire format: a 24-byte header `{u64 size, u64 addr, u8 opcode, 7 bytes padding}`,
//! little-endian, opcode READ 0 / WRITE 1 with the high bit set for v2. A v2 server answers
//! with an 8-byte status frame `0x4D435456_00000000 | code` ("MCTV"; 0 OK, 1 address
//! rejected): before READ data, and after WRITE data has landed in memory. v1 has no status.
//! v3 sets opcode bit `0x40` beside v2's and pads the header and every status frame with
//! zeros to 64 bytes, so blocks stay on the cache-line grid in the socket buffers
//! ([`FRAME_ALIGN`]); a request uses the lower of the two ends' `tcp_proto_version`.
//!
//! The server checks every request against the registered, remote-accessible memory before
//! a byte moves, answers "address rejected" and keeps the connection usable. The client keeps
//! persistent connections, a pool per peer, and stripes slices across them, each connection
//! pipelining several; reads land straight in the destination memory and writes are sent
//! straight from the source memory.
//!
//! It must not decide what to transfer (the engine checks and slices requests), keep
//! deadlines (the engine does), or publish metadata (it only fills its descriptor fields).
#![forbid(unsafe_code)]

mod client;
mod server;
mod wire;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;
use tern_engine::{
    PortChoice, RegionInfo, SegmentDesc, Slice, Transport, TransportContext, TransportError,
    TransportReport,
};
use tern_metadata::auth::ClusterSecret;

pub use server::{RequestOutcome, serve_request};

/// Gives `socket` send and receive buffers of `bytes` each, when asked to.
fn size_buffers(socket: socket2::SockRef<'_>, bytes: Option<usize>) -> std::io::Result<()> {
    if let Some(bytes) = bytes {
        socket.set_send_buffer_size(bytes)?;
        socket.set_recv_buffer_size(bytes)?;
    }
    Ok(())
}
pub use wire::{
    FRAME_ALIGN, HEADER_LEN, Header, OP_ALIGNED, OP_READ, OP_V2, OP_WRITE, STATUS_LEN,
    STATUS_MAGIC, Status,
};

/// The protocol name published in descriptors.
pub const PROTOCOL: &str = "tcp";

/// Environment variable that caps the framing: `1` forces the legacy v1 framing (as
/// Mooncake), `2` Mooncake's v2 without the aligned framing.
pub const PROTO_ENV: &str = "MC_TCP_PROTO";

/// Environment variable with the number of connections per peer (as Mooncake's lanes).
pub const LANES_ENV: &str = "MC_TCP_LANES_PER_PEER";

/// One lane per core, at least 2 and at most 8: each lane is a thread that keeps one
/// connection busy, and more lanes than cores only adds switching.
fn default_lanes() -> usize {
    std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 8)
}

/// Settings of the TCP transport.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Where the data listener binds (default: a free port in 15000–17000).
    pub ports: PortChoice,
    /// Persistent connections per peer; slices are striped across them, and each connection
    /// pipelines several slices. Default: one per core, 2 to 8 (`MC_TCP_LANES_PER_PEER`).
    pub connections_per_peer: usize,
    /// Largest slice; a larger request is cut and striped.
    pub slice_size: usize,
    /// Bound on connecting to a peer.
    pub connect_timeout: Duration,
    /// Bound on each socket read or write once a transfer is under way.
    pub io_timeout: Duration,
    /// How long an inbound connection may sit idle between requests before it is closed.
    pub idle_timeout: Duration,
    /// Inbound connections served at once; more are closed. Connections still in their
    /// opening (first request header, or with a cluster secret its proof) have as many places
    /// again, the oldest given up for a newcomer.
    pub max_inbound: usize,
    /// How long an inbound connection may take from being accepted to its first request
    /// header (with a cluster secret: to its proof) before it is closed.
    pub exchange_timeout: Duration,
    /// Highest protocol version spoken and published: 3 (v2 with the aligned framing of
    /// [`wire`](crate::FRAME_ALIGN)), 2 (Mooncake's status frames) or 1 (legacy). Each request
    /// uses the lower of this and the peer's published version.
    pub proto_version: u8,
    /// Send and receive buffer size of every data socket, both ways (`None`: the kernel's
    /// autotuning). Small buffers are for tests that want the kernel to push back early.
    pub socket_buffer_bytes: Option<usize>,
}

impl Default for TcpConfig {
    fn default() -> Self {
        let lanes = std::env::var(LANES_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| (1..=64).contains(&n))
            .unwrap_or_else(default_lanes);
        let proto_version = match std::env::var(PROTO_ENV).as_deref().map(str::trim) {
            Ok("1") => 1,
            Ok("2") => 2,
            _ => 3,
        };
        Self {
            ports: PortChoice::default(),
            connections_per_peer: lanes,
            slice_size: 1 << 20,
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(300),
            max_inbound: 256,
            exchange_timeout: tern_metadata::auth::EXCHANGE_TIMEOUT,
            proto_version,
            socket_buffer_bytes: None,
        }
    }
}

/// The TCP transport. Install it with `TransferEngine::builder().transport(..)`.
#[derive(Debug)]
pub struct TcpTransport {
    config: TcpConfig,
    running: OnceLock<Arc<Running>>,
}

#[derive(Debug)]
struct Running {
    config: TcpConfig,
    /// The engine's cluster secret: every data connection, both ways, opens by proving it.
    secret: Option<ClusterSecret>,
    /// This node's segment name, claimed when connecting with a secret.
    segment: String,
    stop: Arc<AtomicBool>,
    server: Mutex<Option<server::Server>>,
    local: SocketAddr,
    pools: Mutex<HashMap<(String, u16), Arc<client::Pool>>>,
}

impl TcpTransport {
    /// A transport with `config`.
    pub fn new(config: TcpConfig) -> Self {
        Self {
            config,
            running: OnceLock::new(),
        }
    }

    /// The data port, once started.
    pub fn data_port(&self) -> Option<u16> {
        self.running.get().map(|r| r.local.port())
    }

    fn pool(running: &Running, host: &str, port: u16, peer_segment: &str) -> Arc<client::Pool> {
        let mut pools = running.pools.lock();
        pools
            .entry((host.to_owned(), port))
            .or_insert_with(|| {
                let auth = running.secret.clone().map(|secret| client::PoolAuth {
                    secret,
                    local_segment: running.segment.clone(),
                    peer_segment: peer_segment.to_owned(),
                });
                let endpoint = if host.contains(':') {
                    format!("[{host}]:{port}")
                } else {
                    format!("{host}:{port}")
                };
                client::Pool::start(endpoint, running.config.clone(), auth, running.stop.clone())
            })
            .clone()
    }
}

impl Default for TcpTransport {
    fn default() -> Self {
        Self::new(TcpConfig::default())
    }
}

impl Transport for TcpTransport {
    fn protocol(&self) -> &'static str {
        PROTOCOL
    }

    fn start(&self, context: TransportContext) -> Result<(), TransportError> {
        let stop = Arc::new(AtomicBool::new(false));
        let secret = context.cluster_secret().cloned();
        let server = server::Server::start(
            context.advertised_ip,
            context.registry.clone(),
            self.config.clone(),
            secret.clone(),
            context.segment_name.clone(),
        )
        .map_err(|e| TransportError::Io {
            context: format!("binding the data port on {}", context.advertised_ip),
            message: e.to_string(),
        })?;
        let running = Arc::new(Running {
            config: self.config.clone(),
            secret,
            segment: context.segment_name.clone(),
            local: server.local_addr(),
            stop,
            server: Mutex::new(Some(server)),
            pools: Mutex::new(HashMap::new()),
        });
        self.running
            .set(running)
            .map_err(|_| TransportError::State("TCP transport started twice".into()))
    }

    fn describe(&self, desc: &mut SegmentDesc, _regions: &[RegionInfo]) {
        if let Some(running) = self.running.get() {
            desc.tcp_data_port = running.local.port();
            desc.tcp_proto_version = u32::from(self.config.proto_version);
        }
    }

    fn max_slice_size(&self) -> usize {
        self.config.slice_size.max(1)
    }

    fn submit(&self, slices: &mut Vec<Slice>) {
        let Some(running) = self.running.get() else {
            for slice in slices.drain(..) {
                slice.fail(tern_engine::TransferError::Dropped(
                    "TCP transport not started".into(),
                ));
            }
            return;
        };
        // Runs of slices to one peer view (a submit usually has one) go to its pool together;
        // the pool is looked up once per run, by the peer's address.
        let mut slices = slices.drain(..).peekable();
        while let Some(first) = slices.next() {
            let peer = first.peer().clone();
            let pool = Self::pool(
                running,
                &peer.rpc.ip_or_host_name,
                peer.desc.tcp_data_port,
                &peer.desc.name,
            );
            let run = std::iter::once(first).chain(std::iter::from_fn(|| {
                slices.next_if(|s| Arc::ptr_eq(s.peer(), &peer))
            }));
            pool.push_all(run);
        }
    }

    /// Each pool gives back the queued slices of ended tasks, and its lanes those they hold
    /// (dropping a connection that has one on the wire).
    fn cut_off(&self) {
        let Some(running) = self.running.get() else {
            return;
        };
        let pools: Vec<_> = running.pools.lock().values().cloned().collect();
        for pool in pools {
            pool.cut_off();
        }
    }

    fn report(&self) -> TransportReport {
        let Some(running) = self.running.get() else {
            return TransportReport::default();
        };
        let pools = running.pools.lock();
        let mut peers: Vec<_> = pools.values().map(|pool| pool.peer_stats()).collect();
        peers.sort_by(|a, b| a.peer.cmp(&b.peer));
        let served = running
            .server
            .lock()
            .as_ref()
            .map(server::Server::served)
            .unwrap_or_default();
        TransportReport {
            retries: 0,
            peers,
            nics: Vec::new(),
            served,
            declined: Vec::new(),
        }
    }

    fn shutdown(&self) {
        let Some(running) = self.running.get() else {
            return;
        };
        running.stop.store(true, Ordering::Release);
        running.server.lock().take();
        let pools: Vec<_> = running.pools.lock().drain().map(|(_, p)| p).collect();
        for pool in pools {
            pool.close();
        }
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        self.shutdown();
    }
}
