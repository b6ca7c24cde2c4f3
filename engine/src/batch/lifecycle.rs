//! [`BatchInner`], the state behind a batch, and its tasks' lifecycle: reserved, started,
//! counted slice by slice, ended, settled once every slice has let go, finished.

use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::counts::{NotFreed, NotReserved, TaskCounts};
use super::hooks::Hooks;
use super::kept::{KEEP_FROM, KeptRoom, new_tasks};
use super::sync::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use super::table::TaskTable;
use super::task::{
    COMPLETED, ENDED_SHIFT, FAILED, FIRST_MASK, FIRST_SHIFT, PENDING, PROGRESS_SHIFT, RUN_FLAG,
    SETTLED, SLICES_MASK, TaskState, WAITING, WRITE_FLAG, state_of,
};
use super::wait::Helpers;
use crate::engine::EngineInner;
use crate::error::{EngineError, TransferError};
use crate::stats::{EngineCounters, clock_ns, completion_ns};
use crate::types::Opcode;

#[derive(Debug)]
pub(crate) struct BatchInner {
    /// In the batch's own allocation: the engine's tally reads it through a `Weak` to the
    /// batch while the batch lives.
    pub(crate) tasks: TaskTable,
    /// Slots reserved, tasks reserved and not finished, and whether the batch was freed, in
    /// one word: a reserve counts its tasks unfinished in the step that reserves them, so no
    /// reserved task is ever missing from the count.
    pub(super) counts: TaskCounts,
    pub(super) submitted: AtomicUsize,
    /// The bytes of the tasks submitted, added before they are published: what a batch
    /// whose tasks all completed moved.
    pub(super) submitted_bytes: AtomicU64,
    /// Tasks that ended, or are ending, other than Completed: counted before their state
    /// changes (taken back only by an end that found the task final already). While it is
    /// 0, a batch with no task unfinished shows as completed without a look at each task.
    pub(super) unsuccessful: AtomicUsize,
    pub(super) wake_lock: Mutex<()>,
    pub(super) wake: Condvar,
    /// Waiters asleep on `wake` (or about to be): the last task wakes them only if there
    /// are any, so a waiter that spun to the end costs the finisher no system call.
    pub(super) sleepers: AtomicUsize,
    /// Nanoseconds after `crate::stats::epoch`; 0 = no deadline.
    pub(super) deadline_ns: AtomicU64,
    /// How long `wait` polls before it sleeps: a transfer that ends within it is seen at
    /// once, without a condvar round trip.
    pub(super) spin: Duration,
    /// The engine's counters, which read this batch's tasks while it lives and take their
    /// totals when it goes, and count what the tasks' words do not (a slice another
    /// transport carried, a failure); none with metrics off, when they count nothing.
    pub(crate) timer: Option<Arc<EngineCounters>>,
    /// Transports a waiter may help instead of spinning.
    pub(super) helpers: Option<Helpers>,
    /// Hooks waiting for the batch to go idle; `has_hooks` lets finishers skip the lock
    /// when there are none (the common case).
    pub(super) hooks: Mutex<Hooks>,
    pub(super) has_hooks: AtomicBool,
    /// Tasks ended other than Completed whose slices have not all let go and whose end a
    /// cut-off can hasten: all but the failed tasks of merged runs, whose runs' other slices
    /// carry live tasks (and end with them). Counted before the end's state change, taken
    /// back when the task settles; while it is above 0, waiters and status reads ask the
    /// transports to cut off now and then.
    pub(super) ending: AtomicUsize,
    /// When the transports were last asked to cut off (`stats::clock_ns`).
    pub(super) last_cut_ns: AtomicU64,
    /// The engine, whose transports cut off the slices of ended tasks.
    pub(crate) engine: Weak<EngineInner>,
    /// Where the task table goes when the batch goes, and the parts of its merged runs when
    /// they do, for the batches to come (large batches only).
    pub(crate) kept: Option<Arc<KeptRoom>>,
    /// Whether the batch is a call's on a caller's CUDA stream, started once the work before
    /// it there was done: its device copies need (and must take) no fence on the device's
    /// legacy stream (`tern_cuda::DeviceOrder`).
    pub(crate) stream_ordered: AtomicBool,
}

