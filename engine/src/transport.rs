//! The contract between the engine and a transport.
//!
//! The engine checks and slices every request; a transport only moves slices and reports
//! each one's outcome, from whatever thread it likes. Transports never publish metadata:
//! they describe their part of the local descriptor when asked, and ask the engine to
//! publish again when that part changes.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use std::sync::Weak;

use tern_memreg::{AlignedBuffer, HoldsPin, MemoryRegistry, Pinned, RegionInfo, RegionPin};
use tern_metadata::auth::ClusterSecret;
use tern_metadata::rpc::{self, RpcClientConfig, RpcError, RpcType};
use tern_metadata::{BufferDesc, RpcMeta, SegmentDesc};

use crate::batch::BatchInner;
use crate::engine::EngineInner;
use crate::error::TransferError;
use crate::slicing::Cuts;
use crate::stats::{EngineCounters, TransportReport};
use crate::types::{Opcode, SegmentId};

/// Asks the engine to rebuild and publish the local descriptor.
type Republish = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// What a transport is given when the engine starts it.
#[derive(Clone)]
pub struct TransportContext {
    /// The engine's registered memory; inbound requests must be checked against it
    /// ([`MemoryRegistry::pin_remote`]) before a byte moves.
    pub registry: Arc<MemoryRegistry>,
    /// The address this node advertises; listeners bind here.
    pub advertised_ip: IpAddr,
    /// The name this node was configured with.
    pub local_server_name: String,
    /// The name peers open this node's segment by (`ip:port` in P2P mode); RDMA NIC paths
    /// are `<segment_name>@<device>`.
    pub segment_name: String,
    pub(crate) rpc_client: RpcClientConfig,
    pub(crate) republish: Republish,
}

impl std::fmt::Debug for TransportContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportContext")
            .field("advertised_ip", &self.advertised_ip)
            .field("local_server_name", &self.local_server_name)
            .field("segment_name", &self.segment_name)
            .finish_non_exhaustive()
    }
}

impl TransportContext {
    /// Calls a peer's handshake RPC (one short connection, the engine's timeouts, or
    /// `connect_timeout` for connecting) and returns the reply body.
    pub fn call_peer(
        &self,
        peer: &PeerSegment,
        ty: RpcType,
        body: &[u8],
        connect_timeout: Option<Duration>,
    ) -> Result<Vec<u8>, RpcError> {
        let mut config = self.rpc_client.clone();
        if let Some(timeout) = connect_timeout {
            config.connect_timeout = timeout;
        }
        rpc::call_segment(&peer.rpc.endpoint(), &peer.desc.name, ty, body, &config)
    }

    /// The engine's cluster secret, if it has one: a transport with connections of its own
    /// must open each of them with [`tern_metadata::auth`]'s exchange, both ways. (RPCs made
    /// through [`call_peer`](Self::call_peer) already do.)
    pub fn cluster_secret(&self) -> Option<&ClusterSecret> {
        self.rpc_client.secret.as_ref()
    }

    /// Asks the engine to rebuild the local descriptor (calling every transport's
    /// [`Transport::describe`]) and publish it. Must not be called while holding a lock that
    /// `describe` takes.
    pub fn republish(&self) -> Result<(), String> {
        (self.republish)()
    }
}

/// A transport failure outside any one transfer (start-up, registration, allocation).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// A listener could not be bound or a socket set up; the message names the address.
    #[error("{context}: {message}")]
    Io {
        /// What was being done.
        context: String,
        /// The operating system's error.
        message: String,
    },
    /// A device (NIC, shared-memory socket) could not be opened or used.
    #[error("device {device}: {message}")]
    Device {
        /// Which device.
        device: String,
        /// What failed.
        message: String,
    },
    /// Memory could not be registered with (or allocated by) the transport.
    #[error("memory at {addr:#x} (+{len}): {message}")]
    Memory {
        /// Start of the memory.
        addr: usize,
        /// Its length.
        len: usize,
        /// What failed.
        message: String,
    },
    /// The transport was used out of turn (started twice, used before it started).
    #[error("{0}")]
    State(String),
}

