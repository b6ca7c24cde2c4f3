//! Tern's RDMA transport: topology, one context per NIC, endpoints made by handshake, slices
//! striped over NICs and QPs, pinned worker threads that post and poll.
//!
//! [`RdmaTransport::discover`] opens the NICs (an allow-list, or every device with an active
//! port) and works out their priority matrix; installed in an engine it registers every
//! region on every NIC, publishes the devices, per-NIC keys and matrix in Mooncake's
//! descriptor schema, answers and sends Mooncake's Connection handshake (with Tern's MTU
//! field), and moves slices as RDMA READ and WRITE. Failed slices are retried on another
//! path, NIC or QP; failing paths and NICs are paused; a remote access error fails its task
//! with a typed error. When the engine asks ([`Transport::cut_off`]), slices of tasks it
//! ended are let go at once: dropped if not posted, flushed (their endpoint's QPs moved to
//! the error state) if posted.
//!
//! It must not call libibverbs directly (that is `tern-verbs`), must not publish metadata
//! itself (it hands its part of the descriptor to the engine), and must not own deadlines or
//! cancellation (the engine does).
#![forbid(unsafe_code)]

pub mod config;
mod endpoint;
mod error;
pub mod handshake;
mod nic;
mod route;
mod shared;
pub mod sieve;
pub mod topology;
mod worker;

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use tern_engine::MemoryKind;
use tern_engine::{
    BufferDesc, NicStats, PeerState, PeerStats, RegionInfo, SegmentDesc, Slice, TransferError,
    Transport, TransportContext, TransportError, TransportReport,
};
use tern_memreg::nic::register_on_devices;
use tern_metadata::{DeviceDesc, PriorityMatrix};
use tern_verbs::{Access, CompletionQueue};

pub use config::RdmaConfig;
pub use error::RdmaError;

use endpoint::EndpointStore;
use nic::{Nic, open_nics};
use route::Health;
use shared::{NicSlot, RouteCache, Shared};
use topology::{NicInfo, build_matrix, numa_nodes, parse_matrix, read_matrix_file, restrict};
use worker::{Job, Worker, worker_pair};

/// The protocol name an RDMA node publishes in its segment descriptor.
pub const PROTOCOL: &str = "rdma";

/// Whether `desc` is an RDMA segment this transport could address: protocol `rdma`, at least
/// one device, and every remote-accessible buffer carrying one rkey per device.
pub fn is_addressable(desc: &SegmentDesc) -> bool {
    desc.speaks(PROTOCOL)
        && !desc.devices.is_empty()
        && desc.buffers.iter().all(|b| {
            b.rkey
                .as_ref()
                .is_none_or(|k| k.is_empty() || k.len() == desc.devices.len())
        })
}

/// The RDMA transport. Install it with `TransferEngine::builder().transport(..)`; a clone
/// shares its state (keep one to read [`RdmaTransport::nic_stats`]).
#[derive(Debug, Clone)]
pub struct RdmaTransport {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: RdmaConfig,
    names: Vec<String>,
    matrix: PriorityMatrix,
    /// The opened NICs until `start` moves them into the running state.
    pending: Mutex<Option<Vec<Nic>>>,
    running: OnceLock<Arc<Shared>>,
    monitor: Mutex<Option<JoinHandle<()>>>,
}

