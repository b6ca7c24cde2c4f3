//! The seqlock under which a moved-count word ([`super::MovedCounter`],
//! [`super::SharedMovedCounter`]) spills into wide counters before a field of it overflows.

use std::sync::atomic::{AtomicU64, Ordering, fence};

use super::counters::{MOVED_BYTES_BITS, MOVED_BYTES_MAX};

/// The wide counters a moved-count word is moved into before a field overflows, under a
/// sequence number that readers check (a seqlock). One thread moves at a time.
#[derive(Debug, Default)]
pub(super) struct Spilled {
    bytes: AtomicU64,
    slices: AtomicU64,
    /// Odd while a word is being moved.
    sequence: AtomicU64,
}

impl Spilled {
    /// Adds the word that `take` empties, and `bytes` and `slices`, to the wide counters.
    #[cold]
    pub(super) fn spill(&self, take: impl FnOnce() -> u64, bytes: u64, slices: u64) {
        let sequence = self.sequence.load(Ordering::Relaxed);
        self.sequence.store(sequence + 1, Ordering::Relaxed);
        // Readers that see any store below see the odd sequence (fence to fence).
        fence(Ordering::Release);
        let word = take();
        let add = |counter: &AtomicU64, n: u64| {
            counter.store(
                counter.load(Ordering::Relaxed).wrapping_add(n),
                Ordering::Relaxed,
            );
        };
        add(&self.bytes, (word & MOVED_BYTES_MAX).wrapping_add(bytes));
        add(
            &self.slices,
            (word >> MOVED_BYTES_BITS).wrapping_add(slices),
        );
        self.sequence.store(sequence + 2, Ordering::Release);
    }

    /// `(bytes, slices)` of `word` and the wide counters together, read while no word
    /// was being moved.
    pub(super) fn read(&self, word: &AtomicU64) -> (u64, u64) {
        loop {
            let before = self.sequence.load(Ordering::Acquire);
            let now = word.load(Ordering::Relaxed);
            let bytes = self.bytes.load(Ordering::Relaxed);
            let slices = self.slices.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if before.is_multiple_of(2) && self.sequence.load(Ordering::Relaxed) == before {
                return (
                    bytes.wrapping_add(now & MOVED_BYTES_MAX),
                    slices.wrapping_add(now >> MOVED_BYTES_BITS),
                );
            }
            // A word is being moved: a few instructions, unless its mover was preempted.
            std::thread::yield_now();
        }
    }
}
