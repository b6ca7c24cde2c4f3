//! Device memory is read and written after the work the caller enqueued before the transfer,
//! and Tern never waits on the legacy default stream itself, against the stand-in CUDA
//! driver, which models what a GPU does here: its non-blocking streams (Tern's) run unordered
//! with stream 0 unless an event orders them, its synchronous copies are stream-0 work (one
//! from pageable memory returns before its bytes land), and a "kernel" on stream 0 can be left
//! pending behind a gate.
//!
//! - A transfer that names no stream comes after the device's earlier work on stream 0: a
//!   write sends what a pending kernel writes, a read lands after a pending kernel that writes
//!   its destination.
//! - A transfer on stream 0 over the same-host transport ends: the gate it holds stream 0 with
//!   never waits for a copy of Tern's queued behind it.
//! - A buffer written from pageable memory holds the bytes when the write returns.
//!
//! On a real GPU (the bundle) the last two run as they are; the first two need the stand-in's
//! kernel on stream 0 and leave that to the bundle's PyTorch checks.

use std::time::Duration;

use tern_cuda::{CallerStream, Device, DeviceBuffer};
use tern_engine::{SegmentId, StreamTransfer, TransferEngine, TransferRequest};
#[path = "support/gpu.rs"]
mod gpu_support;
use gpu_support::{device_bytes, engine, gpu, register};
#[path = "../../testkit/include/transfers.rs"]
mod transfers;
use transfers::run_to_completion;

const LEN: usize = 3 * tern_memreg::STAGE_CHUNK + 4321;

/// Device 0 if the driver loaded is the stand-in, which can leave a "kernel" pending on
/// stream 0; `None` on a real GPU, where the bundle's PyTorch checks do that.
fn standin_gpu() -> Option<&'static Device> {
    let gpu = gpu();
    let on_standin =
        tern_cuda::loaded().is_some_and(|d| d.path().ends_with(tern_testkit::cuda::STANDIN_FILE));
    on_standin.then_some(gpu)
}

fn remote_addr(engine: &TransferEngine, peer: SegmentId) -> u64 {
    engine.segment(peer).unwrap().desc.buffers[0].addr
}

/// Holds the legacy stream of `gpu` behind a gate, with a "kernel" filling `buffer` with
/// `value` queued behind it; returns the gate, to open after the transfer was asked for.
fn kernel_pending_on_stream_0(
    gpu: &'static Device,
    buffer: &DeviceBuffer,
    value: u8,
) -> tern_cuda::Gate {
    let _current = gpu.enter().unwrap();
    // SAFETY: 0 is the legacy stream of the context current on this thread.
    let stream_0 = unsafe { CallerStream::from_raw(0) }.unwrap();
    let gate = stream_0.gate().unwrap();
    stream_0.hold_until(&gate).unwrap();
    tern_cuda::standin::fill_on_legacy_stream(gpu, buffer.addr(), value, buffer.len()).unwrap();
    gate
}

/// Runs `requests` on another thread, opens `gate` a while after, and waits for them.
fn run_while_stream_0_is_held(
    engine: &TransferEngine,
    requests: Vec<TransferRequest>,
    gate: tern_cuda::Gate,
) {
    std::thread::scope(|scope| {
        let transfer = scope.spawn(|| run_to_completion(engine, &requests));
        std::thread::sleep(Duration::from_millis(300));
        gate.open();
        transfer.join().unwrap();
    });
}

#[test]
fn a_write_that_names_no_stream_sends_what_the_work_before_it_on_stream_0_wrote() {
    let Some(gpu) = standin_gpu() else { return };
    let (source, target) = (gpu.allocate(LEN).unwrap(), gpu.allocate(LEN).unwrap());
    source.write(0, &vec![0x11; LEN]).unwrap();
    let (initiator, peer_engine) = (engine(false), engine(false));
    register(&initiator, &source, "*");
    register(&peer_engine, &target, "*");
    let peer = initiator.open_segment(peer_engine.segment_name()).unwrap();
    let at = remote_addr(&initiator, peer);
    let gate = kernel_pending_on_stream_0(gpu, &source, 0x5a);
    let write = TransferRequest::write(source.addr() as usize, peer, at, LEN);
    run_while_stream_0_is_held(&initiator, vec![write], gate);
    assert!(
        device_bytes(&target).iter().all(|&b| b == 0x5a),
        "the write sent the bytes from before the kernel queued ahead of it on stream 0"
    );
    drop((initiator, peer_engine));
}

