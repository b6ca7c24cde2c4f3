//! Runs `BATCHES` batches of 128 requests of 64 KiB (one slice each; a second argument sets
//! the requests per batch, 1 for the cost of a lone request) through the engine with
//! a transport that completes slices on another thread, and nothing else: run under
//! `valgrind --tool=callgrind` at two batch counts, the difference in instructions divided
//! by the difference in slices is the engine's instruction cost per slice — a figure that,
//! unlike time, does not move with the load on a shared machine. `cargo xtask bench` does
//! that (with `TERN_WAIT_SPIN_US=0`, so waits sleep instead of spinning a varying number of
//! times); `TERN_METRICS=0` shows what the engine's counting and timing cost.

use std::time::Duration;

use tern_engine::{SegmentId, TransferEngine, TransferRequest};

#[path = "../benches/support/threaded.rs"]
mod threaded;
use threaded::ThreadedTransport;

fn main() {
    let batches: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(100);
    // Requests per batch: 128 for the per-slice figure, 1 for the per-request one.
    let per_batch: usize = std::env::args()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(128)
        .clamp(1, 128);
    let engine = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(ThreadedTransport::new(64 << 10))
        .build()
        .expect("engine");
    let len = 64 << 10;
    let buffer = engine.allocate(2 * 128 * len, "cpu:0").expect("buffer");
    let requests: Vec<TransferRequest> = (0..per_batch)
        .map(|i| {
            TransferRequest::write(
                buffer.addr() + i * len,
                SegmentId::LOCAL,
                (buffer.addr() + (128 + i) * len) as u64,
                len,
            )
        })
        .collect();
    for _ in 0..batches {
        let batch = engine.allocate_batch(per_batch).expect("batch");
        engine.submit(&batch, &requests).expect("submit");
        batch.wait(Duration::from_secs(60));
        assert_eq!(batch.status().completed, per_batch);
        engine.free_batch(&batch).expect("free");
    }
    drop(buffer);
    drop(engine);
}
