//! The state the transport's threads share: NICs with their workers and endpoint stores,
//! registered keys, path health; routing of slices; both sides of the Connection handshake.
//!
//! Here: the shared state and the health of NICs and paths. Beside it: `routing` (which
//! path, NIC and keys a slice takes, and again after a failure), `endpoints` (the endpoint a
//! worker uses for a path, made when there is none), `connect` (the active side of the
//! handshake) and `accept` (the passive side).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use tern_engine::TransportContext;
use tern_memreg::nic::NicKeys;
use tern_metadata::PriorityMatrix;
use tern_verbs::{PathConfig, QpCaps};

use crate::config::RdmaConfig;
use crate::endpoint::EndpointStore;
use crate::nic::Nic;
use crate::route::{Blame, Health, Ranked};
use crate::worker::WorkerHandle;

mod accept;
mod connect;
mod endpoints;
mod routing;

pub(crate) use routing::RouteCache;
use routing::{PeerView, worker_of};

/// Why a slice goes to the next transport when the peer published its buffer without NIC
/// keys (device memory its NICs did not register): the stats' reason.
pub const KEYLESS_PEER_BUFFER: &str = "the peer's buffer is not registered on its NICs";

/// The most QPs a peer may ask for in one endpoint.
pub(crate) const MAX_QPS_PER_ENDPOINT: usize = 64;

/// One local NIC with what hangs off it.
#[derive(Debug)]
pub(crate) struct NicSlot {
    pub nic: Nic,
    pub workers: Vec<WorkerHandle>,
    pub store: Mutex<EndpointStore>,
    /// The port is not ACTIVE (the monitor looks once a second).
    pub port_down: AtomicBool,
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub config: RdmaConfig,
    pub context: TransportContext,
    pub nics: Vec<NicSlot>,
    pub names: Vec<String>,
    pub matrix: PriorityMatrix,
    pub keys: RwLock<HashMap<usize, Arc<NicKeys>>>,
    pub health: Mutex<Health>,
    /// Whether anything might be paused; routing skips the health lookups when not.
    pub maybe_paused: AtomicBool,
    pub stripe: AtomicUsize,
    pub stopping: AtomicBool,
    pub template: PathConfig,
    pub caps: QpCaps,
    pub cq_entries: usize,
    /// Routing views of peers, by segment, rebuilt when the engine swaps a descriptor.
    pub peer_views: Mutex<HashMap<tern_engine::SegmentId, Arc<PeerView>>>,
    /// Local NICs ranked per location.
    pub local_ranked: Mutex<HashMap<String, Arc<Ranked>>>,
    /// Slices sent again after a failure.
    pub retries: std::sync::atomic::AtomicU64,
    /// Slices to peer buffers published without NIC keys (a peer's device memory its NICs
    /// did not register) handed to the next transport, and their bytes.
    pub device_declines: std::sync::atomic::AtomicU64,
    /// See `device_declines`.
    pub device_declined_bytes: std::sync::atomic::AtomicU64,
    /// The last failure seen with each peer server (only written when something fails).
    pub last_errors: Mutex<HashMap<String, String>>,
}

impl Shared {
    pub fn nic(&self, index: usize) -> &Nic {
        &self.nics[index].nic
    }

    pub fn config_spin(&self) -> Duration {
        self.config.spin
    }

    pub fn cq_entries(&self) -> usize {
        self.cq_entries
    }

    pub fn worker_index(&self, key: &str) -> usize {
        worker_of(key, self.config.workers_per_nic)
    }

    /// This node's path for one of its NICs.
    pub fn local_path(&self, nic: usize) -> String {
        format!("{}@{}", self.context.segment_name, self.nics[nic].nic.name)
    }

    /// Whether a local NIC may carry new slices now.
    pub fn nic_usable(&self, nic: usize, now: Instant) -> bool {
        let port_down = self.nics[nic].port_down.load(Ordering::Relaxed);
        let failing =
            self.maybe_paused.load(Ordering::Relaxed) && self.health.lock().nic_paused(nic, now);
        !port_down && !failing
    }

    /// NICs to publish: the usable ones, or all when none is (peers keep trying).
    pub fn published_nics(&self) -> Vec<usize> {
        let now = Instant::now();
        let usable: Vec<usize> = (0..self.nics.len())
            .filter(|&i| self.nic_usable(i, now))
            .collect();
        if usable.is_empty() {
            (0..self.nics.len()).collect()
        } else {
            usable
        }
    }

    /// Remembers the last failure with the peer behind `key` (a NIC path), for stats.
    pub fn note_failure(&self, key: &str, reason: &str) {
        let server = key.rsplit_once('@').map_or(key, |(server, _)| server);
        self.last_errors
            .lock()
            .insert(server.to_owned(), reason.to_owned());
    }

    pub fn blame(&self, nic: usize, key: &Arc<str>, blame: Blame) {
        self.maybe_paused.store(true, Ordering::Relaxed);
        let paused_nic = self.health.lock().failed(nic, key, blame, Instant::now());
        if paused_nic {
            tracing::warn!(
                "NIC {} keeps failing: paused for {:?}, and the descriptor republished without it",
                self.nics[nic].nic.name,
                self.config.rail_pause
            );
            self.republish_later();
        }
    }

    pub fn succeeded(&self, nic: usize) {
        if self.maybe_paused.load(Ordering::Relaxed) {
            self.health.lock().succeeded(nic);
        }
    }

    /// Republishes from a thread of its own: the engine calls back into `describe`, and the
    /// caller may hold locks `describe` needs.
    pub fn republish_later(&self) {
        let context = self.context.clone();
        let spawned = std::thread::Builder::new()
            .name("tern-rdma-publish".into())
            .spawn(move || {
                if let Err(e) = context.republish() {
                    tracing::warn!("republishing after a NIC change: {e}");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot republish after a NIC change: {e}");
        }
    }
}
