//! [`EngineCounters`]: what one engine counts itself, per transport, and the tally it reads
//! off its batches' tasks.

use std::sync::Arc;

use parking_lot::Mutex;

use super::shards::{Shard, Shards, TransportCells};
use super::tally::{TalliedBatches, Tally};
use crate::batch::TaskTable;

/// An engine's counts: per transport (same index) and the latency histograms. What does
/// not fit a task's words is counted in one shard per thread that counted; the rest is
/// read off the tasks of the batches it tallies.
#[derive(Debug)]
pub(crate) struct EngineCounters {
    enabled: bool,
    shards: Shards,
    tallied: Mutex<TalliedBatches>,
}

impl Default for EngineCounters {
    fn default() -> Self {
        Self::new(0, true)
    }
}

impl EngineCounters {
    pub(crate) fn new(transports: usize, enabled: bool) -> Self {
        Self {
            enabled,
            shards: Shards::new(transports),
            tallied: Mutex::default(),
        }
    }

    /// Runs `f` on this thread's shard of this engine, if the engine counts.
    fn with_shard(&self, f: impl FnOnce(&Shard)) {
        if self.enabled {
            self.shards.with(f);
        }
    }

    pub(crate) fn moved(&self, transport: usize, bytes: u64) {
        self.with_shard(|shard| {
            if let Some(cells) = shard.transports.get(transport) {
                cells.bytes.add(bytes);
                cells.slices.add(1);
            }
        });
    }

    pub(crate) fn failed(&self, transport: usize) {
        self.with_shard(|shard| {
            if let Some(cells) = shard.transports.get(transport) {
                cells.failures.add(1);
            }
        });
    }

    /// Whether transfers are timed.
    pub(crate) fn timing(&self) -> bool {
        self.enabled
    }

    /// The tasks of a new batch, to be read by [`tally`](Self::tally) while it lives.
    pub(crate) fn track_batch(&self, tasks: Arc<TaskTable>) {
        if self.enabled {
            self.tallied.lock().track(tasks);
        }
    }

    /// A batch goes: what its tasks did joins the engine's totals, once, and they are no
    /// longer read live.
    pub(crate) fn add_batch_totals(&self, tasks: &Arc<TaskTable>) {
        self.tallied.lock().add_totals(tasks);
    }

    /// What every task so far moved and took.
    pub(crate) fn tally(&self) -> Tally {
        self.tallied.lock().tally()
    }

    /// `(bytes, slices, failures)` of one transport, with `tally` from [`tally`](Self::tally).
    pub(crate) fn totals(&self, transport: usize, tally: &Tally) -> (u64, u64, u64) {
        let of = |f: fn(&TransportCells) -> u64| {
            self.shards
                .sum(|s| s.transports.get(transport).map_or(0, f))
        };
        let (bytes, slices) = tally.of(transport);
        (
            bytes + of(|c| c.bytes.get()),
            slices + of(|c| c.slices.get()),
            of(|c| c.failures.get()),
        )
    }
}
