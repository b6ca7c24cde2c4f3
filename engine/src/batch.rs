//! Batches and tasks: the bookkeeping between submit and completion.
//!
//! A task's state lives in atomics so that status reads take no lock; a finished task never
//! changes again (the first final state wins a compare-and-swap). Waiters sleep on a condvar
//! that the last task to finish signals; each slice costs one atomic add on its task.
//!
//! A task that ends other than Completed (deadline, cancel, a failed slice) is *reported*
//! so only once every slice of it has let go (reported, abandoned or dropped): until then a
//! status read shows it Pending, and waiters ask the transports to cut its slices off
//! ([`Transport::cut_off`]) and wait up to [`DRAIN`] for them. So whoever sees a task
//! Timeout, Canceled or Failed knows that no slice of it touches local memory any more. The
//! count is the one the slices keep anyway: every slice, whatever its outcome, adds one to
//! its task's progress word, and the one that brings it to the total settles the task.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};

/// Called once when a batch has no unfinished task left; see [`Batch::on_complete`].
type CompletionHook = Box<dyn FnOnce() + Send>;

/// The hooks a batch holds, shown by count.
#[derive(Default)]
struct Hooks(Vec<CompletionHook>);

impl std::fmt::Debug for Hooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} completion hook(s)", self.0.len())
    }
}
use std::time::{Duration, Instant};

use crate::engine::EngineInner;
use crate::error::{EngineError, TransferError};
use crate::stats::{EngineCounters, Tally, clock_ns, completion_ns, epoch};
use crate::transport::Transport;
use crate::types::{BatchState, BatchStatus, Opcode, TaskStatus, TransferStatus};

const WAITING: u8 = 0;
const PENDING: u8 = 1;
const COMPLETED: u8 = 2;
const FAILED: u8 = 3;
const TIMEOUT: u8 = 4;
const CANCELED: u8 = 5;

/// How long a task that ended other than Completed may take for its slices still in flight
/// to let go, once the transports were asked to cut them off: a wait (or cancel) that ended
/// tasks waits this long at most for them, and a task whose slices are still out after it
/// stays Pending.
pub const DRAIN: Duration = Duration::from_secs(2);
/// How often a waiter asks the transports again to cut off the slices of ended tasks.
const CUT_AGAIN: Duration = Duration::from_millis(20);

/// Bytes a task may move: a request longer than this is refused at submit.
pub(crate) const MAX_TASK_BYTES: u64 = (1 << PROGRESS_SHIFT) - 1;
/// A task's progress word holds its slices done above this bit and its bytes below.
const PROGRESS_SHIFT: u32 = 40;

/// A task's state word: the state in its low three bits; above them the transport its
/// slices go to first, plus one (0: none); from [`ENDED_SHIFT`] on, once a timed task has
/// completed, when it did (`stats::completion_ns`, at least 1) — so the compare-and-swap
/// that ends a task also times it.
const STATE_MASK: u64 = 0b111;
const FIRST_SHIFT: u32 = 3;
const FIRST_MASK: u64 = 0b1_1111 << FIRST_SHIFT;
/// A final state's bit once every slice of the task has let go: only then is the final state
/// shown, and the task counted finished. Completed tasks have it from the start (their last
/// slice completes them).
const SETTLED: u64 = 1 << 8;
const ENDED_SHIFT: u32 = 9;
/// The bit of a task's slice total that marks a write.
const WRITE_FLAG: u32 = 1 << 31;

fn state_of(word: u64) -> u8 {
    (word & STATE_MASK) as u8
}

/// One task, as its batch and the engine's tally ([`tally_tasks`]) read it.
#[derive(Debug, Default)]
pub(crate) struct TaskState {
    /// See [`STATE_MASK`].
    state: AtomicU64,
    /// Slices to do, and [`WRITE_FLAG`] for a write.
    slices_total: AtomicU32,
    /// Slices done (high bits) and bytes moved (low [`PROGRESS_SHIFT`] bits): one atomic add
    /// per slice counts both.
    progress: AtomicU64,
    /// The part of `progress` the first transport did not move: slices it declined, which
    /// the transports that carried them count as they report, and slices skipped. Added to
    /// before `progress`.
    uncredited: AtomicU64,
    /// A write some of whose bytes left without their landing being confirmed: they may
    /// still land at the peer after the task ended.
    remote_may_change: AtomicBool,
    /// Boxed: a batch sets up and lets go of a task per request, and the few that fail can
    /// afford an allocation.
    error: OnceLock<Box<TransferError>>,
}

impl TaskState {
    fn bytes(&self) -> u64 {
        self.progress.load(Ordering::Relaxed) & MAX_TASK_BYTES
    }

