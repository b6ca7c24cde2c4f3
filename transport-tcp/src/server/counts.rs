//! What the server's connections served.

use std::sync::atomic::{AtomicU64, Ordering};

use tern_engine::ServedStats;

use super::RequestOutcome;

/// What the server's connections served, summed over all of them (each request costs a
/// syscall or more; two relaxed adds beside that are nothing).
#[derive(Debug, Default)]
pub(super) struct OutcomeCounts {
    reads: AtomicU64,
    read_bytes: AtomicU64,
    writes: AtomicU64,
    write_bytes: AtomicU64,
    rejected: AtomicU64,
}

impl OutcomeCounts {
    /// Counts one request the connection survived.
    pub(super) fn add(&self, outcome: RequestOutcome) {
        let (count, bytes) = match outcome {
            RequestOutcome::Read(bytes) => (&self.reads, Some((&self.read_bytes, bytes))),
            RequestOutcome::Wrote(bytes) => (&self.writes, Some((&self.write_bytes, bytes))),
            RequestOutcome::Rejected => (&self.rejected, None),
        };
        count.fetch_add(1, Ordering::Relaxed);
        if let Some((total, bytes)) = bytes {
            total.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    pub(super) fn stats(&self) -> ServedStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ServedStats {
            reads: get(&self.reads),
            read_bytes: get(&self.read_bytes),
            writes: get(&self.writes),
            write_bytes: get(&self.write_bytes),
            rejected: get(&self.rejected),
        }
    }
}