#[test]
fn a_read_that_names_no_stream_lands_after_the_work_before_it_on_stream_0() {
    let Some(gpu) = standin_gpu() else { return };
    let (landing, remote) = (gpu.allocate(LEN).unwrap(), gpu.allocate(LEN).unwrap());
    remote.write(0, &vec![0x77; LEN]).unwrap();
    let (initiator, peer_engine) = (engine(false), engine(false));
    register(&initiator, &landing, "*");
    register(&peer_engine, &remote, "*");
    let peer = initiator.open_segment(peer_engine.segment_name()).unwrap();
    let at = remote_addr(&initiator, peer);
    // A kernel that writes the read's destination, queued before the read.
    let gate = kernel_pending_on_stream_0(gpu, &landing, 0x22);
    let read = TransferRequest::read(landing.addr() as usize, peer, at, LEN);
    run_while_stream_0_is_held(&initiator, vec![read], gate);
    assert!(
        device_bytes(&landing).iter().all(|&b| b == 0x77),
        "the read landed before the kernel queued ahead of it, which then overwrote it"
    );
    drop((initiator, peer_engine));
}

/// Waits for a transfer on a stream, at most 20 s; on a hang the engines are forgotten (their
/// threads are stuck in the driver, and joining them would hang the test too) and the test
/// fails.
fn ends_within(
    transfer: &StreamTransfer,
    engines: (TransferEngine, TransferEngine),
) -> (u64, (TransferEngine, TransferEngine)) {
    match transfer.wait(Duration::from_secs(20)) {
        Some(outcome) => (outcome.unwrap(), engines),
        None => {
            std::mem::forget(engines);
            panic!("a transfer on stream 0 never ended: Tern waited behind its own gate");
        }
    }
}

#[test]
fn a_transfer_on_stream_0_over_the_same_host_transport_ends() {
    let gpu = gpu();
    let (source, target) = (gpu.allocate(LEN).unwrap(), gpu.allocate(LEN).unwrap());
    source.write(0, &vec![0x3c; LEN]).unwrap();
    let (initiator, peer_engine) = (engine(true), engine(true));
    register(&initiator, &source, "*");
    register(&peer_engine, &target, "*");
    let peer = initiator.open_segment(peer_engine.segment_name()).unwrap();
    let at = remote_addr(&initiator, peer);
    let transfer = {
        let _current = gpu.enter().unwrap();
        // SAFETY: 0 is the legacy stream of the context current on this thread.
        let stream_0 = unsafe { CallerStream::from_raw(0) }.unwrap();
        initiator
            .submit_on_stream(
                &stream_0,
                vec![TransferRequest::write(
                    source.addr() as usize,
                    peer,
                    at,
                    LEN,
                )],
            )
            .unwrap()
    };
    let (moved, engines) = ends_within(&transfer, (initiator, peer_engine));
    assert_eq!(moved, LEN as u64);
    let stats = engines.0.stats();
    let shm = stats
        .transports
        .iter()
        .find(|t| t.protocol == "shm")
        .unwrap();
    assert!(
        shm.declined.is_empty() && shm.bytes == LEN as u64,
        "the same-host transport carried it: {stats:?}"
    );
    assert!(device_bytes(&target).iter().all(|&b| b == 0x3c));
    drop(engines);
}

#[test]
fn a_device_buffer_written_from_pageable_memory_holds_the_bytes_when_the_write_returns() {
    let gpu = gpu();
    let buffer = gpu.allocate(LEN).unwrap();
    let data: Vec<u8> = (0..LEN).map(|i| (i % 253) as u8).collect();
    buffer.write(0, &data).unwrap();
    // Read back on a stream of its own, which nothing orders after the write but its end.
    let stream = tern_cuda::Stream::new(gpu).unwrap();
    let mut pinned = tern_cuda::PinnedBuffer::new(gpu, LEN).unwrap();
    // SAFETY: the buffer is live device memory of LEN bytes, the pinned buffer holds LEN
    // bytes and is not read before the stream is synchronized.
    unsafe {
        stream
            .copy_to_host(pinned.as_mut_ptr(), buffer.addr(), LEN)
            .unwrap();
    }
    stream.synchronize().unwrap();
    assert!(
        pinned.bytes() == data,
        "the write returned before its bytes were in device memory"
    );
}
