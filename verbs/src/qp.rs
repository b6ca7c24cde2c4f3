//! RC queue pairs: state transitions and posting work requests.
//!
//! Posting is safe through [`QueuePair::post_send`] and [`QueuePair::post_recv`]: each
//! request hands over a [`MemoryGuard`] for its local memory, and the QP's ledger keeps that
//! guard until the request's completion has been retrieved from the CQ and handed to
//! [`QueuePair::retire`] — the condition `ibv_post_send(3)` sets for reusing a request's
//! memory (see [`crate::ledger`]). A QP dropped with requests still in flight leaks their
//! guards rather than guess that the device is done. The raw
//! [`post_send_unchecked`](QueuePair::post_send_unchecked) leaves that duty to the caller.

use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use rdma_sys as sys;

use crate::cq::{Completion, CompletionError, CompletionQueue};
use crate::error::{VerbsError, errno};
use crate::gid::Gid;
use crate::ledger::{Ledger, Outcome, TRACKED_BIT, signalled};
use crate::mr::{Access, MemoryRegion};
use crate::pd::ProtectionDomain;

/// Sizes of a queue pair's queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send work requests.
    pub max_send_wr: u32,
    /// Outstanding receive work requests.
    pub max_recv_wr: u32,
    /// SGEs per work request.
    pub max_sge: u32,
    /// Inline data bytes.
    pub max_inline: u32,
    /// Of the send requests of one [`QueuePair::post_send`], every this many and the last
    /// are signalled (1: all). The rest are retired by the next signalled completion.
    pub signal_every: u32,
}

impl Default for QpCaps {
    /// Mooncake's: 256 WRs, 4 SGEs, 64 bytes inline; one request in 32 signalled.
    fn default() -> Self {
        Self {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_sge: 4,
            max_inline: 64,
            signal_every: 32,
        }
    }
}

/// What the passive side of a connection needs to know about the other end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Its QP number.
    pub qp_num: u32,
    /// Its first packet sequence number.
    pub psn: u32,
    /// Its GID.
    pub gid: Gid,
    /// Its LID (0 on RoCE).
    pub lid: u16,
}

/// Path settings for RTR and RTS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathConfig {
    /// Local port.
    pub port: u8,
    /// Local GID index.
    pub sgid_index: u8,
    /// Path MTU (verbs enum, 1..=5); the smaller of both ends' active MTUs.
    pub mtu: u32,
    /// ACK timeout exponent (Mooncake: 14 ≈ 67 ms).
    pub timeout: u8,
    /// Retries on timeout (7 means "forever" on some devices).
    pub retry_count: u8,
    /// Retries on receiver-not-ready.
    pub rnr_retry: u8,
    /// Our first packet sequence number.
    pub psn: u32,
}

impl Default for PathConfig {
    fn default() -> Self {
        Self {
            port: 1,
            sgid_index: 0,
            mtu: sys::ibv_mtu::IBV_MTU_4096,
            timeout: 14,
            retry_count: 6,
            rnr_retry: 7,
            psn: 0,
        }
    }
}

static LIVE_QUEUE_PAIRS: AtomicUsize = AtomicUsize::new(0);

/// Queue pairs this process has created and not yet destroyed: what a leak check counts.
pub fn live_queue_pairs() -> usize {
    LIVE_QUEUE_PAIRS.load(Ordering::Relaxed)
}

/// A value that keeps some memory valid for as long as it lives: what a work request hands
/// the queue pair so that the memory its SGE names outlives the request.
///
/// # Safety
///
/// While the value lives, the bytes `[span().0, span().0 + span().1)` must stay mapped and
/// valid for the device to read and write, must not be freed or reused, and nothing may rely
/// on Rust's aliasing guarantees for them (the device writes them at any time). `span` must
/// return the same range every time it is called.
pub unsafe trait MemoryGuard: Send + 'static {
    /// Start address and length of the memory kept valid.
    fn span(&self) -> (usize, usize);
}

// SAFETY: `MemoryRegion::register`'s contract is that the registered range stays valid until
// the region is dropped; the Arc keeps the region, so the range, alive.
unsafe impl MemoryGuard for Arc<MemoryRegion> {
    fn span(&self) -> (usize, usize) {
        (self.addr(), self.len())
    }
}

/// A reliable-connected queue pair whose tracked work requests carry a guard `G` (which
/// keeps their local memory valid) and a value `U` the caller gets back on completion.
pub struct QueuePair<G = Arc<MemoryRegion>, U = u64> {
    qp: NonNull<sys::ibv_qp>,
    pd: Arc<ProtectionDomain>,
    cq: Arc<CompletionQueue>,
    signal_every: usize,
    send: Mutex<WorkQueue<sys::ibv_send_wr, (G, U)>>,
    recv: Mutex<WorkQueue<sys::ibv_recv_wr, (G, U)>>,
}

