//! Tern's same-host transport: transfers between engines on one machine at memory speed, for
//! any registered memory, chosen by the engine on its own.
//!
//! Two paths, chosen per buffer of the peer:
//!
//! - **memfd**: memory the engine allocated ([`TransferEngine::allocate`]) lives in a sealed
//!   memfd ([`Transport::allocate`]). A same-host peer asks for it over the owner's Unix
//!   socket, receives the descriptor (`SCM_RIGHTS`), maps it once, and from then on a slice
//!   is one `memcpy` in the initiator, READ as WRITE. The owner only hands out the memfd of
//!   a registered, remote-accessible buffer it published; the initiator maps only a sealed
//!   memfd at least as large as a buffer the peer's descriptor lists. Unregistering such a
//!   buffer tells every peer that mapped it, which unmaps it (after the copies into it
//!   finish) and confirms before unregistering returns; a peer that does not confirm within
//!   [`ShmConfig::revoke_timeout`] is cut off and shown failed in the report (it may keep the
//!   pages mapped until it reads the close); a peer that leaves has everything unmapped, and
//!   its later slices fail with `Connection`.
//! - **cross-memory attach**: any other registered memory (a tensor, memory registered raw)
//!   moves with `process_vm_readv`/`process_vm_writev` from the initiator, where the kernel
//!   permits it (same user, the target dumpable, Yama's `ptrace_scope` allowing it). The
//!   owner pins the ranges for a lease first, over the socket, refusing those not inside its
//!   registered remote-accessible memory, so a buffer under a lease is in use (unregistering
//!   it fails) until the lease ends.
//!
//! **What the checks cover.** The owner checks every range a peer asks for against its
//! registry, and for memfds hands out only those buffers. Cross-memory attach, though, is
//! done by the *initiator's* process on the owner's memory: the owner cannot check each
//! access itself. What holds it to granted ranges is the initiator's engine (it attaches
//! only inside leases the owner granted) and the kernel (it allows attaching only to a
//! process the initiator could ptrace anyway, which could then read or write all of the
//! owner's memory by other means). It protects against stale descriptors and bugs, not
//! against a hostile process of the same user. [`PtracePolicy::Refuse`] makes a process
//! unreachable by cross-memory attach; memfd buffers stay shared.
//!
//! **Same host, proven.** The descriptor carries `tern.shm` (a field Mooncake peers ignore):
//! boot ID, network namespace, host name, user, and the name of an abstract Unix socket.
//! [`can_reach`](Transport::can_reach) is true only when all of them match this process;
//! the first slice then confirms it: the socket lives in the peer's network namespace (a
//! peer elsewhere cannot be connected to), the kernel's credentials of the connection must
//! show the same user, a cluster secret is proved as on every other connection, the peer
//! must answer as the segment asked for, and reading back a nonce by cross-memory attach
//! proves which process answered. A peer that fails any of it is not same-host: its slices
//! are declined ([`Slice::decline`]) and the engine hands them to the next transport (RDMA,
//! then TCP), without failing the task. A Mooncake descriptor (no `tern.shm`) never matches.
//!
//! It must not decide what to transfer, keep deadlines or publish metadata (the engine
//! does), and it has no `unsafe`: mappings, descriptor passing and cross-memory attach are
//! `tern-memreg`'s safe types.
//!
//! [`TransferEngine::allocate`]: tern_engine::TransferEngine::allocate
#![forbid(unsafe_code)]

mod client;
pub mod identity;
mod server;
pub mod wire;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender, unbounded};
use tern_engine::DeclinedStats;
use tern_engine::{
    AlignedBuffer, Opcode, PeerState, PeerStats, RegionInfo, SegmentDesc, SegmentId, Slice,
    TransferError, Transport, TransportContext, TransportError, TransportReport,
};

/// Why a slice between local device memory and a peer's plain host memory (not a memfd)
/// goes to the next transport: that memory is reached only by cross-memory attach, a CPU
/// copy, which never touches device memory.
pub(crate) const DEVICE_TO_HOST_DECLINED: &str =
    "device memory to a peer's host memory outside memfds: reached only by cross-memory attach";
