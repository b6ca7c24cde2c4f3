//! One task's state: the words a slice and a status read touch, and how they are laid out.

use super::sync::{AtomicBool, AtomicU32, AtomicU64, Ordering};

pub(super) const WAITING: u8 = 0;
pub(super) const PENDING: u8 = 1;
pub(super) const COMPLETED: u8 = 2;
pub(super) const FAILED: u8 = 3;
pub(super) const TIMEOUT: u8 = 4;
pub(super) const CANCELED: u8 = 5;

/// Bytes a task may move: a request longer than this is refused at submit.
pub(crate) const MAX_TASK_BYTES: u64 = (1 << PROGRESS_SHIFT) - 1;
/// A task's progress word holds its slices done above this bit and its bytes below.
pub(super) const PROGRESS_SHIFT: u32 = 40;

/// A task's state word: the state in its low three bits; above them the transport its
/// slices go to first, plus one (0: none); from [`ENDED_SHIFT`] on, once a timed task has
/// completed, when it did (`stats::completion_ns`, at least 1) — so the compare-and-swap
/// that ends a task also times it.
const STATE_MASK: u64 = 0b111;
pub(super) const FIRST_SHIFT: u32 = 3;
pub(super) const FIRST_MASK: u64 = 0b1_1111 << FIRST_SHIFT;
/// A final state's bit once every slice of the task has let go: only then is the final state
/// shown, and the task counted finished. Completed tasks have it from the start (their last
/// slice completes them).
pub(super) const SETTLED: u64 = 1 << 8;
pub(super) const ENDED_SHIFT: u32 = 9;
/// The bit of a task's slice total that marks a write.
pub(super) const WRITE_FLAG: u32 = 1 << 31;
/// The bit of a task's slice total that marks a task of a merged run: its one "slice" is the
/// run, which reports to it once all of the run's slices have let go, and the run, not the
/// task, is what the engine's tally reads.
pub(super) const RUN_FLAG: u32 = 1 << 30;
/// The bits of a task's slice total that count its slices.
pub(super) const SLICES_MASK: u32 = RUN_FLAG - 1;

pub(super) fn state_of(word: u64) -> u8 {
    (word & STATE_MASK) as u8
}

/// One task, as its batch and the engine's tally ([`super::tally_tasks`]) read it: plain
/// atomics, nothing to drop, so that a batch sets up and lets go of its table as one block
/// (the reason a task failed, which few have, is kept by the batch apart).
#[derive(Debug, Default)]
pub(crate) struct TaskState {
    /// See [`STATE_MASK`].
    pub(super) state: AtomicU64,
    /// Slices to do (one for a task of a merged run), [`WRITE_FLAG`] for a write and
    /// [`RUN_FLAG`] for a task of a merged run.
    pub(super) slices_total: AtomicU32,
    /// Slices done (high bits) and bytes moved (low [`PROGRESS_SHIFT`] bits): one atomic add
    /// per slice counts both.
    pub(super) progress: AtomicU64,
    /// The part of `progress` the first transport did not move: slices it declined, which
    /// the transports that carried them count as they report, and slices skipped. Added to
    /// before `progress`.
    pub(super) uncredited: AtomicU64,
    /// A write some of whose bytes left without their landing being confirmed: they may
    /// still land at the peer after the task ended.
    pub(super) remote_may_change: AtomicBool,
}

impl TaskState {
    pub(super) fn bytes(&self) -> u64 {
        self.progress.load(Ordering::Relaxed) & MAX_TASK_BYTES
    }

    /// Whether every slice of the task has let go. Progress first, then the total: the
    /// total grows only while a slice is out, so a total read after a progress equal to it
    /// means none was out when the progress was read.
    pub(super) fn released(&self) -> bool {
        let done = self.progress.load(Ordering::SeqCst) >> PROGRESS_SHIFT;
        done == u64::from(self.slices_total.load(Ordering::SeqCst) & SLICES_MASK)
    }
}
