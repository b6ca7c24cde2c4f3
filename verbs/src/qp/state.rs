//! State transitions: RESET → INIT → RTR → RTS, to the error state, and back to RESET.

use std::os::raw::c_int;

use rdma_sys as sys;

use super::{MemoryGuard, PathConfig, Peer, QueuePair};
use crate::error::VerbsError;
use crate::mr::Access;

impl<G: MemoryGuard, U: Send> QueuePair<G, U> {
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
}
