//! Worker threads: each owns one completion queue of one NIC and every endpoint whose QPs
//! report to it. It takes jobs from a channel, posts them as chains of work requests
//! (signalling only every so often and the last of a chain), polls its CQ and reports each
//! slice to the engine. Nothing on that path takes a lock shared with other workers.
//!
//! What is in flight on a QP lives in the QP's own ledger (`tern_verbs::ledger`): each work
//! request carries its job and a pin on its local region, and a completion retires its
//! request and every older one (RC completes in order); an error completion names the
//! request that failed, and the QP, now in the error state, flushes the rest one by one. A
//! pin is dropped only when its request is retired, so no region can be unregistered while a
//! NIC may still write it. A decommissioned endpoint is dropped (its QPs destroyed) only once
//! its ledgers are empty; one whose device never flushes is abandoned after `DRAIN_LIMIT`:
//! its tasks fail, its pins are kept for good. Asked to cut off (`Msg::CutOff`), a worker
//! drops the queued slices of ended tasks and decommissions every endpoint with a posted
//! request of one, so that a timed-out or canceled task's memory is back once the flush is
//! reaped, not after the QP's retry timeout or a handshake with a peer that does not answer.
//!
//! When it has nothing to do the worker spins briefly, then sleeps on its CQ's completion
//! channel and on a doorbell socket that senders write to only while it sleeps, so an idle
//! engine costs no CPU.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use tern_engine::{MovedCounter, Opcode, Pinned, ReportTogether, Slice, Submission, TransferError};
use tern_verbs::{Completion, CompletionError, CompletionQueue, Outcome, SendOp, SendWork, Sge};

use crate::endpoint::{Endpoint, State};
use crate::nic::WorkerCounters;
use crate::route::Blame;
use crate::shared::Shared;

/// A slice on its way: where it goes and with which keys.
#[derive(Debug)]
pub(crate) struct Job {
    pub slice: Slice,
    /// Failed attempts so far.
    pub attempt: u32,
    /// The local NIC.
    pub nic: usize,
    /// The peer NIC path.
    pub key: Arc<str>,
    pub lkey: u32,
    pub rkey: u32,
}

/// What other threads tell a worker.
#[derive(Debug)]
pub(crate) enum Msg {
    Jobs(Vec<Job>),
    /// The handshake this worker started for an endpoint has ended.
    Connected {
        ep: Arc<Endpoint>,
        result: Result<(), String>,
    },
    /// An endpoint of this worker became usable (its peer's ready ACK came) or was
    /// decommissioned.
    Changed(Arc<Endpoint>),
    /// Tasks ended while slices of them were here: let go of those slices now.
    CutOff,
    Stop,
}

/// How other threads reach a worker.
#[derive(Debug)]
pub(crate) struct WorkerHandle {
    tx: Sender<Msg>,
    bell: UnixStream,
    sleeping: Arc<AtomicBool>,
    pub cq: Arc<CompletionQueue>,
    pub counters: Arc<WorkerCounters>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The worker's half of a [`WorkerHandle`], handed to its thread.
#[derive(Debug)]
pub(crate) struct WorkerInbox {
    rx: Receiver<Msg>,
    bell: UnixStream,
    sleeping: Arc<AtomicBool>,
    cq: Arc<CompletionQueue>,
    counters: Arc<WorkerCounters>,
}

/// A worker's channel, doorbell and CQ, before its thread starts.
pub(crate) fn worker_pair(
    cq: Arc<CompletionQueue>,
) -> std::io::Result<(WorkerHandle, WorkerInbox)> {
    let (tx, rx) = crossbeam_channel::unbounded();
    let (ring, hear) = UnixStream::pair()?;
    ring.set_nonblocking(true)?;
    hear.set_nonblocking(true)?;
    let sleeping = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(WorkerCounters::default());
    Ok((
        WorkerHandle {
            tx,
            bell: ring,
            sleeping: sleeping.clone(),
            cq: cq.clone(),
            counters: counters.clone(),
            thread: Mutex::new(None),
        },
        WorkerInbox {
            rx,
            bell: hear,
            sleeping,
            cq,
            counters,
        },
    ))
}

impl WorkerHandle {
    /// Hands over a message; gives it back if the worker has stopped.
    pub fn send(&self, msg: Msg) -> Result<(), Msg> {
        self.tx.send(msg).map_err(|e| e.0)?;
        // Pairs with the fence in `Worker::sleep`: either the worker sees the message before
        // it sleeps, or this sees it sleeping and rings.
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            // A full socket buffer means a ring is already pending: nothing lost.
            let _ = (&self.bell).write(&[1]);
        }
        Ok(())
    }

