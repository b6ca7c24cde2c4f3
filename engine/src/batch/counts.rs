//! A batch's task counts in one word: the slots reserved, the tasks reserved and not
//! finished, and whether the batch was freed. One word, so that each change of them is one
//! atomic step that no other can come between:
//!
//! - a reserve raises the reserved and the unfinished count together, and only in a batch
//!   not freed and only when the slots fit — so a refused reserve changes nothing that a
//!   concurrent free could see, and no submit runs in a freed batch;
//! - a free succeeds only from "none unfinished, not freed", and then nothing reserves;
//! - a status read sees the reserved and the unfinished count as of one moment.
//!
//! It must not hold anything else: the hot path's finishers touch this word once per
//! submit's tasks (or a run's), and a status read reads it once.

use super::sync::{AtomicU64, Ordering};

/// The unfinished tasks, in the low bits.
const UNFINISHED_MASK: u64 = (1 << RESERVED_SHIFT) - 1;
/// The slots reserved, from this bit to [`FREED`].
const RESERVED_SHIFT: u32 = 32;
/// Set once the batch is freed.
const FREED: u64 = 1 << 63;
/// The most slots a batch can have: what the reserved count holds.
pub(crate) const MAX_CAPACITY: usize = (1 << (63 - RESERVED_SHIFT)) - 1;

/// Why a reserve took nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotReserved {
    /// The batch was freed.
    Freed,
    /// Only `room` slots are left.
    Full { room: usize },
}

/// Why a free did not happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotFreed {
    /// Freed before.
    Freed,
    /// `pending` tasks are unfinished.
    Busy { pending: usize },
}

/// See the module's doc.
#[derive(Debug)]
pub(crate) struct TaskCounts(AtomicU64);

impl TaskCounts {
    pub(crate) fn new() -> Self {
        Self(AtomicU64::new(0))
    }

    fn unfinished_of(word: u64) -> usize {
        (word & UNFINISHED_MASK) as usize
    }

    fn reserved_of(word: u64) -> usize {
        ((word & !FREED) >> RESERVED_SHIFT) as usize
    }

    /// Reserves `n` of `capacity` slots (at most [`MAX_CAPACITY`]), counting their tasks
    /// unfinished in the same step; returns the first slot.
    pub(crate) fn reserve(&self, n: usize, capacity: usize) -> Result<usize, NotReserved> {
        let mut word = self.0.load(Ordering::SeqCst);
        loop {
            if word & FREED != 0 {
                return Err(NotReserved::Freed);
            }
            let used = Self::reserved_of(word);
            let room = capacity.saturating_sub(used);
            if n > room {
                return Err(NotReserved::Full { room });
            }
            // Within the fields: used + n <= capacity <= MAX_CAPACITY, and there are never
            // more unfinished tasks than reserved slots.
            let next = word + ((n as u64) << RESERVED_SHIFT) + n as u64;
            match self
                .0
                .compare_exchange_weak(word, next, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return Ok(used),
                Err(now) => word = now,
            }
        }
    }

    /// `count` tasks finished; true when they were the last unfinished ones.
    #[inline]
    pub(crate) fn finished(&self, count: usize) -> bool {
        let before = self.0.fetch_sub(count as u64, Ordering::SeqCst);
        Self::unfinished_of(before) == count
    }

    /// Tasks reserved and not finished.
    #[inline]
    pub(crate) fn unfinished(&self) -> usize {
        Self::unfinished_of(self.0.load(Ordering::SeqCst))
    }

    /// Slots reserved, and tasks unfinished among them, as of one moment.
    #[inline]
    pub(crate) fn reserved_and_unfinished(&self) -> (usize, usize) {
        let word = self.0.load(Ordering::SeqCst);
        (Self::reserved_of(word), Self::unfinished_of(word))
    }

    /// Marks the batch freed, if no task is unfinished and it was not freed before.
    pub(crate) fn free(&self) -> Result<(), NotFreed> {
        let mut word = self.0.load(Ordering::SeqCst);
        loop {
            if word & FREED != 0 {
                return Err(NotFreed::Freed);
            }
            let pending = Self::unfinished_of(word);
            if pending > 0 {
                return Err(NotFreed::Busy { pending });
            }
            match self.0.compare_exchange_weak(
                word,
                word | FREED,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => return Ok(()),
                Err(now) => word = now,
            }
        }
    }

    /// Whether the batch was freed.
    pub(crate) fn freed(&self) -> bool {
        self.0.load(Ordering::SeqCst) & FREED != 0
    }
}
