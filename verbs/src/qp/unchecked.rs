//! Untracked posting: the caller keeps each request's memory valid.

use std::os::raw::c_int;
use std::ptr;

use rdma_sys as sys;

use super::chain::{link, post_recv_error, post_send_error, raw_sge, recv_wr, refused_at, send_wr};
use super::{MemoryGuard, QueuePair, SendOp, SendRequest, Sge};
use crate::error::VerbsError;
use crate::ledger::TRACKED_BIT;

impl<G: MemoryGuard, U: Send> QueuePair<G, U> {
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
