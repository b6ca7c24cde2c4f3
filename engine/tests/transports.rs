//! What the engine gives a third transport: a slice handed back ([`Slice::decline`]) moves on
//! to the next transport that reaches the peer without failing its task or touching the
//! others; a transport's own descriptor fields live under `tern.<protocol>`; only the
//! transport that owns buffer keys may change them; and `allocate` takes memory from the
//! transport that offers it. Stand-in transports that move no bytes (the conformance suites
//! prove the wire); the engine, its registry and its descriptors are the real ones.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[path = "support/holding.rs"]
mod holding;
use holding::HoldingTransport;
use tern_engine::{
    AlignedBuffer, RegionInfo, SegmentDesc, SegmentId, Slice, TransferEngine, TransferError,
    TransferRequest, TransferStatus, Transport, TransportContext, TransportError,
};

/// Completes or declines every slice it is given, counting both; describes itself.
struct Stub {
    name: &'static str,
    priority: u8,
    /// Declines slices whose local address is at or past this.
    decline_from: usize,
    declined: Arc<AtomicUsize>,
    completed: Arc<AtomicUsize>,
    offers_memory: bool,
    allocations: Arc<AtomicUsize>,
    slice_size: usize,
}

impl Stub {
    fn new(name: &'static str, priority: u8) -> Self {
        Self {
            name,
            priority,
            decline_from: usize::MAX,
            declined: Arc::default(),
            completed: Arc::default(),
            offers_memory: false,
            allocations: Arc::default(),
            slice_size: 4096,
        }
    }
}

impl Transport for Stub {
    fn protocol(&self) -> &'static str {
        self.name
    }
    fn priority(&self) -> u8 {
        self.priority
    }
    fn can_reach(&self, _peer: &SegmentDesc) -> bool {
        true
    }
    fn start(&self, _context: TransportContext) -> Result<(), TransportError> {
        Ok(())
    }
    fn describe(&self, desc: &mut SegmentDesc, _regions: &[RegionInfo]) {
        // A transport without buffer keys tries to change them: the engine puts them back.
        for buffer in &mut desc.buffers {
            buffer.rkey = Some(vec![0xBAD]);
        }
    }
    fn extension(&self, regions: &[RegionInfo]) -> Option<serde_json::Value> {
        Some(serde_json::json!({ "name": self.name, "regions": regions.len() }))
    }
    fn allocate(&self, len: usize) -> Option<Result<AlignedBuffer, TransportError>> {
        self.offers_memory.then(|| {
            self.allocations.fetch_add(1, Ordering::Relaxed);
            AlignedBuffer::new(len).ok_or(TransportError::Memory {
                addr: 0,
                len,
                message: "no memory".into(),
            })
        })
    }
    fn max_slice_size(&self) -> usize {
        self.slice_size
    }
    fn submit(&self, slices: &mut Vec<Slice>) {
        for slice in slices.drain(..) {
            if slice.local_addr >= self.decline_from {
                self.declined.fetch_add(1, Ordering::Relaxed);
                slice.decline("that memory is out of reach");
            } else {
                self.completed.fetch_add(1, Ordering::Relaxed);
                slice.complete();
            }
        }
    }
    fn shutdown(&self) {}
}

/// An engine on loopback with these transports.
fn engine_with<T: Transport>(transports: impl IntoIterator<Item = T>) -> TransferEngine {
    transports
        .into_iter()
        .fold(
            TransferEngine::builder().local_server_name("127.0.0.1"),
            |builder, transport| builder.transport(transport),
        )
        .build()
        .unwrap()
}