    /// Hands over jobs; fails them if the worker has stopped.
    pub fn send_jobs(&self, jobs: Vec<Job>) {
        if let Err(Msg::Jobs(jobs)) = self.send(Msg::Jobs(jobs)) {
            for job in jobs {
                job.slice
                    .fail(TransferError::Dropped("the RDMA transport stopped".into()));
            }
        }
    }

    pub fn set_thread(&self, thread: JoinHandle<()>) {
        *self.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread);
    }

    /// Stops the worker and waits for it.
    pub fn stop(&self) {
        let _ = self.send(Msg::Stop);
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(thread) = thread
            && thread.join().is_err()
        {
            tracing::error!("an RDMA worker panicked");
        }
    }
}

/// Requests about to be posted to one QP.
type Chain = Vec<SendWork<Pinned<Submission>, Job>>;

#[derive(Debug)]
struct Slot {
    ep: Arc<Endpoint>,
    /// Requests posted to each QP and not yet retired (the QP's ledger holds them; this is
    /// the worker's count, to decide without a lock where the next one fits).
    in_flight: Vec<usize>,
    backlog: VecDeque<Job>,
    next_qp: usize,
    /// Set once the endpoint is decommissioned here: the slot goes when nothing is in
    /// flight.
    decommissioned_at: Option<Instant>,
    /// Decommissioned to cut off requests of ended tasks, not for a fault: what else it
    /// flushes goes out again on the same path, uncounted as a failure.
    cut_off: bool,
    /// This worker's `(bytes, slices)` to the endpoint's peer server.
    moved: Arc<MovedCounter>,
}

impl Slot {
    fn in_flight(&self) -> usize {
        self.in_flight.iter().sum()
    }
}

/// Completions taken per poll.
const POLL_BATCH: usize = 64;
/// How long a decommissioned endpoint may wait for its flushed requests before the worker
/// gives up on them (Mooncake: 30 s).
const DRAIN_LIMIT: Duration = Duration::from_secs(30);
/// How long a stopping worker waits for the flushes of its endpoints' requests.
const STOP_DRAIN_LIMIT: Duration = Duration::from_secs(10);
/// How long a path whose handshake failed is not tried again by this worker (Mooncake
/// fast-fails such targets for 100 ms; a second, so that a dead peer's tasks fail in a few
/// quick rounds rather than in a storm of handshakes).
const CONNECT_COOLDOWN: Duration = Duration::from_secs(1);
/// How long an endpoint may wait for its peer's ready ACK while work waits for it.
const READY_ACK_LIMIT: Duration = Duration::from_secs(10);
/// Housekeeping (drain and ready-ACK limits) runs at least this often while something is
/// in flight or waiting.
const TICK: Duration = Duration::from_millis(100);
/// Sleep of a worker with nothing in flight and nothing waiting: only new work (the
/// doorbell) or a completion wakes it sooner, so an idle engine costs next to no CPU.
const IDLE_SLEEP: Duration = Duration::from_secs(5);

pub(crate) struct Worker {
    shared: Arc<Shared>,
    nic: usize,
    index: usize,
    inbox: WorkerInbox,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    by_key: HashMap<Arc<str>, usize>,
    by_qpn: HashMap<u32, (usize, usize)>,
    /// Slots with a backlog, waiting to post.
    waiting: VecDeque<usize>,
    /// Jobs this worker re-routed to itself.
    local: VecDeque<Job>,
    /// Work requests in flight on this CQ (at most `cq_capacity`: an error flushes them all,
    /// and each then needs a CQ entry).
    outstanding: usize,
    cq_capacity: usize,
    max_wr: usize,
    completions: Vec<Completion>,
    /// What the last completion retired (reused).
    retired: Vec<(Job, Outcome<CompletionError>)>,
    chains: Vec<Chain>,
    /// Paths whose handshake failed lately, and why: work for them fails over at once
    /// instead of starting another handshake to a peer that just refused or is gone.
    refused: HashMap<Arc<str>, (Instant, String)>,
}