/// One work queue: its ledger and the scratch arrays a post builds its chain in (reused, so
/// posting allocates nothing once they have grown).
struct WorkQueue<W, T> {
    ledger: Ledger<T>,
    wrs: Vec<W>,
    sges: Vec<sys::ibv_sge>,
}

impl<W, T> WorkQueue<W, T> {
    fn new() -> Self {
        Self {
            ledger: Ledger::new(),
            wrs: Vec::new(),
            sges: Vec::new(),
        }
    }
}

impl<G, U> std::fmt::Debug for QueuePair<G, U> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // SAFETY: the QP is valid while self lives; qp_num is immutable.
        let qp_num = unsafe { self.qp.as_ref().qp_num };
        f.debug_struct("QueuePair")
            .field("qp_num", &qp_num)
            .field("sends_in_flight", &lock(&self.send).ledger.len())
            .field("receives_in_flight", &lock(&self.recv).ledger.len())
            .finish_non_exhaustive()
    }
}

// SAFETY: posting to and modifying a QP from several threads is allowed by libibverbs (its
// verbs are thread-safe); the raw work-request pointers in the scratch arrays are only used
// under their mutex and during one call; payloads move between threads, hence `G, U: Send`.
unsafe impl<G: Send, U: Send> Send for QueuePair<G, U> {}
// SAFETY: see Send; shared access reaches the payloads only under their mutexes.
unsafe impl<G: Send, U: Send> Sync for QueuePair<G, U> {}

/// One scatter/gather element: a piece of registered local memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Start address (inside an MR of the QP's PD).
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// The MR's lkey.
    pub lkey: u32,
}

/// What a send work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Local SGEs → remote memory.
    Write {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// Local SGEs → remote memory, then an immediate value delivered to a posted receive.
    WriteWithImm {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// The immediate value (host order; sent big-endian).
        imm: u32,
    },
    /// Remote memory → local SGEs.
    Read {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// Local SGEs → the peer's next posted receive.
    Send,
}

/// A send work request for [`QueuePair::post_send_unchecked`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendRequest {
    /// Returned in the completion; must not have [`TRACKED_BIT`] set.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// The local memory.
    pub sges: Vec<Sge>,
    /// Whether to produce a completion on success.
    pub signaled: bool,
}

/// A tracked send work request: one local SGE, the guard that keeps its memory valid until
/// the request's completion has been retrieved, and the caller's value.
#[derive(Debug)]
pub struct SendWork<G, U> {
    /// What to do.
    pub op: SendOp,
    /// The local memory; must lie inside `guard`'s span.
    pub local: Sge,
    /// Keeps `local` valid; dropped once the request is retired.
    pub guard: G,
    /// Handed back with the request's outcome.
    pub user: U,
}

/// A tracked receive work request (for SEND and WRITE_WITH_IMM from the peer).
#[derive(Debug)]
pub struct RecvWork<G, U> {
    /// Where a received message lands; must lie inside `guard`'s span.
    pub local: Sge,
    /// Keeps `local` valid; dropped once the request is retired.
    pub guard: G,
    /// Handed back with the request's outcome.
    pub user: U,
}

impl<G: MemoryGuard, U: Send> QueuePair<G, U> {
    /// Creates an RC QP in RESET whose sends and receives complete on `cq`.
    pub fn new_rc(
        pd: &Arc<ProtectionDomain>,
        cq: &Arc<CompletionQueue>,
        caps: QpCaps,
    ) -> Result<Self, VerbsError> {
        // SAFETY: ibv_qp_init_attr is plain data; zero is a valid bit pattern.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.cq.as_ptr();
        init.recv_cq = cq.cq.as_ptr();
        init.cap = sys::ibv_qp_cap {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: caps.max_sge,
            max_recv_sge: caps.max_sge,
            max_inline_data: caps.max_inline,
        };
        init.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        // SAFETY: the PD and CQ are alive (held below for the QP's life); `init` is valid.
        let qp = unsafe { sys::ibv_create_qp(pd.pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| VerbsError::CreateQp(errno()))?;
        LIVE_QUEUE_PAIRS.fetch_add(1, Ordering::Relaxed);
        Ok(Self {
            qp,
            pd: pd.clone(),
            cq: cq.clone(),
            signal_every: caps.signal_every.max(1) as usize,
            send: Mutex::new(WorkQueue::new()),
            recv: Mutex::new(WorkQueue::new()),
        })
    }

    /// The QP number peers address.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: the QP is valid while self lives; qp_num is immutable.
        unsafe { self.qp.as_ref().qp_num }
    }