impl BatchInner {
    #[cfg(test)]
    pub(crate) fn new(capacity: usize) -> Self {
        Self::untracked(capacity, Duration::ZERO, None, None, Weak::new(), None)
    }

    /// A batch of `capacity` tasks, which `timer` (if any) tallies while it lives and once
    /// more when it goes; its task table comes from `kept` and goes back there.
    pub(crate) fn timed(
        capacity: usize,
        spin: Duration,
        timer: Option<Arc<EngineCounters>>,
        helpers: Option<Helpers>,
        engine: Weak<EngineInner>,
        kept: &Arc<KeptRoom>,
    ) -> Arc<Self> {
        let kept = (capacity >= KEEP_FROM).then(|| kept.clone());
        let batch = Arc::new(Self::untracked(
            capacity, spin, timer, helpers, engine, kept,
        ));
        if let Some(timer) = &batch.timer {
            timer.track_batch(Arc::downgrade(&batch));
        }
        batch
    }

    fn untracked(
        capacity: usize,
        spin: Duration,
        timer: Option<Arc<EngineCounters>>,
        helpers: Option<Helpers>,
        engine: Weak<EngineInner>,
        kept: Option<Arc<KeptRoom>>,
    ) -> Self {
        let tasks = match &kept {
            Some(kept) => new_tasks(&kept.tasks, capacity),
            None => (0..capacity).map(|_| TaskState::default()).collect(),
        };
        Self {
            tasks: TaskTable::of(tasks),
            counts: TaskCounts::new(),
            submitted: AtomicUsize::new(0),
            submitted_bytes: AtomicU64::new(0),
            unsuccessful: AtomicUsize::new(0),
            wake_lock: Mutex::new(()),
            wake: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            deadline_ns: AtomicU64::new(0),
            spin,
            timer,
            helpers,
            hooks: Mutex::new(Hooks::default()),
            has_hooks: AtomicBool::new(false),
            ending: AtomicUsize::new(0),
            last_cut_ns: AtomicU64::new(0),
            engine,
            kept,
            stream_ordered: AtomicBool::new(false),
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.tasks.len()
    }

    /// Reserves `n` task slots; returns the first index.
    #[cfg(test)]
    pub(crate) fn reserve(&self, n: usize) -> Result<usize, EngineError> {
        self.reserve_with_timeout(n, None).map(|(first, _)| first)
    }

    /// Reserves `n` task slots, and gives the batch a deadline `timeout` from now unless it
    /// has one; returns the first index, and when the tasks started (`stats::clock_ns`, for
    /// timing them; 0 when untimed). One clock reading serves the deadline and the tasks'
    /// start.
    pub(crate) fn reserve_with_timeout(
        &self,
        n: usize,
        timeout: Option<Duration>,
    ) -> Result<(usize, u64), EngineError> {
        let capacity = self.capacity();
        let first = self
            .counts
            .reserve(n, capacity)
            .map_err(|refused| match refused {
                NotReserved::Freed => EngineError::BatchFreed,
                NotReserved::Full { room } => EngineError::TooManyRequests {
                    capacity,
                    room,
                    requested: n,
                },
            })?;
        let mut started_ns = 0;
        if self.timer.is_some() || timeout.is_some() {
            let now = clock_ns();
            if self.timer.is_some() {
                started_ns = now;
                // The tasks' start, one record for the call: a task stores nothing for
                // metrics. The tasks start after this returns, so a reader that sees them
                // started sees the record too.
                self.tasks.record_start(first, now);
            }
            if let Some(timeout) = timeout {
                let at = now.saturating_add(u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX));
                self.set_deadline_ns_if_unset(at);
            }
        }
        Ok((first, started_ns))
    }

    /// Marks reserved slots as visible to status readers, after their state is set and
    /// before their slices are handed to the transports; `bytes` is the length of the
    /// requests among them that did not fail at submit.
    pub(crate) fn publish(&self, up_to: usize, bytes: u64) {
        self.submitted_bytes.fetch_add(bytes, Ordering::SeqCst);
        self.submitted.fetch_max(up_to, Ordering::SeqCst);
    }