/// A segment as the engine resolved it: its descriptor and where its node listens.
#[derive(Debug, Clone)]
pub struct PeerSegment {
    /// The engine's ID for it.
    pub id: SegmentId,
    /// Its name.
    pub name: String,
    /// Its descriptor.
    pub desc: SegmentDesc,
    /// Where its handshake RPC listens; its host is the peer's data address too.
    pub rpc: RpcMeta,
}

/// Mooncake's keyless buffer form (TCP): named by the segment, no rkeys or lkeys.
pub fn keyless_buffer(region: &RegionInfo, segment_name: &str) -> BufferDesc {
    BufferDesc {
        addr: region.addr as u64,
        length: region.len as u64,
        lkey: None,
        name: segment_name.to_owned(),
        rkey: None,
    }
}

/// A way to move bytes. Implementations live in their own crates (`tern-transport-tcp`,
/// `tern-transport-rdma`); `tern_engine::conformance` (feature `conformance`) checks them.
pub trait Transport: Send + Sync + 'static {
    /// The protocol name published in descriptors (`tcp`, `rdma`).
    fn protocol(&self) -> &'static str;

    /// Among the installed transports that can reach a peer, the one with the highest
    /// priority moves its slices and describes the local buffers (RDMA over TCP).
    fn priority(&self) -> u8 {
        0
    }

    /// Whether this transport can reach a peer with this descriptor. The default: the peer
    /// speaks this transport's protocol.
    fn can_reach(&self, peer: &SegmentDesc) -> bool {
        peer.speaks(self.protocol())
    }

    /// Starts listeners and workers. Called once, before any other method but `protocol`,
    /// `priority` and `offers_help`.
    fn start(&self, context: TransportContext) -> Result<(), TransportError>;

    /// A region was registered: make it reachable (e.g. register it on every NIC).
    fn register_memory(&self, _region: &RegionInfo) -> Result<(), TransportError> {
        Ok(())
    }

    /// A region is being unregistered.
    fn unregister_memory(&self, _region: &RegionInfo) {}

    /// Fills this transport's Mooncake fields of the local descriptor (ports, versions,
    /// devices). `desc.buffers` arrives in the keyless form, one entry per region of
    /// `regions` (the remote-accessible ones, in address order); only a transport that
    /// [`owns_buffer_keys`](Transport::owns_buffer_keys) may change them — the engine puts
    /// back what any other one changes. Transports are asked in ascending
    /// [`priority`](Transport::priority).
    fn describe(&self, desc: &mut SegmentDesc, regions: &[RegionInfo]);

    /// Whether this transport's [`describe`](Transport::describe) fills the buffers' keys
    /// (RDMA's per-NIC `lkey`/`rkey`).
    fn owns_buffer_keys(&self) -> bool {
        false
    }

    /// This transport's own part of the local descriptor, published under
    /// `tern.<protocol>` (a field Mooncake peers ignore), so a transport adds what it needs
    /// without a field of its own in [`SegmentDesc`] and without reach into another's.
    fn extension(&self, _regions: &[RegionInfo]) -> Option<serde_json::Value> {
        None
    }

    /// Memory for [`TransferEngine::allocate`](crate::TransferEngine::allocate) to hand out,
    /// if this transport wants buffers of its own kind (shared-memory mappings, say); the
    /// highest-priority transport that offers one wins. `None`: ordinary memory.
    fn allocate(&self, _len: usize) -> Option<Result<AlignedBuffer, TransportError>> {
        None
    }

    /// Largest slice the engine should hand over.
    fn max_slice_size(&self) -> usize;

    /// A request's last piece shorter than this is merged into the piece before it
    /// (Mooncake: 16 KiB for 64 KiB slices), so no slice is tiny.
    fn merge_tail_below(&self) -> usize {
        0
    }

    /// Answers a handshake RPC of type Connection (RDMA QP exchange): `Some(reply body)`
    /// if this transport handles them, `None` to let another transport answer.
    fn handle_connection(&self, _body: &[u8]) -> Option<Vec<u8>> {
        None
    }

    /// Takes slices to move. Must not block on I/O: outcomes are reported later through
    /// [`Slice::complete`] / [`Slice::fail`], typically from worker threads. A slice this
    /// transport cannot carry goes back with [`Slice::decline`], and the engine offers it to
    /// the next transport that reaches the peer.
    fn submit(&self, slices: Vec<Slice>);

    /// Whether a thread waiting for a batch may lend this transport a hand
    /// ([`help`](Transport::help)): for transports whose work is CPU work anyone can do
    /// (copies in shared memory), so that the waiter copies instead of spinning.
    fn offers_help(&self) -> bool {
        false
    }

    /// Does one piece of this transport's queued work on the calling thread, a waiter with
    /// nothing else to do; true if there was some. Takes only work queued now (never waits
    /// for more), and runs it as the transport's own threads would.
    fn help(&self) -> bool {
        false
    }

    /// What only the transport knows of its work: retries and its peers' state. The engine
    /// counts bytes, slices and failures itself. Called off the data path, when a user asks.
    fn report(&self) -> TransportReport {
        TransportReport::default()
    }

    /// Cuts off, as soon as it can, every slice it holds whose task has ended
    /// ([`Slice::is_live`] false): one not started is abandoned, one on the wire stops
    /// touching its local memory and goes back through [`Slice::cut_off`] (or fails). The
    /// engine calls it from a waiting or status-reading thread when tasks ended (deadline,
    /// cancel, a failed slice) while slices of them were out, and again while they are:
    /// it must not block. A task ended that way is shown ended only once all its slices are
    /// back. The default does nothing: the transport's slices end on their own.
    fn cut_off(&self) {}

    /// Stops listeners and workers; slices still queued are failed.
    fn shutdown(&self);
}

