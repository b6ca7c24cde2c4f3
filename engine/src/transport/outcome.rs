//! How a slice reports: its outcome goes to each task it carries bytes of, and the slice
//! counts as let go by its task (or its run, which ends its tasks together once its last
//! slice has let go), after letting go of its submission.

use std::sync::Arc;

use super::run::Letting;
use super::slice::Slice;
use super::submission::Submission;
use crate::error::TransferError;
use crate::types::Opcode;

/// How a slice ended.
enum Outcome {
    Done,
    Skipped,
    CutOff {
        remote_may_change: bool,
    },
    Failed {
        error: TransferError,
        /// Whether bytes of it may have left.
        sent: bool,
    },
}

impl Slice {
    /// Reports the outcome to each task the slice carries bytes of: the requests' hold on
    /// the pin goes first (with the last slice, the pin itself), so whoever learns a task
    /// ended may unregister its memory at once. Every outcome counts the slice as let go by
    /// its task (or its run); a task's last slice (or its run's) settles it.
    fn report(mut self, outcome: Outcome) {
        let Some(submission) = self.submission.take() else {
            return;
        };
        let transport = submission
            .routes
            .get(self.rank as usize)
            .unwrap_or(usize::MAX);
        let batch = &submission.batch;
        match &outcome {
            // What the tasks' first transport moved is read off the tasks (or runs); a
            // declined slice's next transport counts its own.
            Outcome::Done if self.rank != 0 => {
                if let Some(counters) = &batch.timer {
                    counters.moved(transport, self.len as u64);
                }
            }
            Outcome::Failed { .. } => {
                if let Some(counters) = &batch.timer {
                    counters.failed(transport);
                }
            }
            _ => {}
        }
        let write = self.opcode == Opcode::Write;
        for (task, _) in self.tasks() {
            match &outcome {
                Outcome::Done => {}
                Outcome::Skipped => batch.fail_if_live(task, "skipped"),
                Outcome::CutOff { remote_may_change } => {
                    if *remote_may_change && write {
                        batch.remote_may_change(task);
                    }
                    batch.fail_if_live(task, "cut off");
                }
                Outcome::Failed { error, sent } => {
                    if *sent && write {
                        batch.remote_may_change(task);
                    }
                    // The task ends first, then the slice counts as let go: the last one out
                    // settles the task as Failed.
                    batch.fail_task(task, error.clone());
                }
            }
        }
        let done = matches!(outcome, Outcome::Done);
        if let Some(run) = self.run.take() {
            let how = match (done, self.rank) {
                (true, 0) => Letting::Moved,
                (true, _) => Letting::MovedByOther,
                (false, _) => Letting::Unmoved,
            };
            drop(submission);
            run.let_go(how, self.len, self.tasks_in(&run));
            // The last slice to let go of the run ends its tasks.
            return run.slice_gone();
        }
        let (task, bytes) = (self.task as usize, self.len as u64);
        if !done || self.rank != 0 {
            // Every task counts the slice; the first transport's tally does not.
            batch.slice_uncredited(task, if done { bytes } else { 0 });
        }
        if batch.slice_progress(task, if done { bytes } else { 0 }) {
            let batch = batch.clone();
            drop(submission);
            batch.complete_task(task);
        }
    }

    /// The common case, a slice of one request done by its first transport: what
    /// [`report`](Self::report) comes to for it.
    #[inline(always)]
    fn done_by_first(&self, submission: Arc<Submission>) {
        let task = self.task as usize;
        let batch = &submission.batch;
        if batch.slice_progress(task, self.len as u64) {
            let batch = batch.clone();
            drop(submission);
            batch.complete_task(task);
        }
    }

    /// The slice moved all its bytes.
    pub fn complete(mut self) {
        if self.rank == 0 {
            // Taken here, the slice reports once and its drop has nothing left to do: the
            // rest of it is forgotten, skipping the drop's checks.
            let Some(submission) = self.submission.take() else {
                return;
            };
            match self.run.take() {
                None => {
                    self.done_by_first(submission);
                    std::mem::forget(self);
                }
                Some(run) => {
                    std::mem::forget(self);
                    // Its hold on the pin goes before its hold on the run, whose last
                    // slice to let go ends the run's tasks.
                    drop(submission);
                    run.slice_gone();
                }
            }
            return;
        }
        self.report(Outcome::Done);
    }

    /// The slice failed; its task fails with `error`. For a write, bytes of it may have
    /// left: its task reports that the peer's memory may still change
    /// ([`TaskStatus::remote_may_change`](crate::TaskStatus)). The transport no longer
    /// touches the slice's local memory.
    pub fn fail(self, error: TransferError) {
        self.report(Outcome::Failed { error, sent: true });
    }

    /// As [`fail`](Slice::fail), for a slice none of whose bytes left (no connection, a
    /// refusal before sending).
    pub fn fail_unsent(self, error: TransferError) {
        self.report(Outcome::Failed { error, sent: false });
    }

    /// The slice's task ended while the slice was on the wire, and the transport stopped it:
    /// it no longer touches the slice's local memory. `remote_may_change`: bytes of this
    /// write left without their landing confirmed, and may still land at the peer.
    pub fn cut_off(self, remote_may_change: bool) {
        self.report(Outcome::CutOff { remote_may_change });
    }

    /// The slice was skipped because its task had already ended (canceled, timed out or
    /// failed); nothing is recorded.
    pub fn abandon(self) {
        self.report(Outcome::Skipped);
    }
}
