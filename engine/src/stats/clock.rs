//! The clock tasks are timed by and batches keep their deadlines by: one epoch per process,
//! nanoseconds since it, and this thread's way of timing the tasks it ends (one reading each,
//! or one for all the reports inside a [`ReportTogether`]).

use std::cell::Cell;
use std::sync::OnceLock;
use std::time::Instant;

/// How this thread times the tasks it ends: each by a clock reading of its own, or (inside
/// a [`ReportTogether`]) all by one reading, taken when the first of them ends.
#[derive(Debug, Clone, Copy)]
enum CompletionClock {
    Each,
    /// Nanoseconds since [`clock_ns`]'s epoch, once read.
    Shared(Option<u64>),
}

thread_local! {
    static COMPLETION_CLOCK: Cell<CompletionClock> = const { Cell::new(CompletionClock::Each) };
}

/// While it lives, the slices this thread reports (and the tasks they end) are timed by one
/// clock reading instead of one each: for a transport that learns of many ends at once — one
/// poll of a completion queue, one read of status frames — so that timing costs a clock
/// reading per poll, not per slice. The reading is taken when the first task ends. Hold it
/// only while reporting what has already ended (drop it before moving more bytes, or the
/// times come out early). One begun while another lives shares the outer one's reading.
#[derive(Debug)]
#[must_use = "reports are timed together only while it lives"]
pub struct ReportTogether {
    outer: Option<CompletionClock>,
    /// Thread-bound: it restores this thread's clock.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl ReportTogether {
    /// Starts timing this thread's reports together.
    pub fn begin() -> Self {
        let outer = match COMPLETION_CLOCK.get() {
            CompletionClock::Shared(_) => None,
            outer @ CompletionClock::Each => {
                COMPLETION_CLOCK.set(CompletionClock::Shared(None));
                Some(outer)
            }
        };
        Self {
            outer,
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for ReportTogether {
    fn drop(&mut self) {
        if let Some(outer) = self.outer {
            COMPLETION_CLOCK.set(outer);
        }
    }
}

/// The fixed instant of this process that tasks are timed and batches' deadlines kept from.
pub(crate) fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Nanoseconds since [`epoch`].
pub(crate) fn clock_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

/// When a task this thread ends now ended, by [`clock_ns`] (see [`ReportTogether`]).
pub(crate) fn completion_ns() -> u64 {
    match COMPLETION_CLOCK.get() {
        CompletionClock::Each => clock_ns(),
        CompletionClock::Shared(Some(at)) => at,
        CompletionClock::Shared(None) => {
            let at = clock_ns();
            COMPLETION_CLOCK.set(CompletionClock::Shared(Some(at)));
            at
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn pause() {
        std::thread::sleep(Duration::from_millis(2));
    }

    #[test]
    fn reports_together_share_one_reading_and_only_while_it_lives() {
        let alone = completion_ns();
        pause();
        assert!(
            completion_ns() > alone,
            "without a guard each end reads the clock"
        );
        let outer = ReportTogether::begin();
        pause();
        let first = completion_ns();
        assert!(
            first > alone,
            "the reading is taken at the first end, not before"
        );
        pause();
        assert_eq!(completion_ns(), first);
        {
            let _inner = ReportTogether::begin();
            pause();
            assert_eq!(
                completion_ns(),
                first,
                "a nested guard shares the outer reading"
            );
        }
        assert_eq!(
            completion_ns(),
            first,
            "the inner guard leaves the outer one standing"
        );
        drop(outer);
        pause();
        assert!(completion_ns() > first);
    }
}