/// What the slices of one submit call share when they come from one local region and go to
/// one peer: the pin on that region (one for all of them), the peer, the batch their
/// outcomes go to, and the transports that may carry them. Transports see it through
/// [`Slice`], and hand it to a device as the keeper of a slice's memory ([`Slice::pinned`]).
#[derive(Debug)]
pub struct Submission {
    local: RegionPin,
    peer: Arc<PeerSegment>,
    batch: Arc<BatchInner>,
    /// The installed transports that reach the peer, best first (indices into the
    /// engine's list).
    routes: Routes,
    counters: Arc<EngineCounters>,
    /// To offer a declined slice to the next transport.
    engine: Weak<EngineInner>,
}

impl HoldsPin for Submission {
    fn pin(&self) -> &RegionPin {
        &self.local
    }
}

impl Submission {
    pub(crate) fn new(
        local: RegionPin,
        peer: Arc<PeerSegment>,
        batch: Arc<BatchInner>,
        routes: Routes,
        engine: &EngineInner,
    ) -> Self {
        Self {
            local,
            peer,
            batch,
            routes,
            counters: engine.counters.clone(),
            engine: engine.weak.clone(),
        }
    }

    /// Whether `[addr, addr + len)` lies in this submission's pinned region.
    pub(crate) fn covers(&self, addr: usize, len: usize) -> bool {
        let info = self.local.info();
        addr >= info.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= info.addr + info.len)
    }

    /// Whether requests to `peer` (the very descriptor they were checked against) from
    /// `[addr, addr + len)` may share this submission.
    pub(crate) fn serves(&self, peer: &Arc<PeerSegment>, addr: usize, len: usize) -> bool {
        Arc::ptr_eq(&self.peer, peer) && self.covers(addr, len)
    }

    pub(crate) fn peer(&self) -> &Arc<PeerSegment> {
        &self.peer
    }

    /// Start of the pinned region.
    pub(crate) fn region_start(&self) -> usize {
        self.local.info().addr
    }

    /// The transport that carries this submission's slices first.
    pub(crate) fn first_route(&self) -> Option<usize> {
        self.routes.first()
    }
}

/// One request's part of a merged run: its task, from its local start address up to the
/// next part's (or the run's end).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TaskPart {
    pub(crate) start: usize,
    pub(crate) task: u32,
}

/// The index of the part of `parts` holding `addr`, searching from `parts[from]` on (a part
/// at or before it).
fn part_holding(parts: &[TaskPart], from: usize, addr: usize) -> usize {
    let rest = parts.get(from..).unwrap_or_default();
    from + rest
        .partition_point(|part| part.start <= addr)
        .saturating_sub(1)
}

