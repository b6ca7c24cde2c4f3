//! A batch's table of tasks, and the tally the engine reads off it while the batch lives and
//! once more when it goes.

use std::collections::BTreeMap;

use parking_lot::Mutex;

use super::sync::{AtomicU64, AtomicUsize, Ordering};
use super::task::{
    COMPLETED, ENDED_SHIFT, FIRST_MASK, FIRST_SHIFT, MAX_TASK_BYTES, PROGRESS_SHIFT, RUN_FLAG,
    TaskState, WRITE_FLAG, state_of,
};
use crate::error::TransferError;
use crate::stats::{Tally, bucket_of};

/// A batch's tasks, and when each submit call started its tasks: what the engine's tally
/// reads ([`tally_tasks`]) while the batch lives, and once more when it goes.
#[derive(Debug)]
pub(crate) struct TaskTable {
    /// One allocation even for a lone task: an index into it is a bounds check, where a
    /// table that kept a lone task inline paid a branch on every access of every task. Made
    /// with its room exact, or in the room of a large table kept ([`super::kept`]).
    tasks: Vec<TaskState>,
    /// `stats::clock_ns` of the submit call that took task 0 (timed batches only; 0 until
    /// then): most batches take one call, which so stores its start without a lock.
    first_start: AtomicU64,
    /// `(first task, stats::clock_ns)` of each later submit call, in task order (timed
    /// batches only): one record per call, none per task.
    starts: Mutex<Vec<(usize, u64)>>,
    /// Tasks started as tasks of merged runs, which the runs tally: when they are all the
    /// table's, the tally need not walk it.
    run_tasks: AtomicUsize,
    /// Why tasks failed, by task: the first reason each got (few tasks fail; the table's
    /// tasks hold none).
    errors: Mutex<BTreeMap<usize, TransferError>>,
    /// What the merged runs that ended moved and took (timed batches only; none until the
    /// first ends): their tasks are read off the runs, not one by one.
    runs: Mutex<Option<Box<Tally>>>,
}

impl std::ops::Deref for TaskTable {
    type Target = [TaskState];
    fn deref(&self) -> &[TaskState] {
        &self.tasks
    }
}

impl TaskTable {
    /// `capacity` tasks, none started.
    #[cfg(test)]
    pub(super) fn new(capacity: usize) -> Self {
        Self::of(super::kept::new_tasks(
            &super::kept::Kept::default(),
            capacity,
        ))
    }

