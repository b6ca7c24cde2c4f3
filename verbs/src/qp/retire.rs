//! What is in flight on a queue pair, and its retirement: by the completion that reports it,
//! or abandoned when the device never flushes.

use super::{MemoryGuard, QueuePair};
use crate::cq::{Completion, CompletionError};
use crate::ledger::Outcome;

impl<G: MemoryGuard, U: Send> QueuePair<G, U> {
    /// Tracked requests posted and not yet retired, both queues.
    pub fn in_flight(&self) -> usize {
        self.send.lock().ledger.len() + self.recv.lock().ledger.len()
    }

    /// Whether any tracked send request posted and not yet retired carries a value for
    /// which `test` holds (to find the QPs whose work must be cut off, say).
    pub fn any_send_in_flight(&self, mut test: impl FnMut(&U) -> bool) -> bool {
        self.send.lock().ledger.any(|(_, user)| test(user))
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
        let sent = self.send.lock().ledger.retire(wr_id, error, &mut push);
        if sent > 0 {
            return Ok(sent);
        }
        Ok(self.recv.lock().ledger.retire(wr_id, error, &mut push))
    }

    /// Gives up on every tracked request in flight: their values come back (to fail what
    /// they stood for), their guards are leaked, so the memory they keep stays valid for
    /// good. For a device that never flushes; the normal way out is [`to_error`](Self::to_error)
    /// and retiring the flush completions.
    pub fn abandon(&self) -> Vec<U> {
        let mut users = self.send.lock().ledger.abandon(|item| item);
        users.extend(self.recv.lock().ledger.abandon(|item| item));
        users
    }
}
