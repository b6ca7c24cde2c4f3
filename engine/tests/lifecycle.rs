//! Engine rules that need a transfer to stay in flight on demand: a transport that holds
//! slices until the test releases them stands in for the wire (the wire itself is proven by
//! each transport's conformance run). Registration, batches and segments are the real ones.

use std::time::{Duration, Instant};

use tern_engine::{
    Batch, BatchState, EngineError, OwnedBuffer, RegisterRaw, SegmentId, Slice, TransferEngine,
    TransferError, TransferRequest, TransferStatus,
};

#[path = "support/holding.rs"]
mod holding;
use holding::HoldingTransport;
// Memory registered raw, as an application's own; what watches it is not needed here.
#[allow(dead_code)]
#[path = "../../testkit/include/local.rs"]
mod local;
use local::Local;

fn engine() -> (TransferEngine, HoldingTransport) {
    holding::holding_engine()
}

/// Two 8 KiB reads within 64 KiB of the test's own memory, registered raw, submitted in one
/// batch: the memory's address and the batch.
fn two_reads_of_own_memory(engine: &TransferEngine) -> (usize, Batch) {
    let base = Local::register(engine, 1 << 16).addr();
    let batch = engine.allocate_batch(2).unwrap();
    let req = TransferRequest::read(base, SegmentId::LOCAL, base as u64 + 32768, 8192);
    engine.submit(&batch, &[req, req]).unwrap();
    (base, batch)
}

/// A 100-byte write from the start of a new 64 KiB buffer to `offset` in it, alone in a
/// batch: the buffer (kept while the write may run), the request and its batch.
fn a_write_within_one_buffer(
    engine: &TransferEngine,
    offset: u64,
) -> (OwnedBuffer, TransferRequest, Batch) {
    let buffer = engine.allocate(1 << 16, "cpu:0").unwrap();
    let batch = engine.allocate_batch(1).unwrap();
    let request = TransferRequest::write(
        buffer.addr(),
        SegmentId::LOCAL,
        buffer.addr() as u64 + offset,
        100,
    );
    engine.submit(&batch, &[request]).unwrap();
    (buffer, request, batch)
}

/// Writes of `lens` bytes between two new buffers of `engine`, submitted in one batch: the
/// batch, the slices the transport holds for them, and the buffers (kept while they run).
fn held_writes(
    engine: &TransferEngine,
    transport: &HoldingTransport,
    lens: &[usize],
) -> (Batch, Vec<Slice>, [OwnedBuffer; 2]) {
    let local = engine.allocate(1 << 16, "cpu:0").unwrap();
    let remote = engine.allocate(1 << 16, "cpu:0").unwrap();
    let batch = engine.allocate_batch(lens.len()).unwrap();
    let requests: Vec<TransferRequest> = lens
        .iter()
        .map(|&len| {
            TransferRequest::write(local.addr(), SegmentId::LOCAL, remote.addr() as u64, len)
        })
        .collect();
    engine.submit(&batch, &requests).unwrap();
    (batch, transport.take(), [local, remote])
}

#[test]
fn registration_rejects_zero_length_overlap_and_unknown_addresses() {
    let (engine, _) = engine();
    let mut memory = vec![0u8; 1 << 16];
    let base = memory.as_mut_ptr();
    // SAFETY: `memory` outlives every registration; all are undone before it drops.
    unsafe {
        assert!(matches!(
            engine.register_memory(base, 0, "cpu:0", true),
            Err(EngineError::InvalidArgument(_))
        ));
        engine.register_memory(base, 4096, "cpu:0", true).unwrap();
        assert!(matches!(
            engine.register_memory(base.add(100), 10, "cpu:0", true),
            Err(EngineError::AddressOverlapped { .. })
        ));
        // A batch with one bad entry registers nothing.
        let batch = [(base.add(8192), 4096), (base.add(2048), 4096)];
        assert!(matches!(
            engine.register_memory_batch(&batch, "cpu:0", true),
            Err(EngineError::AddressOverlapped { .. })
        ));
    }
    assert_eq!(engine.registered_regions().len(), 1);
    assert!(matches!(
        engine.unregister_memory(base as usize + 1),
        Err(EngineError::AddressNotRegistered { .. })
    ));
    let published = engine.local_descriptor();
    assert_eq!(published.buffers.len(), 1);
    assert_eq!(published.buffers[0].addr, base as u64);
    engine.unregister_memory(base as usize).unwrap();
    assert!(engine.local_descriptor().buffers.is_empty());
    drop(memory);
}