    /// Whether every slice of the task has let go. Progress first, then the total: the
    /// total grows only while a slice is out, so a total read after a progress equal to it
    /// means none was out when the progress was read.
    fn released(&self) -> bool {
        let done = self.progress.load(Ordering::SeqCst) >> PROGRESS_SHIFT;
        done == u64::from(self.slices_total.load(Ordering::SeqCst) & !WRITE_FLAG)
    }
}

/// A batch's tasks, and when each submit call started its tasks: what the engine's tally
/// reads ([`tally_tasks`]) while the batch lives, and once more when it goes.
#[derive(Debug)]
pub(crate) struct TaskTable {
    tasks: Box<[TaskState]>,
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
        &self.tasks
    }
}

/// Adds what the tasks of `table` moved over the transport each went to first, and how
/// long those that completed took, to `tally`. A task moves once; read while it runs, it
/// shows what it has moved so far.
pub(crate) fn tally_tasks(table: &TaskTable, tally: &mut Tally) {
    let split = |word: u64| (word & MAX_TASK_BYTES, word >> PROGRESS_SHIFT);
    let starts = table.starts.lock().unwrap_or_else(|p| p.into_inner());
    let mut next_start = 0;
    let mut started_ns = table.first_start.load(Ordering::Acquire);
    // A batch's tasks mostly go to one transport: summed here, added to the tally per run.
    let (mut run, mut run_bytes, mut run_slices) = (0, 0, 0);
    // Completed tasks alike in (write, bytes, time taken) not recorded yet, and how many.
    let (mut alike, mut alike_tasks) = ((false, 0, 0), 0);
    for (task, t) in table.tasks.iter().enumerate() {
        while let Some(&(first, at)) = starts.get(next_start)
            && first <= task
        {
            started_ns = at;
            next_start += 1;
        }
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
        if first != run {
            tally.moved(run.wrapping_sub(1), run_bytes, run_slices);
            (run, run_bytes, run_slices) = (first, 0, 0);
        }
        run_bytes += bytes;
        run_slices += slices;
        let ended = word >> ENDED_SHIFT;
        if ended != 0 && state_of(word) == COMPLETED {
            let write = t.slices_total.load(Ordering::Relaxed) & WRITE_FLAG != 0;
            let took = (write, total_bytes, ended.saturating_sub(started_ns));
            // The tasks of one submit call mostly match in all three (their ends shared one
            // clock reading): recorded together.
            if took != alike {
                if alike_tasks > 0 {
                    tally.took(alike.0, alike.1, alike.2, alike_tasks);
                }
                (alike, alike_tasks) = (took, 0);
            }
            alike_tasks += 1;
        }
    }
    tally.moved(run.wrapping_sub(1), run_bytes, run_slices);
    if alike_tasks > 0 {
        tally.took(alike.0, alike.1, alike.2, alike_tasks);
    }
}

/// The transports a waiting thread may help ([`Transport::offers_help`]).
#[derive(Clone)]
pub(crate) struct Helpers(Arc<[Arc<dyn Transport>]>);

impl Helpers {
    /// Those of `transports` that offer help, if any do.
    pub(crate) fn of(transports: &[Arc<dyn Transport>]) -> Option<Self> {
        let helpers: Vec<_> = transports
            .iter()
            .filter(|t| t.offers_help())
            .cloned()
            .collect();
        (!helpers.is_empty()).then(|| Self(helpers.into()))
    }

    /// One piece of work from the first transport that has some.
    fn help(&self) -> bool {
        self.0.iter().any(|t| t.help())
    }
}

impl std::fmt::Debug for Helpers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|t| t.protocol()))
            .finish()
    }
}

#[derive(Debug)]
pub(crate) struct BatchInner {
    tasks: Arc<TaskTable>,
    /// Task slots reserved.
    reserved: AtomicUsize,
    submitted: AtomicUsize,
    unfinished: AtomicUsize,
    wake_lock: Mutex<()>,
    wake: Condvar,
    /// Waiters asleep on `wake` (or about to be): the last task wakes them only if there
    /// are any, so a waiter that spun to the end costs the finisher no system call.
    sleepers: AtomicUsize,
    freed: AtomicBool,
    /// Nanoseconds after `stats::epoch`; 0 = no deadline.
    deadline_ns: AtomicU64,
    /// How long `wait` polls before it sleeps: a transfer that ends within it is seen at
    /// once, without a condvar round trip.
    spin: Duration,
    /// The engine's counters, which read this batch's tasks while it lives and take their
    /// totals when it goes (none with metrics off).
    timer: Option<Arc<EngineCounters>>,
    /// Transports a waiter may help instead of spinning.
    helpers: Option<Helpers>,
    /// Hooks waiting for the batch to go idle; `has_hooks` lets finishers skip the lock
    /// when there are none (the common case).
    hooks: Mutex<Hooks>,
    has_hooks: AtomicBool,
    /// Tasks ended other than Completed whose slices have not all let go.
    ending: AtomicUsize,
    /// When the transports were last asked to cut off (`stats::clock_ns`).
    last_cut_ns: AtomicU64,
    /// The engine, whose transports cut off the slices of ended tasks.
    engine: Weak<EngineInner>,
}

