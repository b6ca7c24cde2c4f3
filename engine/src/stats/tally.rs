//! The tally read off the tasks: what each transport moved and how long tasks took
//! ([`Tally`]), and the batches an engine reads it off ([`TalliedBatches`]).

use std::sync::{Arc, Weak};

use super::latency::{Histogram, LATENCY_BUCKETS_US, SIZE_CLASSES, size_class};
use super::report::LatencyStats;
use crate::batch::{BatchInner, tally_tasks};
use crate::transport::Routes;

/// What tasks moved and how long they took, read off the tasks: per transport `(bytes,
/// slices)`, and the latency histograms `[read, write][size class]`.
#[derive(Debug, Clone, Default)]
pub(crate) struct Tally {
    moved: [(u64, u64); Routes::MAX],
    latency: [[Histogram; SIZE_CLASSES.len()]; 2],
}

impl Tally {
    /// `bytes` in `slices` went over `transport`.
    pub(crate) fn moved(&mut self, transport: usize, bytes: u64, slices: u64) {
        if let Some(cell) = self.moved.get_mut(transport) {
            *cell = (cell.0 + bytes, cell.1 + slices);
        }
    }

    /// `tasks` tasks of `len` bytes each took `sum_ns` together to complete, each a time
    /// in latency bucket `bucket` ([`bucket_of`](super::latency::bucket_of)).
    pub(crate) fn took(&mut self, write: bool, len: u64, bucket: usize, tasks: u64, sum_ns: u64) {
        self.latency[usize::from(write)][size_class(len as usize)].add(bucket, tasks, sum_ns);
    }

    /// The latency histograms with something in them.
    pub(crate) fn latencies(&self) -> Vec<LatencyStats> {
        let mut out = Vec::new();
        for (op, name) in ["read", "write"].iter().enumerate() {
            for (class, (size, _)) in SIZE_CLASSES.iter().enumerate() {
                let histogram = &self.latency[op][class];
                let count: u64 = histogram.buckets.iter().sum();
                if count == 0 {
                    continue;
                }
                out.push(LatencyStats {
                    operation: (*name).to_owned(),
                    size: (*size).to_owned(),
                    buckets: LATENCY_BUCKETS_US
                        .iter()
                        .zip(&histogram.buckets)
                        .map(|(&le, &n)| (le, n))
                        .collect(),
                    count,
                    sum_seconds: histogram.sum_ns as f64 / 1e9,
                });
            }
        }
        out
    }

    /// Adds all of `other`.
    pub(crate) fn absorb(&mut self, other: &Tally) {
        for (mine, theirs) in self.moved.iter_mut().zip(&other.moved) {
            *mine = (mine.0 + theirs.0, mine.1 + theirs.1);
        }
        for (mine, theirs) in self
            .latency
            .iter_mut()
            .flatten()
            .zip(other.latency.iter().flatten())
        {
            mine.absorb(theirs);
        }
    }

    pub(crate) fn of(&self, transport: usize) -> (u64, u64) {
        self.moved.get(transport).copied().unwrap_or_default()
    }
}

/// The batches an engine reads its tally off: the tasks of those that live, and the tally
/// of those that went.
#[derive(Debug, Default)]
pub(super) struct TalliedBatches {
    /// What the tasks of batches gone had moved and taken, added once as each went.
    gone: Tally,
    /// The batches that live: a `Weak`, so that tracking a batch does not keep it.
    live: Vec<Weak<BatchInner>>,
    /// Per transport, the `(bytes, slices)` last shown: a slice carried by another
    /// transport than its task's first is taken off the first's count a moment after it
    /// shows on the task, and a reader between the two would see the first's count drop;
    /// counters never go down, so that reader is shown the count before.
    shown: [(u64, u64); Routes::MAX],
}

impl TalliedBatches {
    /// A new batch, whose tasks [`tally`](Self::tally) reads while it lives.
    pub(super) fn track(&mut self, batch: Weak<BatchInner>) {
        self.live.push(batch);
    }

    /// A batch goes: what its tasks did joins the totals of batches gone, once.
    pub(super) fn add_totals(&mut self, batch: &BatchInner) {
        let going: *const BatchInner = batch;
        if let Some(at) = self.live.iter().position(|b| b.as_ptr() == going) {
            self.live.swap_remove(at);
            tally_tasks(&batch.tasks, &mut self.gone);
        }
    }

    /// What every task so far moved and took, with a hold on each batch read, for the
    /// caller to let go once it no longer holds this tally's lock (the last hold on a batch
    /// adds its totals, which takes the lock). `None` while a batch is going but has not
    /// joined the totals yet: its tasks can be read neither here nor among the gone, and
    /// counters never go down; the caller lets go of the lock and asks again.
    pub(super) fn tally(&mut self) -> Option<(Tally, Vec<Arc<BatchInner>>)> {
        let live: Vec<Arc<BatchInner>> =
            self.live.iter().map(Weak::upgrade).collect::<Option<_>>()?;
        let mut tally = self.gone.clone();
        for batch in &live {
            tally_tasks(&batch.tasks, &mut tally);
        }
        for (now, shown) in tally.moved.iter_mut().zip(self.shown.iter_mut()) {
            *now = (now.0.max(shown.0), now.1.max(shown.1));
            *shown = *now;
        }
        Some((tally, live))
    }
}
