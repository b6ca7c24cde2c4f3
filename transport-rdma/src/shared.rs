//! The state the transport's threads share: NICs with their workers and endpoint stores,
//! registered keys, path health; routing of slices; both sides of the Connection handshake.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

/// Why a slice goes to the next transport when the peer published its buffer without NIC
/// keys (device memory its NICs did not register): the stats' reason.
pub const KEYLESS_PEER_BUFFER: &str = "the peer's buffer is not registered on its NICs";

use tern_engine::{PeerSegment, Slice, TransferError, TransportContext};
use tern_memreg::nic::NicKeys;
use tern_metadata::PriorityMatrix;
use tern_metadata::rpc::RpcType;
use tern_verbs::{Gid, PathConfig, QpCaps};

use crate::config::RdmaConfig;
use crate::endpoint::{Endpoint, EndpointStore, PeerQps, State};
use crate::handshake::{HandshakeDesc, check_psn, check_request, path_mtu};
use crate::nic::Nic;
use crate::route::{Blame, Health, Ranked, Side, choose};
use crate::topology::candidates;
use crate::worker::{Job, Msg, WorkerHandle};

/// The most QPs a peer may ask for in one endpoint.
pub(crate) const MAX_QPS_PER_ENDPOINT: usize = 64;

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// One local NIC with what hangs off it.
#[derive(Debug)]
pub(crate) struct NicSlot {
    pub nic: Nic,
    pub workers: Vec<WorkerHandle>,
    pub store: Mutex<EndpointStore>,
    /// The port is not ACTIVE (the monitor looks once a second).
    pub port_down: AtomicBool,
}

/// Where a slice goes.
#[derive(Debug)]
pub(crate) struct Route {
    pub nic: usize,
    pub key: Arc<str>,
    pub lkey: u32,
    pub rkey: u32,
}

/// A peer as routing sees it: its NIC paths and, per location of its buffers, its ranked
/// NICs. Built once per descriptor the engine hands over.
#[derive(Debug)]
pub(crate) struct PeerView {
    segment: Arc<PeerSegment>,
    names: Vec<String>,
    paths: Vec<Arc<str>>,
    ranked: HashMap<String, Ranked>,
}

impl PeerView {
    fn new(segment: &Arc<PeerSegment>) -> Self {
        let desc = &segment.desc;
        let server = desc
            .rdma_server_name
            .clone()
            .unwrap_or_else(|| segment.name.clone());
        let names: Vec<String> = desc.devices.iter().map(|d| d.name.clone()).collect();
        let matrix = desc.priority_matrix.clone().unwrap_or_default();
        let mut ranked = HashMap::new();
        for buffer in &desc.buffers {
            ranked
                .entry(buffer.name.clone())
                .or_insert_with(|| ranked_in(&matrix, &buffer.name, &names));
        }
        Self {
            segment: segment.clone(),
            paths: names
                .iter()
                .map(|n| Arc::from(format!("{server}@{n}")))
                .collect(),
            names,
            ranked,
        }
    }
}

/// The NICs of `names` for `location`, as the matrix ranks them.
fn ranked_in(matrix: &PriorityMatrix, location: &str, names: &[String]) -> Ranked {
    let found = candidates(matrix, location, names);
    Ranked {
        preferred: indices(&found.preferred, names),
        available: indices(&found.available, names),
    }
}

/// What routing looked up for one submit call, reused across its slices.
#[derive(Debug, Default)]
pub(crate) struct RouteCache {
    /// The local region (by address): its keys and the local NICs ranked for its location.
    keys: Option<(usize, Arc<NicKeys>, Arc<Ranked>)>,
    peer: Option<Arc<PeerView>>,
    /// Index of the peer buffer the last slice landed in.
    buffer: Option<usize>,
    /// The worker of the last path routed to.
    worker: Option<(Arc<str>, usize)>,
}