/// Why the owner could not hand out its device memory (the driver's reason follows).
pub(crate) const DEVICE_UNSHARED: &str = "the owner cannot share its device memory";
/// Why this process could not map a peer's device memory (the driver's reason follows).
pub(crate) const DEVICE_UNMAPPED: &str = "the peer's device memory cannot be mapped here";
/// Why a peer declined its device memory (its reason follows).
pub(crate) const DEVICE_PEER_DECLINED: &str = "the peer declined its device memory";

use crate::client::{Links, Reach};
use crate::identity::{Extension, HostIdentity, same_host};
use crate::server::{Owner, Server, lock};

/// The protocol name: the key of this transport's field in descriptors (`tern.shm`).
pub const PROTOCOL: &str = "shm";

/// Environment variable with the number of copy threads ([`ShmConfig::workers`]).
pub const WORKERS_ENV: &str = "TERN_SHM_WORKERS";

/// Whether other processes may reach this one by cross-memory attach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PtracePolicy {
    /// Leave the process as it is: peers of the same user attach where the kernel lets them
    /// (everywhere without Yama or with `ptrace_scope` 0; with 1 only ancestors).
    #[default]
    Keep,
    /// With Yama's `ptrace_scope` 1, let any process of this user attach
    /// (`prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`), so that same-host peers can reach
    /// registered memory that is not a memfd. A wide grant: opt in only where every process
    /// of the user is trusted.
    AllowSameUser,
    /// Make the process not dumpable (`prctl(PR_SET_DUMPABLE, 0)`): no process without
    /// `CAP_SYS_PTRACE` can attach, so peers reach only its memfd buffers this way and move
    /// everything else over the next transport. (It also stops core dumps.)
    Refuse,
}

/// Settings of the shared-memory transport.
#[derive(Debug, Clone)]
pub struct ShmConfig {
    /// Whether [`TransferEngine::allocate`](tern_engine::TransferEngine::allocate) hands out
    /// memfd-backed buffers (peers map them). Off: ordinary memory, which peers reach by
    /// cross-memory attach.
    pub memfd_buffers: bool,
    /// What this process allows peers' cross-memory attach.
    pub ptrace: PtracePolicy,
    /// Threads that copy (default: one fewer than the cores, 1 to 4; `TERN_SHM_WORKERS`). A
    /// submit's slices are spread over them and the thread that waits for the batch, which
    /// copies a part itself instead of spinning; they sleep when there is nothing to copy.
    pub workers: usize,
    /// Largest slice.
    pub slice_size: usize,
    /// Bound on making a link (connect, exchange, probe) and on the peer's handshake RPC
    /// when its socket does not open.
    pub connect_timeout: Duration,
    /// Bound on each answer on a link (open, lease).
    pub io_timeout: Duration,
    /// How long unregistering waits for peers to confirm they unmapped a buffer.
    pub revoke_timeout: Duration,
    /// Peers served at once; connections still in their opening (credentials, the
    /// cluster-secret proof, the hello) have as many places again, the oldest given up for a
    /// newcomer.
    pub max_inbound: usize,
    /// How long a peer's connection may take from being accepted to its hello (with a
    /// cluster secret, its proof first) before it is closed.
    pub exchange_timeout: Duration,
}

impl Default for ShmConfig {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let workers = std::env::var(WORKERS_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| (1..=64).contains(&n))
            // The waiting thread is one more pair of hands.
            .unwrap_or((cores - 1).clamp(1, 4));
        Self {
            memfd_buffers: true,
            ptrace: PtracePolicy::Keep,
            workers,
            slice_size: 1 << 20,
            connect_timeout: Duration::from_secs(2),
            io_timeout: Duration::from_secs(10),
            revoke_timeout: Duration::from_secs(5),
            max_inbound: 256,
            exchange_timeout: tern_metadata::auth::EXCHANGE_TIMEOUT,
        }
    }
}

/// Why the transport could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// `/proc` did not tell the boot ID, network namespace or host name.
    #[error("reading this host's identity from /proc: {0}")]
    Identity(std::io::Error),
    /// The abstract socket could not be bound.
    #[error("binding the shared-memory socket {socket:?}: {source}")]
    Bind {
        /// Its name.
        socket: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A copy thread could not be started (the process is out of threads or memory).
    #[error("starting a copy thread: {0}")]
    Thread(std::io::Error),
    /// The ptrace setting asked for could not be applied.
    #[error("applying {policy:?}: {source}")]
    Ptrace {
        /// What was asked.
        policy: PtracePolicy,
        /// The operating system's error.
        source: std::io::Error,
    },
}