impl RdmaTransport {
    /// Opens the NICs `config` allows (every device with an active port when its list is
    /// empty) and works out their priority matrix: the one given in `config`, else the file
    /// `MC_CUSTOM_TOPO_JSON` names, else one built from the NICs' NUMA nodes.
    pub fn discover(config: RdmaConfig) -> Result<Self, RdmaError> {
        // Before any device is opened, the part of the check that needs none.
        config.check_slice_size([])?;
        let nics = open_nics(&config)?;
        config.check_slice_size(nics.iter().map(|n| (n.name.as_str(), n.max_msg)))?;
        let names: Vec<String> = nics.iter().map(|n| n.name.clone()).collect();
        let matrix = match (&config.priority_matrix, &config.topology_file) {
            (Some(json), _) => parse_matrix(json)?,
            (None, Some(path)) => read_matrix_file(path)?,
            (None, None) => {
                let infos: Vec<NicInfo> = nics
                    .iter()
                    .map(|n| NicInfo {
                        name: n.name.clone(),
                        numa_node: n.numa_node,
                    })
                    .collect();
                build_matrix(&infos, &numa_nodes(Path::new("/sys")))
            }
        };
        let matrix = restrict(&matrix, &names);
        if !matrix
            .values()
            .any(|[preferred, available]| !preferred.is_empty() || !available.is_empty())
        {
            return Err(RdmaError::NoDevice {
                looked_for: format!("the devices of the priority matrix ({:?})", matrix.keys()),
                found: format!("it names none of this host's usable devices {names:?}"),
            });
        }
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                names,
                matrix,
                pending: Mutex::new(Some(nics)),
                running: OnceLock::new(),
                monitor: Mutex::new(None),
            }),
        })
    }

    /// [`discover`](Self::discover) with the settings from the environment.
    pub fn from_env() -> Result<Self, RdmaError> {
        Self::discover(RdmaConfig::from_env())
    }

    /// The NICs in use, in the order of every key array.
    pub fn device_names(&self) -> &[String] {
        &self.inner.names
    }

    /// The local priority matrix (every NIC; the published one leaves out paused NICs).
    pub fn priority_matrix(&self) -> &PriorityMatrix {
        &self.inner.matrix
    }

    /// What each NIC has moved so far (empty before the engine starts the transport).
    pub fn nic_stats(&self) -> Vec<NicStats> {
        let Some(shared) = self.inner.running.get() else {
            return Vec::new();
        };
        let now = std::time::Instant::now();
        shared
            .nics
            .iter()
            .enumerate()
            .map(|(i, slot)| {
                let (bytes, slices) = slot
                    .workers
                    .iter()
                    .map(|w| w.counters.moved())
                    .fold((0, 0), |(b, s), (wb, ws)| (b + wb, s + ws));
                NicStats {
                    name: slot.nic.name.clone(),
                    bytes,
                    slices,
                    failures: slot.workers.iter().map(|w| w.counters.failures.get()).sum(),
                    paused: !shared.nic_usable(i, now),
                }
            })
            .collect()
    }

    /// Endpoints cached now, over all NICs.
    pub fn endpoints(&self) -> usize {
        self.inner
            .running
            .get()
            .map_or(0, |s| s.nics.iter().map(|n| n.store.lock().len()).sum())
    }

    fn running(&self) -> Option<&Arc<Shared>> {
        self.inner.running.get()
    }
}

/// Fewer CPUs than this near a NIC and workers are left to the scheduler: pinned to one of
/// two or three CPUs, a worker keeps colliding with the application's own threads.
const MIN_CPUS_TO_PIN: usize = 4;

/// The CPU for worker `slot` of a NIC on `node`: counted from the last CPU of the node, so
/// that workers and the application's first threads (usually on CPU 0) stay apart.
fn worker_cpu(node: Option<u32>, slot: usize) -> Option<usize> {
    let node_cpus = node
        .map(|n| topology::node_cpus(Path::new("/sys"), n))
        .unwrap_or_default();
    let cpus: Vec<usize> = if node_cpus.is_empty() {
        core_affinity::get_core_ids()
            .unwrap_or_default()
            .into_iter()
            .map(|c| c.id)
            .collect()
    } else {
        node_cpus
    };
    let len = cpus.len();
    (len >= MIN_CPUS_TO_PIN).then(|| cpus[len - 1 - slot % len])
}