impl RouteCache {
    /// The worker (of `workers` per NIC) for path `key`: the same path always maps to the
    /// same worker, so that one worker owns each endpoint; hashed once per run of slices.
    pub fn worker_of(&mut self, key: &Arc<str>, workers: usize) -> usize {
        match &self.worker {
            Some((last, worker)) if Arc::ptr_eq(last, key) => *worker,
            _ => {
                let worker = worker_of(key, workers);
                self.worker = Some((key.clone(), worker));
                worker
            }
        }
    }
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

/// Which of a NIC's workers owns the endpoints of a peer NIC path.
pub(crate) fn worker_of(key: &str, workers: usize) -> usize {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut hasher);
    (hasher.finish() % workers.max(1) as u64) as usize
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
            self.maybe_paused.load(Ordering::Relaxed) && lock(&self.health).nic_paused(nic, now);
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
        lock(&self.last_errors).insert(server.to_owned(), reason.to_owned());
    }

    pub fn blame(&self, nic: usize, key: &Arc<str>, blame: Blame) {
        self.maybe_paused.store(true, Ordering::Relaxed);
        let paused_nic = lock(&self.health).failed(nic, key, blame, Instant::now());
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
            lock(&self.health).succeeded(nic);
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

    /// Picks the path, NIC and keys of a slice.
    pub fn route(
        &self,
        slice: &Slice,
        attempt: u32,
        stripe: usize,
        avoid: Option<(usize, &str)>,
        cache: &mut RouteCache,
    ) -> Result<Route, TransferError> {
        let region = slice.local().info();
        if cache
            .keys
            .as_ref()
            .is_none_or(|(addr, _, _)| *addr != region.addr)
        {
            let keys = self
                .keys
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .get(&region.addr)
                .cloned()
                .ok_or(TransferError::SourceNotRegistered {
                    addr: slice.local_addr,
                    len: slice.len,
                })?;
            let ranked = lock(&self.local_ranked)
                .entry(region.location.clone())
                .or_insert_with(|| Arc::new(ranked_in(&self.matrix, &region.location, &self.names)))
                .clone();
            cache.keys = Some((region.addr, keys, ranked));
        }
        if cache
            .peer
            .as_ref()
            .is_none_or(|view| !Arc::ptr_eq(&view.segment, slice.peer()))
        {
            cache.peer = Some(self.peer_view(slice.peer()));
            cache.buffer = None;
        }
        let (Some((_, keys, local_ranked)), Some(peer)) = (&cache.keys, &cache.peer) else {
            return Err(TransferError::SourceNotRegistered {
                addr: slice.local_addr,
                len: slice.len,
            });
        };
        let desc = &slice.peer().desc;
        // Slices of one run usually land in one buffer of the peer: try the last one first.
        let (from, len) = (slice.remote_addr, slice.len as u64);
        let buffer = match cache.buffer.and_then(|i| desc.buffers.get(i)) {
            Some(buffer) if buffer.contains(from, len) => buffer,
            _ => {
                let found = desc.buffer_containing(from, len);
                cache.buffer =
                    found.and_then(|b| desc.buffers.iter().position(|x| std::ptr::eq(x, b)));
                found.ok_or_else(|| TransferError::TargetOutOfRange {
                    segment: slice.peer().name.clone(),
                    addr: slice.remote_addr,
                    len: slice.len,
                })?
            }
        };
        let rkeys = match &buffer.rkey {
            Some(rkeys) if !rkeys.is_empty() => rkeys,
            // Published without keys (device memory this build does not register on NICs):
            // another transport may carry it.
            None => {
                self.device_declines
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.device_declined_bytes
                    .fetch_add(slice.len as u64, std::sync::atomic::Ordering::Relaxed);
                return Err(TransferError::Declined {
                    segment: slice.peer().name.clone(),
                    reason: KEYLESS_PEER_BUFFER.into(),
                });
            }
            // Not remote-accessible there: the peer would refuse it.
            _ => {
                return Err(TransferError::RemoteRejected {
                    peer: slice.peer().name.clone(),
                    addr: slice.remote_addr,
                    len: slice.len,
                });
            }
        };
        let unreachable = |why: String| TransferError::Connection {
            peer: slice.peer().name.clone(),
            message: why,
        };
        let computed;
        let peer_ranked = match peer.ranked.get(&buffer.name) {
            Some(ranked) => ranked,
            None => {
                computed = ranked_in(&PriorityMatrix::new(), &buffer.name, &peer.names);
                &computed
            }
        };
        // Health (and a clock read) only once something has failed.
        let health = self
            .maybe_paused
            .load(Ordering::Relaxed)
            .then(|| (lock(&self.health), Instant::now()));
        let paused = |l: usize, p: usize| -> bool {
            if self.nics[l].port_down.load(Ordering::Relaxed) {
                return true;
            }
            health.as_ref().is_some_and(|(h, now)| {
                h.nic_paused(l, *now)
                    || peer
                        .paths
                        .get(p)
                        .is_some_and(|path| h.path_paused(l, path, *now))
            })
        };
        let avoid = avoid.and_then(|(l, key)| {
            peer.paths
                .iter()
                .position(|path| &**path == key)
                .map(|p| (l, p))
        });
        let (l, p) = choose(
            &Side {
                ranked: local_ranked,
                names: &self.names,
            },
            &Side {
                ranked: peer_ranked,
                names: &peer.names,
            },
            stripe,
            attempt,
            avoid,
            &paused,
        )
        .ok_or_else(|| {
            unreachable(format!(
                "no path from this node's NICs {:?} to the peer's {:?}",
                self.names, peer.names
            ))
        })?;
        let lkey = *keys
            .lkeys
            .get(l)
            .ok_or_else(|| unreachable("no local key for the chosen NIC".into()))?;
        let rkey = *rkeys.get(p).ok_or_else(|| {
            unreachable(format!(
                "the peer's buffer has {} rkeys for {} devices",
                rkeys.len(),
                peer.names.len()
            ))
        })?;
        let key = peer
            .paths
            .get(p)
            .cloned()
            .ok_or_else(|| unreachable("no NIC path for the chosen peer NIC".into()))?;
        Ok(Route {
            nic: l,
            key,
            lkey,
            rkey,
        })
    }

    /// The routing view of a peer's current descriptor.
    fn peer_view(&self, segment: &Arc<PeerSegment>) -> Arc<PeerView> {
        let mut views = lock(&self.peer_views);
        match views.get(&segment.id) {
            Some(view) if Arc::ptr_eq(&view.segment, segment) => view.clone(),
            _ => {
                if views.len() >= 1024 {
                    // Views of segments the engine no longer holds (closed, replaced).
                    views.retain(|_, v| Arc::strong_count(&v.segment) > 1);
                }
                let view = Arc::new(PeerView::new(segment));
                views.insert(segment.id, view.clone());
                view
            }
        }
    }

    /// Sends a job to the worker that owns its path.
    pub fn dispatch(&self, job: Job) {
        let worker = self.worker_index(&job.key);
        match self.nics.get(job.nic).and_then(|n| n.workers.get(worker)) {
            Some(handle) => handle.send_jobs(vec![job]),
            None => job.slice.fail(TransferError::Dropped(
                "no worker for the chosen NIC".into(),
            )),
        }
    }

    /// A new route for a job that could not run where it was: `None` when it has been
    /// settled instead — handed back to the engine for the next transport when no path to the
    /// peer works (out of retries, no path), failed when the peer refused it, dropped when its
    /// task is over.
    pub fn reroute(&self, mut job: Job, reason: Option<String>) -> Option<Job> {
        if !job.slice.is_live() {
            job.slice.abandon();
            return None;
        }
        if job.attempt > self.config.retry_count {
            let message = format!(
                "gave up after {} attempt(s); last: {}",
                job.attempt,
                reason.unwrap_or_else(|| "endpoint lost".into())
            );
            job.slice.decline_with(TransferError::Connection {
                peer: job.key.to_string(),
                message,
            });
            return None;
        }
        let stripe = self.stripe.fetch_add(1, Ordering::Relaxed);
        let avoid = reason.is_some().then_some((job.nic, &*job.key));
        let route = self.route(
            &job.slice,
            job.attempt,
            stripe,
            avoid,
            &mut RouteCache::default(),
        );
        match route {
            Ok(route) => {
                self.retries.fetch_add(1, Ordering::Relaxed);
                job.nic = route.nic;
                job.key = route.key;
                job.lkey = route.lkey;
                job.rkey = route.rkey;
                Some(job)
            }
            Err(error @ TransferError::Connection { .. }) => {
                job.slice.decline_with(error);
                None
            }
            Err(error) => {
                job.slice.fail(error);
                None
            }
        }
    }

    /// Removes a decommissioned endpoint from its NIC's store (if it is still there).
    pub fn forget_endpoint(&self, ep: &Arc<Endpoint>) {
        if let Some(slot) = self.nics.get(ep.nic) {
            lock(&slot.store).remove(ep);
        }
    }

    /// Decommissions endpoints another thread displaced and tells their workers.
    fn decommission_displaced(&self, displaced: Vec<Arc<Endpoint>>) {
        for ep in displaced {
            if ep.decommission()
                && let Some(handle) = self.nics.get(ep.nic).and_then(|n| n.workers.get(ep.worker))
            {
                let _ = handle.send(Msg::Changed(ep));
            }
        }
    }

    /// The endpoint a worker should use for `key`: the store's, or a new one whose
    /// handshake starts on a thread of its own (the worker goes on with other endpoints).
    pub fn endpoint_for(
        self: &Arc<Self>,
        nic: usize,
        worker: usize,
        key: &Arc<str>,
        slice: &Slice,
    ) -> Result<Arc<Endpoint>, String> {
        let slot = self.nics.get(nic).ok_or_else(|| format!("no NIC #{nic}"))?;
        let mut store = lock(&slot.store);
        if let Some(ep) = store.get(key) {
            return Ok(ep);
        }
        let ep = self.new_endpoint(
            slot,
            key,
            worker,
            self.config.qps_per_endpoint,
            State::Connecting,
        )?;
        let displaced = store.insert(ep.clone());
        drop(store);
        self.decommission_displaced(displaced);
        let shared = self.clone();
        let connecting = ep.clone();
        let peer = slice.peer().clone();
        let spawned = std::thread::Builder::new()
            .name("tern-rdma-connect".into())
            .spawn(move || {
                let result = shared.handshake(&connecting, &peer);
                if result.is_ok() && !connecting.set_state(State::Ready) {
                    return;
                }
                if let Some(handle) = shared
                    .nics
                    .get(connecting.nic)
                    .and_then(|n| n.workers.get(connecting.worker))
                {
                    let _ = handle.send(Msg::Connected {
                        ep: connecting,
                        result,
                    });
                }
            });
        if let Err(e) = spawned {
            lock(&slot.store).remove(&ep);
            return Err(format!("cannot start a handshake thread: {e}"));
        }
        Ok(ep)
    }

    /// A new endpoint of `count` QPs on `slot`'s NIC, reporting to `worker`'s CQ.
    fn new_endpoint(
        &self,
        slot: &NicSlot,
        key: &Arc<str>,
        worker: usize,
        count: usize,
        state: State,
    ) -> Result<Arc<Endpoint>, String> {
        let cq = &slot
            .workers
            .get(worker)
            .ok_or_else(|| format!("no worker #{worker}"))?
            .cq;
        Endpoint::create(key.clone(), &slot.nic, worker, cq, count, self.caps, state)
            .map(Arc::new)
            .map_err(|e| format!("cannot create QPs on {}: {e}", slot.nic.name))
    }

    fn my_desc(
        &self,
        nic: usize,
        peer_path: &str,
        qp_num: Vec<u32>,
        psn: Option<u32>,
    ) -> HandshakeDesc {
        let n = &self.nics[nic].nic;
        HandshakeDesc {
            local_gid: n.gid.gid.to_string(),
            local_lid: n.lid,
            local_nic_path: self.local_path(nic),
            mtu: Some(n.mtu),
            payload: String::new(),
            peer_nic_path: peer_path.to_owned(),
            psn,
            qp_num,
            ready_ack: Some(false),
            reply_msg: String::new(),
        }
    }

    /// The active side of the Connection handshake: our QPs go out, the peer's come back and
    /// ours connect to them; then the ready ACK, if the peer speaks it.
    fn handshake(&self, ep: &Endpoint, peer: &PeerSegment) -> Result<(), String> {
        let nic = &self.nics[ep.nic].nic;
        let _span = tracing::debug_span!("rdma_connect", path = %ep.key, nic = %nic.name).entered();
        let mut request = self.my_desc(ep.nic, &ep.key, ep.qp_nums(), Some(ep.psn));
        let call = |request: &HandshakeDesc| -> Result<HandshakeDesc, String> {
            let reply = self
                .context
                .call_peer(
                    peer,
                    RpcType::Connection,
                    &request.to_body(),
                    Some(self.config.handshake_timeout),
                )
                .map_err(|e| e.to_string())?;
            let reply = HandshakeDesc::parse(&reply)
                .map_err(|e| format!("{} answered the handshake with {e}", ep.key))?;
            if reply.is_rejection() {
                return Err(format!(
                    "{} refused the connection: {}",
                    ep.key, reply.reply_msg
                ));
            }
            Ok(reply)
        };
        let reply = call(&request)?;
        let gid = Gid::parse(&reply.local_gid)
            .filter(|g| !g.is_zero())
            .ok_or_else(|| format!("{} answered with GID {:?}", ep.key, reply.local_gid))?;
        let remote = PeerQps {
            gid,
            lid: reply.local_lid,
            qps: reply.qp_num.clone(),
            mtu: path_mtu(nic.mtu, reply.mtu),
            psn: check_psn(reply.psn).map_err(|e| format!("{} answered with {e}", ep.key))?,
        };
        ep.connect(nic, &remote, &self.template)?;
        if reply.ready_ack.is_some() {
            request.ready_ack = Some(true);
            call(&request)?;
        }
        Ok(())
    }

    /// The passive side: answers a Connection message (a rejection for anything wrong,
    /// having touched nothing).
    pub fn handle_connection(&self, body: &[u8]) -> Vec<u8> {
        let reply = match HandshakeDesc::parse(body) {
            Err(e) => HandshakeDesc::rejection(format!("malformed handshake: {e}")),
            Ok(desc) => self.answer(&desc).unwrap_or_else(HandshakeDesc::rejection),
        };
        reply.to_body()
    }

    fn answer(&self, desc: &HandshakeDesc) -> Result<HandshakeDesc, String> {
        let _span = tracing::debug_span!("rdma_accept", peer = %desc.local_nic_path).entered();
        if self.stopping.load(Ordering::Acquire) {
            return Err("this node is shutting down".into());
        }
        let names: Vec<&str> = self.names.iter().map(String::as_str).collect();
        let request = check_request(
            desc,
            &self.context.segment_name,
            &names,
            MAX_QPS_PER_ENDPOINT,
        )?;
        let nic = self
            .names
            .iter()
            .position(|n| *n == request.local_nic)
            .ok_or_else(|| format!("no NIC {}", request.local_nic))?;
        let slot = &self.nics[nic];
        let key: Arc<str> = Arc::from(request.peer.to_string());
        if desc.is_ready_ack() {
            let ep = lock(&slot.store).get(&key);
            return match ep {
                Some(ep) if ep.peer_qps() == request.peer_qps => {
                    if ep.state() == State::WaitAck && ep.set_state(State::Ready) {
                        let _ = slot.workers[ep.worker].send(Msg::Changed(ep));
                    }
                    Ok(HandshakeDesc::ack_reply())
                }
                _ => Err(format!(
                    "no connection from {key} with QPs {:?} awaits a ready ACK",
                    request.peer_qps
                )),
            };
        }
        let remote = PeerQps {
            gid: request.peer_gid,
            lid: request.peer_lid,
            qps: request.peer_qps.clone(),
            mtu: path_mtu(slot.nic.mtu, request.peer_mtu),
            psn: request.peer_psn,
        };
        let worker = self.worker_index(&key);
        let mut store = lock(&slot.store);
        let existing = store.get(&key);
        let ep = match existing {
            Some(ep) if ep.state() == State::Connecting && ep.qps.len() == remote.qps.len() => {
                // Both sides opened at once: our pending QPs pair with theirs, and our own
                // handshake, answered the same way, completes the pairing.
                ep.connect(&slot.nic, &remote, &self.template)?;
                ep
            }
            _ => {
                let state = if request.wants_ready_ack {
                    State::WaitAck
                } else {
                    State::Ready
                };
                let ep = self.new_endpoint(slot, &key, worker, remote.qps.len(), state)?;
                ep.connect(&slot.nic, &remote, &self.template)?;
                let displaced = store.insert(ep.clone());
                drop(store);
                self.decommission_displaced(displaced);
                ep
            }
        };
        // Our PSN only to a peer that sent its own: a Mooncake peer starts at 0 both ways.
        let psn = request.peer_psn.map(|_| ep.psn);
        Ok(self.my_desc(nic, &key, ep.qp_nums(), psn))
    }
}

/// Positions of `names` in `all`, in the order of `names`.
fn indices(names: &[String], all: &[String]) -> Vec<usize> {
    names
        .iter()
        .filter_map(|n| all.iter().position(|a| a == n))
        .collect()
}
