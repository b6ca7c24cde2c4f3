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
//!
//! Here: the worker's loop, its sleep and its shutdown. Beside it: `handle` (how other
//! threads reach a worker), `post` (backlogs posted as chains of work requests), `complete`
//! (completions polled and reported, failures sent elsewhere) and `slot` (the endpoints a
//! worker holds: opened, decommissioned, drained, given up on).

use std::collections::{HashMap, VecDeque};
use std::io::Read;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

use crossbeam_channel::TryRecvError;
use tern_engine::{MovedCounter, Pinned, Slice, Submission, TransferError};
use tern_verbs::{Completion, CompletionError, Outcome, SendWork};

use crate::endpoint::{Endpoint, State};
use crate::route::Blame;
use crate::shared::Shared;

mod complete;
mod handle;
mod post;
mod slot;

pub(crate) use handle::{Msg, WorkerHandle, WorkerInbox, worker_pair};

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
    /// A write that was posted and came back failed or flushed while its task was live:
    /// bytes of it may still land through the peer's QP on that path, which stays ready to
    /// receive until a handshake on the same path makes the peer replace it (its answer
    /// moves the QPs it had for this node's NIC to the error state before it replies, as a
    /// Mooncake peer resets them). Until the peer has answered such a handshake, the job
    /// goes to no other path and no other transport, so that no older copy of it lands
    /// after it completed there; it fails (its bytes may land) if that cannot be.
    pub fence: bool,
}

impl Job {
    /// Lets go of a job whose task ended before it could go out again: cut off if an
    /// earlier attempt of a write may still land (see [`fence`](Self::fence)), else skipped.
    pub fn let_go(self) {
        if self.fence {
            self.slice.cut_off(true);
        } else {
            self.slice.abandon();
        }
    }

    /// Fails a fenced job whose path cannot be fenced: its earlier attempt may still land.
    pub fn fail_unfenced(self, why: &str) {
        let message = format!(
            "a write that failed on {} could not be sent again there ({why}), and the peer's \
             QPs of that path may still take bytes of it: they may still land",
            self.key
        );
        self.slice.fail(TransferError::Connection {
            peer: self.key.to_string(),
            message,
        });
    }
}

/// Requests about to be posted to one QP.
type Chain = Vec<SendWork<Pinned<Submission>, Job>>;

/// An endpoint as its worker holds it: what is in flight on its QPs, and what waits for them.
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
    /// Jobs whose path was just fenced, to route again (kept for reuse).
    fenced: Vec<Job>,
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
            fenced: Vec::new(),
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
                        if ep.answered()
                            && let Some(slot) = self.slots[slot].as_mut()
                        {
                            // The peer replaced its QPs of the path before this side's part
                            // failed: the writes waiting for that may go elsewhere.
                            slot.backlog.iter_mut().for_each(|job| job.fence = false);
                        }
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
