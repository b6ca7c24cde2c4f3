//! [`EngineCounters`]: what one engine counts itself, per transport, and the tally it reads
//! off its batches' tasks.

use std::sync::Weak;

use parking_lot::Mutex;

use super::shards::{Shard, Shards, TransportCells};
use super::tally::{TalliedBatches, Tally};
use crate::batch::BatchInner;

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
    pub(crate) fn track_batch(&self, batch: Weak<BatchInner>) {
        if self.enabled {
            self.tallied.lock().track(batch);
        }
    }

    /// A batch goes: what its tasks did joins the engine's totals, once, and they are no
    /// longer read live.
    pub(crate) fn add_batch_totals(&self, batch: &BatchInner) {
        self.tallied.lock().add_totals(batch);
    }

    /// What every task so far moved and took.
    pub(crate) fn tally(&self) -> Tally {
        loop {
            let mut tallied = self.tallied.lock();
            if let Some((tally, live)) = tallied.tally() {
                drop(tallied);
                // The last hold on a batch may go here, after the lock: its going takes it.
                drop(live);
                return tally;
            }
            // A batch is going and has not joined the totals yet: it is about to, under the
            // lock this lets go.
            drop(tallied);
            std::thread::yield_now();
        }
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