    /// The completion queue.
    pub fn cq(&self) -> &Arc<CompletionQueue> {
        &self.cq
    }

    /// The protection domain.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    fn modify(
        &self,
        attr: &mut sys::ibv_qp_attr,
        mask: u32,
        state: &'static str,
    ) -> Result<(), VerbsError> {
        // SAFETY: the QP is alive and `attr` is a valid, initialised attribute block.
        let rc = unsafe { sys::ibv_modify_qp(self.qp.as_ptr(), attr, mask as c_int) };
        if rc != 0 {
            return Err(VerbsError::ModifyQp { state, errno: rc });
        }
        Ok(())
    }

    fn blank_attr() -> sys::ibv_qp_attr {
        // SAFETY: ibv_qp_attr is plain data; zero is a valid bit pattern.
        unsafe { std::mem::zeroed() }
    }

    /// RESET → INIT on `port`, granting peers remote read and write.
    pub fn to_init(&self, port: u8) -> Result<(), VerbsError> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = Self::blank_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = port;
        attr.qp_access_flags = Access::REMOTE.bits();
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_PKEY_INDEX.0
            | m::IBV_QP_PORT.0
            | m::IBV_QP_ACCESS_FLAGS.0;
        self.modify(&mut attr, mask, "INIT")
    }

    /// INIT → RTR towards `peer`.
    pub fn to_rtr(&self, peer: &Peer, path: &PathConfig) -> Result<(), VerbsError> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = Self::blank_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = path.mtu;
        attr.dest_qp_num = peer.qp_num;
        attr.rq_psn = peer.psn;
        attr.max_dest_rd_atomic = 16;
        attr.min_rnr_timer = 12;
        attr.ah_attr.is_global = 1;
        attr.ah_attr.dlid = peer.lid;
        attr.ah_attr.port_num = path.port;
        attr.ah_attr.grh.dgid = sys::ibv_gid { raw: peer.gid.0 };
        attr.ah_attr.grh.sgid_index = path.sgid_index;
        attr.ah_attr.grh.hop_limit = 16;
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_AV.0
            | m::IBV_QP_PATH_MTU.0
            | m::IBV_QP_DEST_QPN.0
            | m::IBV_QP_RQ_PSN.0
            | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
            | m::IBV_QP_MIN_RNR_TIMER.0;
        self.modify(&mut attr, mask, "RTR")
    }

    /// RTR → RTS.
    pub fn to_rts(&self, path: &PathConfig) -> Result<(), VerbsError> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = Self::blank_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        attr.timeout = path.timeout;
        attr.retry_cnt = path.retry_count;
        attr.rnr_retry = path.rnr_retry;
        attr.sq_psn = path.psn;
        attr.max_rd_atomic = 16;
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_TIMEOUT.0
            | m::IBV_QP_RETRY_CNT.0
            | m::IBV_QP_RNR_RETRY.0
            | m::IBV_QP_SQ_PSN.0
            | m::IBV_QP_MAX_QP_RD_ATOMIC.0;
        self.modify(&mut attr, mask, "RTS")
    }

    /// INIT → RTR → RTS in one call.
    pub fn connect(&self, peer: &Peer, path: &PathConfig) -> Result<(), VerbsError> {
        self.to_init(path.port)?;
        self.to_rtr(peer, path)?;
        self.to_rts(path)
    }

    /// To the error state: every outstanding work request completes with a flush error, so
    /// the owner learns what never ran before it destroys or resets the QP.
    pub fn to_error(&self) -> Result<(), VerbsError> {
        let mut attr = Self::blank_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
        self.modify(&mut attr, sys::ibv_qp_attr_mask::IBV_QP_STATE.0, "ERR")
    }

    /// Back to RESET (from any state, the error state included), ready to connect again.
    /// Refused while tracked requests are in flight: a reset QP discards them without
    /// completions, so nothing would then say when their memory is free.
    pub fn reset(&self) -> Result<(), VerbsError> {
        if self.in_flight() > 0 {
            return Err(VerbsError::InvalidRequest(
                "reset with work requests in flight: move to the error state and retire them first",
            ));
        }
        let mut attr = Self::blank_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RESET;
        self.modify(&mut attr, sys::ibv_qp_attr_mask::IBV_QP_STATE.0, "RESET")
    }

    /// Tracked requests posted and not yet retired, both queues.
    pub fn in_flight(&self) -> usize {
        lock(&self.send).ledger.len() + lock(&self.recv).ledger.len()
    }

    /// Whether any tracked send request posted and not yet retired carries a value for
    /// which `test` holds (to find the QPs whose work must be cut off, say).
    pub fn any_send_in_flight(&self, mut test: impl FnMut(&U) -> bool) -> bool {
        lock(&self.send).ledger.any(|(_, user)| test(user))
    }

    /// Posts `work` as one chain (one `ibv_post_send` call), signalling every
    /// [`QpCaps::signal_every`]-th request and the last. What the device took is drained from
    /// the front of `work` and tracked until retired; on a refusal the rest stays in `work`
    /// and the error says how many were posted. When the library fails without naming the
    /// request it refused, all of `work` is tracked as possibly posted, the QP is moved to
    /// the error state so that each one's completion or flush retires it, and the error is
    /// [`VerbsError::PostUncertain`]. An SGE outside its guard's span is refused before
    /// anything is posted.
    pub fn post_send(&self, work: &mut Vec<SendWork<G, U>>) -> Result<(), VerbsError> {
        if work.is_empty() {
            return Ok(());
        }
        if work.iter().any(|w| !inside(&w.local, w.guard.span())) {
            return Err(VerbsError::InvalidRequest(
                "a work request's SGE lies outside the memory its guard keeps valid",
            ));
        }
        let mut queue = lock(&self.send);
        let WorkQueue { ledger, wrs, sges } = &mut *queue;
        sges.clear();
        sges.extend(work.iter().map(|w| raw_sge(&w.local)));
        wrs.clear();
        for (i, w) in work.iter().enumerate() {
            let signaled = signalled(i, work.len(), self.signal_every);
            wrs.push(send_wr(ledger.upcoming_wr_id(i), w.op, signaled));
        }
        let posted = link_and_post(wrs, sges, |head, bad| {
            // SAFETY: the chain and its SGE array live until the call returns (the library
            // copies them into the send queue). Every SGE lies inside its guard's span
            // (checked above), and the guards go into the ledger, which keeps them until the
            // requests' completions have been retrieved (`ibv_post_send(3)`, NOTES) — every
            // request the device may hold, including all of them when the library does not
            // say which one it refused (see `track`). No request is inline, so the library
            // reads no SGE memory itself.
            unsafe { sys::ibv_post_send(self.qp.as_ptr(), head, bad) }
        });
        let outcome = track(ledger, work, posted, |w| (w.guard, w.user));
        drop(queue);
        outcome.map_err(|refused| self.post_error("ibv_post_send", refused, post_send_error))
    }

    /// Posts receive requests as [`post_send`](Self::post_send) does send requests; every
    /// receive completes with its own completion.
    pub fn post_recv(&self, work: &mut Vec<RecvWork<G, U>>) -> Result<(), VerbsError> {
        if work.is_empty() {
            return Ok(());
        }
        if work.iter().any(|w| !inside(&w.local, w.guard.span())) {
            return Err(VerbsError::InvalidRequest(
                "a receive request's SGE lies outside the memory its guard keeps valid",
            ));
        }
        let mut queue = lock(&self.recv);
        let WorkQueue { ledger, wrs, sges } = &mut *queue;
        sges.clear();
        sges.extend(work.iter().map(|w| raw_sge(&w.local)));
        wrs.clear();
        wrs.extend((0..work.len()).map(|i| recv_wr(ledger.upcoming_wr_id(i))));
        let posted = link_and_post(wrs, sges, |head, bad| {
            // SAFETY: as in `post_send`: the chain lives for the call, every SGE lies inside
            // its guard's span, and the ledger keeps the guards until retirement.
            unsafe { sys::ibv_post_recv(self.qp.as_ptr(), head, bad) }
        });
        let outcome = track(ledger, work, posted, |w| (w.guard, w.user));
        drop(queue);
        outcome.map_err(|refused| self.post_error("ibv_post_recv", refused, post_recv_error))
    }

    /// The error of a refused post. When the library did not say which request it refused,
    /// any of the chain may be on the device: the QP goes to the error state, so that each
    /// of those ends with a completion (a flush at the latest) that retires it.
    /// `known` makes the error of a refusal that names its request.
    fn post_error(
        &self,
        verb: &'static str,
        refused: Refused,
        known: fn(i32, usize) -> VerbsError,
    ) -> VerbsError {
        match refused {
            Refused::At { posted, errno } => known(errno, posted),
            Refused::Unknown { chain, errno } => {
                let flushed = match self.to_error() {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!("{verb} failed without naming a request; {e}");
                        false
                    }
                };
                VerbsError::PostUncertain {
                    verb,
                    errno,
                    chain,
                    flushed,
                }
            }
        }
    }

    /// Retires what `completion` reports: its request and every older one on the same
    /// queue. Each retired request's guard is dropped and its value pushed to `out` with its
    /// outcome, in posting order; returns how many. A completion of another QP or CQ comes
    /// back as `Err`; one of an untracked or already retired request retires nothing.
    pub fn retire(
        &self,
        completion: Completion,
        out: &mut Vec<(U, Outcome<CompletionError>)>,
    ) -> Result<usize, Completion> {
        if completion.qp_num() != self.qp_num() || completion.cq_id() != self.cq.id() {
            return Err(completion);
        }
        let wr_id = completion.wr_id();
        let error = completion.status().err();
        let mut push = |(guard, user): (G, U), outcome| {
            drop(guard);
            out.push((user, outcome));
        };
        // The status of an error completion says nothing about which queue it came from
        // (`ibv_poll_cq(3)`: only wr_id, status, qp_num and vendor_err are valid); each
        // queue's ledger knows its own IDs.
        let sent = lock(&self.send).ledger.retire(wr_id, error, &mut push);
        if sent > 0 {
            return Ok(sent);
        }
        Ok(lock(&self.recv).ledger.retire(wr_id, error, &mut push))
    }

    /// Gives up on every tracked request in flight: their values come back (to fail what
    /// they stood for), their guards are leaked, so the memory they keep stays valid for
    /// good. For a device that never flushes; the normal way out is [`to_error`](Self::to_error)
    /// and retiring the flush completions.
    pub fn abandon(&self) -> Vec<U> {
        let mut users = lock(&self.send).ledger.abandon(|item| item);
        users.extend(lock(&self.recv).ledger.abandon(|item| item));
        users
    }

    /// Posts a chain of send work requests without tracking them. On failure the error says
    /// how many requests at the head of the chain were posted (and will complete); if the
    /// library did not say, it is [`VerbsError::PostUncertain`]: any of them may have been
    /// posted, and the QP was moved to the error state so that those complete (flushed).
    ///
    /// # Safety
    ///
    /// Every SGE's memory must stay valid (mapped, not freed or reused, not relied on for
    /// Rust aliasing) and registered under its lkey until the request has completed or been
    /// flushed and that completion — or a later one of the same send queue — has been
    /// retrieved from the CQ (`ibv_post_send(3)`, NOTES).
    pub unsafe fn post_send_unchecked(&self, requests: &[SendRequest]) -> Result<(), VerbsError> {
        if requests.is_empty() {
            return Ok(());
        }
        if requests
            .iter()
            .any(|r| r.sges.is_empty() && r.op != SendOp::Send)
        {
            return Err(VerbsError::InvalidRequest(
                "an RDMA request needs at least one SGE",
            ));
        }
        if requests.iter().any(|r| r.wr_id & TRACKED_BIT != 0) {
            return Err(VerbsError::InvalidRequest(
                "untracked work request IDs must not have the top bit set",
            ));
        }
        let mut sges = flat_sges(requests.iter().map(|r| r.sges.as_slice()))?;
        let mut wrs: Vec<sys::ibv_send_wr> = requests
            .iter()
            .map(|r| send_wr(r.wr_id, r.op, r.signaled))
            .collect();
        let mut first_sge = 0;
        for (wr, request) in wrs.iter_mut().zip(requests) {
            wr.sg_list = sges[first_sge..].as_mut_ptr();
            wr.num_sge = request.sges.len() as c_int;
            first_sge += request.sges.len();
        }
        link(&mut wrs);
        let head: *mut sys::ibv_send_wr = wrs.as_mut_ptr();
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: the chain and its SGE array live until the call returns; the memory the
        // device later touches is the caller's to keep valid (this fn's contract).
        let rc = unsafe { sys::ibv_post_send(self.qp.as_ptr(), head, &mut bad) };
        if rc != 0 {
            let refused = refused_at(head.cast_const(), bad, wrs.len(), rc);
            return Err(self.post_error("ibv_post_send", refused, post_send_error));
        }
        Ok(())
    }

    /// Posts untracked receive work requests.
    ///
    /// # Safety
    ///
    /// As [`post_send_unchecked`](Self::post_send_unchecked): every SGE's memory stays valid
    /// and registered until the receive's completion has been retrieved.
    pub unsafe fn post_recv_unchecked(
        &self,
        requests: &[(u64, Vec<Sge>)],
    ) -> Result<(), VerbsError> {
        if requests.is_empty() {
            return Ok(());
        }
        if requests.iter().any(|(wr_id, _)| wr_id & TRACKED_BIT != 0) {
            return Err(VerbsError::InvalidRequest(
                "untracked work request IDs must not have the top bit set",
            ));
        }
        let mut sges = flat_sges(requests.iter().map(|(_, list)| list.as_slice()))?;
        let mut wrs: Vec<sys::ibv_recv_wr> =
            requests.iter().map(|(wr_id, _)| recv_wr(*wr_id)).collect();
        let mut first_sge = 0;
        for (wr, (_, list)) in wrs.iter_mut().zip(requests) {
            wr.sg_list = sges[first_sge..].as_mut_ptr();
            wr.num_sge = list.len() as c_int;
            first_sge += list.len();
        }
        link(&mut wrs);
        let head: *mut sys::ibv_recv_wr = wrs.as_mut_ptr();
        let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
        // SAFETY: the chain lives until the call returns; the memory is the caller's to keep
        // valid (this fn's contract).
        let rc = unsafe { sys::ibv_post_recv(self.qp.as_ptr(), head, &mut bad) };
        if rc != 0 {
            let refused = refused_at(head.cast_const(), bad, wrs.len(), rc);
            return Err(self.post_error("ibv_post_recv", refused, post_recv_error));
        }
        Ok(())
    }
}

