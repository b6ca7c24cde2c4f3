//! A merged run: the neighbouring requests of one submit call moved as one range, cut into
//! slices. Its slices count down on the run, not on each task; once every one has let go,
//! the run ends its tasks together: each with the bytes of it that moved, completed unless
//! a slice holding its bytes failed (or it was canceled or timed out) meanwhile.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::slice::Slice;
use crate::batch::{BatchInner, KEEP_FROM, KeptRoom};
use crate::stats::bucket_of;

/// One request's part of a merged run: its task, from its local start address up to the
/// next part's (or the run's end).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TaskPart {
    pub(crate) start: usize,
    pub(crate) task: u32,
}

/// How many parts a run keeps in itself, rather than in an allocation of their own: the
/// runs of a few pages a serving stack's layers make then cost one allocation each.
const FEW_PARTS: usize = 8;

/// A run's parts, in address order.
#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "the few parts are kept in the run's own allocation on purpose"
)]
pub(crate) enum Parts {
    Few {
        parts: [TaskPart; FEW_PARTS],
        len: usize,
    },
    /// Many parts, in room of their own.
    Many(Vec<TaskPart>),
    /// Very many parts, in room that goes back to `room` with the run (a large batch's),
    /// for the large runs to come.
    Kept {
        parts: Vec<TaskPart>,
        room: Arc<KeptRoom>,
    },
}

impl Parts {
    /// The `len` parts `parts()` yields; very many in the room of a large run gone when
    /// `kept` has one.
    pub(crate) fn collect<I: Iterator<Item = TaskPart>>(
        len: usize,
        kept: Option<&Arc<KeptRoom>>,
        parts: impl FnOnce() -> I,
    ) -> Self {
        let mut collected = Self::Few {
            parts: [TaskPart { start: 0, task: 0 }; FEW_PARTS],
            len: 0,
        };
        collected.refill(len, kept, parts);
        collected
    }

    /// Replaces the parts with the `len` parts `parts()` yields, in the room they had
    /// where it fits: a run used again allocates nothing.
    pub(crate) fn refill<I: Iterator<Item = TaskPart>>(
        &mut self,
        len: usize,
        kept: Option<&Arc<KeptRoom>>,
        parts: impl FnOnce() -> I,
    ) {
        if len <= FEW_PARTS {
            if !matches!(self, Self::Few { .. }) {
                *self = Self::Few {
                    parts: [TaskPart { start: 0, task: 0 }; FEW_PARTS],
                    len: 0,
                };
            }
            if let Self::Few {
                parts: few,
                len: count,
            } = self
            {
                *count = 0;
                for (slot, part) in few.iter_mut().zip(parts()) {
                    *slot = part;
                    *count += 1;
                }
            }
            return;
        }
        match (self, kept) {
            (Self::Many(many), _) if len < KEEP_FROM => {
                many.clear();
                many.extend(parts());
            }
            (this, Some(room)) if len >= KEEP_FROM => {
                let mut many = room.parts.room(len);
                many.extend(parts());
                *this = Self::Kept {
                    parts: many,
                    room: room.clone(),
                };
            }
            (this, _) => *this = Self::Many(parts().collect()),
        }
    }

    /// The parts' room apart from the run's own, for a pool of runs to bound what it
    /// holds; `None` for room that goes back to a large batch's.
    pub(super) fn room(&self) -> Option<usize> {
        match self {
            Self::Few { .. } => Some(0),
            Self::Many(parts) => Some(parts.capacity()),
            Self::Kept { .. } => None,
        }
    }
}

impl Drop for Parts {
    fn drop(&mut self) {
        if let Self::Kept { parts, room } = self {
            room.parts.keep(std::mem::take(parts));
        }
    }
}

impl std::ops::Deref for Parts {
    type Target = [TaskPart];

    fn deref(&self) -> &[TaskPart] {
        match self {
            Self::Few { parts, len } => parts.get(..*len).unwrap_or_default(),
            Self::Many(parts) | Self::Kept { parts, .. } => parts,
        }
    }
}