impl From<ShmError> for TransportError {
    fn from(e: ShmError) -> Self {
        TransportError::Device {
            device: PROTOCOL.into(),
            message: e.to_string(),
        }
    }
}

/// The shared-memory transport. Install it beside another transport (TCP, RDMA) for the
/// peers that are not on this host or whose memory it cannot reach.
#[derive(Debug)]
pub struct ShmTransport {
    config: ShmConfig,
    identity: Option<HostIdentity>,
    running: OnceLock<Arc<Running>>,
}

struct Running {
    owner: Arc<Owner>,
    links: Arc<Links>,
    extension: serde_json::Value,
    queue: Sender<Vec<Slice>>,
    /// The copy threads' end of `queue`, for a waiter that helps.
    jobs: Receiver<Vec<Slice>>,
    stop: Arc<AtomicBool>,
    server: std::sync::Mutex<Option<Server>>,
    workers: std::sync::Mutex<Vec<std::thread::JoinHandle<()>>>,
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
        match self.config.ptrace {
            PtracePolicy::Keep => {}
            PtracePolicy::AllowSameUser => {
                tern_memreg::shm::allow_ptrace_by_same_user().map_err(|source| {
                    ShmError::Ptrace {
                        policy: self.config.ptrace,
                        source,
                    }
                })?;
            }
            PtracePolicy::Refuse => {
                tern_memreg::shm::set_dumpable(false).map_err(|source| ShmError::Ptrace {
                    policy: self.config.ptrace,
                    source,
                })?;
            }
        }
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
        let (queue, jobs) = unbounded::<Vec<Slice>>();
        let stop = Arc::new(AtomicBool::new(false));
        let mut workers = Vec::new();
        for _ in 0..self.config.workers.max(1) {
            let (jobs, links) = (jobs.clone(), links.clone());
            let stop = stop.clone();
            let worker = std::thread::Builder::new()
                .name("tern-shm-copy".into())
                .spawn(move || work(&jobs, &links, &stop))
                .map_err(ShmError::Thread)?;
            workers.push(worker);
        }
        Ok(Running {
            owner,
            links,
            extension,
            queue,
            jobs,
            stop,
            server: std::sync::Mutex::new(Some(server)),
            workers: std::sync::Mutex::new(workers),
        })
    }
}

impl Default for ShmTransport {
    fn default() -> Self {
        Self::new(ShmConfig::default())
    }
}

/// A copy thread: takes the slices of one submit (or part of it) and moves them.
fn work(jobs: &Receiver<Vec<Slice>>, links: &Links, stop: &AtomicBool) {
    while let Some(slices) = next_job(jobs) {
        if stop.load(Ordering::Acquire) {
            fail_all(slices);
            return;
        }
        run(slices, links);
    }
}

fn send(queue: &Sender<Vec<Slice>>, part: Vec<Slice>) {
    if let Err(back) = queue.send(part) {
        fail_all(back.0);
    }
}

/// Smallest piece a slice is cut into for several hands, and the alignment of the cuts
/// (whole pages, so no two hands write one cache line or pin one page).
const STRIPE_PIECE: usize = 16 << 10;

/// Slices this long (on average) are cut into a piece per hand even when the submit has
/// enough slices to give each hand a run of its own: copies this long run from memory,
/// where two hands on the halves of each slice move more than two on runs of whole ones.
const STRIPE_FROM: u64 = 1 << 20;

/// Where a slice's bytes go, for [`Shape`].
#[derive(Debug, Clone, Copy)]
struct Extent {
    writes: bool,
    local: u64,
    remote: u64,
    len: u64,
}

/// What [`spread`] needs to know of a submit.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Shape {
    slices: usize,
    bytes: u64,
    /// Whether two slices write the same bytes (the same block again, as a benchmark that
    /// reuses one block does): seen when the slices' destinations span fewer bytes than
    /// they hold.
    reuse: bool,
}