fn post_send_error(errno: i32, posted: usize) -> VerbsError {
    VerbsError::PostSend { errno, posted }
}

fn post_recv_error(errno: i32, posted: usize) -> VerbsError {
    VerbsError::PostRecv { errno, posted }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether `sge` lies inside `(start, len)`.
fn inside(sge: &Sge, (start, len): (usize, usize)) -> bool {
    let (Ok(addr), Some(end)) = (usize::try_from(sge.addr), start.checked_add(len)) else {
        return false;
    };
    addr >= start && addr.checked_add(sge.len as usize).is_some_and(|e| e <= end)
}

fn raw_sge(sge: &Sge) -> sys::ibv_sge {
    sys::ibv_sge {
        addr: sge.addr,
        length: sge.len,
        lkey: sge.lkey,
    }
}

/// A send work request without its SGE list.
fn send_wr(wr_id: u64, op: SendOp, signaled: bool) -> sys::ibv_send_wr {
    // SAFETY: ibv_send_wr is plain data (pointers and integers); zero is valid.
    let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.send_flags = if signaled {
        sys::ibv_send_flags::IBV_SEND_SIGNALED.0
    } else {
        0
    };
    let (opcode, remote) = match op {
        SendOp::Write { remote_addr, rkey } => (
            sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            Some((remote_addr, rkey)),
        ),
        SendOp::WriteWithImm {
            remote_addr,
            rkey,
            imm,
        } => {
            wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
            (
                sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
                Some((remote_addr, rkey)),
            )
        }
        SendOp::Read { remote_addr, rkey } => (
            sys::ibv_wr_opcode::IBV_WR_RDMA_READ,
            Some((remote_addr, rkey)),
        ),
        SendOp::Send => (sys::ibv_wr_opcode::IBV_WR_SEND, None),
    };
    wr.opcode = opcode;
    if let Some((remote_addr, rkey)) = remote {
        wr.wr.rdma = sys::rdma_t { remote_addr, rkey };
    }
    wr
}

fn recv_wr(wr_id: u64) -> sys::ibv_recv_wr {
    // SAFETY: ibv_recv_wr is plain data; zero is valid.
    let mut wr: sys::ibv_recv_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr
}

/// A work request type whose chain link and SGE list can be set.
trait ChainLink: Sized {
    fn set_next(&mut self, next: *mut Self);
    fn set_sges(&mut self, sge: *mut sys::ibv_sge, count: c_int);
}

impl ChainLink for sys::ibv_send_wr {
    fn set_next(&mut self, next: *mut Self) {
        self.next = next;
    }
    fn set_sges(&mut self, sge: *mut sys::ibv_sge, count: c_int) {
        self.sg_list = sge;
        self.num_sge = count;
    }
}

impl ChainLink for sys::ibv_recv_wr {
    fn set_next(&mut self, next: *mut Self) {
        self.next = next;
    }
    fn set_sges(&mut self, sge: *mut sys::ibv_sge, count: c_int) {
        self.sg_list = sge;
        self.num_sge = count;
    }
}

/// Links `wrs` into a chain (each to the next, the last to null).
fn link<W: ChainLink>(wrs: &mut [W]) {
    for i in 1..wrs.len() {
        let next: *mut W = &mut wrs[i];
        wrs[i - 1].set_next(next);
    }
    if let Some(last) = wrs.last_mut() {
        last.set_next(ptr::null_mut());
    }
}

/// Gives request `i` of `wrs` the single SGE `sges[i]`, links the chain and posts it with
/// `post(head, &mut bad)`. `Ok(n)` when all `n` were posted; `Err` says what the library
/// said about the one it refused.
fn link_and_post<W: ChainLink>(
    wrs: &mut [W],
    sges: &mut [sys::ibv_sge],
    post: impl FnOnce(*mut W, &mut *mut W) -> c_int,
) -> Result<usize, Refused> {
    for (wr, sge) in wrs.iter_mut().zip(sges.iter_mut()) {
        wr.set_sges(sge, 1);
    }
    link(wrs);
    let head: *mut W = wrs.as_mut_ptr();
    let mut bad: *mut W = ptr::null_mut();
    match post(head, &mut bad) {
        0 => Ok(wrs.len()),
        rc => Err(refused_at(head.cast_const(), bad, wrs.len(), rc)),
    }
}

/// What a failed post said about its chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    /// `bad_wr` named request `posted` of the chain: the ones before it were posted.
    At {
        /// Requests at the head of the chain that were posted.
        posted: usize,
        /// The post's return value.
        errno: i32,
    },
    /// `bad_wr` was left unset or points outside the chain: any request of the chain may
    /// have been posted.
    Unknown {
        /// Requests in the chain.
        chain: usize,
        /// The post's return value.
        errno: i32,
    },
}

