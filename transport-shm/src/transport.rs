//! The transport the engine installs: start-up (the socket, the copy threads), what it
//! publishes, memfd buffers, and submits handed to the hands that copy them.

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use tern_engine::{
    AlignedBuffer, RegionInfo, SegmentDesc, Slice, Transport, TransportContext, TransportError,
    TransportReport,
};

use crate::PROTOCOL;
use crate::client::Links;
use crate::config::ShmConfig;
use crate::error::ShmError;
use crate::identity::{Extension, HostIdentity, same_host};
use crate::server::{Owner, Server};
use crate::share::Hands;

/// The shared-memory transport. Install it beside another transport (TCP, RDMA) for the
/// peers that are not on this host or whose memory it cannot reach.
#[derive(Debug)]
pub struct ShmTransport {
    config: ShmConfig,
    identity: Option<HostIdentity>,
    running: OnceLock<Arc<Running>>,
}

/// What a started transport runs.
pub(crate) struct Running {
    pub(crate) owner: Arc<Owner>,
    pub(crate) links: Arc<Links>,
    extension: serde_json::Value,
    hands: Hands,
    server: Mutex<Option<Server>>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("socket", &self.owner.socket)
            .finish_non_exhaustive()
    }
}

impl ShmTransport {
    /// A transport with `config`.
    pub fn new(config: ShmConfig) -> Self {
        Self {
            config,
            identity: HostIdentity::current().ok(),
            running: OnceLock::new(),
        }
    }

    /// The abstract socket peers connect to, once started.
    pub fn socket_name(&self) -> Option<String> {
        self.running.get().map(|r| r.owner.socket.clone())
    }

    /// Peers connected to this node's socket now.
    pub fn inbound_peers(&self) -> usize {
        self.running.get().map_or(0, |r| r.owner.peers())
    }

    fn start_running(&self, context: TransportContext) -> Result<Running, ShmError> {
        let identity = match &self.identity {
            Some(identity) => identity.clone(),
            None => HostIdentity::current().map_err(ShmError::Identity)?,
        };
        self.config.ptrace.apply()?;
        let mut tag = [0u8; 8];
        getrandom::fill(&mut tag).map_err(|e| ShmError::Identity(std::io::Error::other(e)))?;
        let socket = crate::identity::socket_name(std::process::id(), &tag);
        let owner = Arc::new(Owner::new(
            context.registry.clone(),
            context.segment_name.clone(),
            socket.clone(),
            context.cluster_secret().cloned(),
            self.config.revoke_timeout,
            self.config.max_inbound,
            self.config.exchange_timeout,
        ));
        let server = Server::start(owner.clone()).map_err(|source| ShmError::Bind {
            socket: socket.clone(),
            source,
        })?;
        let extension = Extension {
            identity,
            socket,
            pid: std::process::id(),
        }
        .to_json();
        let links = Arc::new(Links::new(
            context.clone(),
            self.config.connect_timeout,
            self.config.io_timeout,
        ));
        let hands = Hands::start(self.config.workers, &links)?;
        Ok(Running {
            owner,
            links,
            extension,
            hands,
            server: Mutex::new(Some(server)),
        })
    }
}

impl Default for ShmTransport {
    fn default() -> Self {
        Self::new(ShmConfig::default())
    }
}

impl Transport for ShmTransport {
    fn protocol(&self) -> &'static str {
        PROTOCOL
    }

    /// Above RDMA (10) and TCP (0): a same-host peer is reached here first.
    fn priority(&self) -> u8 {
        20
    }

    /// Only a peer whose `tern.shm` names this boot, network namespace, host and user (the
    /// first slice confirms it over the socket).
    fn can_reach(&self, peer: &SegmentDesc) -> bool {
        self.identity
            .as_ref()
            .is_some_and(|me| same_host(me, peer.tern.get(PROTOCOL)))
    }

    fn start(&self, context: TransportContext) -> Result<(), TransportError> {
        let running = self.start_running(context)?;
        self.running
            .set(Arc::new(running))
            .map_err(|_| TransportError::State("shared-memory transport started twice".into()))
    }

    /// Revokes the buffer from every peer that mapped it; those that do not confirm in time
    /// are cut off and listed in the report (the engine's unregistering cannot fail here).
    fn unregister_memory(&self, region: &RegionInfo) {
        if let Some(running) = self.running.get() {
            running.owner.revoke(region.addr);
        }
    }

    /// Mooncake's fields are not this transport's; it takes its name out of `protocol` when
    /// another transport is there, so that Mooncake peers see only protocols they know.
    fn describe(&self, desc: &mut SegmentDesc, _regions: &[RegionInfo]) {
        if desc.protocol.iter().any(|p| p != PROTOCOL) {
            desc.protocol.retain(|p| p != PROTOCOL);
        }
    }

    fn extension(&self, _regions: &[RegionInfo]) -> Option<serde_json::Value> {
        self.running.get().map(|r| r.extension.clone())
    }

    fn allocate(&self, len: usize) -> Option<Result<AlignedBuffer, TransportError>> {
        if !self.config.memfd_buffers {
            return None;
        }
        let running = self.running.get()?;
        let name = format!("tern-shm-{}", std::process::id());
        Some(
            AlignedBuffer::shared(len, &name)
                .inspect(|buffer| {
                    if let Some(memfd) = buffer.memfd() {
                        running.owner.remember(buffer.addr(), memfd);
                    }
                })
                .map_err(|e| TransportError::Memory {
                    addr: 0,
                    len,
                    message: e.to_string(),
                }),
        )
    }

    fn max_slice_size(&self) -> usize {
        self.config.slice_size.max(1)
    }

    fn submit(&self, slices: &mut Vec<Slice>) {
        let Some(running) = self.running.get() else {
            for slice in slices.drain(..) {
                slice.decline("the shared-memory transport is not started");
            }
            return;
        };
        if slices.is_empty() {
            return;
        }
        // Spread over the copy threads and the thread that will wait for the batch (it
        // helps: `help`).
        running
            .hands
            .share_out(std::mem::take(slices), &running.links);
    }

    fn offers_help(&self) -> bool {
        true
    }

    /// A waiter copies one queued job itself: with as many copy threads as cores, a waiter
    /// spinning would take a core from them.
    fn help(&self) -> bool {
        self.running
            .get()
            .is_some_and(|running| running.hands.help(&running.links))
    }

    fn report(&self) -> TransportReport {
        self.running
            .get()
            .map_or_else(TransportReport::default, |running| running.report())
    }

    fn shutdown(&self) {
        let Some(running) = self.running.get() else {
            return;
        };
        running.server.lock().take();
        running.hands.stop();
        running.links.close();
    }
}
