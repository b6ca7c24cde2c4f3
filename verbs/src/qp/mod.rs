//! RC queue pairs: state transitions and posting work requests.
//!
//! Posting is safe through [`QueuePair::post_send`] and [`QueuePair::post_recv`]: each
//! request hands over a [`MemoryGuard`] for its local memory, and the QP's ledger keeps that
//! guard until the request's completion has been retrieved from the CQ and handed to
//! [`QueuePair::retire`] — the condition `ibv_post_send(3)` sets for reusing a request's
//! memory (see [`crate::ledger`]). A QP dropped with requests still in flight leaks their
//! guards rather than guess that the device is done. The raw
//! [`post_send_unchecked`](QueuePair::post_send_unchecked) leaves that duty to the caller.
//!
//! Here: the queue pair, its creation and its destruction. Beside it: `config` (queue sizes,
//! the peer and path it connects with), `work` (what work requests are made of), `state`
//! (INIT → RTR → RTS, the error state, reset), `post` (tracked posting), `retire` (what is
//! in flight, and its retirement), `unchecked` (untracked posting) and `chain` (the raw
//! chains of work requests every post builds).

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use rdma_sys as sys;

use crate::cq::CompletionQueue;
use crate::error::{VerbsError, errno};
use crate::ledger::Ledger;
use crate::mr::MemoryRegion;
use crate::pd::ProtectionDomain;

mod chain;
mod config;
mod post;
mod retire;
mod state;
mod unchecked;
mod work;

pub use config::{PathConfig, Peer, QpCaps};
pub use work::{MemoryGuard, RecvWork, SendOp, SendRequest, SendWork, Sge};

static LIVE_QUEUE_PAIRS: AtomicUsize = AtomicUsize::new(0);

/// Queue pairs this process has created and not yet destroyed: what a leak check counts.
pub fn live_queue_pairs() -> usize {
    LIVE_QUEUE_PAIRS.load(Ordering::Relaxed)
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
            .field("sends_in_flight", &self.send.lock().ledger.len())
            .field("receives_in_flight", &self.recv.lock().ledger.len())
            .finish_non_exhaustive()
    }
}

// SAFETY: posting to and modifying a QP from several threads is allowed by libibverbs (its
// verbs are thread-safe); the raw work-request pointers in the scratch arrays are only used
// under their mutex and during one call; payloads move between threads, hence `G, U: Send`.
unsafe impl<G: Send, U: Send> Send for QueuePair<G, U> {}
// SAFETY: see Send; shared access reaches the payloads only under their mutexes.
unsafe impl<G: Send, U: Send> Sync for QueuePair<G, U> {}

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
            &mut self.send.get_mut().ledger,
            &mut self.recv.get_mut().ledger,
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