/// Moves the requests the device may now hold from the front of `work` into `ledger`, each
/// split by `entry` into what the ledger keeps. `ibv_post_send(3)` and `ibv_post_recv(3)`
/// only say that the library "stops processing WRs from this list at the first failure ...
/// and returns this failing WR through bad_wr"; what was posted when it does not (a
/// provider that fails without setting `bad_wr`) is undocumented. So then every request of
/// the chain counts as posted: its guard stays in the ledger until a completion or a flush
/// retires it, and the caller moves the QP to the error state so that one comes (a request
/// that was in fact never posted is never retired, and its guard is leaked with the QP,
/// which is safe). Returns `Ok(())` when everything was posted.
fn track<T, E>(
    ledger: &mut Ledger<E>,
    work: &mut Vec<T>,
    posted: Result<usize, Refused>,
    mut entry: impl FnMut(T) -> E,
) -> Result<(), Refused> {
    let taken = match posted {
        Ok(all) => all,
        Err(Refused::At { posted, .. }) => posted,
        Err(Refused::Unknown { .. }) => work.len(),
    }
    .min(work.len());
    for w in work.drain(..taken) {
        ledger.record(entry(w));
    }
    posted.map(|_| ())
}

/// Every request's SGEs in one array, in order (one allocation per post).
fn flat_sges<'a>(lists: impl Iterator<Item = &'a [Sge]>) -> Result<Vec<sys::ibv_sge>, VerbsError> {
    let mut flat = Vec::new();
    for list in lists {
        if list.len() > c_int::MAX as usize {
            return Err(VerbsError::InvalidRequest("too many SGEs in one request"));
        }
        flat.extend(list.iter().map(raw_sge));
    }
    Ok(flat)
}

