//! How a slice reports: its outcome goes to each task it carries bytes of, and the tasks it
//! was the last of complete once it has let go of its submission.

use std::sync::Arc;

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

/// The tasks a slice was the last of: they settle only after the slice has let go of its
/// submission, so they are gathered first (on the stack, unless the slice ended many).
#[derive(Default)]
struct LastOf {
    few: [u32; 8],
    count: usize,
    more: Vec<u32>,
}

/// Room the list past [`LastOf::few`] takes at once: with them, the 64 pages of 16 KiB a
/// same-host slice of 1 MiB ends, in one allocation rather than one per doubling.
const LAST_OF_MORE: usize = 56;

impl LastOf {
    fn push(&mut self, task: usize) {
        match self.few.get_mut(self.count) {
            Some(slot) => {
                *slot = task as u32;
                self.count += 1;
            }
            None => self.spill(task),
        }
    }

    /// [`push`](Self::push) past the tasks kept on the stack.
    #[cold]
    #[inline(never)]
    fn spill(&mut self, task: usize) {
        if self.more.capacity() == 0 {
            self.more.reserve_exact(LAST_OF_MORE);
        }
        self.more.push(task as u32);
    }

    fn is_empty(&self) -> bool {
        self.count == 0
    }

    fn tasks(&self) -> impl Iterator<Item = usize> + '_ {
        self.few[..self.count]
            .iter()
            .chain(&self.more)
            .map(|&task| task as usize)
    }

    /// Completes these tasks, after letting go of the slice's `submission` (and with the
    /// last slice, its pin): so that no one sees them ended before.
    fn complete(self, submission: Arc<Submission>) {
        if self.is_empty() {
            return;
        }
        let batch = submission.batch.clone();
        drop(submission);
        batch.complete_tasks(self.tasks());
    }
}

impl Slice {
    /// Reports the outcome to each task the slice carries bytes of: the requests' hold on
    /// the pin goes first (with the last slice, the pin itself), so whoever learns a task
    /// ended may unregister its memory at once. Every outcome counts the slice as let go by
    /// each of its tasks; a task's last slice settles it.
    fn report(mut self, outcome: Outcome) {
        let Some(submission) = self.submission.take() else {
            return;
        };
        if self.rank == 0 && matches!(outcome, Outcome::Done) {
            return self.done_by_first(submission);
        }
        let transport = submission
            .routes
            .get(self.rank as usize)
            .unwrap_or(usize::MAX);
        let batch = &submission.batch;
        let write = self.opcode == Opcode::Write;
        match &outcome {
            // What the tasks' first transport moved is read off the tasks; a declined slice's
            // next transport counts its own.
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
        for (i, (task, bytes)) in self.tasks().enumerate() {
            match &outcome {
                Outcome::Done if self.rank != 0 => batch.slice_uncredited(task, bytes),
                // Every task counts the slice; the first transport's tally counts it once.
                Outcome::Done if i > 0 => batch.slice_uncredited(task, 0),
                Outcome::Done => {}
                Outcome::Skipped => {
                    batch.fail_if_live(task, "skipped");
                    batch.slice_uncredited(task, 0);
                }
                Outcome::CutOff { remote_may_change } => {
                    if *remote_may_change && write {
                        batch.remote_may_change(task);
                    }
                    batch.fail_if_live(task, "cut off");
                    batch.slice_uncredited(task, 0);
                }
                Outcome::Failed { error, sent } => {
                    if *sent && write {
                        batch.remote_may_change(task);
                    }
                    // The task ends first, then the slice counts as let go: the last one out
                    // settles the task as Failed.
                    batch.fail_task(task, error.clone());
                    batch.slice_uncredited(task, 0);
                }
            }
        }
        let done = matches!(outcome, Outcome::Done);
        let mut last_of = LastOf::default();
        for (task, bytes) in self.tasks() {
            if batch.slice_progress(task, if done { bytes } else { 0 }) {
                last_of.push(task);
            }
        }
        last_of.complete(submission);
    }

    /// The common case, a slice done by its first transport: what [`report`](Self::report)
    /// comes to for it, in one pass (each task counts its share before its progress), and
    /// for a slice of one task without a list of the tasks it ended.
    #[inline(always)]
    fn done_by_first(&self, submission: Arc<Submission>) {
        let Some(task) = self.only_task() else {
            return self.done_by_first_for_many(submission);
        };
        let batch = &submission.batch;
        if batch.slice_progress(task, self.len as u64) {
            let batch = batch.clone();
            drop(submission);
            batch.complete_task(task);
        }
    }

    /// [`done_by_first`](Self::done_by_first) for a slice holding bytes of several tasks.
    #[inline(never)]
    fn done_by_first_for_many(&self, submission: Arc<Submission>) {
        let batch = &submission.batch;
        let mut last_of = LastOf::default();
        for (i, (task, bytes)) in self.tasks().enumerate() {
            if i > 0 {
                // Every task counts the slice; the first transport's tally counts it once.
                batch.slice_uncredited(task, 0);
            }
            if batch.slice_progress(task, bytes) {
                last_of.push(task);
            }
        }
        last_of.complete(submission);
    }

    /// The slice moved all its bytes.
    pub fn complete(mut self) {
        if self.rank == 0 {
            // Taken here, the slice reports once and its drop has nothing left to do.
            if let Some(submission) = self.submission.take() {
                self.done_by_first(submission);
            }
            // Nothing of it is left to let go but its run's list of parts (if any): taken
            // out, the rest is forgotten, skipping the drop's checks. Two branches, because
            // taking the `Option` on the common path (no run) cost it 4 instructions.
            if self.run.is_none() {
                std::mem::forget(self);
            } else {
                let run = self.run.take();
                std::mem::forget(self);
                drop(run);
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