    /// A table of `tasks`, each as new.
    pub(super) fn of(tasks: Vec<TaskState>) -> Self {
        Self {
            tasks,
            first_start: AtomicU64::new(0),
            starts: Mutex::default(),
            runs: Mutex::default(),
            run_tasks: AtomicUsize::new(0),
            errors: Mutex::default(),
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

impl TaskTable {
    /// The tasks, for a table kept for another batch; none left here.
    pub(super) fn take_tasks(&mut self) -> Vec<TaskState> {
        std::mem::take(&mut self.tasks)
    }

    /// `count` more tasks started as tasks of merged runs.
    pub(crate) fn count_run_tasks(&self, count: usize) {
        self.run_tasks.fetch_add(count, Ordering::Release);
    }

    /// `task` failed for `error`, unless it had a reason already.
    pub(crate) fn set_error(&self, task: usize, error: TransferError) {
        self.errors.lock().entry(task).or_insert(error);
    }

    /// Why `task` failed, if it did.
    pub(crate) fn error(&self, task: usize) -> Option<TransferError> {
        self.errors.lock().get(&task).cloned()
    }

    /// Adds to the tally of the batch's merged runs, with `record` (under its lock: the
    /// run's tasks complete inside it, so that a tally read after they show completed
    /// holds them).
    pub(crate) fn record_run<R>(&self, record: impl FnOnce(&mut Tally) -> R) -> R {
        let mut runs = self.runs.lock();
        record(runs.get_or_insert_with(Box::default))
    }
}

/// Adds what the tasks of `table` moved over the transport each went to first, and how
/// long those that completed took, to `tally`. A task moves once; read while it runs, it
/// shows what it has moved so far.
pub(crate) fn tally_tasks(table: &TaskTable, tally: &mut Tally) {
    let tasks: &[TaskState] = table;
    if table.run_tasks.load(Ordering::Acquire) < tasks.len() {
        tally_tasks_one_by_one(table, tally);
    }
    if let Some(runs) = &*table.runs.lock() {
        tally.absorb(runs);
    }
}

/// [`tally_tasks`] for the tasks that did not go in a merged run.
fn tally_tasks_one_by_one(table: &TaskTable, tally: &mut Tally) {
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
    /// Completed tasks alike (see [`Alike`]) not recorded yet.
    alike: Alike,
}

/// Completed tasks of one operation and length whose times taken fall in one latency
/// bucket: recorded at once, where the tasks of a submit call mostly are (their times differ
/// by the moments their slices ended, but rarely by a bucket).
#[derive(Default)]
struct Alike {
    /// The length, with [`WRITE_KEY`] for a write: one comparison tells both.
    key: u64,
    /// The bucket, and the times it holds: `[from_ns, below_ns)` (empty before the first).
    bucket: usize,
    from_ns: u64,
    below_ns: u64,
    tasks: u64,
    sum_ns: u64,
}

/// What a task that completed plainly leaves in its words, but for when it ended: a task
/// whose words are these, with an end in the same latency bucket, is tallied as it was.
struct Lane {
    /// The state word below [`ENDED_SHIFT`]: completed, settled, the first transport.
    state: u64,
    /// The slice total and the progress word, whole: the operation, the length, the slices.
    total: u32,
    progress: u64,
    /// What the task moved, all of it on its first transport.
    bytes: u64,
    slices: u64,
}

/// The bits of a task's state word that say when it ended.
const ENDED_MASK: u64 = !((1 << ENDED_SHIFT) - 1);

impl Lane {
    /// How many of `tasks`, from the first, are tasks of this lane (ended, in `alike`'s
    /// bucket, timed from `started_ns`); adds their times to `alike`.
    fn count(&self, tasks: &[TaskState], started_ns: u64, alike: &mut Alike) -> usize {
        let width = alike.below_ns.wrapping_sub(alike.from_ns);
        let mut taken = 0;
        let mut sum_ns = 0u64;
        for t in tasks {
            let word = t.state.load(Ordering::Acquire);
            let ended = word >> ENDED_SHIFT;
            // An end before the start (not seen: the clock is monotonic) wraps past the
            // bucket and goes the general way, which saturates.
            let ns = ended.wrapping_sub(started_ns);
            if word & !ENDED_MASK != self.state
                || ended == 0
                || ns.wrapping_sub(alike.from_ns) >= width
                || t.slices_total.load(Ordering::Relaxed) != self.total
                || t.progress.load(Ordering::Acquire) != self.progress
                || t.uncredited.load(Ordering::Acquire) != 0
            {
                break;
            }
            taken += 1;
            sum_ns = sum_ns.wrapping_add(ns);
        }
        alike.tasks += taken as u64;
        alike.sum_ns = alike.sum_ns.wrapping_add(sum_ns);
        taken
    }
}

/// The bit of [`Alike::key`] that marks a write: above any task's length.
const WRITE_KEY: u64 = 1 << 63;
const _: () = assert!(MAX_TASK_BYTES < WRITE_KEY);

impl Alike {
    fn key(write: bool, len: u64) -> u64 {
        if write { len | WRITE_KEY } else { len }
    }

    /// Records what it holds, and holds nothing after.
    fn record(&mut self, tally: &mut Tally) {
        if self.tasks > 0 {
            let (write, len) = (self.key & WRITE_KEY != 0, self.key & !WRITE_KEY);
            tally.took(write, len, self.bucket, self.tasks, self.sum_ns);
        }
        (self.tasks, self.sum_ns) = (0, 0);
    }
}

impl Sums {
    /// Adds `tasks`, started at `started_ns`. A task that completed plainly (one transport,
    /// its bytes all its first's, timed) opens a [`Lane`]: the tasks after it that look
    /// the same but for when they ended — the most of a submit's — are counted in a loop
    /// of their own.
    fn add(&mut self, tasks: &[TaskState], started_ns: u64, tally: &mut Tally) {
        let mut rest = tasks;
        while let Some((task, after)) = rest.split_first() {
            rest = after;
            let lane = self.add_one(task, started_ns, tally);
            if rest.is_empty() {
                break;
            }
            if let Some(lane) = lane {
                let alike = lane.count(rest, started_ns, &mut self.alike);
                self.bytes += alike as u64 * lane.bytes;
                self.slices += alike as u64 * lane.slices;
                rest = rest.get(alike..).unwrap_or_default();
            }
        }
    }

    /// Adds task `t`; the lane of the tasks like it, if it completed plainly.
    #[inline]
    fn add_one(&mut self, t: &TaskState, started_ns: u64, tally: &mut Tally) -> Option<Lane> {
        let split = |word: u64| (word & MAX_TASK_BYTES, word >> PROGRESS_SHIFT);
        let word = t.state.load(Ordering::Acquire);
        let first = ((word & FIRST_MASK) >> FIRST_SHIFT) as usize;
        if first == 0 {
            return None;
        }
        let total = t.slices_total.load(Ordering::Relaxed);
        if total & RUN_FLAG != 0 {
            // Its run tallies it.
            return None;
        }
        // `uncredited` is added to before `progress` and read after: all of it that this
        // `progress` holds is seen.
        let progress = t.progress.load(Ordering::Acquire);
        let (mut bytes, mut slices) = split(progress);
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
        if ended == 0 || state_of(word) != COMPLETED {
            return None;
        }
        let write = total & WRITE_FLAG != 0;
        let (key, ns) = (
            Alike::key(write, total_bytes),
            ended.saturating_sub(started_ns),
        );
        let alike = &mut self.alike;
        if key != alike.key || ns < alike.from_ns || ns >= alike.below_ns {
            alike.record(tally);
            let (bucket, from_ns, below_ns) = bucket_of(ns);
            alike.key = key;
            (alike.bucket, alike.from_ns, alike.below_ns) = (bucket, from_ns, below_ns);
        }
        alike.tasks += 1;
        // Wraps only past 584 years of tasks' time.
        alike.sum_ns = alike.sum_ns.wrapping_add(ns);
        (uncredited == 0).then_some(Lane {
            state: word & !ENDED_MASK,
            total,
            progress,
            bytes,
            slices,
        })
    }

    /// Adds what is left.
    fn flush(mut self, tally: &mut Tally) {
        tally.moved(self.transport.wrapping_sub(1), self.bytes, self.slices);
        self.alike.record(tally);
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

    #[test]
    fn tasks_are_recorded_in_the_bucket_of_their_own_time_whatever_their_neighbours_took() {
        // Ends spread over several buckets, back and forth, with a read and another length
        // among them: the histograms come out as one record per task would make them.
        let ended_us = [1, 2, 7, 3, 30, 31, 4, 4, 900, 2, 5, 6, 6, 6, 20_000_000];
        let table = TaskTable::new(ended_us.len());
        table.record_start(0, 0);
        let mut expected = Tally::default();
        for (i, (t, &us)) in table.iter().zip(&ended_us).enumerate() {
            let (write, len) = (i % 5 != 3, if i % 7 == 6 { 8192 } else { 4096 });
            let ended_ns = us * 1_000 + i as u64;
            t.state.store(
                u64::from(COMPLETED) | SETTLED | (1 << FIRST_SHIFT) | (ended_ns << ENDED_SHIFT),
                Ordering::SeqCst,
            );
            t.slices_total
                .store(1 | if write { WRITE_FLAG } else { 0 }, Ordering::SeqCst);
            t.progress
                .store((1 << PROGRESS_SHIFT) | len, Ordering::SeqCst);
            let (bucket, _, _) = bucket_of(ended_ns);
            expected.took(write, len, bucket, 1, ended_ns);
        }
        let mut tally = Tally::default();
        tally_tasks(&table, &mut tally);
        let (got, want) = (tally.latencies(), expected.latencies());
        assert_eq!(format!("{got:?}"), format!("{want:?}"));
        let counted: u64 = got.iter().map(|l| l.count).sum();
        assert_eq!(counted, ended_us.len() as u64);
        assert!(got.len() >= 3, "reads, writes, two lengths: {got:?}");
    }
    #[test]
    fn tasks_counted_together_come_out_as_counted_one_by_one() {
        // Runs of tasks alike but for their ends (the lane), broken by every kind of task
        // that is not: another length, operation or transport, slices another transport
        // carried, a task of a run, one that failed or never started, an end in another
        // bucket. The tally must be what one record per task makes.
        let mut next = tern_testkit::random::below_from(0x9e37_79b9_7f4a_7c15);
        for round in 0..40 {
            let tasks = 1 + next(300) as usize;
            let table = TaskTable::new(tasks);
            let started = 1_000 + next(1_000);
            table.record_start(0, started);
            let mut expected = Tally::default();
            let mut expected_moved = [(0u64, 0u64); 3];
            let (mut len, mut write, mut transport) = (4096u64, true, 1u64);
            let mut ended = started + 2_000;
            for t in table.iter() {
                // Mostly alike; now and then something else.
                match next(12) {
                    0 => len = 1 + next(1 << 20),
                    1 => write = !write,
                    2 => transport = 1 + next(3),
                    3 => ended = started + next(50_000_000),
                    _ => ended += next(3),
                }
                let slices = 1 + len / 65_536;
                let kind = next(20);
                let run = kind == 0;
                let state = match kind {
                    1 => u64::from(crate::batch::task::FAILED) | SETTLED,
                    2 => 0, // never started: no first transport
                    _ => u64::from(COMPLETED) | SETTLED | (ended << ENDED_SHIFT),
                };
                let first = if kind == 2 {
                    0
                } else {
                    transport << FIRST_SHIFT
                };
                t.state.store(state | first, Ordering::SeqCst);
                let flags = if write { WRITE_FLAG } else { 0 } | if run { RUN_FLAG } else { 0 };
                t.slices_total
                    .store(slices as u32 | flags, Ordering::SeqCst);
                t.progress
                    .store((slices << PROGRESS_SHIFT) | len, Ordering::SeqCst);
                let (other_bytes, other_slices) = if kind == 3 { (len / 2, 1) } else { (0, 0) };
                t.uncredited.store(
                    (other_slices << PROGRESS_SHIFT) | other_bytes,
                    Ordering::SeqCst,
                );
                if kind == 2 || run {
                    continue;
                }
                let moved = &mut expected_moved[transport as usize - 1];
                moved.0 += len - other_bytes;
                moved.1 += slices - other_slices;
                if kind != 1 {
                    let ns = ended - started;
                    let (bucket, _, _) = bucket_of(ns);
                    expected.took(write, len, bucket, 1, ns);
                }
            }
            let mut tally = Tally::default();
            tally_tasks(&table, &mut tally);
            let (got, want) = (tally.latencies(), expected.latencies());
            assert_eq!(format!("{got:?}"), format!("{want:?}"), "round {round}");
            for (transport, moved) in expected_moved.iter().enumerate() {
                assert_eq!(
                    tally.of(transport),
                    *moved,
                    "round {round}, transport {transport}"
                );
            }
        }
    }
}
