//! Worker threads: each owns one completion queue of one NIC and every endpoint whose QPs
//! report to it. It takes jobs from a channel, posts them as chains of work requests
//! (signalling only every so often and the last of a chain), polls its CQ and reports each
//! slice to the engine. Nothing on that path takes a lock shared with other workers.
//!
//! A work request's completion tells the worker about every request posted before it on the
//! same QP (RC completes in order), so each QP keeps a FIFO of what is in flight; an error
//! completion names the request that failed, and the QP, now in the error state, flushes
//! the rest one by one. A retired endpoint is dropped (its QPs destroyed) only once its
//! FIFOs are empty, so no completion can arrive for a QP that no longer exists.
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
use tern_engine::{Opcode, Slice, TransferError};
use tern_verbs::{Completion, CompletionError, CompletionQueue, SendOp, SendRequest, Sge};

use crate::endpoint::{Endpoint, State};
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
    /// An endpoint of this worker became usable (its peer's ready ACK came) or was retired.
    Changed(Arc<Endpoint>),
    Stop,
}

/// How other threads reach a worker.
#[derive(Debug)]
pub(crate) struct WorkerHandle {
    tx: Sender<Msg>,
    bell: UnixStream,
    sleeping: Arc<AtomicBool>,
    pub cq: Arc<CompletionQueue>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The worker's half of a [`WorkerHandle`], handed to its thread.
#[derive(Debug)]
pub(crate) struct WorkerInbox {
    rx: Receiver<Msg>,
    bell: UnixStream,
    sleeping: Arc<AtomicBool>,
    cq: Arc<CompletionQueue>,
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
    Ok((
        WorkerHandle {
            tx,
            bell: ring,
            sleeping: sleeping.clone(),
            cq: cq.clone(),
            thread: Mutex::new(None),
        },
        WorkerInbox {
            rx,
            bell: hear,
            sleeping,
            cq,
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

#[derive(Debug)]
struct InFlight {
    seq: u64,
    job: Job,
}

#[derive(Debug, Default)]
struct QpTrack {
    inflight: VecDeque<InFlight>,
    next_seq: u64,
}

/// Requests about to be posted to one QP, and their jobs.
#[derive(Debug, Default)]
struct Chain {
    requests: Vec<SendRequest>,
    jobs: Vec<Job>,
}

#[derive(Debug)]
struct Slot {
    ep: Arc<Endpoint>,
    qps: Vec<QpTrack>,
    backlog: VecDeque<Job>,
    next_qp: usize,
    /// Set once the endpoint is retired here: the slot goes when its FIFOs are empty.
    retired_at: Option<Instant>,
}

impl Slot {
    fn in_flight(&self) -> usize {
        self.qps.iter().map(|q| q.inflight.len()).sum()
    }
}

/// Completions taken per poll.
const POLL_BATCH: usize = 64;
/// Every this many requests of a chain, one is signalled, so a long chain frees its queue
/// slots before it ends.
const SIGNAL_EVERY: usize = 32;
/// How long a retired endpoint may wait for its flushed requests before the worker gives up
/// on them (Mooncake: 30 s).
const DRAIN_LIMIT: Duration = Duration::from_secs(30);
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
            completions: vec![Completion::EMPTY; POLL_BATCH],
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
                        self.retire(slot, Some(reason));
                    }
                }
            }
            Msg::Changed(ep) => {
                if let Some(slot) = self.slot_of(&ep) {
                    if ep.state() == State::Dead {
                        self.retire(slot, None);
                    } else {
                        self.mark_waiting(slot);
                    }
                }
            }
            Msg::Stop => {}
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
        let slot = Slot {
            qps: ep.qps.iter().map(|_| QpTrack::default()).collect(),
            ep: ep.clone(),
            backlog: VecDeque::new(),
            next_qp: 0,
            retired_at: None,
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
                .is_some_and(|s| s.retired_at.is_none() && s.ep.state() == State::Ready);
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
        let qp_count = slot.qps.len();
        if self.chains.len() < qp_count {
            self.chains.resize_with(qp_count, Chain::default);
        }
        let mut budget = self.cq_capacity.saturating_sub(self.outstanding);
        let mut taken = 0;
        while budget > 0 {
            let Some(q) = (0..qp_count)
                .map(|i| (slot.next_qp + i) % qp_count)
                .find(|&q| slot.qps[q].inflight.len() + self.chains[q].jobs.len() < self.max_wr)
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
            slot.next_qp = (q + 1) % qp_count;
            let track = &mut slot.qps[q];
            let seq = track.next_seq;
            track.next_seq += 1;
            let (remote_addr, rkey) = (job.slice.remote_addr, job.rkey);
            let op = match job.slice.opcode {
                Opcode::Write => SendOp::Write { remote_addr, rkey },
                Opcode::Read => SendOp::Read { remote_addr, rkey },
            };
            self.chains[q].requests.push(SendRequest {
                wr_id: seq,
                op,
                sges: vec![Sge {
                    addr: job.slice.local_addr as u64,
                    len: job.slice.len as u32,
                    lkey: job.lkey,
                }],
                signaled: false,
            });
            self.chains[q].jobs.push(job);
            budget -= 1;
            taken += 1;
        }
        if taken == 0 {
            return false;
        }
        let mut broken = None;
        for q in 0..qp_count {
            let Chain { requests, jobs } = &mut self.chains[q];
            if requests.is_empty() {
                continue;
            }
            let last = requests.len() - 1;
            for (i, request) in requests.iter_mut().enumerate() {
                request.signaled = i == last || (i + 1) % SIGNAL_EVERY == 0;
            }
            let posted = match slot.ep.qps[q].post_send(requests) {
                Ok(()) => requests.len(),
                // The requests before the refused one are on the wire; an unsignalled last
                // one among them is still reported, by the flush that retiring the endpoint
                // below causes.
                Err(tern_verbs::VerbsError::PostSend { posted, errno }) => {
                    broken = Some(format!("ibv_post_send failed (errno {errno})"));
                    posted.min(requests.len())
                }
                Err(e) => {
                    broken = Some(e.to_string());
                    0
                }
            };
            let track = &mut slot.qps[q];
            for (request, job) in requests.drain(..).zip(jobs.drain(..posted)) {
                track.inflight.push_back(InFlight {
                    seq: request.wr_id,
                    job,
                });
            }
            self.outstanding += posted;
            self.local.extend(jobs.drain(..));
        }
        if let Some(reason) = broken {
            tracing::warn!("posting to {}: {reason}", slot.ep.key);
            self.retire(slot_index, None);
        }
        true
    }