impl Inner {
    fn start(&self, context: TransportContext) -> Result<(), RdmaError> {
        let nics = self
            .pending
            .lock()
            .take()
            .ok_or(RdmaError::State("the RDMA transport was started twice"))?;
        let config = &self.config;
        let nic::Sizing {
            cq_entries,
            caps,
            template,
        } = nic::sizing(config, &nics);
        let mut slots = Vec::with_capacity(nics.len());
        let mut inboxes = Vec::new();
        for nic in nics {
            let mut workers = Vec::with_capacity(config.workers_per_nic);
            for w in 0..config.workers_per_nic {
                let device = |source| RdmaError::Device {
                    device: nic.name.clone(),
                    source,
                };
                let cq = CompletionQueue::with_channel(nic.context(), cq_entries as i32)
                    .map_err(device)?;
                let (handle, inbox) = worker_pair(cq).map_err(|e| RdmaError::Device {
                    device: nic.name.clone(),
                    source: tern_verbs::VerbsError::InvalidRequest(
                        if e.kind() == std::io::ErrorKind::OutOfMemory {
                            "no memory for a worker doorbell"
                        } else {
                            "cannot make a worker doorbell"
                        },
                    ),
                })?;
                workers.push(handle);
                inboxes.push((slots.len(), w, inbox));
            }
            let qp_bound = (nic.limits.max_qp.max(1) as usize) / config.qps_per_endpoint.max(1);
            let capacity = config.max_endpoints.min(qp_bound.max(1));
            slots.push(NicSlot {
                nic,
                workers,
                store: Mutex::new(EndpointStore::new(capacity)),
                port_down: AtomicBool::new(false),
            });
        }
        let shared = Arc::new(Shared {
            config: config.clone(),
            context,
            names: self.names.clone(),
            matrix: self.matrix.clone(),
            keys: RwLock::new(HashMap::new()),
            health: Mutex::new(Health::new(slots.len(), config.rail_pause)),
            maybe_paused: AtomicBool::new(false),
            stripe: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
            template,
            caps,
            cq_entries,
            peer_views: Mutex::new(HashMap::new()),
            local_ranked: Mutex::new(HashMap::new()),
            retries: std::sync::atomic::AtomicU64::new(0),
            device_declines: std::sync::atomic::AtomicU64::new(0),
            device_declined_bytes: std::sync::atomic::AtomicU64::new(0),
            last_errors: Mutex::new(HashMap::new()),
            nics: slots,
        });
        for (n, w, inbox) in inboxes {
            let worker = Worker::new(shared.clone(), n, w, inbox);
            let pin = config
                .pin_workers
                .then(|| worker_cpu(shared.nics[n].nic.numa_node, n * config.workers_per_nic + w))
                .flatten();
            let thread = std::thread::Builder::new()
                .name(format!("tern-rdma-{}-{w}", shared.nics[n].nic.name))
                .spawn(move || {
                    if let Some(cpu) = pin
                        && !core_affinity::set_for_current(core_affinity::CoreId { id: cpu })
                    {
                        tracing::debug!("could not pin an RDMA worker to CPU {cpu}");
                    }
                    worker.run();
                })
                .map_err(|_| RdmaError::State("cannot start an RDMA worker thread"))?;
            shared.nics[n].workers[w].set_thread(thread);
        }
        let watched = shared.clone();
        let monitor = std::thread::Builder::new()
            .name("tern-rdma-monitor".into())
            .spawn(move || monitor(&watched))
            .map_err(|_| RdmaError::State("cannot start the RDMA monitor thread"))?;
        *self.monitor.lock() = Some(monitor);
        self.running
            .set(shared)
            .map_err(|_| RdmaError::State("the RDMA transport was started twice"))
    }

