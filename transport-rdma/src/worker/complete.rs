//! Completions: polled from the CQ, retired from their QP's ledger and reported; a failed
//! or flushed request's slice goes out again, elsewhere or on a fresh endpoint.

use std::sync::atomic::Ordering;

use tern_engine::{Opcode, ReportTogether, TransferError};
use tern_verbs::{Completion, CompletionError, Outcome};

use super::{Job, POLL_BATCH, Worker};
use crate::route::Blame;

impl Worker {
    pub(super) fn poll(&mut self) -> usize {
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

    pub(super) fn complete(&mut self, completion: Completion) {
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
    /// may have left, and may still land: it goes out again only behind a handshake on the
    /// same path ([`Job::fence`]).
    fn again(&mut self, mut job: Job, reason: Option<String>) {
        let write = job.slice.opcode() == Opcode::Write;
        if !job.slice.is_live() {
            return job.slice.cut_off(write);
        }
        job.fence |= write;
        self.reroute(job, reason);
    }

    /// Sends a job that could not run here on another attempt: to another path when it
    /// failed (`reason` set), to a fresh endpoint on the same path when its endpoint merely
    /// went away.
    pub(super) fn reroute(&mut self, mut job: Job, reason: Option<String>) {
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
}