    fn poll(&mut self) -> usize {
        let mut completions = std::mem::take(&mut self.completions);
        let got = match self.inbox.cq.poll(&mut completions) {
            Ok(got) => got,
            Err(e) => {
                tracing::error!("polling the CQ of NIC #{}: {e}", self.nic);
                0
            }
        };
        for completion in &completions[..got] {
            self.complete(completion);
        }
        self.completions = completions;
        got
    }

    fn complete(&mut self, completion: &Completion) {
        let Some(&(slot_index, q)) = self.by_qpn.get(&completion.qp_num) else {
            tracing::debug!("completion for unknown QP {}", completion.qp_num);
            return;
        };
        let Some(slot) = self.slots[slot_index].as_mut() else {
            return;
        };
        let track = &mut slot.qps[q];
        let nic = self.shared.nic(self.nic);
        let mut succeeded = 0usize;
        let mut failed = None;
        while let Some(front) = track.inflight.front() {
            if front.seq > completion.wr_id {
                break;
            }
            let Some(entry) = track.inflight.pop_front() else {
                break;
            };
            self.outstanding -= 1;
            match completion.status {
                Err(error) if entry.seq == completion.wr_id => failed = Some((entry.job, error)),
                // RC completes in order: everything before the reported request succeeded.
                _ => {
                    nic.counted(entry.job.slice.len);
                    entry.job.slice.complete();
                    succeeded += 1;
                }
            }
        }
        if succeeded > 0 {
            self.shared.succeeded(self.nic);
        }
        if let Some((job, error)) = failed {
            self.failed(slot_index, job, error);
        }
        self.drop_if_drained(slot_index);
    }

