//! Posting: jobs join their endpoint's backlog, and ready backlogs go out as chains of work
//! requests, as far as QP and CQ room allow.

use tern_engine::{Opcode, TransferError};
use tern_verbs::{SendOp, SendWork, Sge};

use super::{CONNECT_COOLDOWN, Chain, Job, Worker};
use crate::endpoint::State;
use crate::route::Blame;

impl Worker {
    pub(super) fn mark_waiting(&mut self, slot: usize) {
        if self.slots[slot]
            .as_ref()
            .is_some_and(|s| !s.backlog.is_empty())
            && !self.waiting.contains(&slot)
        {
            self.waiting.push_back(slot);
        }
    }

    /// Puts a job in its endpoint's backlog, opening the endpoint first if needed.
    pub(super) fn enqueue(&mut self, job: Job) {
        if !job.slice.is_live() {
            job.let_go();
            return;
        }
        let slot = match self.by_key.get(&job.key) {
            Some(&slot) => slot,
            None if let Some((at, reason)) = self.refused.get(&job.key)
                && at.elapsed() < CONNECT_COOLDOWN =>
            {
                if job.fence {
                    // The path's handshake just failed: it cannot be fenced now.
                    let why = format!("its handshake failed: {reason}");
                    return job.fail_unfenced(&why);
                }
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

    /// Posts the backlogs of ready endpoints, as far as QP and CQ room allow.
    pub(super) fn post_waiting(&mut self) -> bool {
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
            let mut fenced = std::mem::take(&mut self.fenced);
            for job in fenced.drain(..) {
                self.reroute(job, None);
            }
            self.fenced = fenced;
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
            let Some(mut job) = slot.backlog.pop_front() else {
                break;
            };
            if !job.slice.is_live() {
                job.let_go();
                continue;
            }
            if job.fence {
                // A ready endpoint on the job's path: the peer answered its handshake, made
                // after the earlier attempt's endpoint was gone, and so replaced the QPs that
                // attempt went through. A job that failed on the path (not one its endpoint's
                // cut-off flushed) may now take another.
                job.fence = false;
                if job.attempt > 0 {
                    self.fenced.push(job);
                    continue;
                }
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
}
