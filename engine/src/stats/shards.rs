//! One engine's counts, kept per thread: each thread that counts for an engine adds to a
//! shard of its own (no atomic read-modify-write, no shared cache line), and a reader sums
//! the shards.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::counters::LocalCounter;

/// One transport's counts in one shard.
#[derive(Debug, Default)]
pub(super) struct TransportCells {
    pub(super) bytes: LocalCounter,
    pub(super) slices: LocalCounter,
    pub(super) failures: LocalCounter,
}

/// One thread's counts for one engine.
#[derive(Debug)]
pub(super) struct Shard {
    pub(super) transports: Box<[TransportCells]>,
}

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's shards, by engine.
    static SHARDS: RefCell<Vec<(u64, Arc<Shard>)>> = const { RefCell::new(Vec::new()) };
}

/// The shards of one engine, one per thread that counted, each with a cell per transport.
#[derive(Debug)]
pub(super) struct Shards {
    /// The engine's number, which this thread's shards are found by.
    engine: u64,
    transports: usize,
    all: Mutex<Vec<Arc<Shard>>>,
}

impl Shards {
    pub(super) fn new(transports: usize) -> Self {
        Self {
            engine: NEXT_ENGINE.fetch_add(1, Ordering::Relaxed),
            transports,
            all: Mutex::new(Vec::new()),
        }
    }

    /// Runs `f` on this thread's shard, making it on first use. The shard used last sits
    /// first, so a thread counting for one engine finds it at once.
    pub(super) fn with(&self, f: impl FnOnce(&Shard)) {
        SHARDS.with(|shards| {
            {
                let shards = shards.borrow();
                if let Some((engine, shard)) = shards.first()
                    && *engine == self.engine
                {
                    return f(shard);
                }
            }
            let shards = &mut *shards.borrow_mut();
            f(&self.put_first(shards));
        });
    }

    /// Puts this engine's shard of this thread first in `shards`, making it if there is none.
    #[cold]
    #[inline(never)]
    fn put_first(&self, shards: &mut Vec<(u64, Arc<Shard>)>) -> Arc<Shard> {
        if let Some(at) = shards.iter().position(|(engine, _)| *engine == self.engine) {
            shards.swap(0, at);
            return shards[0].1.clone();
        }
        // Shards of engines gone (only this thread holds them) go first.
        shards.retain(|(_, shard)| Arc::strong_count(shard) > 1);
        let shard = Arc::new(Shard {
            transports: (0..self.transports)
                .map(|_| TransportCells::default())
                .collect(),
        });
        self.all.lock().push(shard.clone());
        shards.insert(0, (self.engine, shard.clone()));
        shard
    }

    /// `f` of every shard, summed.
    pub(super) fn sum(&self, f: impl Fn(&Shard) -> u64) -> u64 {
        self.all.lock().iter().map(|s| f(s)).sum()
    }
}