#[test]
fn unregister_and_free_are_refused_while_a_task_is_in_flight() {
    let (engine, transport) = engine();
    let base = Local::register(&engine, 1 << 16).addr();
    let target = engine.allocate(1 << 16, "cpu:0").unwrap();
    let batch = engine.allocate_batch(4).unwrap();
    engine
        .submit(
            &batch,
            &[TransferRequest::write(
                base,
                SegmentId::LOCAL,
                target.addr() as u64,
                10_000,
            )],
        )
        .unwrap();
    let slices = transport.take();
    assert_eq!(slices.len(), 3, "10 000 bytes in 4 KiB slices");
    assert_eq!(
        batch.task_status(0).unwrap().status,
        TransferStatus::Pending
    );
    assert!(matches!(
        engine.unregister_memory(base),
        Err(EngineError::RegionInUse { .. })
    ));
    assert!(matches!(
        engine.free_batch(&batch),
        Err(EngineError::BatchBusy { pending: 1 })
    ));
    let mut slices = slices.into_iter();
    slices.next().unwrap().complete();
    slices.next().unwrap().complete();
    assert_eq!(
        batch.task_status(0).unwrap().status,
        TransferStatus::Pending
    );
    slices.next().unwrap().complete();
    let done = batch.task_status(0).unwrap();
    assert_eq!(
        (done.status, done.transferred_bytes),
        (TransferStatus::Completed, 10_000)
    );
    engine.free_batch(&batch).unwrap();
    engine.unregister_memory(base).unwrap();
}

#[test]
fn cancel_returns_once_the_slices_are_cut_off_and_the_memory_is_free() {
    let (engine, transport) = engine();
    let (base, batch) = two_reads_of_own_memory(&engine);
    assert_eq!(batch.cancel(), 2);
    assert!(transport.take().is_empty(), "cancel cut every slice off");
    assert_eq!(
        batch.task_status(1).unwrap().status,
        TransferStatus::Canceled
    );
    assert_eq!(batch.status().state, BatchState::Failed);
    engine.free_batch(&batch).unwrap();
    engine.unregister_memory(base).unwrap();
}

#[test]
fn a_canceled_task_whose_slices_stay_out_shows_pending_and_keeps_its_memory_pinned() {
    let (engine, transport) = engine();
    transport
        .deaf
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let (base, batch) = two_reads_of_own_memory(&engine);
    // The transport ignores the cut-off: cancel gives up after the drain time, and nothing
    // claims the memory is free.
    assert_eq!(batch.cancel(), 2);
    assert_eq!(
        batch.task_status(1).unwrap().status,
        TransferStatus::Pending
    );
    assert!(matches!(
        engine.free_batch(&batch),
        Err(EngineError::BatchBusy { pending: 2 })
    ));
    assert!(matches!(
        engine.unregister_memory(base),
        Err(EngineError::RegionInUse { .. })
    ));
    for slice in transport.take() {
        assert!(!slice.is_live());
        slice.abandon();
    }
    assert_eq!(
        batch.task_status(1).unwrap().status,
        TransferStatus::Canceled
    );
    engine.free_batch(&batch).unwrap();
    engine.unregister_memory(base).unwrap();
}

