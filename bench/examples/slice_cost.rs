//! Runs `BATCHES` batches of 128 requests of 64 KiB (one slice each; 16 KiB for `pages`) through the engine with
//! a transport that moves no bytes, and nothing else: run under `valgrind --tool=callgrind`
//! at two batch counts, the difference in instructions divided by the difference in
//! requests is the engine's instruction cost per request — a figure that, unlike time, does
//! not move with the load on a shared machine. `cargo xtask bench` does that (with
//! `TERN_WAIT_SPIN_US=0`, so waits sleep instead of spinning a varying number of times);
//! `TERN_METRICS=0` shows what the engine's counting and timing cost.
//!
//! `slice_cost BATCHES [PER_BATCH] [contiguous|gaps|runs|pages|apart|long] [threaded|instant]`:
//! - `PER_BATCH`: requests per batch, 128 by default, 1 for the cost of a lone request.
//! - `contiguous` requests are neighbours both locally and remotely, so the engine merges
//!   them into one run; `gaps` leaves 4 KiB between them, so each moves on its own; `runs`
//!   submits contiguous requests in runs of 8 out of address order (runs 0, 5, 10, …, as
//!   a serving stack hands over a layer's pages), which the engine puts in order and merges;
//!   `pages` does the same with 16 KiB requests, four to a slice (a KV cache's pages);
//!   `apart` too, with a page's gap after every run of 8, so that each run is merged on its
//!   own (a serving stack's runs of pages from many layers: `tern-bench --page_order runs:8`);
//!   `long` submits contiguous 16 KiB pages to a transport of 1 MiB slices, as the
//!   same-host transport cuts them: 64 pages to a slice.
//! - `threaded` completes slices on another thread, as real transports do; `instant`
//!   completes them inside `submit`, which leaves the engine's bookkeeping alone.

use std::time::Duration;

use tern_engine::{SegmentId, TransferEngine, TransferRequest};

#[path = "../benches/support/threaded.rs"]
mod threaded;
use threaded::ThreadedTransport;

const LEN: usize = 64 << 10;
/// A request of the `pages` layout: a KV cache's page, a quarter of a slice.
const PAGE: usize = 16 << 10;
const MAX_PER_BATCH: usize = 128;
/// The transport's slice in the `long` layout: the same-host transport's.
const LONG_SLICE: usize = 1 << 20;
/// Requests in a run of the `runs` layout.
const RUN: usize = 8;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let batches: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(100);
    let per_batch: usize = args
        .get(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(MAX_PER_BATCH)
        .clamp(1, MAX_PER_BATCH);
    // (request length, gap after each request, gap after each run of `RUN`, runs out of
    // order, the transport's slice)
    let (len, gap, run_gap, in_runs, slice) = match args.get(2).map(String::as_str) {
        None | Some("contiguous") => (LEN, 0, 0, false, LEN),
        Some("gaps") => (LEN, 4 << 10, 0, false, LEN),
        Some("runs") => (LEN, 0, 0, true, LEN),
        Some("pages") => (PAGE, 0, 0, true, LEN),
        Some("apart") => (PAGE, 0, PAGE, true, LEN),
        Some("long") => (PAGE, 0, 0, false, LONG_SLICE),
        Some(other) => panic!("layout {other}: contiguous, gaps, runs, pages, apart or long"),
    };
    let transport = match args.get(3).map(String::as_str) {
        None | Some("threaded") => ThreadedTransport::new(slice),
        Some("instant") => ThreadedTransport::instant(slice),
        Some(other) => panic!("transport {other}: threaded or instant"),
    };
    let engine = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(transport)
        .build()
        .expect("engine");
    let stride = len + gap;
    let at = |i: usize| i * stride + i / RUN * run_gap;
    let half = at(MAX_PER_BATCH);
    let buffer = engine.allocate(2 * half, "cpu:0").expect("buffer");
    let runs = per_batch.div_ceil(RUN);
    let requests: Vec<TransferRequest> = (0..per_batch)
        .map(|n| {
            // Where the `n`th request submitted sits: in order, or the runs of `RUN` taken
            // 0, 5, 10, … (5 has no factor in common with a power of two, so when the count
            // of runs is one, every run comes once).
            let i = if in_runs && runs.is_power_of_two() {
                (n / RUN * 5 % runs) * RUN + n % RUN
            } else {
                n
            };
            TransferRequest::write(
                buffer.addr() + at(i),
                SegmentId::LOCAL,
                (buffer.addr() + half + at(i)) as u64,
                len,
            )
        })
        .collect();
    for _ in 0..batches {
        let batch = engine.allocate_batch(per_batch).expect("batch");
        engine.submit(&batch, &requests).expect("submit");
        // What the wait returns is the batch's status: read once, as a caller would.
        let status = batch.wait(Duration::from_secs(60));
        assert_eq!(status.completed, per_batch);
        engine.free_batch(&batch).expect("free");
    }
    drop(buffer);
    drop(engine);
}
