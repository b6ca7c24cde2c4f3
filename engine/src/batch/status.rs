//! What a batch and its tasks show: read without a lock, after timing the batch out if its
//! deadline has passed.

use super::lifecycle::BatchInner;
use super::sync::Ordering;
use super::task::{CANCELED, COMPLETED, PENDING, SETTLED, TIMEOUT, WAITING, state_of};
use crate::error::TransferError;
use crate::types::{BatchState, BatchStatus, TaskStatus, TransferStatus};

impl BatchInner {
    pub(crate) fn task_status(&self, task: usize) -> Option<TaskStatus> {
        self.enforce_deadline();
        if task >= self.submitted.load(Ordering::Acquire) {
            return None;
        }
        let t = &self.tasks[task];
        let word = t.state.load(Ordering::SeqCst);
        let status = match state_of(word) {
            WAITING => TransferStatus::Waiting,
            // Ended, but with slices still out: not over yet for the caller's memory.
            _ if word & SETTLED == 0 => TransferStatus::Pending,
            COMPLETED => TransferStatus::Completed,
            TIMEOUT => TransferStatus::Timeout,
            CANCELED => TransferStatus::Canceled,
            _ => TransferStatus::Failed(
                self.tasks
                    .error(task)
                    .unwrap_or(TransferError::Dropped("no reason recorded".into())),
            ),
        };
        // Whatever the status: a task shown Completed never has it (no transport completes a
        // write whose earlier bytes may still land), and should one ever, the caller learns.
        let remote_may_change = status.is_finished() && t.remote_may_change.load(Ordering::Relaxed);
        Some(TaskStatus {
            status,
            transferred_bytes: t.bytes(),
            remote_may_change,
        })
    }

    pub(crate) fn status(&self) -> BatchStatus {
        self.enforce_deadline();
        let submitted = self.submitted.load(Ordering::SeqCst);
        self.all_completed(submitted)
            .unwrap_or_else(|| self.walked_status(submitted))
    }

    /// The status of a batch whose `submitted` tasks all completed, read off its counts
    /// without a look at each task; `None` unless every task reserved was published and
    /// finished, and none ended otherwise.
    ///
    /// Why the counts agree: a task is counted unfinished in the step that reserves its
    /// slot, and unsuccessful before it can end other than Completed. So with no task
    /// unfinished (read after `submitted`), every task reserved by then has finished, and
    /// with none unsuccessful, each of those completed — after its submit published it and
    /// added its bytes (a task's slices reach the transports only after that). Bytes read
    /// before the reserved count include no later submit's: those reserve first, and would
    /// show in a reserved count above `submitted`.
    fn all_completed(&self, submitted: usize) -> Option<BatchStatus> {
        if self.counts.unfinished() != 0 || self.unsuccessful.load(Ordering::SeqCst) != 0 {
            return None;
        }
        let bytes = self.submitted_bytes.load(Ordering::SeqCst);
        let (reserved, unfinished) = self.counts.reserved_and_unfinished();
        (reserved == submitted && unfinished == 0).then_some(BatchStatus {
            state: BatchState::Completed,
            submitted,
            completed: submitted,
            failed: 0,
            pending: 0,
            transferred_bytes: bytes,
        })
    }

    /// The status of the first `submitted` tasks, task by task.
    pub(super) fn walked_status(&self, submitted: usize) -> BatchStatus {
        let (mut completed, mut failed, mut pending, mut bytes) = (0, 0, 0, 0);
        for t in &self.tasks[..submitted] {
            // The state first: a task read as finished has all its bytes counted already.
            let word = t.state.load(Ordering::SeqCst);
            bytes += t.bytes();
            match state_of(word) {
                WAITING | PENDING => pending += 1,
                _ if word & SETTLED == 0 => pending += 1,
                COMPLETED => completed += 1,
                _ => failed += 1,
            }
        }
        let state = if failed > 0 {
            BatchState::Failed
        } else if pending > 0 {
            BatchState::Pending
        } else {
            BatchState::Completed
        };
        BatchStatus {
            state,
            submitted,
            completed,
            failed,
            pending,
            transferred_bytes: bytes,
        }
    }

    #[cfg(test)]
    pub(crate) fn unfinished(&self) -> usize {
        self.enforce_deadline();
        self.counts.unfinished()
    }
}
