//! What a batch and its tasks show: read without a lock, after timing the batch out if its
//! deadline has passed.

use std::sync::atomic::Ordering;

use super::lifecycle::BatchInner;
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
        let remote_may_change = status.is_finished()
            && status != TransferStatus::Completed
            && t.remote_may_change.load(Ordering::Relaxed);
        Some(TaskStatus {
            status,
            transferred_bytes: t.bytes(),
            remote_may_change,
        })
    }

    pub(crate) fn status(&self) -> BatchStatus {
        self.enforce_deadline();
        let submitted = self.submitted.load(Ordering::Acquire);
        let (mut completed, mut failed, mut pending, mut bytes) = (0, 0, 0, 0);
        for t in &self.tasks[..submitted] {
            bytes += t.bytes();
            let word = t.state.load(Ordering::SeqCst);
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

    pub(crate) fn unfinished(&self) -> usize {
        self.enforce_deadline();
        self.unfinished.load(Ordering::SeqCst)
    }
}