    /// Starts `task`: `slices` of `opcode`, going to transport `first` (an index into the
    /// engine's list) first — the words the task keeps anyway, so metrics store nothing here.
    #[inline]
    pub(crate) fn start_task(&self, task: usize, slices: u32, opcode: Opcode, first: usize) {
        self.start(task, slices, opcode, first);
    }

    /// Starts `task` as one of a merged run's, whose slices go to transport `first` first:
    /// its one slice is the run, which reports to it with
    /// [`run_task_released`](Self::run_task_released) once all the run's slices let go.
    #[inline]
    pub(crate) fn start_run_task(&self, task: usize, opcode: Opcode, first: usize) {
        self.start(task, 1 | RUN_FLAG, opcode, first);
    }

    /// Starts `task` with `slices` (its count, and [`RUN_FLAG`] for a task of a run).
    #[inline(always)]
    fn start(&self, task: usize, slices: u32, opcode: Opcode, first: usize) {
        let t = &self.tasks[task];
        let write = if opcode == Opcode::Write {
            WRITE_FLAG
        } else {
            0
        };
        t.slices_total.store(slices | write, Ordering::SeqCst);
        let first = ((first as u64 + 1) << FIRST_SHIFT) & FIRST_MASK;
        let started = t.state.compare_exchange(
            u64::from(WAITING),
            u64::from(PENDING) | first,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
        if started.is_err() {
            // Ended (canceled, timed out) before it started: its slices, handed over after
            // this, let go unrun, and the last of them settles it; with none, it settles now.
            self.settle_if_released(task);
        }
    }

    /// Moves a pending (or just-reserved) task to a final state other than Completed; false
    /// if it already was final. The task is settled (shown, and counted finished) once its
    /// slices have all let go: here if they have, else by the last of them.
    pub(super) fn end(&self, task: usize, state: u8) -> bool {
        let t = &self.tasks[task];
        let hastened = Self::cut_off_hastens(t, state);
        // Before the state changes: whoever settles the task, on whatever thread, takes
        // them back (and counts it finished) after this.
        self.unsuccessful.fetch_add(1, Ordering::SeqCst);
        if hastened {
            self.ending.fetch_add(1, Ordering::SeqCst);
        }
        let mut current = t.state.load(Ordering::SeqCst);
        loop {
            if !matches!(state_of(current), PENDING | WAITING) {
                if hastened {
                    self.ending.fetch_sub(1, Ordering::SeqCst);
                }
                self.unsuccessful.fetch_sub(1, Ordering::SeqCst);
                return false;
            }
            let next = u64::from(state) | (current & FIRST_MASK);
            match t
                .state
                .compare_exchange(current, next, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => break,
                Err(now) => current = now,
            }
        }
        // A task ended before it started is settled by `start_task` (its slices exist but
        // are not counted yet) or by `fail_unstarted`.
        if state_of(current) == PENDING {
            self.settle_if_released(task);
        }
        true
    }

    /// Whether cutting off slices can hasten the end of task `t`, ending as `state`: all
    /// but a failed task of a merged run, whose run's other slices carry live tasks. The
    /// same answer at its end and at its settling: a run task fails only through its run's
    /// slices, after it started (and its slice total was set).
    #[inline]
    fn cut_off_hastens(t: &TaskState, state: u8) -> bool {
        state != FAILED || t.slices_total.load(Ordering::SeqCst) & RUN_FLAG == 0
    }

    /// Settles `task` if it has ended other than Completed and every slice has let go.
    #[cold]
    pub(super) fn settle_if_released(&self, task: usize) {
        if self.tasks[task].released() {
            self.settle(task);
        }
    }

    /// The last slice of `task` let go: completes it if nothing ended it before (true: the
    /// caller then counts it [`finished`](Self::finished)), else shows the state it ended in.
    #[inline]
    fn last_released(&self, task: usize, ended_ns: u64) -> bool {
        if self.try_complete(task, ended_ns) {
            return true;
        }
        self.settle(task);
        false
    }

    /// Moves `task` to Completed (settled, ended at `ended_ns`) unless something ended it
    /// before.
    #[inline(always)]
    fn try_complete(&self, task: usize, ended_ns: u64) -> bool {
        Self::try_complete_state(&self.tasks[task], ended_ns)
    }

    /// [`try_complete`](Self::try_complete), for the task `t`.
    #[inline(always)]
    fn try_complete_state(t: &TaskState, ended_ns: u64) -> bool {
        let current = t.state.load(Ordering::SeqCst);
        if matches!(state_of(current), PENDING | WAITING) {
            let next = u64::from(COMPLETED)
                | SETTLED
                | (current & FIRST_MASK)
                | (ended_ns & (u64::MAX >> ENDED_SHIFT)) << ENDED_SHIFT;
            return t
                .state
                .compare_exchange(current, next, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok();
        }
        false
    }

    /// Marks an ended task settled, once (whoever sees it both ended and released first).
    #[cold]
    fn settle(&self, task: usize) {
        if self.mark_settled(task) {
            self.finished();
        }
    }

    /// [`settle`](Self::settle), but the caller counts the task
    /// [`finished_many`](Self::finished_many) if this returns true (it settled it).
    #[cold]
    fn mark_settled(&self, task: usize) -> bool {
        let t = &self.tasks[task];
        let mut current = t.state.load(Ordering::SeqCst);
        loop {
            if matches!(state_of(current), PENDING | WAITING) || current & SETTLED != 0 {
                return false;
            }
            match t.state.compare_exchange(
                current,
                current | SETTLED,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => break,
                Err(now) => current = now,
            }
        }
        if Self::cut_off_hastens(t, state_of(current)) {
            self.ending.fetch_sub(1, Ordering::SeqCst);
        }
        true
    }

    /// One task more has finished (and shows so).
    #[inline]
    fn finished(&self) {
        self.finished_many(1);
    }

    /// `count` tasks more have finished (and show so): one write to the count every
    /// finisher shares, whichever thread it runs on, for the tasks one slice ended.
    #[inline]
    pub(crate) fn finished_many(&self, count: usize) {
        if count > 0 && self.counts.finished(count) {
            self.went_idle();
        }
    }

    /// The batch's last task finished: its waiters wake and its hooks run. Apart from
    /// [`finished`](Self::finished), which runs once per task, to keep that one small.
    #[cold]
    fn went_idle(&self) {
        // Waiters wait for the whole batch (and wake at its deadline on their own): only the
        // last task wakes them, under the lock they check the count under, so no wake-up is
        // lost. A waiter counts itself in `sleepers` before it checks the count (both
        // SeqCst): either this load sees it, or its check sees the decrement and it does
        // not sleep.
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = self.wake_lock.lock();
            self.wake.notify_all();
        }
        if self.has_hooks.load(Ordering::SeqCst) {
            self.run_hooks();
        }
    }

    /// Fails `task` for a slice of it that failed (and lets go after this).
    pub(crate) fn fail_task(&self, task: usize, error: TransferError) {
        self.tasks.set_error(task, error);
        self.end(task, FAILED);
    }

    /// A slice of `task` let go without moving its bytes, as only the slice of an ended task
    /// may: if the task still runs (a transport's mistake), it fails here, before the slice
    /// counts, so that its last slice cannot complete it with bytes missing.
    pub(crate) fn fail_if_live(&self, task: usize, how: &str) {
        if self.task_live(task) {
            self.fail_task(
                task,
                TransferError::Dropped(format!("a slice was {how} while its task was running")),
            );
        }
    }

    /// Fails `task`, which never started: it has no slice.
    pub(crate) fn fail_unstarted(&self, task: usize, error: TransferError) {
        self.fail_task(task, error);
        self.settle_if_released(task);
    }

    /// A write slice of `task` let go with bytes that may still land at the peer.
    pub(crate) fn remote_may_change(&self, task: usize) {
        self.tasks[task]
            .remote_may_change
            .store(true, Ordering::Relaxed);
    }

    /// `task` has `more` slices than it started with (a declined slice cut again). Only
    /// while a slice of the task has not reported, so the task cannot end meanwhile.
    pub(crate) fn add_slices(&self, task: usize, more: u32) {
        self.tasks[task]
            .slices_total
            .fetch_add(more, Ordering::AcqRel);
    }

    /// Counts one slice of `task` let go (done with `bytes` moved, or skipped, failed or cut
    /// off with none); true when it was the last, and the caller then
    /// [`complete_task`](Self::complete_task)s it (after letting go of what the task held).
    #[inline]
    pub(crate) fn slice_progress(&self, task: usize, bytes: u64) -> bool {
        let t = &self.tasks[task];
        let before = t
            .progress
            .fetch_add((1 << PROGRESS_SHIFT) | bytes, Ordering::SeqCst);
        let done = (before >> PROGRESS_SHIFT) + 1;
        done == u64::from(t.slices_total.load(Ordering::SeqCst) & SLICES_MASK)
    }

    /// A merged run has let go of all its slices: each of its `tasks`, `(task, len, moved)`
    /// with `moved` of its `len` bytes moved, gets the run as its one slice, and completes
    /// if nothing ended it before (timed `ended_ns`; `completed` is told its length), else
    /// settles as it ended. Returns how many finished, for the caller to count
    /// [`finished_many`](Self::finished_many) after the run's tally.
    #[inline]
    pub(crate) fn release_run_tasks(
        &self,
        tasks: impl Iterator<Item = (usize, u64, u64)>,
        ended_ns: u64,
        mut completed: impl FnMut(u64),
    ) -> usize {
        let table: &[TaskState] = &self.tasks;
        let mut finished = 0;
        for (task, len, moved) in tasks {
            let Some(t) = table.get(task) else {
                continue;
            };
            t.progress
                .fetch_add((1 << PROGRESS_SHIFT) | moved, Ordering::SeqCst);
            if Self::try_complete_state(t, ended_ns) {
                finished += 1;
                completed(len);
            } else if self.mark_settled(task) {
                finished += 1;
            }
        }
        finished
    }

    /// A slice of `task` with `bytes` that the task's first transport did not move (another
    /// carried it, or it was skipped): called before its
    /// [`slice_progress`](Self::slice_progress), so that the tally never credits it to the
    /// first transport.
    pub(crate) fn slice_uncredited(&self, task: usize, bytes: u64) {
        self.tasks[task]
            .uncredited
            .fetch_add((1 << PROGRESS_SHIFT) | bytes, Ordering::AcqRel);
    }

    /// The last slice of `task` let go: moves it to Completed (if nothing ended it before,
    /// timed by this thread's completion clock when metrics are on), else shows how it ended.
    #[inline(always)]
    pub(crate) fn complete_task(&self, task: usize) {
        if self.last_released(task, self.ended_ns()) {
            self.finished();
        }
    }

    /// When a task completing now ends, for its timing (metrics on; else 0, untimed).
    #[inline]
    pub(crate) fn ended_ns(&self) -> u64 {
        if self.timer.is_some() {
            completion_ns().max(1)
        } else {
            0
        }
    }

    /// Whether a slice of `task` should still run: the task is pending. (A task past its
    /// deadline is timed out by the next status read or wait — a waiter wakes at the
    /// deadline — so no clock is read per slice.)
    pub(crate) fn task_live(&self, task: usize) -> bool {
        state_of(self.tasks[task].state.load(Ordering::Acquire)) == PENDING
    }

    pub(crate) fn mark_freed(&self) -> Result<(), EngineError> {
        // Times out what is past the deadline first: a batch whose tasks all ended frees.
        self.enforce_deadline();
        self.counts.free().map_err(|refused| match refused {
            NotFreed::Freed => EngineError::BatchFreed,
            NotFreed::Busy { pending } => EngineError::BatchBusy { pending },
        })
    }

    /// Whether the batch was freed.
    pub(crate) fn is_freed(&self) -> bool {
        self.counts.freed()
    }
}

impl Drop for BatchInner {
    fn drop(&mut self) {
        // Every slice has reported (each held the batch): the tasks are as they end.
        if let Some(timer) = &self.timer {
            timer.add_batch_totals(self);
        }
        // Read for the last time above: the table may serve the next batch.
        if let Some(kept) = &self.kept {
            kept.tasks.keep(self.tasks.take_tasks());
        }
    }
}
