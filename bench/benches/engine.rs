//! Engine bookkeeping without I/O, and the region map's lookup cost.
//!
//! `submit_complete_64k` measures one 64 KiB request from batch allocation through submit,
//! slice completion and status to free, with a transport that completes every slice as soon
//! as it is handed over: what the engine itself costs per request.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use tern_engine::{SegmentId, TransferEngine, TransferRequest};
use tern_memreg::RegionMap;

#[path = "support/threaded.rs"]
mod threaded;
use threaded::ThreadedTransport;

fn submit_complete(c: &mut Criterion) {
    let engine = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(ThreadedTransport::instant(1 << 20))
        .build()
        .expect("engine");
    let buffer = engine.allocate(1 << 20, "cpu:0").expect("buffer");
    let request = TransferRequest::write(
        buffer.addr(),
        SegmentId::LOCAL,
        (buffer.addr() + (512 << 10)) as u64,
        64 << 10,
    );
    c.bench_function("submit_complete_64k", |b| {
        b.iter(|| {
            let batch = engine.allocate_batch(1).expect("batch");
            engine
                .submit(&batch, black_box(&[request]))
                .expect("submit");
            let status = batch.status();
            assert_eq!(status.completed, 1);
            engine.free_batch(&batch).expect("free");
        })
    });
    let batch128: Vec<TransferRequest> = (0..128).map(|_| request).collect();
    c.bench_function("submit_complete_128x64k_per_request", |b| {
        b.iter_custom(|iters| {
            let started = std::time::Instant::now();
            for _ in 0..iters {
                let batch = engine.allocate_batch(128).expect("batch");
                engine.submit(&batch, black_box(&batch128)).expect("submit");
                assert_eq!(batch.status().completed, 128);
                engine.free_batch(&batch).expect("free");
            }
            started.elapsed() / 128
        })
    });
}

fn open_cached_segment(c: &mut Criterion) {
    let build = || {
        TransferEngine::builder()
            .local_server_name("127.0.0.1")
            .transport(ThreadedTransport::instant(1 << 20))
            .build()
            .expect("engine")
    };
    let (engine, peer) = (build(), build());
    let name = peer.segment_name().to_owned();
    let id = engine.open_segment(&name).expect("first open fetches");
    c.bench_function("open_segment_cached", |b| {
        b.iter(|| assert_eq!(engine.open_segment(black_box(&name)).expect("open"), id))
    });
}

fn region_lookup(c: &mut Criterion) {
    let mut map = RegionMap::new();
    for i in 0..10_000usize {
        map.insert(0x1000_0000 + i * 0x10_0000, 0x8_0000, i)
            .expect("insert");
    }
    let mut probe = 0usize;
    c.bench_function("region_lookup_10k", |b| {
        b.iter(|| {
            probe = (probe + 7919) % 10_000;
            black_box(map.find_containing(0x1000_0000 + probe * 0x10_0000 + 100, 4096))
        })
    });
}

criterion_group!(benches, submit_complete, open_cached_segment, region_lookup);
criterion_main!(benches);
