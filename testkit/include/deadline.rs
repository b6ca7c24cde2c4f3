//! One transfer in a batch of its own, ended at a deadline: what the transports' tests of
//! timed-out calls share. Included by path (`#[path]`) into tests that depend on
//! `tern-engine`, like `local.rs`.

use std::time::{Duration, Instant};

use tern_engine::{Batch, TaskStatus, TransferEngine, TransferRequest, TransferStatus};

/// `request` alone in a batch of its own, submitted.
pub fn submit_alone(engine: &TransferEngine, request: TransferRequest) -> Batch {
    let batch = engine.allocate_batch(1).unwrap();
    engine.submit(&batch, &[request]).unwrap();
    batch
}

/// Sets the batch's deadline `after` from now and waits (30 s at most) for its one task:
/// the task's status, and how long after the deadline the wait came back.
pub fn wait_past_deadline(batch: &Batch, after: Duration) -> (TaskStatus, Duration) {
    let deadline = Instant::now() + after;
    batch.set_deadline(Some(deadline));
    batch.wait(Duration::from_secs(30));
    let late = deadline.elapsed();
    (batch.task_status(0).unwrap(), late)
}

/// A read ended at its deadline: `Timeout`, and nothing remote may change because of it.
pub fn assert_read_timed_out(status: &TaskStatus) {
    assert_eq!(status.status, TransferStatus::Timeout, "{status:?}");
    assert!(!status.remote_may_change, "a read changes nothing remote");
}

/// A write ended at its deadline: `Timeout`, and the peer's memory may still change (bytes
/// of it may have left before it was cut off).
pub fn assert_write_timed_out(status: &TaskStatus) {
    assert_eq!(status.status, TransferStatus::Timeout, "{status:?}");
    assert!(status.remote_may_change, "{status:?}");
}