/// The tasks a slice carries bytes of, with how many bytes of each.
struct SliceTasks<'a> {
    /// The merged run's parts, from the first the slice touches; empty for a slice of one
    /// task.
    parts: &'a [TaskPart],
    /// The slice's unvisited range.
    at: usize,
    end: usize,
    only: Option<(usize, u64)>,
}

impl Iterator for SliceTasks<'_> {
    type Item = (usize, u64);

    fn next(&mut self) -> Option<(usize, u64)> {
        if let Some(only) = self.only.take() {
            return Some(only);
        }
        let (part, rest) = self.parts.split_first()?;
        if self.at >= self.end {
            return None;
        }
        let part_end = rest
            .first()
            .map_or(self.end, |next| next.start.min(self.end));
        let bytes = part_end.saturating_sub(self.at) as u64;
        (self.parts, self.at) = (rest, part_end);
        Some((part.task as usize, bytes))
    }
}

/// The tasks a slice was the last of: they settle only after the slice has let go of its
/// submission, so they are gathered first (on the stack, unless the slice ended many).
#[derive(Default)]
struct LastOf {
    few: [u32; 8],
    count: usize,
    more: Vec<u32>,
}

impl LastOf {
    fn push(&mut self, task: usize) {
        match self.few.get_mut(self.count) {
            Some(slot) => {
                *slot = task as u32;
                self.count += 1;
            }
            None => self.more.push(task as u32),
        }
    }

    fn is_empty(&self) -> bool {
        self.count == 0
    }

    fn tasks(&self) -> impl Iterator<Item = usize> + '_ {
        self.few[..self.count]
            .iter()
            .chain(&self.more)
            .map(|&task| task as usize)
    }

    /// Completes these tasks, after letting go of the slice's `submission` (and with the
    /// last slice, its pin): so that no one sees them ended before.
    fn complete(self, submission: Arc<Submission>) {
        if self.is_empty() {
            return;
        }
        let batch = submission.batch.clone();
        drop(submission);
        for task in self.tasks() {
            batch.complete_task(task);
        }
    }
}

/// The transports that reach one peer, best first.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Routes {
    order: [u8; Routes::MAX],
    len: u8,
}

impl Routes {
    /// Transports an engine may have.
    pub(crate) const MAX: usize = 8;

    pub(crate) fn push(&mut self, transport: usize) {
        if (self.len as usize) < Self::MAX {
            self.order[self.len as usize] = transport as u8;
            self.len += 1;
        }
    }

    pub(crate) fn first(&self) -> Option<usize> {
        self.get(0)
    }

    pub(crate) fn get(&self, rank: usize) -> Option<usize> {
        (rank < self.len as usize).then(|| self.order[rank] as usize)
    }
}

/// One piece of a task, or of a run of neighbouring requests merged at submit: a contiguous
/// range moved in one operation. A slice of a run carries bytes of every task whose request
/// it overlaps, and reports to each of them for its part: its bytes credit each task with
/// what it holds of it, its failure fails exactly those tasks. Dropping it without a report
/// fails its tasks, so a transport can never leave a task hanging.
#[derive(Debug)]
pub struct Slice {
    /// Local start address (inside [`local`](Slice::local)).
    pub local_addr: usize,
    /// Bytes.
    pub len: usize,
    /// Remote start address.
    pub remote_addr: u64,
    opcode: Opcode,
    /// The task, for a slice of one request (`run` is `None`); for a slice of a merged run,
    /// the index in `run` of the first part it touches, so that reporting needs no search.
    task: u32,
    /// Which of the submission's routes carries it now.
    rank: u8,
    submission: Option<Arc<Submission>>,
    /// The parts of the merged run the slice was cut from, in address order.
    run: Option<Arc<[TaskPart]>>,
}

impl Slice {
    pub(crate) fn new(
        submission: Arc<Submission>,
        opcode: Opcode,
        task: usize,
        local_addr: usize,
        len: usize,
        remote_addr: u64,
    ) -> Self {
        Self {
            local_addr,
            len,
            remote_addr,
            opcode,
            task: task as u32,
            rank: 0,
            submission: Some(submission),
            run: None,
        }
    }