impl BatchInner {
    #[cfg(test)]
    pub(crate) fn new(capacity: usize) -> Self {
        Self::timed(capacity, Duration::ZERO, None, None, Weak::new())
    }

    pub(crate) fn timed(
        capacity: usize,
        spin: Duration,
        timer: Option<Arc<EngineCounters>>,
        helpers: Option<Helpers>,
        engine: Weak<EngineInner>,
    ) -> Self {
        let tasks = Arc::new(TaskTable {
            tasks: (0..capacity).map(|_| TaskState::default()).collect(),
            first_start: AtomicU64::new(0),
            starts: Mutex::default(),
        });
        if let Some(timer) = &timer {
            timer.track_batch(tasks.clone());
        }
        Self {
            tasks,
            reserved: AtomicUsize::new(0),
            submitted: AtomicUsize::new(0),
            unfinished: AtomicUsize::new(0),
            wake_lock: Mutex::new(()),
            wake: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            freed: AtomicBool::new(false),
            deadline_ns: AtomicU64::new(0),
            spin,
            timer,
            helpers,
            hooks: Mutex::new(Hooks::default()),
            has_hooks: AtomicBool::new(false),
            ending: AtomicUsize::new(0),
            last_cut_ns: AtomicU64::new(0),
            engine,
        }
    }

    pub(crate) fn capacity(&self) -> usize {
        self.tasks.len()
    }

