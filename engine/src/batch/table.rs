//! A batch's table of tasks, and the tally the engine reads off it while the batch lives and
//! once more when it goes.

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::task::{
    COMPLETED, ENDED_SHIFT, FIRST_MASK, FIRST_SHIFT, MAX_TASK_BYTES, PROGRESS_SHIFT, TaskState,
    WRITE_FLAG, state_of,
};
use crate::stats::Tally;

/// A batch's tasks, and when each submit call started its tasks: what the engine's tally
/// reads ([`tally_tasks`]) while the batch lives, and once more when it goes.
#[derive(Debug)]
pub(crate) struct TaskTable {
    tasks: Tasks,
    /// `stats::clock_ns` of the submit call that took task 0 (timed batches only; 0 until
    /// then): most batches take one call, which so stores its start without a lock.
    first_start: AtomicU64,
    /// `(first task, stats::clock_ns)` of each later submit call, in task order (timed
    /// batches only): one record per call, none per task.
    starts: Mutex<Vec<(usize, u64)>>,
}

impl std::ops::Deref for TaskTable {
    type Target = [TaskState];
    fn deref(&self) -> &[TaskState] {
        match &self.tasks {
            Tasks::One(one) => one,
            Tasks::Many(many) => many,
        }
    }
}

/// The task states: a lone task (`transfer_sync`, a batch of one) lives in the table itself,
/// one allocation fewer per batch; more in a slice of their own.
#[derive(Debug)]
enum Tasks {
    One([TaskState; 1]),
    Many(Box<[TaskState]>),
}

impl TaskTable {
    /// `capacity` tasks, none started.
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            tasks: if capacity == 1 {
                Tasks::One([TaskState::default()])
            } else {
                Tasks::Many((0..capacity).map(|_| TaskState::default()).collect())
            },
            first_start: AtomicU64::new(0),
            starts: Mutex::default(),
        }
    }

    /// A submit call started the tasks from `first` on at `at` (`crate::stats::clock_ns`):
    /// one record for the call.
    pub(super) fn record_start(&self, first: usize, at: u64) {
        if first == 0 {
            self.first_start.store(at, Ordering::Release);
        } else {
            let mut starts = self.starts.lock();
            // Calls racing each other record in task order all the same.
            let at_index = starts.partition_point(|&(task, _)| task < first);
            starts.insert(at_index, (first, at));
        }
    }
}

/// Adds what the tasks of `table` moved over the transport each went to first, and how
/// long those that completed took, to `tally`. A task moves once; read while it runs, it
/// shows what it has moved so far.
pub(crate) fn tally_tasks(table: &TaskTable, tally: &mut Tally) {
    let starts = table.starts.lock();
    let tasks: &[TaskState] = table;
    // The tasks of each submit call, from the one that took task 0 on: a call's tasks share
    // its start.
    let mut from = 0;
    let mut started_ns = table.first_start.load(Ordering::Acquire);
    let mut sums = Sums::default();
    for &(first, at) in starts.iter() {
        let to = first.min(tasks.len()).max(from);
        sums.add(&tasks[from..to], started_ns, tally);
        (from, started_ns) = (to, at);
    }
    sums.add(&tasks[from..], started_ns, tally);
    sums.flush(tally);
}

/// What [`tally_tasks`] gathers before it adds to the tally: a batch's tasks mostly go to
/// one transport and take alike, so runs of them are added at once.
#[derive(Default)]
struct Sums {
    /// The transport (plus one) of the run being summed, its bytes and slices.
    transport: usize,
    bytes: u64,
    slices: u64,
    /// Completed tasks alike in (write, bytes, time taken) not recorded yet, and how many.
    alike: (bool, u64, u64),
    alike_tasks: u64,
}

impl Sums {
    /// Adds `tasks`, started at `started_ns`.
    fn add(&mut self, tasks: &[TaskState], started_ns: u64, tally: &mut Tally) {
        let split = |word: u64| (word & MAX_TASK_BYTES, word >> PROGRESS_SHIFT);
        for t in tasks {
            let word = t.state.load(Ordering::Acquire);
            let first = ((word & FIRST_MASK) >> FIRST_SHIFT) as usize;
            if first == 0 {
                continue;
            }
            // `uncredited` is added to before `progress` and read after: all of it that this
            // `progress` holds is seen.
            let (mut bytes, mut slices) = split(t.progress.load(Ordering::Acquire));
            let (total_bytes, uncredited) = (bytes, t.uncredited.load(Ordering::Acquire));
            if uncredited != 0 {
                let (other_bytes, other_slices) = split(uncredited);
                bytes = bytes.saturating_sub(other_bytes);
                slices = slices.saturating_sub(other_slices);
            }
            if first != self.transport {
                tally.moved(self.transport.wrapping_sub(1), self.bytes, self.slices);
                (self.transport, self.bytes, self.slices) = (first, 0, 0);
            }
            self.bytes += bytes;
            self.slices += slices;
            let ended = word >> ENDED_SHIFT;
            if ended != 0 && state_of(word) == COMPLETED {
                let write = t.slices_total.load(Ordering::Relaxed) & WRITE_FLAG != 0;
                let took = (write, total_bytes, ended.saturating_sub(started_ns));
                // The tasks of one submit call mostly match in all three (their ends shared
                // one clock reading): recorded together.
                if took != self.alike {
                    if self.alike_tasks > 0 {
                        let (write, len, ns) = self.alike;
                        tally.took(write, len, ns, self.alike_tasks);
                    }
                    (self.alike, self.alike_tasks) = (took, 0);
                }
                self.alike_tasks += 1;
            }
        }
    }

    /// Adds what is left.
    fn flush(self, tally: &mut Tally) {
        tally.moved(self.transport.wrapping_sub(1), self.bytes, self.slices);
        if self.alike_tasks > 0 {
            let (write, len, ns) = self.alike;
            tally.took(write, len, ns, self.alike_tasks);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::task::{COMPLETED, ENDED_SHIFT, SETTLED};

    #[test]
    fn each_task_is_timed_from_the_start_of_the_submit_call_that_took_it() {
        // Tasks 0..2 taken by a call at 100 ns, 2..5 by one at 1 000 ns, all ended at 5 000.
        let table = TaskTable::new(5);
        table.record_start(0, 100);
        table.record_start(2, 1_000);
        for t in table.iter() {
            let first_transport = 1 << FIRST_SHIFT;
            t.state.store(
                u64::from(COMPLETED) | SETTLED | first_transport | (5_000 << ENDED_SHIFT),
                Ordering::SeqCst,
            );
            t.slices_total.store(1 | WRITE_FLAG, Ordering::SeqCst);
            t.progress
                .store((1 << PROGRESS_SHIFT) | 4096, Ordering::SeqCst);
        }
        let mut tally = Tally::default();
        tally_tasks(&table, &mut tally);
        assert_eq!(tally.of(0), (5 * 4096, 5));
        let latencies = tally.latencies();
        assert_eq!(latencies.len(), 1, "{latencies:?}");
        assert_eq!(latencies[0].operation, "write");
        assert_eq!(latencies[0].count, 5);
        let took_ns = 2 * 4_900 + 3 * 4_000;
        assert!(
            (latencies[0].sum_seconds - took_ns as f64 / 1e9).abs() < 1e-12,
            "{latencies:?}"
        );
    }
}
