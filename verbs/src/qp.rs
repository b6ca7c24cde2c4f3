//! RC queue pairs: state transitions and posting work requests.

use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rdma_sys as sys;

use crate::cq::CompletionQueue;
use crate::error::{VerbsError, errno};
use crate::gid::Gid;
use crate::mr::Access;
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
}

impl Default for QpCaps {
    /// Mooncake's: 256 WRs, 4 SGEs, 64 bytes inline.
    fn default() -> Self {
        Self {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_sge: 4,
            max_inline: 64,
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

/// A reliable-connected queue pair.
#[derive(Debug)]
pub struct QueuePair {
    qp: NonNull<sys::ibv_qp>,
    pd: Arc<ProtectionDomain>,
    cq: Arc<CompletionQueue>,
}

// SAFETY: posting to a QP from several threads is allowed by libibverbs; released in Drop.
unsafe impl Send for QueuePair {}
// SAFETY: see Send.
unsafe impl Sync for QueuePair {}

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

/// A send work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendRequest {
    /// Returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// The local memory.
    pub sges: Vec<Sge>,
    /// Whether to produce a completion on success.
    pub signaled: bool,
}

impl QueuePair {
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
    pub fn reset(&self) -> Result<(), VerbsError> {
        let mut attr = Self::blank_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RESET;
        self.modify(&mut attr, sys::ibv_qp_attr_mask::IBV_QP_STATE.0, "RESET")
    }

    /// Posts a chain of send work requests (one `ibv_post_send` call). On failure the error
    /// says how many requests at the head of the chain were posted (and will complete).
    ///
    /// This is safe because of how RDMA protects memory: the device reaches local memory
    /// only through the lkey of a live [`MemoryRegion`](crate::MemoryRegion) of the QP's protection domain (and
    /// remote memory only through a peer's rkey), checking the address range against that
    /// region; a wrong key or range ends the request with an error completion, never an
    /// access elsewhere. A region's memory stays valid for as long as the region lives
    /// (the contract of [`MemoryRegion::register`](crate::MemoryRegion::register)), and the kernel keeps an in-use region's
    /// pages pinned until the device is done with them. No request here asks the library to
    /// read SGE memory on the CPU (no inline sends).
    pub fn post_send(&self, requests: &[SendRequest]) -> Result<(), VerbsError> {
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
        let mut sges = flat_sges(requests.iter().map(|r| r.sges.as_slice()))?;
        // SAFETY: ibv_send_wr is plain data (pointers and integers); zero is valid.
        let mut wrs: Vec<sys::ibv_send_wr> = (0..requests.len())
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        let mut first_sge = 0;
        for (wr, request) in wrs.iter_mut().zip(requests) {
            wr.wr_id = request.wr_id;
            wr.sg_list = sges[first_sge..].as_mut_ptr();
            wr.num_sge = request.sges.len() as c_int;
            first_sge += request.sges.len();
            wr.send_flags = if request.signaled {
                sys::ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            let (opcode, remote) = match request.op {
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
        }
        let head: *mut sys::ibv_send_wr = wrs.as_mut_ptr();
        for i in 1..wrs.len() {
            let next: *mut sys::ibv_send_wr = &mut wrs[i];
            wrs[i - 1].next = next;
        }
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: the chain and its SGE array live until the call returns (the library copies
        // them into the send queue); what the device later touches is governed by the keys,
        // as this fn's documentation explains.
        let rc = unsafe { sys::ibv_post_send(self.qp.as_ptr(), head, &mut bad) };
        if rc != 0 {
            return Err(VerbsError::PostSend {
                errno: rc,
                posted: posted_before(head.cast_const(), bad, wrs.len()),
            });
        }
        Ok(())
    }

    /// Posts receive work requests (for SEND and WRITE_WITH_IMM from the peer). Safe for the
    /// reasons given at [`QueuePair::post_send`]: the device writes received data only
    /// through the lkeys of live memory regions.
    pub fn post_recv(&self, requests: &[(u64, Vec<Sge>)]) -> Result<(), VerbsError> {
        if requests.is_empty() {
            return Ok(());
        }
        let mut sges = flat_sges(requests.iter().map(|(_, list)| list.as_slice()))?;
        // SAFETY: ibv_recv_wr is plain data; zero is valid.
        let mut wrs: Vec<sys::ibv_recv_wr> = (0..requests.len())
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        let mut first_sge = 0;
        for (wr, (wr_id, list)) in wrs.iter_mut().zip(requests) {
            wr.wr_id = *wr_id;
            wr.sg_list = sges[first_sge..].as_mut_ptr();
            wr.num_sge = list.len() as c_int;
            first_sge += list.len();
        }
        let head: *mut sys::ibv_recv_wr = wrs.as_mut_ptr();
        for i in 1..wrs.len() {
            let next: *mut sys::ibv_recv_wr = &mut wrs[i];
            wrs[i - 1].next = next;
        }
        let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
        // SAFETY: the chain lives until the call returns; the device writes only through
        // the keys of live memory regions (see `post_send`).
        let rc = unsafe { sys::ibv_post_recv(self.qp.as_ptr(), head, &mut bad) };
        if rc != 0 {
            return Err(VerbsError::PostRecv {
                errno: rc,
                posted: posted_before(head.cast_const(), bad, wrs.len()),
            });
        }
        Ok(())
    }
}

/// Every request's SGEs in one array, in order (one allocation per post).
fn flat_sges<'a>(lists: impl Iterator<Item = &'a [Sge]>) -> Result<Vec<sys::ibv_sge>, VerbsError> {
    let mut flat = Vec::new();
    for list in lists {
        if list.len() > c_int::MAX as usize {
            return Err(VerbsError::InvalidRequest("too many SGEs in one request"));
        }
        flat.extend(list.iter().map(|s| sys::ibv_sge {
            addr: s.addr,
            length: s.len,
            lkey: s.lkey,
        }));
    }
    Ok(flat)
}

/// How many requests of a chain of `len` starting at `head` precede `bad`, the one the
/// library refused (all of them when `bad` is not in the chain).
fn posted_before<T>(head: *const T, bad: *const T, len: usize) -> usize {
    let offset = (bad as usize).wrapping_sub(head as usize) / std::mem::size_of::<T>().max(1);
    if bad.is_null() || offset >= len {
        0
    } else {
        offset
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once; outstanding WRs are flushed by the device.
        unsafe { sys::ibv_destroy_qp(self.qp.as_ptr()) };
        LIVE_QUEUE_PAIRS.fetch_sub(1, Ordering::Relaxed);
    }
}