/// Which request of a chain of `len` starting at `head` the library refused with `errno`:
/// the one `bad` points at, if it points at one ([`Refused::Unknown`] when it is null, outside
/// the chain or between two requests).
fn refused_at<T>(head: *const T, bad: *const T, len: usize, errno: i32) -> Refused {
    let size = std::mem::size_of::<T>().max(1);
    let bytes = (bad as usize).wrapping_sub(head as usize);
    if bad.is_null() || !bytes.is_multiple_of(size) || bytes / size >= len {
        Refused::Unknown { chain: len, errno }
    } else {
        Refused::At {
            posted: bytes / size,
            errno,
        }
    }
}

impl<G, U> Drop for QueuePair<G, U> {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once.
        unsafe { sys::ibv_destroy_qp(self.qp.as_ptr()) };
        LIVE_QUEUE_PAIRS.fetch_sub(1, Ordering::Relaxed);
        // Nothing documents that a destroyed QP's outstanding requests no longer touch their
        // memory: their guards are leaked (counted by `leaked_guards`), their values dropped.
        let mut stuck = 0;
        for ledger in [
            &mut self
                .send
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .ledger,
            &mut self
                .recv
                .get_mut()
                .unwrap_or_else(|p| p.into_inner())
                .ledger,
        ] {
            stuck += ledger.abandon(|item| item).len();
        }
        if stuck > 0 {
            tracing::warn!(
                "a queue pair was destroyed with {stuck} work request(s) in flight; their \
                 memory stays pinned"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use super::*;

    /// A chain of five send requests, as `post_send` builds it.
    fn chain() -> (Vec<sys::ibv_send_wr>, Vec<sys::ibv_sge>) {
        let wrs = (0..5u64).map(|i| send_wr(i, SendOp::Send, false)).collect();
        // SAFETY: ibv_sge is plain data; zero is valid.
        let sges = vec![unsafe { std::mem::zeroed::<sys::ibv_sge>() }; 5];
        (wrs, sges)
    }

    #[test]
    fn a_refusal_that_names_its_request_counts_the_ones_before_it() {
        let (mut wrs, mut sges) = chain();
        let result = link_and_post(&mut wrs, &mut sges, |head, bad| {
            // Index 3 of the chain, as a provider refusing the fourth request sets it.
            *bad = head.wrapping_add(3);
            12
        });
        assert_eq!(
            result,
            Err(Refused::At {
                posted: 3,
                errno: 12
            })
        );
    }

    #[test]
    fn a_refusal_without_bad_wr_leaves_every_request_possibly_posted() {
        for offset in [None, Some(5), Some(100)] {
            let (mut wrs, mut sges) = chain();
            let result = link_and_post(&mut wrs, &mut sges, |head, bad| {
                if let Some(offset) = offset {
                    *bad = head.wrapping_add(offset);
                }
                22
            });
            assert_eq!(
                result,
                Err(Refused::Unknown {
                    chain: 5,
                    errno: 22
                }),
                "bad_wr at {offset:?}"
            );
        }
        // Between two requests: not a request of the chain either.
        let head = 0x1000 as *const sys::ibv_send_wr;
        let between = (0x1000 + std::mem::size_of::<sys::ibv_send_wr>() / 2) as *const _;
        assert!(matches!(
            refused_at(head, between, 5, 1),
            Refused::Unknown { .. }
        ));
    }

    /// What the ledger keeps is what keeps a request's memory alive: counted here through
    /// `Rc`s standing in for guards.
    /// A request's ledger entry in these tests: its stand-in guard and its index.
    type Entry = (Rc<()>, usize);

    fn guards(n: usize) -> (Vec<Rc<()>>, Vec<Entry>) {
        let guards: Vec<Rc<()>> = (0..n).map(|_| Rc::new(())).collect();
        let work = guards.iter().cloned().zip(0..).collect();
        (guards, work)
    }

    fn alive(guards: &[Rc<()>]) -> usize {
        guards.iter().filter(|g| Rc::strong_count(g) > 1).count()
    }

    #[test]
    fn every_guard_stays_until_retired_when_the_library_does_not_say_what_it_took() {
        let (guards, mut work) = guards(5);
        let mut ledger: Ledger<Entry> = Ledger::new();
        let first = ledger.upcoming_wr_id(0);
        let unknown = Err(Refused::Unknown {
            chain: 5,
            errno: 22,
        });
        assert_eq!(
            track(&mut ledger, &mut work, unknown, |w| w),
            unknown.map(|_| ())
        );
        assert!(work.is_empty(), "nothing is handed back to post again");
        assert_eq!(ledger.len(), 5);
        assert_eq!(alive(&guards), 5, "every guard is kept");
        // The flush of the third request (the QP went to the error state) retires it and
        // the two before it; the rest stay until theirs.
        let mut retired = Vec::new();
        let third = first + 2;
        ledger.retire(third, Some("flushed"), |(guard, user), outcome| {
            drop(guard);
            retired.push((user, outcome));
        });
        assert_eq!(retired.len(), 3);
        assert_eq!(alive(&guards), 2);
    }

    #[test]
    fn a_named_refusal_keeps_the_guards_of_the_posted_ones_only() {
        let (guards, mut work) = guards(5);
        let mut ledger: Ledger<Entry> = Ledger::new();
        let at = Err(Refused::At {
            posted: 2,
            errno: 12,
        });
        assert!(track(&mut ledger, &mut work, at, |w| w).is_err());
        assert_eq!(ledger.len(), 2);
        let left: Vec<usize> = work.iter().map(|(_, i)| *i).collect();
        assert_eq!(
            left,
            [2, 3, 4],
            "the refused one and those after it come back"
        );
        drop(work);
        assert_eq!(alive(&guards), 2);
        let (_guards, mut work) = self::guards(3);
        assert_eq!(track(&mut ledger, &mut work, Ok(3), |w| w), Ok(()));
        assert!(work.is_empty());
        assert_eq!(ledger.len(), 5);
    }
}
