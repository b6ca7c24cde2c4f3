//! Merged runs kept by a submitting thread for its next runs. A batch of pages makes a run
//! for every few requests, and a run made afresh costs an allocation and its free (at 16
//! runs in a batch of 128, more than the rest of the allocator's and the run's bookkeeping
//! together); a run whose tasks have ended and that nothing else holds is made into the next
//! run in place instead.

use std::collections::VecDeque;
use std::sync::Arc;

use super::run::{Parts, Run, RunHead, TaskPart};
use crate::batch::KeptRoom;

/// The most runs a thread keeps: the runs of a few batches of pages at once (a run is
/// about 250 bytes).
const POOLED_RUNS: usize = 256;

/// The most parts the runs a thread keeps have room for apart from their own (256 KiB):
/// enough for a batch of a few thousand neighbours.
const POOLED_PARTS: usize = 16 << 10;

/// Runs made by one thread, oldest first: each either still held by slices of its own or
/// ended and free for the next run. Holds no batch: a run's end lets go of it.
#[derive(Debug)]
pub(crate) struct RunPool {
    runs: VecDeque<Arc<Run>>,
    /// The parts' room of the runs kept (a kept run's parts change only once it is taken
    /// out to be made again).
    parts_room: usize,
}

impl RunPool {
    pub(crate) const EMPTY: Self = Self {
        runs: VecDeque::new(),
        parts_room: 0,
    };

    fn pop_oldest(&mut self) -> Option<Arc<Run>> {
        let run = self.runs.pop_front()?;
        self.parts_room -= run.parts.room().unwrap_or(0);
        Some(run)
    }

    /// Keeps `run` (as the newest, or the oldest) unless its parts' room would take the
    /// pool past its bound.
    fn keep(&mut self, run: Arc<Run>, newest: bool) {
        let Some(room) = run.parts.room() else {
            return;
        };
        if self.parts_room + room > POOLED_PARTS {
            return;
        }
        self.parts_room += room;
        if newest {
            self.runs.push_back(run);
        } else {
            self.runs.push_front(run);
        }
    }

    /// A run of the `len` parts `parts()` yields (very many in the room of a large run
    /// gone when `kept` has one), as `head` says: the oldest run kept, if only the pool
    /// holds it, else a new one, kept for later if its room is small.
    pub(crate) fn run<I: Iterator<Item = TaskPart>>(
        &mut self,
        len: usize,
        kept: Option<&Arc<KeptRoom>>,
        parts: impl FnOnce() -> I,
        head: RunHead,
    ) -> Arc<Run> {
        if let Some(mut oldest) = self.pop_oldest() {
            // Only the pool holds it: every slice of it has let go, the last after its
            // tasks ended (`Arc::get_mut` acquires their releases).
            if let Some(free) = Arc::get_mut(&mut oldest) {
                free.end_if_left();
                free.parts.refill(len, kept, parts);
                free.reset(head);
                self.keep(oldest.clone(), true);
                return oldest;
            }
            self.keep(oldest, false);
        }
        let run = Arc::new(Run::new(Parts::collect(len, kept, parts), head));
        if self.runs.len() == POOLED_RUNS {
            // Still held by its slices: it goes with the last of them.
            self.pop_oldest();
        }
        self.keep(run.clone(), true);
        run
    }