/// A merged run, shared by its slices. Its tasks end when the last of its slices lets go
/// ([`Run::slice_gone`]), not when the run itself goes: a run whose tasks ended can be
/// used again for another run ([`RunPool`](super::RunPool)).
#[derive(Debug)]
pub(crate) struct Run {
    /// The requests' parts, in address order.
    pub(super) parts: Parts,
    /// Where the run ends locally.
    end: usize,
    /// Slices it was cut into, pieces included.
    slices: AtomicUsize,
    /// Slices that have not let go yet.
    holding: AtomicUsize,
    /// The transport its slices go to first, and whether it is a write: what the tally
    /// counts the run under.
    transport: usize,
    write: bool,
    /// When the submit call that made it started (`stats::clock_ns`): its tasks' start.
    started_ns: u64,
    /// The batch, until the run's end takes it, and what the slices that let go other
    /// than moved by the first transport left.
    ending: Mutex<Ending>,
}

/// What a run's end takes.
#[derive(Debug, Default)]
struct Ending {
    /// The batch its tasks are in (held here once, not by each slice's report); taken by
    /// the end, so that a run kept for use again holds no batch.
    batch: Option<Arc<BatchInner>>,
    trouble: Trouble,
}

/// What a run is, apart from its parts.
pub(crate) struct RunHead {
    /// Where the run ends locally.
    pub(crate) end: usize,
    pub(crate) batch: Arc<BatchInner>,
    /// Slices it is cut into.
    pub(crate) slices: usize,
    /// The transport its slices go to first.
    pub(crate) transport: usize,
    pub(crate) write: bool,
    /// When the submit call that makes it started.
    pub(crate) started_ns: u64,
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
    /// A run of `parts` (the requests' tasks and starts, in address order) as `head` says.
    pub(crate) fn new(parts: Parts, head: RunHead) -> Self {
        Self {
            parts,
            end: head.end,
            slices: AtomicUsize::new(head.slices),
            holding: AtomicUsize::new(head.slices),
            transport: head.transport,
            write: head.write,
            started_ns: head.started_ns,
            ending: Mutex::new(Ending {
                batch: Some(head.batch),
                trouble: Trouble::default(),
            }),
        }
    }

    /// Makes this run, whose tasks ended, the run `head` says (its parts refilled by the
    /// caller).
    pub(super) fn reset(&mut self, head: RunHead) {
        self.end = head.end;
        *self.slices.get_mut() = head.slices;
        *self.holding.get_mut() = head.slices;
        self.transport = head.transport;
        self.write = head.write;
        self.started_ns = head.started_ns;
        let ending = self.ending.get_mut();
        ending.batch = Some(head.batch);
        ending.trouble = Trouble::default();
    }

    /// Ends the run's tasks if no slice did: a run can go back to its pool only after
    /// its last slice let go, which ended them, but should a slice ever go without
    /// letting go, its tasks end here rather than wait forever.
    pub(super) fn end_if_left(&mut self) {
        if self.ending.get_mut().batch.is_some() {
            self.end_tasks();
        }
    }

    /// A slice of the run is about to be cut into `more` more pieces.
    pub(super) fn add_slices(&self, more: usize) {
        self.slices.fetch_add(more, Ordering::Relaxed);
        self.holding.fetch_add(more, Ordering::Relaxed);
    }