#[test]
fn a_deadline_times_out_a_stuck_batch_and_wait_sleeps_until_then() {
    let transport = HoldingTransport::default();
    let engine = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(transport.clone())
        .transfer_timeout(Some(Duration::from_millis(200)))
        .build()
        .unwrap();
    let (_buffer, request, batch) = a_write_within_one_buffer(&engine, 4096);
    let started = Instant::now();
    let status = batch.wait(Duration::from_secs(60));
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "wait ignored the deadline"
    );
    assert_eq!(status.state, BatchState::Failed);
    assert_eq!(
        batch.task_status(0).unwrap().status,
        TransferStatus::Timeout
    );
    assert!(
        transport.take().is_empty(),
        "the deadline cut every slice off"
    );
    assert!(matches!(
        engine.transfer_sync(request),
        Err(EngineError::TransferFailed {
            status: TransferStatus::Timeout
        })
    ));
}

#[test]
fn a_transport_that_drops_slices_fails_the_task_instead_of_hanging() {
    let (engine, transport) = engine();
    let (_buffer, _, batch) = a_write_within_one_buffer(&engine, 8192);
    drop(transport.take());
    assert!(matches!(
        batch.task_status(0).unwrap().status,
        TransferStatus::Failed(TransferError::Dropped(_))
    ));
}

#[test]
fn segments_open_close_and_reject_bad_names() {
    let (engine, _) = engine();
    assert!(matches!(
        engine.open_segment(""),
        Err(EngineError::InvalidArgument(_))
    ));
    assert!(matches!(
        engine.open_segment("/"),
        Err(EngineError::InvalidArgument(_))
    ));
    assert_eq!(
        engine.open_segment(engine.segment_name()).unwrap(),
        SegmentId::LOCAL
    );
    let own = format!("/{}", engine.segment_name());
    assert_eq!(engine.open_segment(&own).unwrap(), SegmentId::LOCAL);
    assert!(engine.open_segment("not-an-endpoint").is_err());
    assert!(
        engine.open_segment("127.0.0.1:1").is_err(),
        "nothing listens on port 1"
    );

    let (other, _) = self::engine();
    let id = engine.open_segment(other.segment_name()).unwrap();
    assert_ne!(id, SegmentId::LOCAL);
    assert_eq!(
        engine.open_segment(other.segment_name()).unwrap(),
        id,
        "cached"
    );
    engine.close_segment(id).unwrap();
    assert!(matches!(
        engine.close_segment(id),
        Err(EngineError::UnknownSegment(_))
    ));
    let buffer = engine.allocate(4096, "cpu:0").unwrap();
    let batch = engine.allocate_batch(1).unwrap();
    engine
        .submit(
            &batch,
            &[TransferRequest::read(buffer.addr(), id, 4096, 16)],
        )
        .unwrap();
    assert!(matches!(
        batch.task_status(0).unwrap().status,
        TransferStatus::Failed(TransferError::UnknownSegment(_))
    ));
    assert!(matches!(
        engine.allocate(0, "cpu:0"),
        Err(EngineError::InvalidArgument(_))
    ));
    assert!(matches!(
        engine.allocate_batch(0),
        Err(EngineError::InvalidArgument(_))
    ));
}

#[test]
fn error_codes_follow_mooncake() {
    assert_eq!(
        EngineError::InvalidArgument(String::new()).mooncake_code(),
        -1
    );
    let too_many = EngineError::TooManyRequests {
        capacity: 1,
        room: 0,
        requested: 2,
    };
    assert_eq!(too_many.mooncake_code(), -2);
    assert_eq!(
        EngineError::AddressNotRegistered { addr: 0 }.mooncake_code(),
        -3
    );
    assert_eq!(EngineError::BatchBusy { pending: 1 }.mooncake_code(), -4);
    let overlap = EngineError::AddressOverlapped {
        addr: 0,
        len: 1,
        existing: 0,
    };
    assert_eq!(overlap.mooncake_code(), -7);
    assert_eq!(TransferStatus::Completed.mooncake_code(), 4);
    assert_eq!(
        TransferStatus::Failed(TransferError::ZeroLength).mooncake_code(),
        6
    );
}