    /// Reserves `n` task slots; returns the first index.
    pub(crate) fn reserve(&self, n: usize) -> Result<usize, EngineError> {
        if self.freed.load(Ordering::Acquire) {
            return Err(EngineError::BatchFreed);
        }
        let capacity = self.capacity();
        let first = self
            .reserved
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (n <= capacity - used).then_some(used + n)
            })
            .map_err(|used| EngineError::TooManyRequests {
                capacity,
                room: capacity - used,
                requested: n,
            })?;
        if self.timer.is_some() {
            // The tasks' start, one record for the call: a task stores nothing for metrics.
            // The tasks start after this returns, so a reader that sees them started sees
            // the record too.
            let at = clock_ns();
            if first == 0 {
                self.tasks.first_start.store(at, Ordering::Release);
            } else {
                let mut starts = self.tasks.starts.lock().unwrap_or_else(|p| p.into_inner());
                // Calls racing each other record in task order all the same.
                let at_index = starts.partition_point(|&(task, _)| task < first);
                starts.insert(at_index, (first, at));
            }
        }
        self.unfinished.fetch_add(n, Ordering::SeqCst);
        Ok(first)
    }

    /// Marks reserved slots as visible to status readers, after their state is set.
    pub(crate) fn publish(&self, up_to: usize) {
        self.submitted.fetch_max(up_to, Ordering::Release);
    }

    /// Starts `task`: `slices` of `opcode`, going to transport `first` (an index into the
    /// engine's list) first — the words the task keeps anyway, so metrics store nothing here.
    pub(crate) fn start_task(&self, task: usize, slices: u32, opcode: Opcode, first: usize) {
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
    fn end(&self, task: usize, state: u8) -> bool {
        let t = &self.tasks[task];
        let mut current = t.state.load(Ordering::SeqCst);
        loop {
            if !matches!(state_of(current), PENDING | WAITING) {
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
        self.ending.fetch_add(1, Ordering::SeqCst);
        // A task ended before it started is settled by `start_task` (its slices exist but
        // are not counted yet) or by `fail_unstarted`.
        if state_of(current) == PENDING {
            self.settle_if_released(task);
        }
        true
    }

    /// Settles `task` if it has ended other than Completed and every slice has let go.
    fn settle_if_released(&self, task: usize) {
        if self.tasks[task].released() {
            self.settle(task);
        }
    }

    /// The last slice of `task` let go: completes it if nothing ended it before, else shows
    /// the state it ended in.
    fn last_released(&self, task: usize, ended_ns: u64) {
        let t = &self.tasks[task];
        let current = t.state.load(Ordering::SeqCst);
        if matches!(state_of(current), PENDING | WAITING) {
            let next = u64::from(COMPLETED)
                | SETTLED
                | (current & FIRST_MASK)
                | (ended_ns & (u64::MAX >> ENDED_SHIFT)) << ENDED_SHIFT;
            if t.state
                .compare_exchange(current, next, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                self.finished();
                return;
            }
        }
        self.settle(task);
    }

    /// Marks an ended task settled, once (whoever sees it both ended and released first).
    fn settle(&self, task: usize) {
        let t = &self.tasks[task];
        let mut current = t.state.load(Ordering::SeqCst);
        loop {
            if matches!(state_of(current), PENDING | WAITING) || current & SETTLED != 0 {
                return;
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
        self.ending.fetch_sub(1, Ordering::SeqCst);
        self.finished();
    }

    /// One task more has finished (and shows so).
    fn finished(&self) {
        let idle = self.unfinished.fetch_sub(1, Ordering::SeqCst) == 1;
        // Waiters wait for the whole batch (and wake at its deadline on their own): only the
        // last task wakes them, under the lock they check the count under, so no wake-up is
        // lost. A waiter counts itself in `sleepers` before it checks the count (both
        // SeqCst): either this load sees it, or its check sees this decrement and it does
        // not sleep.
        if idle && self.sleepers.load(Ordering::SeqCst) > 0 {
            let _guard = self.wake_lock.lock().unwrap_or_else(|p| p.into_inner());
            self.wake.notify_all();
        }
        if idle && self.has_hooks.load(Ordering::SeqCst) {
            self.run_hooks();
        }
    }

    /// Runs `hook` once no task is unfinished: now, if none is, else from the thread that
    /// finishes the last one.
    pub(crate) fn on_complete(&self, hook: CompletionHook) {
        let mut hooks = self.hooks.lock().unwrap_or_else(|p| p.into_inner());
        // The flag goes up before the count is read, and a finisher reads the flag after its
        // decrement (all SeqCst): either this read sees the last decrement, or that finisher
        // sees the flag and takes the hooks lock, after this hook is in the list.
        self.has_hooks.store(true, Ordering::SeqCst);
        if self.unfinished.load(Ordering::SeqCst) == 0 {
            if hooks.0.is_empty() {
                self.has_hooks.store(false, Ordering::SeqCst);
            }
            drop(hooks);
            hook();
            return;
        }
        hooks.0.push(hook);
    }

    fn run_hooks(&self) {
        let ready = {
            let mut hooks = self.hooks.lock().unwrap_or_else(|p| p.into_inner());
            if self.unfinished.load(Ordering::SeqCst) != 0 {
                // A submit reserved more tasks since: the hooks wait for those too.
                return;
            }
            self.has_hooks.store(false, Ordering::SeqCst);
            std::mem::take(&mut hooks.0)
        };
        for hook in ready {
            hook();
        }
    }

    /// Fails `task` for a slice of it that failed (and lets go after this).
    pub(crate) fn fail_task(&self, task: usize, error: TransferError) {
        let _ = self.tasks[task].error.set(Box::new(error));
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
    pub(crate) fn slice_progress(&self, task: usize, bytes: u64) -> bool {
        let t = &self.tasks[task];
        let before = t
            .progress
            .fetch_add((1 << PROGRESS_SHIFT) | bytes, Ordering::SeqCst);
        let done = (before >> PROGRESS_SHIFT) + 1;
        done == u64::from(t.slices_total.load(Ordering::SeqCst) & !WRITE_FLAG)
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
    pub(crate) fn complete_task(&self, task: usize) {
        let ended = if self.timer.is_some() {
            completion_ns().max(1)
        } else {
            0
        };
        self.last_released(task, ended);
    }

    /// Whether a slice of `task` should still run: the task is pending. (A task past its
    /// deadline is timed out by the next status read or wait — a waiter wakes at the
    /// deadline — so no clock is read per slice.)
    pub(crate) fn task_live(&self, task: usize) -> bool {
        state_of(self.tasks[task].state.load(Ordering::Acquire)) == PENDING
    }

    /// As [`task_live`](Self::task_live), timing the batch out first if its deadline has
    /// passed: one clock reading, for checks between long pieces of one slice.
    pub(crate) fn task_live_by_clock(&self, task: usize) -> bool {
        if self.past_deadline() {
            self.enforce_deadline();
        }
        self.task_live(task)
    }

    fn past_deadline(&self) -> bool {
        let deadline = self.deadline_ns.load(Ordering::Relaxed);
        deadline != 0 && clock_ns() >= deadline
    }

    pub(crate) fn set_deadline(&self, at: Option<Instant>) {
        let ns = at.map_or(0, |at| {
            (at.saturating_duration_since(epoch()).as_nanos() as u64).max(1)
        });
        self.deadline_ns.store(ns, Ordering::Relaxed);
    }

    pub(crate) fn set_deadline_if_unset(&self, at: Instant) {
        let ns = (at.saturating_duration_since(epoch()).as_nanos() as u64).max(1);
        let _ = self
            .deadline_ns
            .compare_exchange(0, ns, Ordering::Relaxed, Ordering::Relaxed);
    }

    fn deadline(&self) -> Option<Instant> {
        match self.deadline_ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(epoch() + Duration::from_nanos(ns)),
        }
    }

    /// Times out every unfinished task once the deadline has passed, and asks the
    /// transports to cut off the slices of ended tasks still out.
    fn enforce_deadline(&self) {
        if self.unfinished.load(Ordering::Acquire) > 0 && self.past_deadline() {
            for task in 0..self.submitted.load(Ordering::Acquire) {
                self.end(task, TIMEOUT);
            }
        }
        self.cut_off_ended();
    }

    /// Asks every transport to cut off the slices of ended tasks, if this batch has tasks
    /// waiting for theirs (at most every [`CUT_AGAIN`]).
    fn cut_off_ended(&self) {
        if self.ending.load(Ordering::SeqCst) == 0 {
            return;
        }
        let now = clock_ns();
        let last = self.last_cut_ns.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < CUT_AGAIN.as_nanos() as u64 {
            return;
        }
        if self
            .last_cut_ns
            .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        if let Some(engine) = self.engine.upgrade() {
            for transport in &engine.transports {
                transport.cut_off();
            }
        }
    }

    /// Cancels every unfinished task, then waits up to [`DRAIN`] for their slices to let go.
    pub(crate) fn cancel(&self) -> usize {
        let canceled = (0..self.submitted.load(Ordering::Acquire))
            .filter(|&task| self.end(task, CANCELED))
            .count();
        if canceled > 0 {
            self.drain(Instant::now() + DRAIN);
        }
        canceled
    }

    /// Waits until no ended task has slices out, or `until`, cutting them off meanwhile.
    fn drain(&self, until: Instant) {
        let mut nap = Duration::from_micros(20);
        while self.ending.load(Ordering::SeqCst) > 0 && Instant::now() < until {
            self.cut_off_ended();
            if self.help() {
                continue;
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(1));
        }
    }

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
                t.error
                    .get()
                    .map(|error| TransferError::clone(error))
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

    /// Sleeps until no task is in flight, `timeout` passes, or the deadline passes; tasks
    /// that ended meanwhile with slices still out are waited for up to [`DRAIN`] more.
    pub(crate) fn wait(&self, timeout: Duration) -> BatchStatus {
        if self.unfinished.load(Ordering::Acquire) == 0 && self.ending.load(Ordering::SeqCst) == 0 {
            // Over already: what the loops below come to, without reading the clock.
            return self.status();
        }
        let started = Instant::now();
        let mut until = started + timeout;
        let mut draining = false;
        let spin_until = started + self.spin.min(timeout);
        loop {
            let unfinished = self.unfinished.load(Ordering::Acquire);
            if unfinished == 0 {
                break;
            }
            let now = Instant::now();
            if self.past_deadline() {
                // The loop below times the tasks out and waits for their slices.
                break;
            }
            // Work a transport lets a waiter do is better than spinning, and is not bounded
            // by the spin budget (only by the timeout): it moves this batch's bytes or
            // someone else's.
            if now < until && self.help() {
                continue;
            }
            if now >= spin_until {
                break;
            }
            // With one task left the end is near: watch memory for it. With more, the work
            // still to do is likely done by threads on this machine's cores (a TCP lane, a
            // copy hand, the kernel): give them the core at each look instead of taking it
            // from them. A spinning waiter cost TCP 64 KiB reads 10 % on 2 cores; yielding,
            // it costs nothing measurable, and a lone task's latency is as before.
            if unfinished == 1 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        loop {
            // Outside the wake lock: timing tasks out finishes them, which takes that lock.
            self.enforce_deadline();
            let now = Instant::now();
            if !draining && self.ending.load(Ordering::SeqCst) > 0 {
                // Tasks ended with slices out: the caller learns of their end once those
                // let go (cut off meanwhile), within the drain time.
                draining = true;
                until = until.max(now + DRAIN);
            }
            if now >= until {
                break;
            }
            if self.unfinished.load(Ordering::Acquire) > 0 && self.help() {
                continue;
            }
            let guard = self.wake_lock.lock().unwrap_or_else(|p| p.into_inner());
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            if self.unfinished.load(Ordering::SeqCst) == 0 {
                self.sleepers.fetch_sub(1, Ordering::SeqCst);
                break;
            }
            let mut wake_at = self.deadline().map_or(until, |d| d.min(until));
            if self.ending.load(Ordering::SeqCst) > 0 {
                // Cut off again now and then: a transport may only see the slices it has.
                wake_at = wake_at.min(now + CUT_AGAIN);
            }
            let nap = wake_at
                .saturating_duration_since(now)
                .max(Duration::from_micros(100));
            let guard = self
                .wake
                .wait_timeout(guard, nap)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
            drop(guard);
        }
        self.status()
    }

    /// One piece of a transport's work done on this thread, if a transport offered some.
    fn help(&self) -> bool {
        self.helpers.as_ref().is_some_and(Helpers::help)
    }

    pub(crate) fn mark_freed(&self) -> Result<(), EngineError> {
        let pending = self.unfinished();
        if pending > 0 {
            return Err(EngineError::BatchBusy { pending });
        }
        if self.freed.swap(true, Ordering::AcqRel) {
            return Err(EngineError::BatchFreed);
        }
        Ok(())
    }
}

/// A batch of transfers: allocate with [`crate::TransferEngine::allocate_batch`], submit into
/// it, then poll or wait. Cloning gives another handle to the same batch.
#[derive(Debug, Clone)]
pub struct Batch {
    pub(crate) inner: Arc<BatchInner>,
}

impl Batch {
    /// How many requests the batch takes in all.
    pub fn capacity(&self) -> usize {
        self.inner.capacity()
    }

    /// The status of task `task` (in submission order), or `None` if not submitted.
    pub fn task_status(&self, task: usize) -> Option<TaskStatus> {
        self.inner.task_status(task)
    }

    /// The aggregate status; reading it takes no lock.
    pub fn status(&self) -> BatchStatus {
        self.inner.status()
    }

    /// Sleeps (no busy polling) until every submitted task has finished, the batch's
    /// deadline has passed (tasks then end as `Timeout`), or `timeout` elapses. A task that
    /// ends other than Completed is shown so only once no slice of it touches local memory
    /// and its pins are released: tasks that ended during the wait with slices still on the
    /// wire are cut off and waited for up to [`DRAIN`] more, and still show `Pending` if
    /// their slices are out after that.
    pub fn wait(&self, timeout: Duration) -> BatchStatus {
        self.inner.wait(timeout)
    }

    /// Cancels every unfinished task; returns how many were canceled. Slices not started
    /// are skipped; the transports cut off those on the wire (a TCP lane drops its
    /// connection, a copy stops before its next piece), and this returns once every slice of
    /// the canceled tasks has let go, or after [`DRAIN`] at most: a canceled task shows
    /// `Canceled` only from then on (`Pending` before), its memory no longer touched and
    /// unpinned. [`TaskStatus::remote_may_change`](crate::TaskStatus) says whether a write's
    /// bytes may still land at the peer.
    pub fn cancel(&self) -> usize {
        self.inner.cancel()
    }

    /// Sets (or clears) the deadline after which unfinished tasks end as `Timeout`.
    pub fn set_deadline(&self, at: Option<Instant>) {
        self.inner.set_deadline(at);
    }

    /// Calls `hook` once, when no submitted task is unfinished: at once if none is, else on
    /// the thread that finishes the last one (a transport's worker, or a thread whose status
    /// read or wait times the batch out at its deadline). For completion notices to an event
    /// loop: the hook must be quick and must not block (write a byte to a pipe, say). A
    /// deadline only fires when someone reads the status or waits, so a caller that relies
    /// on the hook alone reads the status once the deadline has passed.
    pub fn on_complete(&self, hook: impl FnOnce() + Send + 'static) {
        self.inner.on_complete(Box::new(hook));
    }
}

impl Drop for BatchInner {
    fn drop(&mut self) {
        // Every slice has reported (each held the batch): the tasks are as they end.
        if let Some(timer) = &self.timer {
            timer.add_batch_totals(&self.tasks);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One slice's report, as `Slice` makes it, without a request behind it.
    struct SliceCompletion {
        batch: Arc<BatchInner>,
        task: usize,
        reported: bool,
    }

    impl SliceCompletion {
        fn new(batch: Arc<BatchInner>, task: usize) -> Self {
            Self {
                batch,
                task,
                reported: false,
            }
        }

        fn live(&self) -> bool {
            self.batch.task_live(self.task)
        }

        fn succeed(mut self, bytes: u64) {
            self.reported = true;
            if self.batch.slice_progress(self.task, bytes) {
                self.batch.complete_task(self.task);
            }
        }

        fn fail(mut self, error: TransferError) {
            self.reported = true;
            self.batch.fail_task(self.task, error);
            self.let_go();
        }

        fn abandon(mut self) {
            self.reported = true;
            self.let_go();
        }

        fn let_go(&self) {
            if self.batch.slice_progress(self.task, 0) {
                self.batch.complete_task(self.task);
            }
        }
    }

    impl Drop for SliceCompletion {
        fn drop(&mut self) {
            if !self.reported {
                self.batch.fail_task(
                    self.task,
                    TransferError::Dropped("slice released without a result".into()),
                );
                self.let_go();
            }
        }
    }

    #[test]
    fn a_task_completes_when_its_last_slice_does() {
        let batch = Arc::new(BatchInner::new(2));
        let first = batch.reserve(2).unwrap();
        batch.start_task(first, 2, Opcode::Read, 0);
        batch.start_task(first + 1, 1, Opcode::Read, 0);
        batch.publish(2);
        let a = SliceCompletion::new(batch.clone(), 0);
        let b = SliceCompletion::new(batch.clone(), 0);
        let c = SliceCompletion::new(batch.clone(), 1);
        a.succeed(10);
        assert_eq!(
            batch.task_status(0).unwrap().status,
            TransferStatus::Pending
        );
        b.succeed(5);
        let done = batch.task_status(0).unwrap();
        assert_eq!(
            (done.status, done.transferred_bytes),
            (TransferStatus::Completed, 15)
        );
        assert_eq!(batch.status().state, BatchState::Pending);
        drop(c);
        assert!(matches!(
            batch.task_status(1).unwrap().status,
            TransferStatus::Failed(TransferError::Dropped(_))
        ));
        assert_eq!(batch.status().state, BatchState::Failed);
        assert!(batch.task_status(2).is_none());
    }

    #[test]
    fn capacity_is_enforced_without_partial_reservation() {
        let batch = BatchInner::new(3);
        batch.reserve(2).unwrap();
        assert!(matches!(
            batch.reserve(2),
            Err(EngineError::TooManyRequests {
                capacity: 3,
                room: 1,
                requested: 2
            })
        ));
        assert_eq!(batch.reserve(1).unwrap(), 2);
    }

    #[test]
    fn free_is_refused_while_busy_and_cancel_finishes_tasks() {
        let batch = Arc::new(BatchInner::new(1));
        batch.reserve(1).unwrap();
        batch.start_task(0, 1, Opcode::Read, 0);
        batch.publish(1);
        let late = SliceCompletion::new(batch.clone(), 0);
        assert!(matches!(
            batch.mark_freed(),
            Err(EngineError::BatchBusy { pending: 1 })
        ));
        // The slice stays out past the drain time: cancel gives up waiting, and the task
        // still shows pending (its memory is not free), the batch busy.
        assert_eq!(batch.cancel(), 1);
        assert!(!late.live());
        assert_eq!(
            batch.task_status(0).unwrap().status,
            TransferStatus::Pending
        );
        assert!(batch.mark_freed().is_err());
        late.succeed(100);
        assert_eq!(
            batch.task_status(0).unwrap().status,
            TransferStatus::Canceled
        );
        batch.mark_freed().unwrap();
        assert!(matches!(batch.reserve(1), Err(EngineError::BatchFreed)));
    }

    #[test]
    fn deadlines_time_tasks_out_and_wake_waiters() {
        let batch = Arc::new(BatchInner::new(1));
        batch.reserve(1).unwrap();
        batch.start_task(0, 0, Opcode::Read, 0);
        batch.publish(1);
        batch.set_deadline(Some(Instant::now() + Duration::from_millis(30)));
        let status = batch.wait(Duration::from_secs(30));
        assert_eq!(status.state, BatchState::Failed);
        assert_eq!(
            batch.task_status(0).unwrap().status,
            TransferStatus::Timeout
        );
    }

    #[test]
    fn a_timed_out_task_shows_its_end_only_once_its_slices_let_go() {
        let batch = Arc::new(BatchInner::new(1));
        batch.reserve(1).unwrap();
        batch.start_task(0, 2, Opcode::Write, 0);
        batch.publish(1);
        let (done, out) = (
            SliceCompletion::new(batch.clone(), 0),
            SliceCompletion::new(batch.clone(), 0),
        );
        done.succeed(7);
        batch.set_deadline(Some(Instant::now()));
        // Ended, not settled: shown pending, the batch busy.
        let status = batch.task_status(0).unwrap();
        assert_eq!(status.status, TransferStatus::Pending);
        assert!(!out.live());
        assert_eq!(batch.status().state, BatchState::Pending);
        assert!(matches!(
            batch.mark_freed(),
            Err(EngineError::BatchBusy { pending: 1 })
        ));
        // The waiter returns once the last slice lets go, with the task timed out.
        let slice = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            out.fail(TransferError::Dropped("cut".into()));
        });
        let status = batch.wait(Duration::from_millis(1));
        slice.join().unwrap();
        assert_eq!(status.state, BatchState::Failed);
        let task = batch.task_status(0).unwrap();
        assert_eq!(
            (task.status, task.transferred_bytes, task.remote_may_change),
            (TransferStatus::Timeout, 7, false)
        );
        batch.mark_freed().unwrap();
    }

    #[test]
    fn cancel_returns_once_the_slices_of_the_canceled_tasks_let_go() {
        let batch = Arc::new(BatchInner::new(2));
        batch.reserve(2).unwrap();
        batch.start_task(0, 1, Opcode::Read, 0);
        batch.start_task(1, 1, Opcode::Read, 0);
        batch.publish(2);
        let (a, b) = (
            SliceCompletion::new(batch.clone(), 0),
            SliceCompletion::new(batch.clone(), 1),
        );
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            a.abandon();
            b.succeed(3);
        });
        assert_eq!(batch.cancel(), 2);
        // Both let go before cancel returned: both show canceled, the batch is idle.
        assert_eq!(
            batch.task_status(0).unwrap().status,
            TransferStatus::Canceled
        );
        assert_eq!(
            batch.task_status(1).unwrap().status,
            TransferStatus::Canceled
        );
        assert_eq!(batch.unfinished(), 0);
        late.join().unwrap();
    }

    #[test]
    fn a_task_canceled_before_it_started_settles_when_its_slices_let_go() {
        let batch = Arc::new(BatchInner::new(2));
        batch.reserve(2).unwrap();
        // Another submit published past this task before it started.
        batch.publish(2);
        let slice = SliceCompletion::new(batch.clone(), 0);
        batch.start_task(1, 0, Opcode::Read, 0);
        assert_eq!(batch.submitted.load(Ordering::Acquire), 2);
        let canceler = {
            let batch = batch.clone();
            std::thread::spawn(move || batch.cancel())
        };
        while batch.ending.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        batch.start_task(0, 1, Opcode::Read, 0);
        assert_eq!(
            batch.task_status(0).unwrap().status,
            TransferStatus::Pending
        );
        assert!(!slice.live());
        slice.abandon();
        canceler.join().unwrap();
        assert_eq!(
            batch.task_status(0).unwrap().status,
            TransferStatus::Canceled
        );
        assert_eq!(batch.unfinished(), 0);
    }

    #[test]
    fn completion_hooks_run_once_when_the_last_task_finishes() {
        use std::sync::atomic::AtomicUsize;
        let batch = Arc::new(BatchInner::new(2));
        batch.reserve(2).unwrap();
        batch.start_task(0, 1, Opcode::Read, 0);
        batch.start_task(1, 1, Opcode::Read, 0);
        batch.publish(2);
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = calls.clone();
        batch.on_complete(Box::new(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        let first = SliceCompletion::new(batch.clone(), 0);
        let last = SliceCompletion::new(batch.clone(), 1);
        first.succeed(1);
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        std::thread::spawn(move || last.fail(TransferError::ZeroLength))
            .join()
            .unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // Registered on an idle batch: runs at once, on the caller's thread.
        let counter = calls.clone();
        batch.on_complete(Box::new(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn completion_hooks_run_when_the_deadline_times_tasks_out() {
        let batch = Arc::new(BatchInner::new(1));
        batch.reserve(1).unwrap();
        batch.start_task(0, 0, Opcode::Read, 0);
        batch.publish(1);
        let (tx, rx) = std::sync::mpsc::channel();
        batch.on_complete(Box::new(move || tx.send(()).unwrap()));
        batch.set_deadline(Some(Instant::now() + Duration::from_millis(10)));
        assert!(rx.try_recv().is_err());
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(batch.status().state, BatchState::Failed);
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
    }

    #[test]
    fn waiters_wake_when_another_thread_completes() {
        let batch = Arc::new(BatchInner::new(1));
        batch.reserve(1).unwrap();
        batch.start_task(0, 1, Opcode::Read, 0);
        batch.publish(1);
        let slice = SliceCompletion::new(batch.clone(), 0);
        let worker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            slice.succeed(1);
        });
        let status = batch.wait(Duration::from_secs(30));
        worker.join().unwrap();
        assert_eq!(status.state, BatchState::Completed);
    }
}
