//! What the engine costs per slice when a transport completes slices on another thread, as
//! real transports do: the submitting thread checks, pins and slices requests and hands them
//! over through a channel; a worker thread completes each one; the submitter waits for its
//! batch. No bytes move, so what is measured is the engine's bookkeeping, the hand-over and
//! the wake-up.
//!
//! - `slices/128x64k_per_slice`: a batch of 128 requests of 64 KiB (one slice each), time
//!   per slice;
//! - `slices/16x1m_per_slice`: a batch of 16 requests of 1 MiB (16 slices each), per slice;
//! - `slices/batch1_64k_per_request`: one 64 KiB request per batch, per request (the round
//!   trip through the worker included);
//! - `slices/128x64k_per_slice_metrics_off`: the first with the engine's counting and timing
//!   off (`TransferEngineBuilder::metrics(false)`), for what metrics cost per slice.
//!
//! Before the benches it prints the heap allocations per slice in steady state, counted by a
//! counting global allocator over 1000 batches of 128.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use tern_engine::{SegmentId, TransferEngine, TransferRequest};
use tern_memreg::CountingAllocator;

#[path = "support/threaded.rs"]
mod threaded;
use threaded::ThreadedTransport;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

struct Setup {
    engine: TransferEngine,
    _buffer: tern_engine::OwnedBuffer,
    requests: Vec<TransferRequest>,
}

fn setup(count: usize, len: usize, metrics: bool) -> Setup {
    let engine = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .metrics(metrics)
        .transport(ThreadedTransport::new(64 << 10))
        .build()
        .expect("engine");
    let buffer = engine.allocate(2 * count * len, "cpu:0").expect("buffer");
    let requests = (0..count)
        .map(|i| {
            TransferRequest::write(
                buffer.addr() + i * len,
                SegmentId::LOCAL,
                (buffer.addr() + (count + i) * len) as u64,
                len,
            )
        })
        .collect();
    Setup {
        engine,
        _buffer: buffer,
        requests,
    }
}

/// One batch: allocate, submit, wait for every task, free.
fn one_batch(setup: &Setup) {
    let batch = setup
        .engine
        .allocate_batch(setup.requests.len())
        .expect("batch");
    setup
        .engine
        .submit(&batch, black_box(&setup.requests))
        .expect("submit");
    batch.wait(Duration::from_secs(10));
    assert_eq!(batch.status().completed, setup.requests.len());
    setup.engine.free_batch(&batch).expect("free");
}

fn allocations_per_slice() {
    let setup = setup(128, 64 << 10, true);
    for _ in 0..100 {
        one_batch(&setup);
    }
    let before = CountingAllocator::allocations();
    let batches = 1000u64;
    for _ in 0..batches {
        one_batch(&setup);
    }
    let per_slice = (CountingAllocator::allocations() - before) as f64 / (batches * 128) as f64;
    println!(
        "slices: heap allocations per 64 KiB slice in steady state (batch of 128): {per_slice:.2}"
    );
}

fn per_slice(c: &mut Criterion, name: &str, count: usize, len: usize, metrics: bool) {
    let setup = setup(count, len, metrics);
    let slices = (count * len.div_ceil(64 << 10)) as u32;
    c.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let started = Instant::now();
            for _ in 0..iters {
                one_batch(&setup);
            }
            started.elapsed() / slices
        })
    });
}

fn slices(c: &mut Criterion) {
    allocations_per_slice();
    per_slice(c, "slices/128x64k_per_slice", 128, 64 << 10, true);
    per_slice(
        c,
        "slices/128x64k_per_slice_metrics_off",
        128,
        64 << 10,
        false,
    );
    per_slice(c, "slices/16x1m_per_slice", 16, 1 << 20, true);
    per_slice(c, "slices/batch1_64k_per_request", 1, 64 << 10, true);
}

criterion_group!(benches, slices);
criterion_main!(benches);