#[test]
fn a_declined_slice_moves_to_the_next_transport_and_its_task_completes() {
    let mut near = Stub::new("near", 20);
    let mut far = Stub::new("far", 10);
    let (near_done, near_declined, far_done) = (
        near.completed.clone(),
        near.declined.clone(),
        far.completed.clone(),
    );
    near.decline_from = 0;
    far.decline_from = usize::MAX;
    let engine = engine_with([far, near]);
    let buffer = engine.allocate(64 << 10, "cpu:0").unwrap();
    let batch = engine.allocate_batch(2).unwrap();
    engine
        .submit(
            &batch,
            &[
                TransferRequest::write(
                    buffer.addr(),
                    SegmentId::LOCAL,
                    (buffer.addr() + (32 << 10)) as u64,
                    16 << 10,
                ),
                TransferRequest::read(
                    buffer.addr() + (16 << 10),
                    SegmentId::LOCAL,
                    (buffer.addr() + (48 << 10)) as u64,
                    8 << 10,
                ),
            ],
        )
        .unwrap();
    batch.wait(Duration::from_secs(5));
    for task in 0..2 {
        assert_eq!(
            batch.task_status(task).unwrap().status,
            TransferStatus::Completed
        );
    }
    // Six 4 KiB slices: the preferred transport declined each, the next carried each.
    assert_eq!(near_declined.load(Ordering::Relaxed), 6);
    assert_eq!(near_done.load(Ordering::Relaxed), 0);
    assert_eq!(far_done.load(Ordering::Relaxed), 6);
    let stats = engine.stats();
    assert_eq!(moved_by(&stats, "far"), (6, 24 << 10));
    assert_eq!(
        moved_by(&stats, "near"),
        (0, 0),
        "what the first transport declined is not counted for it"
    );
    let timed = |stats: &tern_engine::EngineStats| -> Vec<(String, String, u64)> {
        stats
            .latency
            .iter()
            .map(|l| (l.operation.clone(), l.size.clone(), l.count))
            .collect()
    };
    let expected = [
        ("read".to_owned(), "64KiB".to_owned(), 1),
        ("write".to_owned(), "64KiB".to_owned(), 1),
    ];
    assert_eq!(timed(&stats), expected);
    // A batch that goes leaves its counts behind, once.
    engine.free_batch(&batch).unwrap();
    drop(batch);
    let after = engine.stats();
    assert_eq!(moved_by(&after, "far"), (6, 24 << 10));
    assert_eq!(timed(&after), expected);
}

/// `(slices, bytes)` that the transport named `protocol` moved.
fn moved_by(stats: &tern_engine::EngineStats, protocol: &str) -> (u64, u64) {
    let transport = stats
        .transports
        .iter()
        .find(|t| t.protocol == protocol)
        .unwrap();
    (transport.slices, transport.bytes)
}

#[test]
fn among_transports_of_one_priority_the_first_installed_carries_and_a_higher_one_wins() {
    // Each transport's priority, in the order installed; which carries the two 4 KiB slices.
    let cases: [(&[u8], &[usize]); 3] = [
        (&[10, 10], &[2, 0]),
        (&[10, 10, 30], &[0, 0, 2]),
        (&[5, 30, 30], &[0, 2, 0]),
    ];
    const NAMES: [&str; 3] = ["a", "b", "c"];
    for (priorities, carried) in cases {
        let stubs: Vec<Stub> = priorities
            .iter()
            .zip(NAMES)
            .map(|(&priority, name)| Stub::new(name, priority))
            .collect();
        let counts: Vec<Arc<AtomicUsize>> = stubs.iter().map(|s| s.completed.clone()).collect();
        let engine = engine_with(stubs);
        let buffer = engine.allocate(16 << 10, "cpu:0").unwrap();
        let request = TransferRequest::write(
            buffer.addr(),
            SegmentId::LOCAL,
            (buffer.addr() + 8192) as u64,
            8192,
        );
        engine.transfer_sync(request).unwrap();
        let moved: Vec<usize> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        assert_eq!(moved, carried, "priorities {priorities:?}");
    }
}

#[test]
fn a_declined_slice_larger_than_the_next_transport_takes_is_cut_again() {
    let mut near = Stub::new("near", 20);
    near.slice_size = 16 << 10;
    near.decline_from = 0;
    let near_declined = near.declined.clone();
    let far = Stub::new("far", 10);
    let far_done = far.completed.clone();
    let engine = engine_with([far, near]);
    let buffer = engine.allocate(64 << 10, "cpu:0").unwrap();
    let batch = engine.allocate_batch(1).unwrap();
    let request = TransferRequest::write(
        buffer.addr(),
        SegmentId::LOCAL,
        (buffer.addr() + (32 << 10)) as u64,
        32 << 10,
    );
    engine.submit(&batch, &[request]).unwrap();
    batch.wait(Duration::from_secs(5));
    let status = batch.task_status(0).unwrap();
    assert_eq!(status.status, TransferStatus::Completed);
    assert_eq!(status.transferred_bytes, 32 << 10);
    // Two 16 KiB slices declined, carried as eight of the next transport's 4 KiB.
    assert_eq!(near_declined.load(Ordering::Relaxed), 2);
    assert_eq!(far_done.load(Ordering::Relaxed), 8);
}