    /// How many runs are kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.runs.len()
    }

    /// Whether `run` is kept.
    #[cfg(test)]
    fn keeps(&self, run: &Arc<Run>) -> bool {
        self.runs.iter().any(|kept| Arc::ptr_eq(kept, run))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::BatchInner;
    use crate::types::{Opcode, TransferStatus};

    /// A batch whose `tasks` tasks are started as one run of `len`-byte parts from address
    /// `at`, cut into `slices` slices, made by `pool`.
    fn run_of(
        pool: &mut RunPool,
        tasks: usize,
        len: usize,
        at: usize,
        slices: usize,
    ) -> (Arc<BatchInner>, Arc<Run>) {
        let batch = Arc::new(BatchInner::new(tasks));
        let first = batch.reserve(tasks).unwrap();
        for task in first..first + tasks {
            batch.start_run_task(task, Opcode::Write, 0);
        }
        batch.publish(tasks, (tasks * len) as u64);
        let head = RunHead {
            end: at + tasks * len,
            batch: batch.clone(),
            slices,
            transport: 0,
            write: true,
            started_ns: 0,
        };
        let parts = (0..tasks).map(|task| TaskPart {
            start: at + task * len,
            task: task as u32,
        });
        let run = pool.run(tasks, None, || parts, head);
        batch.tasks.count_run_tasks(tasks);
        (batch, run)
    }

    fn each_completed_with(batch: &BatchInner, tasks: usize, len: u64) -> bool {
        (0..tasks).all(|task| {
            let status = batch.task_status(task).unwrap();
            (status.status, status.transferred_bytes) == (TransferStatus::Completed, len)
        })
    }

    #[test]
    fn a_run_is_made_again_in_place_once_its_tasks_ended_and_never_while_a_slice_holds_it() {
        let mut pool = RunPool::EMPTY;
        let (first_batch, first) = run_of(&mut pool, 3, 100, 0x1000, 2);
        let held = first.clone();
        drop(first);
        // One slice of the first run still holds it: the next run is another.
        let (_, second) = run_of(&mut pool, 12, 10, 0x8000, 1);
        assert!(!Arc::ptr_eq(&held, &second));
        held.slice_gone();
        assert_eq!(first_batch.status().state, crate::BatchState::Pending);
        held.slice_gone();
        assert!(each_completed_with(&first_batch, 3, 100));
        drop(held);
        // Ended and held by the pool alone: made again, with nothing of before.
        let first_at = Arc::as_ptr(&pool.runs[0]);
        let (batch, again) = run_of(&mut pool, 9, 7, 0x20000, 1);
        assert_eq!(Arc::as_ptr(&again), first_at, "the ended run is made again");
        assert_eq!(again.parts.len(), 9);
        assert_eq!(again.parts[8].start, 0x20000 + 8 * 7);
        again.slice_gone();
        assert!(
            each_completed_with(&batch, 9, 7),
            "its own tasks, its own bytes"
        );
        assert_eq!(pool.len(), 2);
        second.slice_gone();
    }

    #[test]
    fn a_run_made_again_after_a_slice_of_it_moved_nothing_starts_without_that() {
        let mut pool = RunPool::EMPTY;
        let (batch, run) = run_of(&mut pool, 2, 50, 0, 2);
        run.let_go(
            super::super::run::Letting::Unmoved,
            50,
            [(0, 50)].into_iter(),
        );
        run.slice_gone();
        run.slice_gone();
        let failed = batch.task_status(0).unwrap();
        assert_eq!(failed.transferred_bytes, 0);
        drop(run);
        let (batch, again) = run_of(&mut pool, 2, 50, 0, 1);
        again.slice_gone();
        assert!(each_completed_with(&batch, 2, 50));
    }

    #[test]
    fn the_pool_keeps_a_bounded_number_of_runs_and_bounded_room_for_their_parts() {
        let mut pool = RunPool::EMPTY;
        let mut held = Vec::new();
        for _ in 0..POOLED_RUNS + 10 {
            held.push(run_of(&mut pool, 2, 8, 0, 1));
        }
        assert_eq!(
            pool.len(),
            POOLED_RUNS,
            "runs still held are let go past the bound"
        );
        for (_, run) in &held {
            run.slice_gone();
        }
        held.clear();
        // Runs of many parts are kept while their room fits, and made again with it.
        let many = POOLED_PARTS / 4 + 1;
        let mut large = Vec::new();
        for _ in 0..5 {
            let (_, run) = run_of(&mut pool, many, 1, 0, 1);
            large.push(run);
        }
        let kept: Vec<bool> = large.iter().map(|run| pool.keeps(run)).collect();
        assert_eq!(kept, [true, true, true, false, false], "within the bound");
        assert!(pool.parts_room <= POOLED_PARTS);
        for run in &large {
            run.slice_gone();
        }
        let first = Arc::as_ptr(&large[0]);
        large.clear();
        while pool
            .runs
            .front()
            .is_some_and(|run| Arc::as_ptr(run) != first)
        {
            run_of(&mut pool, 2, 8, 0, 1).1.slice_gone();
        }
        let (batch, again) = run_of(&mut pool, many, 3, 0, 1);
        assert_eq!(Arc::as_ptr(&again), first);
        again.slice_gone();
        assert!(each_completed_with(&batch, many, 3));
        assert!(pool.parts_room <= POOLED_PARTS);
    }
}