impl Shape {
    fn of(extents: impl Iterator<Item = Extent>) -> Self {
        // Destinations: the peer's memory for writes, this node's for reads.
        #[derive(Clone, Copy)]
        struct Span {
            low: u64,
            high: u64,
            bytes: u64,
        }
        let empty = Span {
            low: u64::MAX,
            high: 0,
            bytes: 0,
        };
        let mut spans = [empty; 2];
        let mut shape = Shape::default();
        for extent in extents {
            let start = if extent.writes {
                extent.remote
            } else {
                extent.local
            };
            let span = &mut spans[usize::from(extent.writes)];
            span.low = span.low.min(start);
            span.high = span.high.max(start.saturating_add(extent.len));
            span.bytes = span.bytes.saturating_add(extent.len);
            shape.slices += 1;
            shape.bytes = shape.bytes.saturating_add(extent.len);
        }
        shape.reuse = spans
            .iter()
            .any(|s| s.bytes > 0 && s.high.saturating_sub(s.low) < s.bytes);
        shape
    }
}

/// How one submit is shared among the hands.
#[derive(Debug, PartialEq, Eq)]
enum Spread {
    /// One hand takes it all: too little to share.
    Whole,
    /// Runs of whole slices, one per hand: distinct memory streams best this way.
    Runs(usize),
    /// Each slice cut into a piece per hand, so that the hands never write the same bytes:
    /// for memory reused within the submit (two hands on one block fight over its cache
    /// lines), for long slices, and for a submit of too few slices to share out whole.
    Stripes,
}

/// Memory reused within the submit is striped on both paths: cross-memory attach moves all
/// of a hand's pieces in one system call (`write_many`), and two hands on runs of the same
/// block moved 7–10 GB/s at 1 MiB against 11–14 striped (alternating runs). Long slices and
/// too few slices are cut only through a mapping (`mapped`: asked only when it matters): over
/// distinct memory, stripes gained cross-memory attach nothing measurable.
fn spread(shape: &Shape, hands: usize, mapped: impl FnOnce() -> bool) -> Spread {
    let enough_for_runs = shape.slices >= 2 * hands;
    if hands < 2 || shape.bytes < 2 * STRIPE_PIECE as u64 {
        return Spread::Whole;
    }
    let long = shape.bytes / shape.slices as u64 >= STRIPE_FROM;
    if shape.reuse || ((long || !enough_for_runs) && mapped()) {
        return Spread::Stripes;
    }
    if enough_for_runs {
        Spread::Runs(hands)
    } else {
        Spread::Whole
    }
}

/// How long a copy thread that ran out of work keeps looking for more before it sleeps: a
/// submitter that finds it awake hands it work without a wake-up call (a system call of
/// microseconds, often longer than the copy), and an idle one sleeps after one budget.
const LINGER: std::time::Duration = std::time::Duration::from_micros(50);

/// The next job: spinning for up to [`LINGER`], then sleeping until one comes; `None` once
/// the queue is closed.
fn next_job(jobs: &Receiver<Vec<Slice>>) -> Option<Vec<Slice>> {
    let since = std::time::Instant::now();
    loop {
        match jobs.try_recv() {
            Ok(slices) => return Some(slices),
            Err(crossbeam_channel::TryRecvError::Disconnected) => return None,
            Err(crossbeam_channel::TryRecvError::Empty) => {}
        }
        if since.elapsed() >= LINGER {
            return jobs.recv().ok();
        }
        for _ in 0..64 {
            std::hint::spin_loop();
        }
    }
}

/// Moves the slices of one job (a submit, or part of one), on a copy thread or a waiter.
fn run(slices: Vec<Slice>, links: &Links) {
    let mut rest = slices.into_iter().peekable();
    while let Some(first) = rest.next() {
        // The slices of one peer, in order: a submit usually has one.
        let peer = first.peer().clone();
        let mut group = vec![first];
        while let Some(next) = rest.next_if(|s| Arc::ptr_eq(s.peer(), &peer)) {
            group.push(next);
        }
        if peer.id == SegmentId::LOCAL {
            local(group, links.registry());
            continue;
        }
        match links.reach(&peer) {
            Reach::Up(link) => link.carry(group),
            Reach::Decline(why) => {
                for slice in group {
                    slice.decline(&why);
                }
            }
            Reach::Gone(why) => {
                for slice in group {
                    slice.fail(TransferError::Connection {
                        peer: peer.name.clone(),
                        message: why.clone(),
                    });
                }
            }
        }
    }
}