    /// A slice of a merged run: it carries bytes of the tasks of `run` it overlaps, from
    /// `run[first_part]` on (the part holding `local_addr`).
    pub(crate) fn of_run(
        submission: Arc<Submission>,
        opcode: Opcode,
        run: Arc<[TaskPart]>,
        first_part: usize,
        local_addr: usize,
        len: usize,
        remote_addr: u64,
    ) -> Self {
        Self {
            local_addr,
            len,
            remote_addr,
            opcode,
            task: first_part as u32,
            rank: 0,
            submission: Some(submission),
            run: Some(run),
        }
    }

    /// The piece `[offset, offset + len)` of this slice, for `submission`, carried by route
    /// `rank`.
    fn piece(&self, submission: Arc<Submission>, offset: usize, len: usize, rank: u8) -> Slice {
        let local_addr = self.local_addr + offset;
        let task = match self.run.as_deref() {
            None => self.task,
            Some(parts) => part_holding(parts, self.task as usize, local_addr) as u32,
        };
        Slice {
            local_addr,
            len,
            remote_addr: self.remote_addr + offset as u64,
            opcode: self.opcode,
            task,
            rank,
            submission: Some(submission),
            run: self.run.clone(),
        }
    }

    /// The tasks this slice carries bytes of, each with how many.
    fn tasks(&self) -> SliceTasks<'_> {
        let Some(parts) = self.run.as_deref() else {
            return SliceTasks {
                parts: &[],
                at: 0,
                end: 0,
                only: Some((self.task as usize, self.len as u64)),
            };
        };
        let first = self.task as usize;
        SliceTasks {
            parts: parts.get(first..).unwrap_or_default(),
            at: self.local_addr,
            end: self.local_addr.saturating_add(self.len),
            only: None,
        }
    }

    /// Counts, before any piece reports, the pieces this slice is about to be cut into, at
    /// offsets `cuts` (ascending, inside the slice): each cut through a task's bytes gives
    /// that task one slice more; a cut between two tasks' parts gives none.
    fn count_cuts(&self, submission: &Submission, cuts: impl Iterator<Item = usize>) {
        let batch = &submission.batch;
        let Some(parts) = self.run.as_deref() else {
            let more = cuts.count() as u32;
            if more > 0 {
                batch.add_slices(self.task as usize, more);
            }
            return;
        };
        for cut in cuts {
            let at = self.local_addr + cut;
            let holder = parts.partition_point(|part| part.start <= at);
            if let Some(part) = holder.checked_sub(1).and_then(|i| parts.get(i))
                && part.start != at
            {
                batch.add_slices(part.task as usize, 1);
            }
        }
    }

    fn submission(&self) -> &Submission {
        // Present until the slice reports, which consumes it.
        self.submission
            .as_deref()
            .unwrap_or_else(|| unreachable!("a slice reports once"))
    }

    /// Read or write.
    pub fn opcode(&self) -> Opcode {
        self.opcode
    }

    /// The local region, pinned for as long as the slice (or any [`Slice::pinned`] of it)
    /// lives.
    pub fn local(&self) -> &RegionPin {
        &self.submission().local
    }

    /// The other side.
    pub fn peer(&self) -> &Arc<PeerSegment> {
        &self.submission().peer
    }

    /// A shared hold on the slice's memory, for as long as a device may use it (an RDMA
    /// work request's guard): one reference count, not a pin of its own.
    pub fn pinned(&self) -> Pinned<Submission> {
        Pinned(
            self.submission
                .clone()
                .unwrap_or_else(|| unreachable!("a slice reports once")),
        )
    }

    /// Whether the slice should still run (its task is pending). A transport checks this
    /// before starting I/O and calls [`Slice::abandon`] if not.
    pub fn is_live(&self) -> bool {
        let batch = &self.submission().batch;
        self.tasks().any(|(task, _)| batch.task_live(task))
    }

    /// As [`is_live`](Slice::is_live), and ends the task (with its batch's other unfinished
    /// tasks) as timed out if the batch's deadline has passed: it reads the clock, so it is
    /// for checks between long pieces of one slice, where no waiter may be free to notice
    /// the deadline (a waiter helping copies, say).
    pub fn is_live_by_clock(&self) -> bool {
        let batch = &self.submission().batch;
        // The first task's check reads the clock (and times the batch out); the others need
        // not read it again.
        let mut tasks = self.tasks();
        tasks
            .next()
            .is_some_and(|(task, _)| batch.task_live_by_clock(task))
            || tasks.any(|(task, _)| batch.task_live(task))
    }

    /// Reports the outcome to each task the slice carries bytes of: the requests' hold on
    /// the pin goes first (with the last slice, the pin itself), so whoever learns a task
    /// ended may unregister its memory at once. Every outcome counts the slice as let go by
    /// each of its tasks; a task's last slice settles it.
    fn report(mut self, outcome: Outcome) {
        let Some(submission) = self.submission.take() else {
            return;
        };
        if self.rank == 0 && matches!(outcome, Outcome::Done) {
            // The common case, a slice done by its first transport: what the loops below
            // come to for it, in one pass (each task counts its share before its progress).
            let batch = &submission.batch;
            if self.run.is_none() {
                let task = self.task as usize;
                if batch.slice_progress(task, self.len as u64) {
                    let batch = batch.clone();
                    drop(submission);
                    batch.complete_task(task);
                }
                return;
            }
            let mut last_of = LastOf::default();
            for (i, (task, bytes)) in self.tasks().enumerate() {
                if i > 0 {
                    // Every task counts the slice; the first transport's tally counts it once.
                    batch.slice_uncredited(task, 0);
                }
                if batch.slice_progress(task, bytes) {
                    last_of.push(task);
                }
            }
            return last_of.complete(submission);
        }
        let transport = submission
            .routes
            .get(self.rank as usize)
            .unwrap_or(usize::MAX);
        let batch = &submission.batch;
        let write = self.opcode == Opcode::Write;
        match &outcome {
            // What the tasks' first transport moved is read off the tasks; a declined slice's
            // next transport counts its own.
            Outcome::Done if self.rank != 0 => {
                submission.counters.moved(transport, self.len as u64);
            }
            Outcome::Failed { .. } => submission.counters.failed(transport),
            _ => {}
        }
        for (i, (task, bytes)) in self.tasks().enumerate() {
            match &outcome {
                Outcome::Done if self.rank != 0 => batch.slice_uncredited(task, bytes),
                // Every task counts the slice; the first transport's tally counts it once.
                Outcome::Done if i > 0 => batch.slice_uncredited(task, 0),
                Outcome::Done => {}
                Outcome::Skipped => {
                    batch.fail_if_live(task, "skipped");
                    batch.slice_uncredited(task, 0);
                }
                Outcome::CutOff { remote_may_change } => {
                    if *remote_may_change && write {
                        batch.remote_may_change(task);
                    }
                    batch.fail_if_live(task, "cut off");
                    batch.slice_uncredited(task, 0);
                }
                Outcome::Failed { error, sent } => {
                    if *sent && write {
                        batch.remote_may_change(task);
                    }
                    // The task ends first, then the slice counts as let go: the last one out
                    // settles the task as Failed.
                    batch.fail_task(task, error.clone());
                    batch.slice_uncredited(task, 0);
                }
            }
        }
        let done = matches!(outcome, Outcome::Done);
        let mut last_of = LastOf::default();
        for (task, bytes) in self.tasks() {
            if batch.slice_progress(task, if done { bytes } else { 0 }) {
                last_of.push(task);
            }
        }
        last_of.complete(submission);
    }

    /// The slice moved all its bytes.
    pub fn complete(self) {
        self.report(Outcome::Done);
    }

    /// The slice failed; its task fails with `error`. For a write, bytes of it may have
    /// left: its task reports that the peer's memory may still change
    /// ([`TaskStatus::remote_may_change`](crate::TaskStatus)). The transport no longer
    /// touches the slice's local memory.
    pub fn fail(self, error: TransferError) {
        self.report(Outcome::Failed { error, sent: true });
    }

    /// As [`fail`](Slice::fail), for a slice none of whose bytes left (no connection, a
    /// refusal before sending).
    pub fn fail_unsent(self, error: TransferError) {
        self.report(Outcome::Failed { error, sent: false });
    }

    /// The slice's task ended while the slice was on the wire, and the transport stopped it:
    /// it no longer touches the slice's local memory. `remote_may_change`: bytes of this
    /// write left without their landing confirmed, and may still land at the peer.
    pub fn cut_off(self, remote_may_change: bool) {
        self.report(Outcome::CutOff { remote_may_change });
    }

    /// The slice was skipped because its task had already ended (canceled, timed out or
    /// failed); nothing is recorded.
    pub fn abandon(self) {
        self.report(Outcome::Skipped);
    }

    /// Cuts the slice into up to `pieces` slices of about equal length, in order, each handed
    /// to `place` with its index; the task counts every piece before any can report. Cuts
    /// fall on multiples of `align` bytes from the slice's start (no two pieces share a
    /// cache line, say), so a slice shorter than `2 × align` stays whole. For a transport
    /// that moves one slice with several threads at once.
    pub fn cut(self, pieces: usize, align: usize, mut place: impl FnMut(usize, Slice)) {
        let align = align.max(1);
        let pieces = pieces.min(self.len / align).max(1);
        if pieces == 1 {
            return place(0, self);
        }
        // Aligned bounds: piece k starts at k × len / pieces rounded down to `align`.
        let len = self.len;
        let bound = move |k: usize| {
            if k == pieces {
                len
            } else {
                (len / pieces * k + len % pieces * k / pieces) / align * align
            }
        };
        let Some(submission) = self.submission.clone() else {
            return;
        };
        self.count_cuts(&submission, (1..pieces).map(bound));
        for k in 1..pieces {
            let (start, end) = (bound(k), bound(k + 1));
            place(
                k,
                self.piece(submission.clone(), start, end - start, self.rank),
            );
        }
        let mut first = self;
        first.len = bound(1);
        place(0, first);
    }

    /// This transport cannot carry the slice (memory it cannot reach, a peer it cannot
    /// connect to): the engine offers it to the next transport that reaches the peer (cut
    /// again to that transport's slice size if it is larger), and fails it with `why` if
    /// there is none. The slice's task goes on; the slices already moving are not touched.
    pub fn decline(self, why: &str) {
        let error = TransferError::Declined {
            segment: self.submission().peer.name.clone(),
            reason: why.to_owned(),
        };
        self.decline_with(error);
    }

    /// As [`decline`](Slice::decline), for a transport that tried and failed (no path to the
    /// peer's NICs, say): with no transport left to offer it to, the slice fails with `error`
    /// itself.
    pub fn decline_with(mut self, error: TransferError) {
        let submission = self.submission();
        let next = self.rank as usize + 1;
        let (Some(transport), Some(engine)) =
            (submission.routes.get(next), submission.engine.upgrade())
        else {
            return self.fail(error);
        };
        tracing::debug!(
            "slice of {} declined ({error}); offered to {}",
            submission.peer.name,
            engine.transports[transport].protocol()
        );
        let next_transport = &engine.transports[transport];
        let cuts = Cuts::new(
            self.len,
            next_transport.max_slice_size(),
            next_transport.merge_tail_below(),
        );
        if cuts.count() <= 1 {
            self.rank = next as u8;
            return next_transport.submit(vec![self]);
        }
        // Too large for the next transport: cut again to its slice size. The tasks count the
        // extra slices before any of them can report (this one has not).
        let Some(submission) = self.submission.take() else {
            return;
        };
        self.count_cuts(&submission, cuts.pieces().skip(1).map(|(offset, _)| offset));
        let slices = cuts
            .pieces()
            .map(|(offset, len)| self.piece(submission.clone(), offset, len, next as u8))
            .collect();
        drop(submission);
        next_transport.submit(slices);
    }
}

/// How a slice ended.
enum Outcome {
    Done,
    Skipped,
    CutOff {
        remote_may_change: bool,
    },
    Failed {
        error: TransferError,
        /// Whether bytes of it may have left.
        sent: bool,
    },
}

impl Drop for Slice {
    fn drop(&mut self) {
        if let Some(submission) = self.submission.take() {
            // Reported as a failure (a write may have left): the same count as any outcome.
            let slice = self.piece(submission, 0, self.len, self.rank);
            slice.fail(TransferError::Dropped(
                "slice released without a result".into(),
            ));
        }
    }
}
