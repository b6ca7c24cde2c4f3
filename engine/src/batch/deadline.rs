//! Ending a batch's tasks early: its deadline, cancel, and cutting off the slices of ended
//! tasks that are still out until they let go (at most [`DRAIN`]).

use std::time::{Duration, Instant};

use super::lifecycle::BatchInner;
use super::sync::Ordering;
use super::task::{CANCELED, TIMEOUT};
use crate::stats::{clock_ns, epoch};

/// How long a task that ended other than Completed may take for its slices still in flight
/// to let go, once the transports were asked to cut them off: a wait (or cancel) that ended
/// tasks waits this long at most for them, and a task whose slices are still out after it
/// stays Pending.
pub const DRAIN: Duration = Duration::from_secs(2);
/// How often a waiter asks the transports again to cut off the slices of ended tasks.
pub(super) const CUT_AGAIN: Duration = Duration::from_millis(20);

impl BatchInner {
    /// As [`task_live`](Self::task_live), timing the batch out first if its deadline has
    /// passed: one clock reading, for checks between long pieces of one slice.
    pub(crate) fn task_live_by_clock(&self, task: usize) -> bool {
        if self.past_deadline() {
            self.enforce_deadline();
        }
        self.task_live(task)
    }

    pub(super) fn past_deadline(&self) -> bool {
        let deadline = self.deadline_ns.load(Ordering::Relaxed);
        deadline != 0 && clock_ns() >= deadline
    }

    pub(crate) fn set_deadline(&self, at: Option<Instant>) {
        let ns = at.map_or(0, |at| {
            (at.saturating_duration_since(epoch()).as_nanos() as u64).max(1)
        });
        self.deadline_ns.store(ns, Ordering::Relaxed);
    }

    /// Gives the batch a deadline at `ns` (`stats::clock_ns`) unless it has one.
    pub(super) fn set_deadline_ns_if_unset(&self, ns: u64) {
        let ns = ns.max(1);
        let _ = self
            .deadline_ns
            .compare_exchange(0, ns, Ordering::Relaxed, Ordering::Relaxed);
    }

    pub(super) fn deadline(&self) -> Option<Instant> {
        match self.deadline_ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(epoch() + Duration::from_nanos(ns)),
        }
    }

    /// Times out every unfinished task once the deadline has passed, and asks the
    /// transports to cut off the slices of ended tasks still out.
    #[inline]
    pub(super) fn enforce_deadline(&self) {
        if self.counts.unfinished() > 0 && self.past_deadline() {
            for task in 0..self.submitted.load(Ordering::Acquire) {
                self.end(task, TIMEOUT);
            }
        }
        self.cut_off_ended();
    }

    /// Asks every transport to cut off the slices of ended tasks, if this batch has tasks
    /// waiting for theirs (at most every [`CUT_AGAIN`]).
    #[inline]
    fn cut_off_ended(&self) {
        if self.ending.load(Ordering::SeqCst) != 0 {
            self.cut_off_ended_now();
        }
    }

    /// The rest of [`cut_off_ended`](Self::cut_off_ended), once tasks have ended with slices
    /// out: apart, so that the check above costs a status read only a load.
    #[cold]
    fn cut_off_ended_now(&self) {
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
}