#[test]
fn a_slice_every_transport_declines_fails_its_task_with_the_last_reason() {
    let mut only = Stub::new("only", 5);
    only.decline_from = 0;
    let engine = engine_with([only]);
    let buffer = engine.allocate(16 << 10, "cpu:0").unwrap();
    let outcome = engine.transfer_sync(TransferRequest::write(
        buffer.addr(),
        SegmentId::LOCAL,
        (buffer.addr() + (8 << 10)) as u64,
        4096,
    ));
    match outcome {
        Err(tern_engine::EngineError::TransferFailed {
            status: TransferStatus::Failed(TransferError::Declined { reason, .. }),
        }) => assert!(reason.contains("out of reach"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn extensions_are_namespaced_buffer_keys_are_guarded_and_allocation_is_offered() {
    let mut memory = Stub::new("memory", 30);
    memory.offers_memory = true;
    let allocations = memory.allocations.clone();
    let engine = engine_with([Stub::new("other", 1), memory]);
    let buffer = engine.allocate(8192, "cpu:0").unwrap();
    assert_eq!(
        allocations.load(Ordering::Relaxed),
        1,
        "the transport was asked"
    );
    let desc = engine.local_descriptor();
    assert_eq!(desc.tern["memory"]["name"], "memory");
    assert_eq!(desc.tern["other"]["regions"], 1);
    assert!(
        desc.buffers.iter().all(|b| b.rkey.is_none()),
        "a transport that owns no buffer keys changed them: {:?}",
        desc.buffers
    );
    // Mooncake peers see the field as one more key they ignore.
    let json: serde_json::Value = serde_json::from_str(&desc.to_json()).unwrap();
    assert!(json["tern"].is_object());
    assert_eq!(json["buffers"][0]["addr"], buffer.addr() as u64);
}

fn queued_engine(
    offers_help: bool,
) -> (
    TransferEngine,
    Arc<std::sync::Mutex<Vec<std::thread::ThreadId>>>,
) {
    let transport = HoldingTransport {
        offers_help,
        ..HoldingTransport::default()
    };
    let helped_by = transport.helped_by.clone();
    let engine = engine_with([transport]);
    (engine, helped_by)
}

/// A batch with one write of `len` bytes from the start of `buffer` to its second half.
fn write_within(
    engine: &TransferEngine,
    buffer: &tern_engine::OwnedBuffer,
    len: usize,
) -> tern_engine::Batch {
    let batch = engine.allocate_batch(1).unwrap();
    let half = buffer.len() / 2;
    let request = TransferRequest::write(
        buffer.addr(),
        SegmentId::LOCAL,
        (buffer.addr() + half) as u64,
        len,
    );
    engine.submit(&batch, &[request]).unwrap();
    batch
}

#[test]
fn a_waiter_does_the_work_a_transport_offers_it_instead_of_spinning() {
    let (engine, helped_by) = queued_engine(true);
    let buffer = engine.allocate(64 << 10, "cpu:0").unwrap();
    // 32 KiB in 4 KiB slices: eight pieces of work, and no thread but the waiter to do them.
    let batch = write_within(&engine, &buffer, 32 << 10);
    let status = batch.wait(Duration::from_secs(5));
    assert_eq!(status.completed, 1, "{status:?}");
    let helped_by = helped_by.lock().unwrap();
    assert_eq!(helped_by.len(), 8, "one call per queued slice");
    assert!(
        helped_by
            .iter()
            .all(|&id| id == std::thread::current().id()),
        "the waiting thread did the work"
    );
}

#[test]
fn a_transport_that_offers_no_help_gets_none() {
    let (engine, helped_by) = queued_engine(false);
    let buffer = engine.allocate(64 << 10, "cpu:0").unwrap();
    let batch = write_within(&engine, &buffer, 4096);
    let status = batch.wait(Duration::from_millis(300));
    assert_eq!(
        status.completed, 0,
        "nothing ran the queued slice: {status:?}"
    );
    assert!(helped_by.lock().unwrap().is_empty());
    batch.cancel();
}

/// Cuts every slice into up to three pieces (cuts on 4 KiB from the slice's start), records
/// them, and completes them from threads of its own — failing each slice's piece number
/// `fail_piece`, if any.
struct Cutter {
    pieces: Arc<std::sync::Mutex<Vec<(usize, usize)>>>,
    fail_piece: Option<usize>,
}

impl Transport for Cutter {
    fn protocol(&self) -> &'static str {
        "cutter"
    }
    fn can_reach(&self, _peer: &SegmentDesc) -> bool {
        true
    }
    fn start(&self, _context: TransportContext) -> Result<(), TransportError> {
        Ok(())
    }
    fn describe(&self, _desc: &mut SegmentDesc, _regions: &[RegionInfo]) {}
    fn max_slice_size(&self) -> usize {
        64 << 10
    }
    fn submit(&self, slices: &mut Vec<Slice>) {
        for slice in slices.drain(..) {
            slice.cut(3, 4096, |k, piece| {
                self.pieces
                    .lock()
                    .unwrap()
                    .push((piece.local_addr, piece.len));
                let fail = self.fail_piece == Some(k);
                std::thread::spawn(move || {
                    if fail {
                        piece.fail(TransferError::Dropped("this piece fails".into()));
                    } else {
                        piece.complete();
                    }
                });
            });
        }
    }
    fn shutdown(&self) {}
}

#[test]
fn a_slice_cut_into_pieces_completes_its_task_once_every_piece_has() {
    let pieces = Arc::new(std::sync::Mutex::new(Vec::new()));
    let engine = engine_with([Cutter {
        pieces: pieces.clone(),
        fail_piece: None,
    }]);
    let buffer = engine.allocate(256 << 10, "cpu:0").unwrap();
    let base = buffer.addr();
    // 100 KiB + 10: a 64 KiB slice and one of 36 KiB + 10; and a 6 KiB task, too short to cut.
    let long = (100 << 10) + 10;
    let batch = engine.allocate_batch(2).unwrap();
    engine
        .submit(
            &batch,
            &[
                TransferRequest::write(base, SegmentId::LOCAL, (base + (128 << 10)) as u64, long),
                TransferRequest::read(
                    base + (120 << 10),
                    SegmentId::LOCAL,
                    (base + (240 << 10)) as u64,
                    6 << 10,
                ),
            ],
        )
        .unwrap();
    batch.wait(Duration::from_secs(5));
    let task = batch.task_status(0).unwrap();
    assert_eq!(task.status, TransferStatus::Completed);
    assert_eq!(task.transferred_bytes, long as u64);
    assert_eq!(
        batch.task_status(1).unwrap().status,
        TransferStatus::Completed
    );
    let mut seen = pieces.lock().unwrap().clone();
    seen.sort();
    let offsets: Vec<_> = seen.iter().map(|&(addr, len)| (addr - base, len)).collect();
    // Each slice covered exactly, cuts on 4 KiB from its start; the short task whole.
    assert_eq!(
        offsets,
        [
            (0, 20 << 10),
            (20 << 10, 20 << 10),
            (40 << 10, 24 << 10),
            (64 << 10, 12 << 10),
            (76 << 10, 12 << 10),
            (88 << 10, (12 << 10) + 10),
            (120 << 10, 6 << 10),
        ]
    );
    assert_eq!(
        moved_by(&engine.stats(), "cutter"),
        (7, long as u64 + (6 << 10))
    );

    // A piece that fails fails its task; the others of the slice change nothing.
    let failing = engine_with([Cutter {
        pieces: Arc::default(),
        fail_piece: Some(1),
    }]);
    let buffer = failing.allocate(256 << 10, "cpu:0").unwrap();
    let outcome = failing.transfer_sync(TransferRequest::write(
        buffer.addr(),
        SegmentId::LOCAL,
        (buffer.addr() + (128 << 10)) as u64,
        64 << 10,
    ));
    assert!(
        outcome.is_err(),
        "a failed piece fails the task: {outcome:?}"
    );
}

#[test]
fn a_declined_slice_of_a_merged_run_is_cut_again_and_each_task_gets_its_bytes() {
    let mut near = Stub::new("near", 20);
    near.slice_size = 16 << 10;
    near.decline_from = 0;
    let near_declined = near.declined.clone();
    let far = Stub::new("far", 10);
    let engine = engine_with([far, near]);
    let buffer = engine.allocate(64 << 10, "cpu:0").unwrap();
    let (tasks, len) = (8, 3000);
    let target = (buffer.addr() + (32 << 10)) as u64;
    let requests = holding::neighbours_last_first(buffer.addr(), target, tasks, len);
    let batch = engine.allocate_batch(tasks).unwrap();
    engine.submit(&batch, &requests).unwrap();
    let status = batch.wait(Duration::from_secs(5));
    assert_eq!(status.completed, tasks, "{status:?}");
    for task in 0..tasks {
        assert_eq!(
            batch.task_status(task).unwrap().transferred_bytes,
            len as u64
        );
    }
    let run = tasks * len;
    let near_slices: Vec<(usize, usize)> = tern_engine::slicing::split(run, 16 << 10, 0).collect();
    assert_eq!(near_declined.load(Ordering::Relaxed), near_slices.len());
    let far_slices: usize = near_slices
        .iter()
        .map(|&(_, n)| tern_engine::slicing::split(n, 4096, 0).count())
        .sum();
    assert_eq!(
        moved_by(&engine.stats(), "far"),
        (far_slices as u64, run as u64)
    );
    assert_eq!(moved_by(&engine.stats(), "near"), (0, 0), "near moved none");
}
