//! Waiting for a batch: spinning briefly, helping a transport that offers work, then sleeping
//! until the last task wakes the waiters.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::deadline::CUT_AGAIN;
use super::lifecycle::BatchInner;
use super::sync::Ordering;
use crate::transport::Transport;
use crate::types::BatchStatus;

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

impl BatchInner {
    /// Sleeps until no task is in flight or `timeout` passes, whichever comes first; a
    /// deadline passing meanwhile times the tasks out, and their slices are asked to be cut
    /// off (the tasks show their end once those let go — within this wait if they do).
    pub(crate) fn wait(&self, timeout: Duration) -> BatchStatus {
        if self.counts.unfinished() == 0 {
            // Over already: what the loops below come to, without reading the clock.
            return self.status();
        }
        let started = Instant::now();
        let until = started.checked_add(timeout).unwrap_or_else(far_future);
        let spin_until = started + self.spin.min(timeout);
        loop {
            let unfinished = self.counts.unfinished();
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
            // from them (measured in the README, "A waiter that gives way").
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
            if now >= until {
                break;
            }
            if self.counts.unfinished() > 0 && self.help() {
                continue;
            }
            let mut guard = self.wake_lock.lock();
            self.sleepers.fetch_add(1, Ordering::SeqCst);
            if self.counts.unfinished() == 0 {
                self.sleepers.fetch_sub(1, Ordering::SeqCst);
                break;
            }
            let mut wake_at = self.deadline().map_or(until, |d| d.min(until));
            if self.ending.load(Ordering::SeqCst) > 0 {
                // Cut off again now and then: a transport may only see the slices it has.
                wake_at = wake_at.min(now + CUT_AGAIN);
            }
            // Never past `until`: a wait keeps its timeout.
            let nap = wake_at
                .saturating_duration_since(now)
                .max(Duration::from_micros(100))
                .min(until.saturating_duration_since(now));
            self.wake.wait_for(&mut guard, nap);
            self.sleepers.fetch_sub(1, Ordering::SeqCst);
            drop(guard);
        }
        self.status()
    }

    /// One piece of a transport's work done on this thread, if a transport offered some.
    pub(super) fn help(&self) -> bool {
        self.helpers.as_ref().is_some_and(Helpers::help)
    }
}

/// An instant no wait reaches: what a timeout too long for the clock waits until.
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(u64::from(u32::MAX))
}