    /// A slice of the run lets go of it, after its hold on the pin: the last one ends the
    /// run's tasks.
    pub(super) fn slice_gone(&self) {
        // Release: what each slice recorded comes before the count; acquire: the last one
        // sees all of it.
        if self.holding.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.end_tasks();
        }
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
                let trouble = &mut self.ending.lock().trouble;
                trouble.other_bytes += len as u64;
                trouble.other_slices += 1;
            }
            Letting::Unmoved => {
                let trouble = &mut self.ending.lock().trouble;
                trouble
                    .unmoved
                    .extend(tasks.map(|(task, bytes)| (task as u32, bytes)));
                trouble.unmoved_slices += 1;
            }
        }
    }

    /// Every slice has let go: each task gets the run as its one slice, with the bytes of
    /// it that moved. With metrics on, the run's bytes, slices and its tasks' times are
    /// recorded under the lock a tally reads them with, before any task is counted
    /// finished: whoever sees the batch done, or reads a tally after seeing a task end,
    /// sees them.
    /// Runs once: the end takes the batch.
    #[inline(never)]
    fn end_tasks(&self) {
        let (batch, mut trouble) = {
            let mut ending = self.ending.lock();
            let Some(batch) = ending.batch.take() else {
                return;
            };
            (batch, std::mem::take(&mut ending.trouble))
        };
        if !trouble.unmoved.is_empty() {
            trouble.unmoved.sort_unstable_by_key(|&(task, _)| task);
        }
        let Some(first) = self.parts.first() else {
            return;
        };
        let batch = &batch;
        let ended_ns = batch.ended_ns();
        let finished = if batch.timer.is_none() {
            self.release(batch, &trouble, ended_ns, |_| {})
        } else {
            let unmoved: u64 = trouble.unmoved.iter().map(|&(_, bytes)| bytes).sum();
            let bytes =
                ((self.end - first.start) as u64).saturating_sub(unmoved + trouble.other_bytes);
            let slices = (self.slices.load(Ordering::Relaxed) as u64)
                .saturating_sub(trouble.unmoved_slices + trouble.other_slices);
            let took_ns = ended_ns.saturating_sub(self.started_ns);
            let (bucket, _, _) = bucket_of(took_ns);
            let (transport, write) = (self.transport, self.write);
            batch.tasks.record_run(|tally| {
                tally.moved(transport, bytes, slices);
                // Completed tasks of one length in a row are recorded together: a run's
                // requests are mostly of one length (a cache's pages).
                let mut alike = (0u64, 0u64);
                let finished = self.release(batch, &trouble, ended_ns, |len| {
                    if alike.0 != len {
                        if alike.1 > 0 {
                            tally.took(
                                write,
                                alike.0,
                                bucket,
                                alike.1,
                                took_ns.saturating_mul(alike.1),
                            );
                        }
                        alike = (len, 0);
                    }
                    alike.1 += 1;
                });
                if alike.1 > 0 {
                    tally.took(
                        write,
                        alike.0,
                        bucket,
                        alike.1,
                        took_ns.saturating_mul(alike.1),
                    );
                }
                finished
            })
        };
        batch.finished_many(finished);
    }
}

impl Run {
    /// Gives each task the run as its one slice, with the bytes of it `trouble` does not
    /// say went unmoved; `completed` is told the length of each that completed. Returns
    /// how many finished.
    fn release(
        &self,
        batch: &BatchInner,
        trouble: &Trouble,
        ended_ns: u64,
        completed: impl FnMut(u64),
    ) -> usize {
        // Last part first: each ends where the one after starts.
        let mut part_end = self.end;
        let parts = self.parts.iter().rev().map(|part| {
            let len = (part_end - part.start) as u64;
            part_end = part.start;
            (part.task as usize, len)
        });
        if trouble.unmoved.is_empty() {
            let all_moved = parts.map(|(task, len)| (task, len, len));
            batch.release_run_tasks(all_moved, ended_ns, completed)
        } else {
            let moved = |(task, len): (usize, u64)| {
                let unmoved = trouble.unmoved_of(task as u32);
                (task, len, len.saturating_sub(unmoved))
            };
            batch.release_run_tasks(parts.map(moved), ended_ns, completed)
        }
    }
}

/// A run goes after its last slice: its tasks ended then ([`Run::slice_gone`]). Should a
/// slice ever go without letting go of it, the run's tasks end here all the same, rather
/// than wait forever.
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