    fn failed(&mut self, slot_index: usize, job: Job, error: CompletionError) {
        // Any error leaves the QP in the error state: the endpoint is done for.
        self.retire(slot_index, None);
        if error.code == CompletionError::FLUSHED {
            let reason = format!("flushed after an error on {}", job.key);
            return self.reroute(job, Some(reason));
        }
        self.shared
            .nic(self.nic)
            .counters
            .failures
            .fetch_add(1, Ordering::Relaxed);
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
        self.reroute(job, Some(reason));
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

    /// Retires an endpoint: its backlog goes elsewhere, its QPs flush, and the slot goes once
    /// nothing is in flight.
    fn retire(&mut self, slot_index: usize, failure: Option<String>) {
        let Some(slot) = self.slots[slot_index].as_mut() else {
            return;
        };
        if slot.retired_at.is_some() {
            return;
        }
        slot.retired_at = Some(Instant::now());
        let ep = slot.ep.clone();
        let backlog: Vec<Job> = slot.backlog.drain(..).collect();
        if self.by_key.get(&ep.key) == Some(&slot_index) {
            self.by_key.remove(&ep.key);
        }
        self.shared.forget_endpoint(&ep);
        ep.retire();
        for job in backlog {
            self.reroute(job, failure.clone());
        }
        self.drop_if_drained(slot_index);
    }

    fn drop_if_drained(&mut self, slot_index: usize) {
        let done = self.slots[slot_index]
            .as_ref()
            .is_some_and(|s| s.retired_at.is_some() && s.in_flight() == 0);
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
            if let Some(at) = slot.retired_at {
                if now.duration_since(at) >= DRAIN_LIMIT {
                    // The device never flushed: give the requests up rather than hold their
                    // tasks forever.
                    let stuck: Vec<Job> = slot
                        .qps
                        .iter_mut()
                        .flat_map(|q| q.inflight.drain(..))
                        .map(|f| f.job)
                        .collect();
                    self.outstanding -= stuck.len();
                    tracing::warn!(
                        "{} request(s) on {} never completed after its retirement",
                        stuck.len(),
                        slot.ep.key
                    );
                    for job in stuck {
                        job.slice.fail(TransferError::Connection {
                            peer: job.key.to_string(),
                            message: "the request never completed".into(),
                        });
                    }
                    self.drop_slot(index);
                }
            } else if slot.ep.state() == State::WaitAck
                && !slot.backlog.is_empty()
                && slot.ep.age() >= READY_ACK_LIMIT
            {
                let key = slot.ep.key.clone();
                self.retire(index, Some(format!("{key} never sent its ready ACK")));
            } else if slot.ep.state() == State::Dead {
                self.retire(index, None);
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
            || self.slots.iter().flatten().any(|s| s.retired_at.is_some());
        let nap = if busy { TICK } else { IDLE_SLEEP };
        let mut completions = std::mem::take(&mut self.completions);
        let waited = self
            .inbox
            .cq
            .wait_or(&mut completions, Some(self.inbox.bell.as_fd()), nap);
        self.inbox.sleeping.store(false, Ordering::SeqCst);
        let mut drain = [0u8; 64];
        while matches!((&self.inbox.bell).read(&mut drain), Ok(n) if n > 0) {}
        match waited {
            Ok(got) => {
                for completion in &completions[..got] {
                    self.complete(completion);
                }
            }
            Err(e) => tracing::error!("waiting on the CQ of NIC #{}: {e}", self.nic),
        }
        self.completions = completions;
    }

    /// Shutdown: every job still here fails, every endpoint's QPs stop.
    fn stop(mut self) {
        let dropped = || TransferError::Dropped("the RDMA transport stopped".into());
        for job in self.local.drain(..) {
            job.slice.fail(dropped());
        }
        for slot in self.slots.iter_mut().flatten() {
            slot.ep.retire();
            for job in slot.backlog.drain(..) {
                job.slice.fail(dropped());
            }
            for track in &mut slot.qps {
                for entry in track.inflight.drain(..) {
                    entry.job.slice.fail(dropped());
                }
            }
        }
        while let Ok(msg) = self.inbox.rx.try_recv() {
            if let Msg::Jobs(jobs) = msg {
                for job in jobs {
                    job.slice.fail(dropped());
                }
            }
        }
    }
}