/// Slices to this engine's own segment: copies between two pinned regions of its registry.
fn local(slices: Vec<Slice>, registry: &tern_memreg::MemoryRegistry) {
    for slice in slices {
        if !slice.is_live() {
            slice.abandon();
            continue;
        }
        client::copy_in_registry(registry, slice, Slice::complete);
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

    fn submit(&self, slices: Vec<Slice>) {
        let Some(running) = self.running.get() else {
            for slice in slices {
                slice.decline("the shared-memory transport is not started");
            }
            return;
        };
        if slices.is_empty() {
            return;
        }
        // Spread a large submit over the copy threads and the thread that will wait for it
        // (it helps: `help`).
        let hands = self.config.workers.max(1) + 1;
        let mapped = || {
            slices.first().is_some_and(|first| {
                running
                    .links
                    .maps(first.peer(), first.remote_addr, first.len as u64)
            })
        };
        let shape = Shape::of(slices.iter().map(|s| Extent {
            writes: s.opcode() == Opcode::Write,
            local: s.local_addr as u64,
            remote: s.remote_addr,
            len: s.len as u64,
        }));
        match spread(&shape, hands, mapped) {
            Spread::Whole => send(&running.queue, slices),
            Spread::Runs(parts) => {
                let per = slices.len().div_ceil(parts);
                let mut slices = slices;
                while slices.len() > per {
                    let rest = slices.split_off(per);
                    send(&running.queue, std::mem::replace(&mut slices, rest));
                }
                send(&running.queue, slices);
            }
            Spread::Stripes => {
                let mut parts: Vec<Vec<Slice>> = (0..hands)
                    .map(|_| Vec::with_capacity(slices.len()))
                    .collect();
                for (i, slice) in slices.into_iter().enumerate() {
                    // Piece k of every slice to hand k (the same bytes always to the same
                    // hand); a slice too short to cut goes whole, to the hands in turn.
                    if slice.len < 2 * STRIPE_PIECE {
                        parts[i % hands].push(slice);
                        continue;
                    }
                    slice.cut(hands, STRIPE_PIECE, |k, piece| parts[k].push(piece));
                }
                for part in parts.into_iter().filter(|p| !p.is_empty()) {
                    send(&running.queue, part);
                }
            }
        }
    }

    fn offers_help(&self) -> bool {
        true
    }

    /// A waiter copies one queued job itself: with as many copy threads as cores, a waiter
    /// spinning would take a core from them.
    fn help(&self) -> bool {
        let Some(running) = self.running.get() else {
            return false;
        };
        if running.stop.load(Ordering::Acquire) {
            return false;
        }
        match running.jobs.try_recv() {
            Ok(slices) => {
                run(slices, &running.links);
                true
            }
            Err(_) => false,
        }
    }

    fn report(&self) -> TransportReport {
        let Some(running) = self.running.get() else {
            return TransportReport::default();
        };
        let mut peers: Vec<PeerStats> = running
            .links
            .report()
            .into_iter()
            .map(|link| PeerStats {
                peer: link.peer,
                state: PeerState::of(usize::from(link.up), 0, link.error.is_some()),
                endpoints: link.mapped,
                bytes: link.bytes,
                slices: link.slices,
                last_error: link.error,
            })
            .collect();
        // Peers that did not confirm a revocation: the owner cut them off, yet they may still
        // map the buffer's pages; said here, not passed off as confirmed.
        peers.extend(
            running
                .owner
                .unconfirmed()
                .into_iter()
                .map(|unconfirmed| PeerStats {
                    peer: unconfirmed.peer,
                    state: PeerState::Failed,
                    endpoints: 0,
                    bytes: 0,
                    slices: 0,
                    last_error: Some(unconfirmed.message),
                }),
        );
        peers.sort_by(|a, b| a.peer.cmp(&b.peer));
        let declined = running
            .links
            .device_declines
            .get()
            .into_iter()
            .map(|(reason, slices, bytes)| DeclinedStats {
                reason: reason.into(),
                slices,
                bytes,
            })
            .collect();
        TransportReport {
            retries: 0,
            peers,
            declined,
            ..TransportReport::default()
        }
    }

    fn shutdown(&self) {
        let Some(running) = self.running.get() else {
            return;
        };
        lock(&running.server).take();
        running.stop.store(true, Ordering::Release);
        let workers: Vec<_> = lock(&running.workers).drain(..).collect();
        // Each worker stops at the first job it takes from now on: one empty job each.
        for _ in &workers {
            let _ = running.queue.send(Vec::new());
        }
        for worker in workers {
            let _ = worker.join();
        }
        running.links.close();
    }
}

fn fail_all(slices: Vec<Slice>) {
    for slice in slices {
        slice.fail(TransferError::Dropped(
            "the shared-memory transport stopped".into(),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1 << 10;

    fn writes(blocks: &[(u64, u64)]) -> Shape {
        Shape::of(blocks.iter().map(|&(remote, len)| Extent {
            writes: true,
            local: 0,
            remote,
            len,
        }))
    }

    fn distinct(count: u64, len: u64) -> Shape {
        writes(&(0..count).map(|i| (i * len, len)).collect::<Vec<_>>())
    }

    #[test]
    fn reuse_is_slices_writing_the_same_bytes() {
        assert!(!distinct(128, 64 * KIB).reuse);
        assert!(writes(&[(0, 64 * KIB); 128]).reuse);
        assert!(writes(&[(0, 64 * KIB), (32 * KIB, 64 * KIB)]).reuse);
        // Reads land in local memory: the same remote block read into distinct local ones
        // is no reuse; read into one local block, it is.
        let reads = |locals: &[u64]| {
            Shape::of(locals.iter().map(|&local| Extent {
                writes: false,
                local,
                remote: 0,
                len: 64 * KIB,
            }))
        };
        assert!(!reads(&[0, 64 * KIB, 128 * KIB]).reuse);
        assert!(reads(&[0, 0]).reuse);
        let shape = distinct(3, 64 * KIB);
        assert_eq!((shape.slices, shape.bytes), (3, 192 * KIB));
    }

    #[test]
    fn a_submit_is_shared_out_by_what_it_moves_and_how() {
        let asked = std::cell::Cell::new(0);
        let mapped = |answer: bool| {
            let asked = &asked;
            move || {
                asked.set(asked.get() + 1);
                answer
            }
        };
        // Too little to share, or one hand: whole, without looking up the mapping.
        assert_eq!(
            spread(&distinct(1, 4 * KIB), 2, mapped(true)),
            Spread::Whole
        );
        assert_eq!(
            spread(&distinct(128, 64 * KIB), 1, mapped(true)),
            Spread::Whole
        );
        assert_eq!(asked.get(), 0);
        // Distinct 64 KiB blocks stream best in runs, mapped or not.
        assert_eq!(
            spread(&distinct(128, 64 * KIB), 2, mapped(true)),
            Spread::Runs(2)
        );
        assert_eq!(
            spread(&distinct(128, 64 * KIB), 2, mapped(false)),
            Spread::Runs(2)
        );
        // One block again and again: cut on both paths, without asking. Long slices, or
        // too few slices: cut through a mapping only.
        let again = writes(&[(0, 64 * KIB); 128]);
        let before = asked.get();
        assert_eq!(spread(&again, 2, mapped(true)), Spread::Stripes);
        assert_eq!(spread(&again, 2, mapped(false)), Spread::Stripes);
        assert_eq!(asked.get(), before);
        assert_eq!(
            spread(&distinct(128, 1 << 20), 2, mapped(false)),
            Spread::Runs(2)
        );
        assert_eq!(
            spread(&distinct(128, 1 << 20), 2, mapped(true)),
            Spread::Stripes
        );
        assert_eq!(
            spread(&distinct(1, 1 << 20), 2, mapped(true)),
            Spread::Stripes
        );
        assert_eq!(
            spread(&distinct(1, 1 << 20), 2, mapped(false)),
            Spread::Whole
        );
    }
}
