//! A merged run: the neighbouring requests of one submit call moved as one range, cut into
//! slices. Its slices count down on the run, not on each task; once every one has let go,
//! the run ends its tasks together: each with the bytes of it that moved, completed unless
//! a slice holding its bytes failed (or it was canceled or timed out) meanwhile.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::slice::Slice;
use crate::batch::BatchInner;
use crate::stats::bucket_of;

/// One request's part of a merged run: its task, from its local start address up to the
/// next part's (or the run's end).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TaskPart {
    pub(crate) start: usize,
    pub(crate) task: u32,
}

/// A merged run, shared by its slices.
#[derive(Debug)]
pub(crate) struct Run {
    /// The requests' parts, in address order.
    pub(super) parts: Box<[TaskPart]>,
    /// Where the run ends locally.
    end: usize,
    /// The batch its tasks are in (held here once, not by each slice's report).
    batch: Arc<BatchInner>,
    /// Slices it was cut into, pieces included.
    slices: AtomicUsize,
    /// The transport its slices go to first, and whether it is a write: what the tally
    /// counts the run under.
    transport: usize,
    write: bool,
    /// What the slices that let go other than moved by the first transport left.
    trouble: Mutex<Trouble>,
}

/// What the slices of a run that did not simply move their bytes left for its end.
#[derive(Debug, Default)]
struct Trouble {
    /// `(task, bytes)` of the task's bytes a slice let go of without moving.
    unmoved: Vec<(u32, u64)>,
    /// Slices that moved nothing.
    unmoved_slices: u64,
    /// Bytes and slices a transport other than the first carried (its own counters count
    /// them).
    other_bytes: u64,
    other_slices: u64,
}

impl Trouble {
    /// The bytes of `task` no slice moved; `unmoved` sorted by task.
    fn unmoved_of(&self, task: u32) -> u64 {
        let from = self.unmoved.partition_point(|&(t, _)| t < task);
        self.unmoved[from..]
            .iter()
            .take_while(|&&(t, _)| t == task)
            .map(|&(_, bytes)| bytes)
            .sum()
    }
}

/// How a slice of a run let go, for its end.
pub(super) enum Letting {
    /// Moved by its first transport.
    Moved,
    /// Moved by another transport, which counted it.
    MovedByOther,
    /// Moved nothing.
    Unmoved,
}

impl Run {
    /// A run of `parts` (the requests' tasks and starts, in address order), ending at `end`,
    /// cut into `slices` slices that go to `transport` first.
    pub(crate) fn new(
        parts: Box<[TaskPart]>,
        end: usize,
        batch: Arc<BatchInner>,
        slices: usize,
        transport: usize,
        write: bool,
    ) -> Self {
        Self {
            parts,
            end,
            batch,
            slices: AtomicUsize::new(slices),
            transport,
            write,
            trouble: Mutex::default(),
        }
    }

    /// A slice of the run is about to be cut into `more` more pieces.
    pub(super) fn add_slices(&self, more: usize) {
        self.slices.fetch_add(more, Ordering::Relaxed);
    }

    /// A slice holding `tasks` (each with its bytes in the slice) let go as `how`, other
    /// than moved by the first transport: recorded for the run's end. The slice lets go of
    /// the run after.
    pub(super) fn let_go(
        &self,
        how: Letting,
        len: usize,
        tasks: impl Iterator<Item = (usize, u64)>,
    ) {
        match how {
            Letting::Moved => {}
            Letting::MovedByOther => {
                let mut trouble = self.trouble.lock();
                trouble.other_bytes += len as u64;
                trouble.other_slices += 1;
            }
            Letting::Unmoved => {
                let mut trouble = self.trouble.lock();
                trouble
                    .unmoved
                    .extend(tasks.map(|(task, bytes)| (task as u32, bytes)));
                trouble.unmoved_slices += 1;
            }
        }
    }