    fn shutdown(&self) {
        let Some(shared) = self.running.get() else {
            return;
        };
        if shared.stopping.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(monitor) = self.monitor.lock().take() {
            monitor.thread().unpark();
            let _ = monitor.join();
        }
        for slot in &shared.nics {
            for worker in &slot.workers {
                worker.stop();
            }
        }
        for slot in &shared.nics {
            let endpoints = slot.store.lock().drain();
            for ep in endpoints {
                ep.decommission();
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Once a second: which ports are up, and whether the published NICs changed (a port went
/// down or came back, a pause ran out); republishes when they did.
fn monitor(shared: &Shared) {
    let mut published = shared.published_nics();
    while !shared.stopping.load(Ordering::Acquire) {
        std::thread::park_timeout(Duration::from_secs(1));
        if shared.stopping.load(Ordering::Acquire) {
            break;
        }
        for slot in &shared.nics {
            let down = !slot.nic.port_active();
            if slot.port_down.swap(down, Ordering::Relaxed) != down {
                tracing::warn!(
                    "NIC {} port {} is {}",
                    slot.nic.name,
                    slot.nic.port,
                    if down { "down" } else { "up again" }
                );
            }
        }
        if shared.maybe_paused.load(Ordering::Relaxed)
            && !shared
                .health
                .lock()
                .anything_paused(std::time::Instant::now())
        {
            // Every pause ran out: routing can skip the health lookups again.
            shared.maybe_paused.store(false, Ordering::Relaxed);
        }
        let now = shared.published_nics();
        if now != published {
            published = now;
            if let Err(e) = shared.context.republish() {
                tracing::warn!("republishing after a NIC change: {e}");
            }
        }
    }
}

impl Transport for RdmaTransport {
    fn protocol(&self) -> &'static str {
        PROTOCOL
    }

    fn priority(&self) -> u8 {
        10
    }

    fn can_reach(&self, peer: &SegmentDesc) -> bool {
        peer.speaks(PROTOCOL) && !peer.devices.is_empty()
    }

    fn start(&self, context: TransportContext) -> Result<(), TransportError> {
        self.inner
            .start(context)
            .map_err(|e| TransportError::Device {
                device: "RDMA".into(),
                message: e.to_string(),
            })
    }

    fn register_memory(&self, region: &RegionInfo) -> Result<(), TransportError> {
        let shared = self
            .running()
            .ok_or_else(|| TransportError::State("the RDMA transport is not started".into()))?;
        let pin = shared
            .context
            .registry
            .pin(region.addr, region.len)
            .map_err(|e| TransportError::Memory {
                addr: region.addr,
                len: region.len,
                message: e.to_string(),
            })?;
        let access = Access {
            remote_write: region.remote_accessible,
            remote_read: region.remote_accessible,
            relaxed_ordering: true,
        };
        let pds: Vec<_> = shared.nics.iter().map(|s| s.nic.pd.clone()).collect();
        let registered = if region.kind == MemoryKind::Host {
            register_on_devices(&pin, &pds, access).map_err(|e| e.to_string())
        } else {
            // Device memory: by dma-buf, else nvidia_peermem, else a typed error naming both.
            tern_memreg::nic::register_device_on_devices(&pin, &pds, access)
                .map_err(|e| e.to_string())
        };
        let keys = registered.map_err(|message| TransportError::Memory {
            addr: region.addr,
            len: region.len,
            message: format!("registering on {:?}: {message}", shared.names),
        })?;
        shared.keys.write().insert(region.addr, Arc::new(keys));
        Ok(())
    }

    fn unregister_memory(&self, region: &RegionInfo) {
        if let Some(shared) = self.running() {
            shared.keys.write().remove(&region.addr);
        }
    }

    /// The per-NIC `lkey`/`rkey` arrays of every buffer are this transport's.
    fn owns_buffer_keys(&self) -> bool {
        true
    }

    fn describe(&self, desc: &mut SegmentDesc, regions: &[RegionInfo]) {
        let Some(shared) = self.running() else {
            return;
        };
        let nics = shared.published_nics();
        desc.devices = nics
            .iter()
            .map(|&i| {
                let nic = shared.nic(i);
                DeviceDesc {
                    gid: nic.gid.gid.to_string(),
                    lid: nic.lid,
                    name: nic.name.clone(),
                }
            })
            .collect();
        let names: Vec<String> = nics.iter().map(|&i| shared.names[i].clone()).collect();
        desc.priority_matrix = Some(restrict(&shared.matrix, &names));
        let keys = shared.keys.read();
        let pick = |all: &[u32]| -> Vec<u32> {
            nics.iter().filter_map(|&i| all.get(i).copied()).collect()
        };
        desc.buffers = regions
            .iter()
            .map(|region| match keys.get(&region.addr) {
                Some(k) => BufferDesc {
                    addr: region.addr as u64,
                    length: region.len as u64,
                    lkey: Some(pick(&k.lkeys)),
                    name: region.location.clone(),
                    rkey: Some(if region.remote_accessible {
                        pick(&k.rkeys)
                    } else {
                        Vec::new()
                    }),
                },
                None => tern_engine::keyless_buffer(region, &desc.name),
            })
            .collect();
    }

    fn max_slice_size(&self) -> usize {
        self.inner.config.slice_size.max(1)
    }

    fn merge_tail_below(&self) -> usize {
        self.inner.config.tail_merge_below()
    }

    fn handle_connection(&self, body: &[u8]) -> Option<Vec<u8>> {
        Some(match self.running() {
            Some(shared) => shared.handle_connection(body),
            None => {
                handshake::HandshakeDesc::rejection("the RDMA transport is not started").to_body()
            }
        })
    }

    fn submit(&self, slices: &mut Vec<Slice>) {
        let Some(shared) = self.running() else {
            for slice in slices.drain(..) {
                slice.fail(TransferError::Dropped(
                    "the RDMA transport is not started".into(),
                ));
            }
            return;
        };
        let workers = shared.config.workers_per_nic;
        let mut groups: Vec<Vec<Job>> = (0..shared.nics.len() * workers)
            .map(|_| Vec::new())
            .collect();
        let mut cache = RouteCache::default();
        let first = shared.stripe.fetch_add(slices.len(), Ordering::Relaxed);
        for (i, slice) in slices.drain(..).enumerate() {
            if !slice.is_live() {
                slice.abandon();
                continue;
            }
            match shared.route(&slice, 0, first.wrapping_add(i), None, &mut cache) {
                Ok(route) => {
                    let group = route.nic * workers + cache.worker_of(&route.key, workers);
                    groups[group].push(Job {
                        slice,
                        attempt: 0,
                        nic: route.nic,
                        key: route.key,
                        lkey: route.lkey,
                        rkey: route.rkey,
                        fence: false,
                    });
                }
                // No path to the peer's NICs: another transport may still reach it.
                Err(
                    error @ (TransferError::Connection { .. } | TransferError::Declined { .. }),
                ) => slice.decline_with(error),
                Err(error) => slice.fail(error),
            }
        }
        for (group, jobs) in groups.into_iter().enumerate() {
            if !jobs.is_empty() {
                shared.nics[group / workers].workers[group % workers].send_jobs(jobs);
            }
        }
    }

    /// Asks every worker to let go of the slices of ended tasks (see `Worker::cut_off`);
    /// only sends messages, so it never blocks.
    fn cut_off(&self) {
        let Some(shared) = self.running() else {
            return;
        };
        for worker in shared.nics.iter().flat_map(|slot| &slot.workers) {
            // A stopped worker has failed its slices already.
            let _ = worker.send(worker::Msg::CutOff);
        }
    }

    fn report(&self) -> TransportReport {
        let Some(shared) = self.running() else {
            return TransportReport::default();
        };
        // Per peer server: (ready endpoints, connecting endpoints).
        let mut peers: std::collections::BTreeMap<String, (usize, usize)> = Default::default();
        for slot in &shared.nics {
            for ep in slot.store.lock().endpoints() {
                let server = ep.key.rsplit_once('@').map_or(&*ep.key, |(s, _)| s);
                let entry = peers.entry(server.to_owned()).or_default();
                match ep.state() {
                    endpoint::State::Ready | endpoint::State::WaitAck => entry.0 += 1,
                    endpoint::State::Connecting => entry.1 += 1,
                    endpoint::State::Dead => {}
                }
            }
        }
        let errors = shared.last_errors.lock().clone();
        for server in errors.keys() {
            peers.entry(server.clone()).or_default();
        }
        // Per peer server: (bytes, slices), summed over every worker.
        let mut moved: HashMap<String, (u64, u64)> = HashMap::new();
        for worker in shared.nics.iter().flat_map(|slot| &slot.workers) {
            for (server, counters) in worker.counters.peers.lock().iter() {
                peers.entry(server.clone()).or_default();
                let entry = moved.entry(server.clone()).or_default();
                let (bytes, slices) = counters.get();
                entry.0 += bytes;
                entry.1 += slices;
            }
        }
        TransportReport {
            retries: shared.retries.load(Ordering::Relaxed),
            declined: {
                let slices = shared.device_declines.load(Ordering::Relaxed);
                let bytes = shared.device_declined_bytes.load(Ordering::Relaxed);
                (slices > 0)
                    .then(|| tern_engine::DeclinedStats {
                        reason: crate::shared::KEYLESS_PEER_BUFFER.into(),
                        slices,
                        bytes,
                    })
                    .into_iter()
                    .collect()
            },
            peers: peers
                .into_iter()
                .map(|(peer, (ready, connecting))| {
                    let last_error = errors.get(&peer).cloned();
                    let (bytes, slices) = moved.get(&peer).copied().unwrap_or_default();
                    PeerStats {
                        state: PeerState::of(ready, connecting, last_error.is_some()),
                        peer,
                        endpoints: ready + connecting,
                        bytes,
                        slices,
                        last_error,
                    }
                })
                .collect(),
            nics: self.nic_stats(),
            // One-sided operations never reach this node's CPU: nothing to count.
            served: Default::default(),
        }
    }

    fn shutdown(&self) {
        self.inner.shutdown();
    }
}
