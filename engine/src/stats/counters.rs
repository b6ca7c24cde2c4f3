//! The counters transports add to on their data paths: [`LocalCounter`] (one writer),
//! [`MovedCounter`] (bytes and slices in one word, one writer) and [`SharedMovedCounter`]
//! (the same word, any number of writers). None takes an atomic read-modify-write where
//! one writer is enough; a moved-count word that would overflow moves into wide counters
//! under a seqlock ([`super::seqlock`]).

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::seqlock::Spilled;

/// A counter one thread adds to and any thread reads: adding is a relaxed load and store,
/// no atomic read-modify-write. If two threads add at once a count may be lost, never more;
/// so each writer keeps counters of its own (a worker's, a lane's) and readers sum them.
#[derive(Debug, Default)]
pub struct LocalCounter(AtomicU64);

impl LocalCounter {
    /// Adds `n` (from the counter's one writer).
    pub fn add(&self, n: u64) {
        self.0.store(
            self.0.load(Ordering::Relaxed).wrapping_add(n),
            Ordering::Relaxed,
        );
    }

    /// The count so far.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Bytes and slices moved, in one word that one thread adds to and any thread reads: adding
/// is one relaxed load and store (bytes in the low 40 bits, slices above), so a transport's
/// per-peer count costs a slice no more than that. Before a field would overflow (past a
/// TiB, or 16 M slices) the writer moves the word into wide counters, under a sequence
/// number that readers check (a seqlock). For a count that several threads add to, see
/// [`SharedMovedCounter`].
#[derive(Debug, Default)]
pub struct MovedCounter {
    word: AtomicU64,
    spilled: Spilled,
}

/// Bits of a moved-count word that count bytes.
pub(super) const MOVED_BYTES_BITS: u32 = 40;
pub(super) const MOVED_BYTES_MAX: u64 = (1 << MOVED_BYTES_BITS) - 1;
const MOVED_SLICES_MAX: u64 = u64::MAX >> MOVED_BYTES_BITS;

impl MovedCounter {
    /// Adds `slices` that moved `bytes` in all (from the counter's one writer).
    pub fn add(&self, bytes: u64, slices: u64) {
        let word = self.word.load(Ordering::Relaxed);
        let (sum_bytes, sum_slices) = (
            (word & MOVED_BYTES_MAX).saturating_add(bytes),
            (word >> MOVED_BYTES_BITS).saturating_add(slices),
        );
        if sum_bytes <= MOVED_BYTES_MAX && sum_slices <= MOVED_SLICES_MAX {
            self.word.store(
                sum_slices << MOVED_BYTES_BITS | sum_bytes,
                Ordering::Relaxed,
            );
        } else {
            let take = || {
                self.word.store(0, Ordering::Relaxed);
                word
            };
            self.spilled.spill(take, bytes, slices);
        }
    }

    /// `(bytes, slices)` so far.
    pub fn get(&self) -> (u64, u64) {
        self.spilled.read(&self.word)
    }
}

/// A [`MovedCounter`] that any number of threads add to: adding is one relaxed
/// `fetch_add` on the word. Adds of 4 GiB or 64 Ki slices and more go to the wide
/// counters directly; a writer whose add takes a field past half its range moves the word
/// there, one writer at a time — so a field overflows only if more than 128 threads add
/// at once before one of them does.
#[derive(Debug, Default)]
pub struct SharedMovedCounter {
    word: AtomicU64,
    spilled: Spilled,
    spilling: Mutex<()>,
}

impl SharedMovedCounter {
    /// Adds `slices` that moved `bytes` in all.
    pub fn add(&self, bytes: u64, slices: u64) {
        if bytes >= 1 << 32 || slices >= 1 << 16 {
            let _one = self.spilling.lock();
            return self.spilled.spill(|| 0, bytes, slices);
        }
        let before = self
            .word
            .fetch_add(slices << MOVED_BYTES_BITS | bytes, Ordering::Relaxed);
        if (before & MOVED_BYTES_MAX) + bytes > MOVED_BYTES_MAX / 2
            || (before >> MOVED_BYTES_BITS) + slices > MOVED_SLICES_MAX / 2
        {
            let _one = self.spilling.lock();
            // Another writer may have moved it meanwhile: this moves what is there now.
            self.spilled
                .spill(|| self.word.swap(0, Ordering::Relaxed), 0, 0);
        }
    }

    /// `(bytes, slices)` so far.
    pub fn get(&self) -> (u64, u64) {
        self.spilled.read(&self.word)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_moved_counter_keeps_counting_past_its_word() {
        let counter = MovedCounter::default();
        counter.add(10, 1);
        counter.add(MOVED_BYTES_MAX - 20, 2);
        assert_eq!(counter.get(), (MOVED_BYTES_MAX - 10, 3));
        // Past the bytes field: into the wide counters, nothing lost.
        counter.add(100, 1);
        assert_eq!(counter.get(), (MOVED_BYTES_MAX + 90, 4));
        assert_eq!(
            counter.word.load(Ordering::Relaxed),
            0,
            "moved out of the word"
        );
        counter.add(5, 1);
        assert_eq!(counter.get(), (MOVED_BYTES_MAX + 95, 5));
        // Past the slices field.
        counter.add(0, MOVED_SLICES_MAX);
        assert_eq!(counter.get(), (MOVED_BYTES_MAX + 95, MOVED_SLICES_MAX + 5));
        // A reader beside a writer that spills often sees only counts that grow.
        let counter = std::sync::Arc::new(MovedCounter::default());
        let writer = {
            let counter = counter.clone();
            std::thread::spawn(move || {
                for _ in 0..200_000 {
                    counter.add(MOVED_BYTES_MAX / 3, 1);
                }
            })
        };
        let mut last = (0, 0);
        while !writer.is_finished() {
            let now = counter.get();
            assert!(now.0 >= last.0 && now.1 >= last.1, "{last:?} then {now:?}");
            assert_eq!(
                now.0,
                now.1 * (MOVED_BYTES_MAX / 3),
                "bytes and slices agree"
            );
            last = now;
            // A reader that never enters the kernel can keep the writer from running where
            // threads take turns on one lock (under valgrind): it gives way between reads.
            std::thread::yield_now();
        }
        writer.join().unwrap();
        assert_eq!(counter.get(), (200_000 * (MOVED_BYTES_MAX / 3), 200_000));
    }

    #[test]
    fn a_shared_moved_counter_loses_nothing_to_writers_at_once() {
        const STEP: u64 = 1 << 31;
        const ADDS: u64 = 50_000;
        let counter = std::sync::Arc::new(SharedMovedCounter::default());
        let writers: Vec<_> = (0..4)
            .map(|_| {
                let counter = counter.clone();
                std::thread::spawn(move || {
                    for _ in 0..ADDS {
                        counter.add(STEP, 1);
                    }
                })
            })
            .collect();
        let mut last = (0, 0);
        while !writers.iter().all(|w| w.is_finished()) {
            let now = counter.get();
            assert!(now.0 >= last.0 && now.1 >= last.1, "{last:?} then {now:?}");
            assert_eq!(now.0, now.1 * STEP, "bytes and slices agree");
            last = now;
            // As above: the writers must get their turns where threads take turns.
            std::thread::yield_now();
        }
        for writer in writers {
            writer.join().unwrap();
        }
        assert_eq!(counter.get(), (4 * ADDS * STEP, 4 * ADDS));
        // An add too large for the word goes to the wide counters whole.
        counter.add(1 << 45, 3);
        assert_eq!(counter.get(), (4 * ADDS * STEP + (1 << 45), 4 * ADDS + 3));
    }
}