    /// Every slice has let go: each task gets the run as its one slice, with the bytes of
    /// it that moved. The tally counts the run's bytes and slices before any task shows
    /// finished, so whoever sees the batch done sees them counted.
    #[inline(never)]
    fn end_tasks(&mut self) {
        let mut trouble = std::mem::take(self.trouble.get_mut());
        let batch = &self.batch;
        trouble.unmoved.sort_unstable_by_key(|&(task, _)| task);
        let timed = batch.timer.is_some();
        let Some(first) = self.parts.first() else {
            return;
        };
        if timed {
            let unmoved: u64 = trouble.unmoved.iter().map(|&(_, bytes)| bytes).sum();
            let bytes = (self.end - first.start) as u64;
            let slices = self.slices.load(Ordering::Relaxed) as u64;
            batch.tasks.record_run(|tally| {
                tally.moved(
                    self.transport,
                    bytes.saturating_sub(unmoved + trouble.other_bytes),
                    slices.saturating_sub(trouble.unmoved_slices + trouble.other_slices),
                );
            });
        }
        let ended_ns = batch.ended_ns();
        // Completed tasks of one length in a row, for the latency histogram: a run's
        // requests are mostly of one length (a cache's pages), so mostly one entry.
        let (mut alike, mut more_alike) = ((0u64, 0u64), Vec::new());
        let mut completed = |len: u64| {
            if alike.0 == len {
                alike.1 += 1;
            } else {
                if alike.1 > 0 {
                    more_alike.push(alike);
                }
                alike = (len, 1);
            }
        };
        // Last part first: each ends where the one after starts.
        let mut part_end = self.end;
        let parts = self.parts.iter().rev().map(|part| {
            let len = (part_end - part.start) as u64;
            part_end = part.start;
            (part.task as usize, len)
        });
        let finished = if trouble.unmoved.is_empty() {
            batch.release_run_tasks(
                parts.map(|(task, len)| (task, len, len)),
                ended_ns,
                &mut completed,
            )
        } else {
            let moved = |(task, len): (usize, u64)| {
                (
                    task,
                    len,
                    len.saturating_sub(trouble.unmoved_of(task as u32)),
                )
            };
            batch.release_run_tasks(parts.map(moved), ended_ns, &mut completed)
        };
        if timed && alike.1 > 0 {
            let took_ns = ended_ns.saturating_sub(batch.tasks.started_ns(first.task as usize));
            let (bucket, _, _) = bucket_of(took_ns);
            batch.tasks.record_run(|tally| {
                for &(len, count) in more_alike.iter().chain([&alike]) {
                    tally.took(
                        self.write,
                        len,
                        bucket,
                        count,
                        took_ns.saturating_mul(count),
                    );
                }
            });
        }
        batch.finished_many(finished);
    }
}

/// The last slice of a run lets go of it: every slice has let go of its hold on the pin
/// before (a slice lets go of its submission first), so the run's tasks end here.
impl Drop for Run {
    fn drop(&mut self) {
        self.end_tasks();
    }
}

/// The index of the part of `parts` holding `addr`, searching from `parts[from]` on (a part
/// at or before it).
pub(super) fn part_holding(parts: &[TaskPart], from: usize, addr: usize) -> usize {
    let rest = parts.get(from..).unwrap_or_default();
    from + rest
        .partition_point(|part| part.start <= addr)
        .saturating_sub(1)
}

/// The tasks a slice carries bytes of, with how many bytes of each.
pub(super) struct SliceTasks<'a> {
    /// The merged run's parts, from the first the slice touches; empty for a slice of one
    /// task.
    parts: &'a [TaskPart],
    /// The slice's unvisited range.
    at: usize,
    end: usize,
    only: Option<(usize, u64)>,
}

impl Iterator for SliceTasks<'_> {
    type Item = (usize, u64);

    fn next(&mut self) -> Option<(usize, u64)> {
        if let Some(only) = self.only.take() {
            return Some(only);
        }
        let (part, rest) = self.parts.split_first()?;
        if self.at >= self.end {
            return None;
        }
        let part_end = rest
            .first()
            .map_or(self.end, |next| next.start.min(self.end));
        let bytes = part_end.saturating_sub(self.at) as u64;
        (self.parts, self.at) = (rest, part_end);
        Some((part.task as usize, bytes))
    }
}

impl Slice {
    /// The tasks this slice carries bytes of, each with how many.
    pub(super) fn tasks(&self) -> SliceTasks<'_> {
        match self.run.as_deref() {
            None => SliceTasks {
                parts: &[],
                at: 0,
                end: 0,
                only: Some((self.task as usize, self.len as u64)),
            },
            Some(run) => self.tasks_in(run),
        }
    }

    /// [`tasks`](Self::tasks), for a slice of `run` (taken out of the slice, say).
    pub(super) fn tasks_in<'a>(&self, run: &'a Run) -> SliceTasks<'a> {
        SliceTasks {
            parts: run.parts.get(self.task as usize..).unwrap_or_default(),
            at: self.local_addr,
            end: self.local_addr.saturating_add(self.len),
            only: None,
        }
    }
}