impl Worker {
    pub fn new(shared: Arc<Shared>, nic: usize, index: usize, inbox: WorkerInbox) -> Self {
        let cq_capacity = shared.cq_entries();
        let max_wr = shared.caps.max_send_wr as usize;
        Self {
            shared,
            nic,
            index,
            inbox,
            slots: Vec::new(),
            free: Vec::new(),
            by_key: HashMap::new(),
            by_qpn: HashMap::new(),
            waiting: VecDeque::new(),
            local: VecDeque::new(),
            outstanding: 0,
            cq_capacity,
            max_wr,
            completions: Vec::with_capacity(POLL_BATCH),
            retired: Vec::new(),
            chains: Vec::new(),
            refused: HashMap::new(),
        }
    }

    pub fn run(mut self) {
        let spin = self.shared.config_spin();
        let mut last_progress = Instant::now();
        let mut last_tick = Instant::now();
        loop {
            let mut progress = false;
            loop {
                match self.inbox.rx.try_recv() {
                    Ok(Msg::Stop) | Err(TryRecvError::Disconnected) => return self.stop(),
                    Ok(msg) => {
                        self.handle(msg);
                        progress = true;
                    }
                    Err(TryRecvError::Empty) => break,
                }
            }
            while let Some(job) = self.local.pop_front() {
                self.enqueue(job);
                progress = true;
            }
            progress |= self.post_waiting();
            let polled = self.poll();
            progress |= polled > 0;
            let now = Instant::now();
            if now.duration_since(last_tick) >= TICK {
                self.housekeeping(now);
                last_tick = now;
            }
            if progress {
                last_progress = now;
            } else if now.duration_since(last_progress) >= spin {
                self.sleep();
                last_progress = Instant::now();
            }
        }
    }

    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Jobs(jobs) => {
                for job in jobs {
                    self.enqueue(job);
                }
            }
            Msg::Connected { ep, result } => {
                let Some(slot) = self.slot_of(&ep) else {
                    return;
                };
                match result {
                    Ok(()) => self.mark_waiting(slot),
                    Err(reason) => {
                        tracing::warn!("RDMA connection to {} failed: {reason}", ep.key);
                        self.shared.note_failure(&ep.key, &reason);
                        self.shared.blame(self.nic, &ep.key, Blame::Hard);
                        self.refused
                            .insert(ep.key.clone(), (Instant::now(), reason.clone()));
                        self.decommission(slot, Some(reason));
                    }
                }
            }
            Msg::Changed(ep) => {
                if let Some(slot) = self.slot_of(&ep) {
                    if ep.state() == State::Dead {
                        self.decommission(slot, None);
                    } else {
                        self.mark_waiting(slot);
                    }
                }
            }
            Msg::CutOff => self.cut_off(),
            Msg::Stop => {}
        }
    }

    /// Lets go of every slice here whose task has ended. One not posted (queued, waiting for
    /// a handshake or a ready ACK) is abandoned at once. An endpoint with a posted request
    /// of an ended task is decommissioned: its QPs are moved to the error state
    /// (`ibv_modify_qp(3)`, `IBV_QPS_ERR`), in which, by the InfiniBand Architecture
    /// Specification, every outstanding request completes with a flush error
    /// (`IBV_WC_WR_FLUSH_ERR`, `ibv_poll_cq(3)`), and `complete` reports each ended one as
    /// cut off once that completion has been polled. Only then does its pin go: once a
    /// request's completion (a flush included) has been retrieved from the CQ the device no
    /// longer accesses its memory (`ibv_post_send(3)`, NOTES; the specification: a completion
    /// returns the request's buffers to the application). The endpoint's other requests go
    /// out again on a fresh one.
    fn cut_off(&mut self) {
        for job in std::mem::take(&mut self.local) {
            if job.slice.is_live() {
                self.local.push_back(job);
            } else {
                job.slice.abandon();
            }
        }
        for index in 0..self.slots.len() {
            let Some(slot) = self.slots[index].as_mut() else {
                continue;
            };
            for job in std::mem::take(&mut slot.backlog) {
                if job.slice.is_live() {
                    slot.backlog.push_back(job);
                } else {
                    job.slice.abandon();
                }
            }
            let posted_ended = slot.decommissioned_at.is_none()
                && slot.in_flight() > 0
                && slot
                    .ep
                    .qps
                    .iter()
                    .any(|qp| qp.any_send_in_flight(|job| !job.slice.is_live()));
            if posted_ended {
                tracing::debug!(
                    "cutting off requests of ended tasks on {}: its QPs go to the error state",
                    slot.ep.key
                );
                slot.cut_off = true;
                self.decommission(index, None);
            }
        }
    }

    fn slot_of(&self, ep: &Arc<Endpoint>) -> Option<usize> {
        let slot = *self.by_key.get(&ep.key)?;
        let same = self.slots[slot]
            .as_ref()
            .is_some_and(|s| Arc::ptr_eq(&s.ep, ep));
        same.then_some(slot)
    }

    fn mark_waiting(&mut self, slot: usize) {
        if self.slots[slot]
            .as_ref()
            .is_some_and(|s| !s.backlog.is_empty())
            && !self.waiting.contains(&slot)
        {
            self.waiting.push_back(slot);
        }
    }

    /// Puts a job in its endpoint's backlog, opening the endpoint first if needed.
    fn enqueue(&mut self, job: Job) {
        if !job.slice.is_live() {
            job.slice.abandon();
            return;
        }
        let slot = match self.by_key.get(&job.key) {
            Some(&slot) => slot,
            None if let Some((at, reason)) = self.refused.get(&job.key)
                && at.elapsed() < CONNECT_COOLDOWN =>
            {
                let reason = reason.clone();
                return self.reroute(job, Some(reason));
            }
            None => match self.open(&job) {
                Ok(slot) => slot,
                Err(reason) => {
                    self.shared.blame(self.nic, &job.key, Blame::Hard);
                    return self.reroute(job, Some(reason));
                }
            },
        };
        if let Some(s) = self.slots[slot].as_mut() {
            s.backlog.push_back(job);
        }
        self.mark_waiting(slot);
    }

    /// Finds or makes the endpoint for `job`'s path and gives it a slot.
    fn open(&mut self, job: &Job) -> Result<usize, String> {
        let ep = self
            .shared
            .endpoint_for(self.nic, self.index, &job.key, &job.slice)?;
        let server = ep.key.rsplit_once('@').map_or(&*ep.key, |(s, _)| s);
        let slot = Slot {
            moved: self.inbox.counters.peer(server),
            in_flight: vec![0; ep.qps.len()],
            ep: ep.clone(),
            backlog: VecDeque::new(),
            next_qp: 0,
            decommissioned_at: None,
            cut_off: false,
        };
        let index = match self.free.pop() {
            Some(index) => {
                self.slots[index] = Some(slot);
                index
            }
            None => {
                self.slots.push(Some(slot));
                self.slots.len() - 1
            }
        };
        for (q, qp) in ep.qps.iter().enumerate() {
            self.by_qpn.insert(qp.qp_num(), (index, q));
        }
        self.by_key.insert(ep.key.clone(), index);
        Ok(index)
    }

    /// Posts the backlogs of ready endpoints, as far as QP and CQ room allow.
    fn post_waiting(&mut self) -> bool {
        let mut progress = false;
        for _ in 0..self.waiting.len() {
            let Some(slot) = self.waiting.pop_front() else {
                break;
            };
            let ready = self.slots[slot]
                .as_ref()
                .is_some_and(|s| s.decommissioned_at.is_none() && s.ep.state() == State::Ready);
            if !ready {
                // Connecting, or waiting for the peer's ready ACK: the message that changes
                // that puts it back.
                continue;
            }
            progress |= self.post(slot);
            if self.slots[slot]
                .as_ref()
                .is_some_and(|s| !s.backlog.is_empty())
            {
                self.waiting.push_back(slot);
            }
        }
        progress
    }

    fn post(&mut self, slot_index: usize) -> bool {
        let Some(slot) = self.slots[slot_index].as_mut() else {
            return false;
        };
        let qp_count = slot.in_flight.len();
        if self.chains.len() < qp_count {
            self.chains.resize_with(qp_count, Chain::new);
        }
        let mut budget = self.cq_capacity.saturating_sub(self.outstanding);
        let mut taken = 0;
        while budget > 0 {
            let Some(q) = (0..qp_count)
                .map(|i| (slot.next_qp + i) % qp_count)
                .find(|&q| slot.in_flight[q] + self.chains[q].len() < self.max_wr)
            else {
                break;
            };
            let Some(job) = slot.backlog.pop_front() else {
                break;
            };
            if !job.slice.is_live() {
                job.slice.abandon();
                continue;
            }
            // The configuration keeps slices within u32::MAX (see `RdmaConfig::check_slice_size`);
            // a longer one is refused here rather than posted truncated.
            let Ok(len) = u32::try_from(job.slice.len) else {
                let message = format!(
                    "a slice of {} bytes does not fit one RDMA work request (at most {})",
                    job.slice.len,
                    u32::MAX
                );
                job.slice.fail(TransferError::Dropped(message));
                continue;
            };
            slot.next_qp = (q + 1) % qp_count;
            let (remote_addr, rkey) = (job.slice.remote_addr, job.rkey);
            let op = match job.slice.opcode() {
                Opcode::Write => SendOp::Write { remote_addr, rkey },
                Opcode::Read => SendOp::Read { remote_addr, rkey },
            };
            self.chains[q].push(SendWork {
                op,
                local: Sge {
                    addr: job.slice.local_addr as u64,
                    len,
                    lkey: job.lkey,
                },
                guard: job.slice.pinned(),
                user: job,
            });
            budget -= 1;
            taken += 1;
        }
        if taken == 0 {
            return false;
        }
        let mut broken = None;
        for q in 0..qp_count {
            let chain = &mut self.chains[q];
            if chain.is_empty() {
                continue;
            }
            let before = chain.len();
            if let Err(e) = slot.ep.qps[q].post_send(chain) {
                // The requests before the refused one are on the wire; an unsignalled last
                // one among them is still retired, by the flush that decommissioning the
                // endpoint below causes.
                broken = Some(e.to_string());
            }
            let posted = before - chain.len();
            slot.in_flight[q] += posted;
            self.outstanding += posted;
            self.local.extend(chain.drain(..).map(|work| work.user));
        }
        if let Some(reason) = broken {
            tracing::warn!("posting to {}: {reason}", slot.ep.key);
            self.decommission(slot_index, None);
        }
        true
    }

    fn poll(&mut self) -> usize {
        let mut completions = std::mem::take(&mut self.completions);
        let got = match self.inbox.cq.poll(&mut completions, POLL_BATCH) {
            Ok(got) => got,
            Err(e) => {
                tracing::error!("polling the CQ of NIC #{}: {e}", self.nic);
                0
            }
        };
        // What one poll found ended at one time: one clock reading times them all.
        let _together = ReportTogether::begin();
        for completion in completions.drain(..) {
            self.complete(completion);
        }
        self.completions = completions;
        got
    }

    fn complete(&mut self, completion: Completion) {
        let Some(&(slot_index, q)) = self.by_qpn.get(&completion.qp_num()) else {
            tracing::debug!("completion for unknown QP {}", completion.qp_num());
            return;
        };
        let Some(slot) = self.slots[slot_index].as_mut() else {
            return;
        };
        let mut retired = std::mem::take(&mut self.retired);
        let count = match slot.ep.qps[q].retire(completion, &mut retired) {
            Ok(count) => count,
            Err(stray) => {
                tracing::debug!(
                    "completion of QP {} that is not this slot's",
                    stray.qp_num()
                );
                0
            }
        };
        slot.in_flight[q] -= count;
        self.outstanding -= count;
        let mut succeeded = false;
        let mut failed = None;
        // Counted for the peer (and so for the NIC, which sums its peers) once for all that
        // this completion retired, before any of them reports, so that whoever sees a task
        // end sees it counted.
        let (bytes, slices) = retired
            .iter()
            .filter(|(_, outcome)| matches!(outcome, Outcome::Done))
            .fold((0u64, 0u64), |(bytes, slices), (job, _)| {
                (bytes + job.slice.len as u64, slices + 1)
            });
        if slices > 0 {
            slot.moved.add(bytes, slices);
        }
        for (job, outcome) in retired.drain(..) {
            match outcome {
                Outcome::Done => {
                    job.slice.complete();
                    succeeded = true;
                }
                Outcome::Failed(error) => failed = Some((job, error)),
            }
        }
        self.retired = retired;
        if succeeded {
            self.shared.succeeded(self.nic);
        }
        if let Some((job, error)) = failed {
            self.failed(slot_index, job, error);
        }
        self.drop_if_drained(slot_index);
    }

    fn failed(&mut self, slot_index: usize, job: Job, error: CompletionError) {
        let cut_off = self.slots[slot_index].as_ref().is_some_and(|s| s.cut_off);
        // Any error leaves the QP in the error state: the endpoint is done for.
        self.decommission(slot_index, None);
        if self.shared.stopping.load(Ordering::Acquire) {
            return job
                .slice
                .fail(TransferError::Dropped("the RDMA transport stopped".into()));
        }
        if error.code == CompletionError::FLUSHED {
            // Flushed because this worker cut the endpoint off: no fault of the path.
            let reason = (!cut_off).then(|| format!("flushed after an error on {}", job.key));
            return self.again(job, reason);
        }
        self.inbox.counters.failures.add(1);
        if error.code == CompletionError::REMOTE_ACCESS {
            // The peer's NIC refused the key or range: it unregistered that memory (or never
            // registered it for remote access). Retrying cannot help.
            let slice = job.slice;
            let (addr, len) = (slice.remote_addr, slice.len);
            self.shared.note_failure(
                &job.key,
                &format!("remote access error at {addr:#x} (+{len})"),
            );
            return slice.fail(TransferError::RemoteRejected {
                peer: job.key.to_string(),
                addr,
                len,
            });
        }
        let blame = if error.code == CompletionError::RETRY_EXCEEDED
            || error.code == CompletionError::RNR_RETRY_EXCEEDED
        {
            Blame::Hard
        } else {
            Blame::Soft
        };
        self.shared.blame(self.nic, &job.key, blame);
        let reason = format!("{error} on {}", job.key);
        self.shared.note_failure(&job.key, &reason);
        self.again(job, Some(reason));
    }

    /// A posted request came back without having run (flushed, or failed on the path): its
    /// slice goes out again, or, if its task has ended meanwhile, is reported cut off. Its
    /// completion was polled, so the NIC no longer touches its local memory; a write's bytes
    /// may have left, and may have landed.
    fn again(&mut self, job: Job, reason: Option<String>) {
        if !job.slice.is_live() {
            let write = job.slice.opcode() == Opcode::Write;
            return job.slice.cut_off(write);
        }
        self.reroute(job, reason);
    }

    /// Sends a job that could not run here on another attempt: to another path when it
    /// failed (`reason` set), to a fresh endpoint on the same path when its endpoint merely
    /// went away.
    fn reroute(&mut self, mut job: Job, reason: Option<String>) {
        if reason.is_some() {
            job.attempt += 1;
        }
        match self.shared.reroute(job, reason) {
            Some(job)
                if job.nic == self.nic && self.shared.worker_index(&job.key) == self.index =>
            {
                self.local.push_back(job);
            }
            Some(job) => self.shared.dispatch(job),
            None => {}
        }
    }

    /// Decommissions an endpoint: its backlog goes elsewhere, its QPs flush, and the slot
    /// goes once nothing is in flight.
    fn decommission(&mut self, slot_index: usize, failure: Option<String>) {
        let Some(slot) = self.slots[slot_index].as_mut() else {
            return;
        };
        if slot.decommissioned_at.is_some() {
            return;
        }
        slot.decommissioned_at = Some(Instant::now());
        let ep = slot.ep.clone();
        let backlog: Vec<Job> = slot.backlog.drain(..).collect();
        if self.by_key.get(&ep.key) == Some(&slot_index) {
            self.by_key.remove(&ep.key);
        }
        self.shared.forget_endpoint(&ep);
        ep.decommission();
        for job in backlog {
            self.reroute(job, failure.clone());
        }
        self.drop_if_drained(slot_index);
    }

    fn drop_if_drained(&mut self, slot_index: usize) {
        let done = self.slots[slot_index]
            .as_ref()
            .is_some_and(|s| s.decommissioned_at.is_some() && s.in_flight() == 0);
        if done {
            self.drop_slot(slot_index);
        }
    }

    fn drop_slot(&mut self, slot_index: usize) {
        if let Some(slot) = self.slots[slot_index].take() {
            for qp in &slot.ep.qps {
                self.by_qpn.remove(&qp.qp_num());
            }
            if self.by_key.get(&slot.ep.key) == Some(&slot_index) {
                self.by_key.remove(&slot.ep.key);
            }
            self.free.push(slot_index);
        }
    }

    fn housekeeping(&mut self, now: Instant) {
        self.refused
            .retain(|_, (at, _)| now.duration_since(*at) < CONNECT_COOLDOWN);
        for index in 0..self.slots.len() {
            let Some(slot) = self.slots[index].as_mut() else {
                continue;
            };
            if let Some(at) = slot.decommissioned_at {
                if now.duration_since(at) >= DRAIN_LIMIT {
                    // The device never flushed: fail the tasks rather than hold them forever,
                    // but keep the pins (the QPs' ledgers leak them), since nothing says the
                    // NIC is done with that memory.
                    self.abandon(index, "the request never completed");
                }
            } else if slot.ep.state() == State::WaitAck
                && !slot.backlog.is_empty()
                && slot.ep.age() >= READY_ACK_LIMIT
            {
                let key = slot.ep.key.clone();
                self.decommission(index, Some(format!("{key} never sent its ready ACK")));
            } else if slot.ep.state() == State::Dead {
                self.decommission(index, None);
            }
        }
    }

    fn sleep(&mut self) {
        self.inbox.sleeping.store(true, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if !self.inbox.rx.is_empty() || !self.local.is_empty() {
            self.inbox.sleeping.store(false, Ordering::SeqCst);
            return;
        }
        let busy = self.outstanding > 0
            || !self.waiting.is_empty()
            || self
                .slots
                .iter()
                .flatten()
                .any(|s| s.decommissioned_at.is_some());
        let nap = if busy { TICK } else { IDLE_SLEEP };
        let mut completions = std::mem::take(&mut self.completions);
        let waited = self.inbox.cq.wait_or(
            &mut completions,
            POLL_BATCH,
            Some(self.inbox.bell.as_fd()),
            nap,
        );
        self.inbox.sleeping.store(false, Ordering::SeqCst);
        let mut drain = [0u8; 64];
        while matches!((&self.inbox.bell).read(&mut drain), Ok(n) if n > 0) {}
        match waited {
            Ok(_) => {
                for completion in completions.drain(..) {
                    self.complete(completion);
                }
            }
            Err(e) => tracing::error!("waiting on the CQ of NIC #{}: {e}", self.nic),
        }
        self.completions = completions;
    }

    /// Gives up on a decommissioned slot's requests: their tasks fail, their pins stay taken.
    fn abandon(&mut self, slot_index: usize, why: &str) {
        let Some(slot) = self.slots[slot_index].as_mut() else {
            return;
        };
        let stuck: Vec<Job> = slot.ep.qps.iter().flat_map(|qp| qp.abandon()).collect();
        self.outstanding -= slot.in_flight();
        slot.in_flight.iter_mut().for_each(|n| *n = 0);
        if !stuck.is_empty() {
            tracing::warn!(
                "{} request(s) on {} never completed after it was decommissioned; their memory \
                 stays registered for good",
                stuck.len(),
                slot.ep.key
            );
        }
        for job in stuck {
            job.slice.fail(TransferError::Connection {
                peer: job.key.to_string(),
                message: why.into(),
            });
        }
        self.drop_slot(slot_index);
    }

    /// Shutdown: every endpoint's QPs go to the error state and their requests are retired as
    /// they flush (so each pin outlives the requests naming its memory); every job still here
    /// fails.
    fn stop(mut self) {
        let dropped = || TransferError::Dropped("the RDMA transport stopped".into());
        for job in self.local.drain(..) {
            job.slice.fail(dropped());
        }
        for index in 0..self.slots.len() {
            if let Some(slot) = self.slots[index].as_mut() {
                for job in slot.backlog.drain(..) {
                    job.slice.fail(dropped());
                }
            }
            self.decommission(index, Some("the RDMA transport stopped".into()));
        }
        let started = Instant::now();
        while self.outstanding > 0 && started.elapsed() < STOP_DRAIN_LIMIT {
            if self.poll() == 0 {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        for index in 0..self.slots.len() {
            self.abandon(index, "the RDMA transport stopped");
        }
        while let Ok(msg) = self.inbox.rx.try_recv() {
            if let Msg::Jobs(jobs) = msg {
                for job in jobs {
                    job.slice.fail(dropped());
                }
            }
        }
        for job in self.local.drain(..) {
            job.slice.fail(dropped());
        }
    }
}