#[test]
fn engines_need_a_transport_and_a_known_metadata_store() {
    assert!(matches!(
        TransferEngine::builder()
            .local_server_name("127.0.0.1")
            .build(),
        Err(EngineError::InvalidArgument(_))
    ));
    let err = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .metadata("redis://127.0.0.1:6379")
        .transport(HoldingTransport::default())
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("redis"), "{err}");
    assert!(
        TransferEngine::builder()
            .metadata("ftp://x")
            .transport(HoldingTransport::default())
            .build()
            .is_err()
    );
}

/// The engine counts what its transports report back: completed slices and their bytes,
/// failed slices; skipped ones (their task already over) count as neither.
#[test]
fn stats_count_completed_failed_and_skipped_slices() {
    let (engine, transport) = engine();
    // 10 000 bytes in slices of 4096: three slices; then one slice to fail; one to skip.
    let (batch, mut slices, _buffers) = held_writes(&engine, &transport, &[10_000, 100, 200]);
    assert_eq!(slices.len(), 5);
    let skipped = slices.pop().unwrap();
    let failed = slices.pop().unwrap();
    for slice in slices {
        slice.complete();
    }
    failed.fail(TransferError::Dropped("on purpose".into()));
    batch.cancel();
    skipped.abandon();
    let stats = engine.stats();
    assert_eq!(stats.transports.len(), 1);
    let hold = &stats.transports[0];
    assert_eq!(hold.protocol, "hold");
    assert_eq!((hold.bytes, hold.slices, hold.failures), (10_000, 3, 1));
    assert_eq!(hold.retries, 0, "this transport reports none");
    assert!(hold.peers.is_empty());
}

/// A slice given up (abandoned, cut off) while its task still runs fails the task: whatever
/// a transport does, a task whose bytes did not all move never shows Completed.
#[test]
fn a_slice_given_up_while_its_task_runs_fails_the_task() {
    let (engine, transport) = engine();
    let (batch, mut slices, _buffers) = held_writes(&engine, &transport, &[4096, 4096]);
    assert_eq!(slices.len(), 2);
    let (cut, skipped) = (slices.pop().unwrap(), slices.pop().unwrap());
    assert!(skipped.is_live() && cut.is_live());
    skipped.abandon();
    cut.cut_off(true);
    let status = batch.wait(Duration::from_secs(10));
    assert_eq!((status.completed, status.failed), (0, 2), "{status:?}");
    for task in 0..2 {
        let status = batch.task_status(task).unwrap();
        assert!(
            matches!(
                status.status,
                TransferStatus::Failed(TransferError::Dropped(_))
            ),
            "{status:?}"
        );
        assert_eq!(status.transferred_bytes, 0);
    }
    assert!(batch.task_status(1).unwrap().remote_may_change);
}

/// A batch's tasks count once, whether the stats are read while it lives or after it went,
/// and a reader racing batches as they go never sees a count go down or a batch's bytes
/// counted twice.
#[test]
fn stats_count_each_batch_once_while_batches_go_under_a_reader() {
    const BATCHES: usize = 200;
    const LEN: usize = 1000;
    let (engine, transport) = engine();
    let engine = std::sync::Arc::new(engine);
    let buffers = [
        engine.allocate(1 << 16, "cpu:0").unwrap(),
        engine.allocate(1 << 16, "cpu:0").unwrap(),
    ];
    let request = TransferRequest::write(
        buffers[0].addr(),
        SegmentId::LOCAL,
        buffers[1].addr() as u64,
        LEN,
    );
    let hold_bytes = |engine: &TransferEngine| engine.stats().transports[0].bytes;

    // One batch read while it lives, then after it went.
    let batch = engine.allocate_batch(1).unwrap();
    engine.submit(&batch, &[request]).unwrap();
    for slice in transport.take() {
        slice.complete();
    }
    assert_eq!(
        hold_bytes(&engine),
        LEN as u64,
        "a live batch's tasks count"
    );
    engine.free_batch(&batch).unwrap();
    drop(batch);
    assert_eq!(
        hold_bytes(&engine),
        LEN as u64,
        "a gone batch's tasks count once"
    );

    // Batches going on this thread while another reads.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (engine, done) = (engine.clone(), done.clone());
        std::thread::spawn(move || {
            let mut last = 0;
            let mut reads = 0u64;
            while !done.load(std::sync::atomic::Ordering::Acquire) || reads == 0 {
                let now = hold_bytes(&engine);
                assert!(now >= last, "the count went down: {last} -> {now}");
                assert!(now <= ((BATCHES + 1) * LEN) as u64, "counted twice: {now}");
                last = now;
                reads += 1;
            }
        })
    };
    for _ in 0..BATCHES {
        let batch = engine.allocate_batch(1).unwrap();
        engine.submit(&batch, &[request]).unwrap();
        for slice in transport.take() {
            slice.complete();
        }
        assert_eq!(batch.wait(Duration::from_secs(5)).completed, 1);
    }
    done.store(true, std::sync::atomic::Ordering::Release);
    reader.join().unwrap();
    assert_eq!(hold_bytes(&engine), ((BATCHES + 1) * LEN) as u64);
}

