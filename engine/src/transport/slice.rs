//! [`Slice`]: one piece of a task, or of a merged run, as a transport receives it.

use std::sync::Arc;

use tern_memreg::{DeviceOrder, Pinned, RegionPin};

use super::run::{Run, part_holding};
use super::segment::PeerSegment;
use super::submission::Submission;
use crate::error::TransferError;
use crate::types::Opcode;

/// One piece of a task, or of a run of neighbouring requests merged at submit: a contiguous
/// range moved in one operation. A slice of a run carries bytes of every task whose request
/// it overlaps: its failure fails exactly those tasks at once, and the bytes it moved count
/// for each of them when the run ends (once all its slices have let go, the run's tasks
/// end together). Dropping it without a report fails its tasks, so a transport can never
/// leave a task hanging.
#[derive(Debug)]
pub struct Slice {
    /// Local start address (inside [`local`](Slice::local)).
    pub local_addr: usize,
    /// Bytes.
    pub len: usize,
    /// Remote start address.
    pub remote_addr: u64,
    pub(super) opcode: Opcode,
    /// The task, for a slice of one request (`run` is `None`); for a slice of a merged run,
    /// the index in `run` of the first part it touches, so that reporting needs no search.
    pub(super) task: u32,
    /// Which of the submission's routes carries it now.
    pub(super) rank: u8,
    pub(super) submission: Option<Arc<Submission>>,
    /// The merged run the slice was cut from.
    pub(super) run: Option<Arc<Run>>,
}

impl Slice {
    pub(crate) fn new(
        submission: Arc<Submission>,
        opcode: Opcode,
        task: usize,
        local_addr: usize,
        len: usize,
        remote_addr: u64,
    ) -> Self {
        Self {
            local_addr,
            len,
            remote_addr,
            opcode,
            task: task as u32,
            rank: 0,
            submission: Some(submission),
            run: None,
        }
    }

    /// A slice of a merged run: it carries bytes of the tasks of `run` it overlaps, from
    /// its part `first_part` on (the part holding `local_addr`).
    pub(crate) fn of_run(
        submission: Arc<Submission>,
        opcode: Opcode,
        run: Arc<Run>,
        first_part: usize,
        local_addr: usize,
        len: usize,
        remote_addr: u64,
    ) -> Self {
        let mut slice = Self::new(submission, opcode, first_part, local_addr, len, remote_addr);
        slice.run = Some(run);
        slice
    }

    /// The piece `[offset, offset + len)` of this slice, for `submission`, carried by route
    /// `rank`.
    pub(super) fn piece(
        &self,
        submission: Arc<Submission>,
        offset: usize,
        len: usize,
        rank: u8,
    ) -> Slice {
        let local_addr = self.local_addr + offset;
        let task = match self.run.as_deref() {
            None => self.task,
            Some(run) => part_holding(&run.parts, self.task as usize, local_addr) as u32,
        };
        Slice {
            local_addr,
            len,
            remote_addr: self.remote_addr + offset as u64,
            opcode: self.opcode,
            task,
            rank,
            submission: Some(submission),
            run: self.run.clone(),
        }
    }

    pub(super) fn submission(&self) -> &Submission {
        // Present until the slice reports, which consumes it.
        self.submission
            .as_deref()
            .unwrap_or_else(|| unreachable!("a slice reports once"))
    }

    /// Read or write.
    pub fn opcode(&self) -> Opcode {
        self.opcode
    }

    /// The local region, pinned for as long as the slice (or any [`Slice::pinned`] of it)
    /// lives.
    pub fn local(&self) -> &RegionPin {
        &self.submission().local
    }

    /// What the slice's device copies must come after: the device's earlier work, unless
    /// its batch is a call on the caller's CUDA stream, which ordered it already (see
    /// [`DeviceOrder`]).
    pub fn device_order(&self) -> DeviceOrder {
        if self
            .submission()
            .batch
            .stream_ordered
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            DeviceOrder::CallerOrdered
        } else {
            DeviceOrder::AfterPriorWork
        }
    }

    /// The other side.
    pub fn peer(&self) -> &Arc<PeerSegment> {
        &self.submission().peer
    }

    /// A shared hold on the slice's memory, for as long as a device may use it (an RDMA
    /// work request's guard): one reference count, not a pin of its own.
    pub fn pinned(&self) -> Pinned<Submission> {
        Pinned(
            self.submission
                .clone()
                .unwrap_or_else(|| unreachable!("a slice reports once")),
        )
    }

    /// Whether the slice should still run (its task is pending). A transport checks this
    /// before starting I/O and calls [`Slice::abandon`] if not.
    pub fn is_live(&self) -> bool {
        let batch = &self.submission().batch;
        self.tasks().any(|(task, _)| batch.task_live(task))
    }

    /// As [`is_live`](Slice::is_live), and ends the task (with its batch's other unfinished
    /// tasks) as timed out if the batch's deadline has passed: it reads the clock, so it is
    /// for checks between long pieces of one slice, where no waiter may be free to notice
    /// the deadline (a waiter helping copies, say).
    pub fn is_live_by_clock(&self) -> bool {
        let batch = &self.submission().batch;
        // The first task's check reads the clock (and times the batch out); the others need
        // not read it again.
        let mut tasks = self.tasks();
        tasks
            .next()
            .is_some_and(|(task, _)| batch.task_live_by_clock(task))
            || tasks.any(|(task, _)| batch.task_live(task))
    }
}

impl Drop for Slice {
    fn drop(&mut self) {
        if let Some(submission) = self.submission.take() {
            // Reported as a failure (a write may have left): the same count as any outcome.
            let slice = self.piece(submission, 0, self.len, self.rank);
            slice.fail(TransferError::Dropped(
                "slice released without a result".into(),
            ));
        }
    }
}