/// An engine over the holding transport, with metrics on and the transfer timeout given.
fn timed_engine(timeout: Option<Duration>) -> (TransferEngine, HoldingTransport) {
    let transport = HoldingTransport::default();
    let engine = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transfer_timeout(timeout)
        .metrics(true)
        .transport(transport.clone())
        .build()
        .unwrap();
    (engine, transport)
}

/// A 100-byte write within a new 64 KiB buffer (kept while the write may run).
fn a_write_request(engine: &TransferEngine) -> (OwnedBuffer, TransferRequest) {
    let buffer = engine.allocate(1 << 16, "cpu:0").unwrap();
    let request = TransferRequest::write(
        buffer.addr(),
        SegmentId::LOCAL,
        buffer.addr() as u64 + 4096,
        100,
    );
    (buffer, request)
}

#[test]
fn an_empty_submit_arms_no_deadline() {
    let (engine, transport) = timed_engine(Some(Duration::from_millis(100)));
    let (_buffer, request) = a_write_request(&engine);
    let batch = engine.allocate_batch(2).unwrap();
    engine.submit(&batch, &[]).unwrap();
    assert_eq!(batch.status().submitted, 0, "an empty submit takes no slot");
    // Longer than the transfer timeout: a deadline the empty call armed would have passed.
    std::thread::sleep(Duration::from_millis(300));
    engine.submit(&batch, &[request]).unwrap();
    assert_eq!(
        batch.task_status(0).unwrap().status,
        TransferStatus::Pending,
        "the batch's deadline runs from its first request"
    );
    for slice in transport.take() {
        slice.complete();
    }
    let status = batch.wait(Duration::from_secs(10));
    assert_eq!(status.completed, 1, "{status:?}");
    engine.free_batch(&batch).unwrap();
    assert!(matches!(
        engine.submit(&batch, &[]),
        Err(EngineError::BatchFreed)
    ));
}

#[test]
fn an_empty_submit_is_not_the_start_a_later_task_is_timed_from() {
    let (engine, transport) = timed_engine(None);
    let (_buffer, request) = a_write_request(&engine);
    let batch = engine.allocate_batch(2).unwrap();
    // Task 0, done at once.
    engine.submit(&batch, &[request]).unwrap();
    for slice in transport.take() {
        slice.complete();
    }
    engine.submit(&batch, &[]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    // Task 1, done at once too.
    engine.submit(&batch, &[request]).unwrap();
    for slice in transport.take() {
        slice.complete();
    }
    let status = batch.wait(Duration::from_secs(10));
    assert_eq!((status.completed, status.submitted), (2, 2), "{status:?}");
    let stats = engine.stats();
    let (count, seconds) = stats
        .latency
        .iter()
        .fold((0, 0.0), |(n, s), l| (n + l.count, s + l.sum_seconds));
    assert_eq!(count, 2, "{:?}", stats.latency);
    assert!(
        seconds < 0.25,
        "a task was timed from the empty call: {seconds} s in all"
    );
}
