//! Neighbouring requests merged at submit: bytes land where each request says over the real
//! TCP transport whatever order the pages come in, each request stays its own task with its
//! own status and bytes, and a slice of a merged run that fails, declines or is cut off
//! touches exactly the tasks whose bytes it holds. The slice-level cases use a transport
//! that holds slices until the test reports them.

use std::time::Duration;

use tern_engine::slicing::split;
use tern_engine::{
    Batch, BatchState, OwnedBuffer, SegmentId, Slice, TransferEngine, TransferError,
    TransferRequest, TransferStatus,
};
use tern_transport_tcp::{TcpConfig, TcpTransport};

#[path = "support/holding.rs"]
mod holding;
use holding::HoldingTransport;

/// A page size that does not divide the slice size, so that slices straddle pages.
const PAGE: usize = 12 << 10;
const TCP_SLICE: usize = 64 << 10;
const PAGES_PER_LAYER: usize = 100;
/// Layers sit this far apart, with a gap after each layer's pages.
const LAYER_STRIDE: usize = 2 << 20;
const LAYERS: usize = 2;

fn tcp_engine(merge: bool) -> TransferEngine {
    TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .merge_requests(merge)
        .transport(TcpTransport::new(TcpConfig {
            slice_size: TCP_SLICE,
            ..TcpConfig::default()
        }))
        .build()
        .unwrap()
}

/// A permutation of `0..n` from a fixed seed (xorshift, Fisher–Yates).
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut below = tern_testkit::random::below_from(seed);
    for i in (1..n).rev() {
        order.swap(i, below(i as u64 + 1) as usize);
    }
    order
}

/// Offset of page `page` of layer `layer` in either side's buffer.
fn page_offset(layer: usize, page: usize) -> usize {
    layer * LAYER_STRIDE + page * PAGE
}

fn pattern(offset: usize, salt: u8) -> u8 {
    (offset as u8) ^ ((offset >> 9) as u8).wrapping_mul(31) ^ salt
}

fn fill(buffer: &OwnedBuffer, salt: u8) {
    let bytes: Vec<u8> = (0..buffer.len()).map(|i| pattern(i, salt)).collect();
    buffer.write_at(0, &bytes).unwrap();
}

fn contents(buffer: &OwnedBuffer) -> Vec<u8> {
    let mut bytes = vec![0; buffer.len()];
    buffer.read_at(0, &mut bytes).unwrap();
    bytes
}

/// Two TCP engines on loopback, the initiator's buffer zeroed and the target's patterned:
/// `(initiator, target, its segment, local buffer, remote buffer)`.
fn tcp_pair(
    merge: bool,
) -> (
    TransferEngine,
    TransferEngine,
    SegmentId,
    OwnedBuffer,
    OwnedBuffer,
) {
    let target = tcp_engine(true);
    let initiator = tcp_engine(merge);
    let len = LAYERS * LAYER_STRIDE;
    let remote = target.allocate(len, "cpu:0").unwrap();
    fill(&remote, 0x5A);
    let local = initiator.allocate(len, "cpu:0").unwrap();
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    (initiator, target, peer, local, remote)
}

/// Every (layer, page), in the order `order` gives the pages of all layers.
fn page_requests(
    order: &[usize],
    make: impl Fn(usize, u64, usize) -> TransferRequest,
    local: &OwnedBuffer,
    remote: &OwnedBuffer,
) -> Vec<TransferRequest> {
    order
        .iter()
        .map(|&n| {
            let offset = page_offset(n % LAYERS, n / LAYERS);
            make(local.addr() + offset, (remote.addr() + offset) as u64, PAGE)
        })
        .collect()
}

/// Submits `requests` as one batch and waits for every one of them to complete.
fn run_to_completion(engine: &TransferEngine, requests: &[TransferRequest]) -> Batch {
    let batch = engine.allocate_batch(requests.len()).unwrap();
    engine.submit(&batch, requests).unwrap();
    let status = batch.wait(Duration::from_secs(60));
    assert_eq!(status.state, BatchState::Completed, "{status:?}");
    batch
}

fn tcp_slices(engine: &TransferEngine) -> u64 {
    engine
        .stats()
        .transports
        .iter()
        .find(|t| t.protocol == "tcp")
        .map_or(0, |t| t.slices)
}

/// Reads every page of both layers, shuffled, into the initiator; returns the TCP slices
/// that took.
fn read_shuffled_pages(merge: bool) -> u64 {
    let (initiator, _target, peer, local, remote) = tcp_pair(merge);
    let order = shuffled(LAYERS * PAGES_PER_LAYER, 0x9E37_79B9);
    let read = |local, remote, len| TransferRequest::read(local, peer, remote, len);
    let requests = page_requests(&order, read, &local, &remote);
    let batch = run_to_completion(&initiator, &requests);
    for task in 0..requests.len() {
        let task_status = batch.task_status(task).unwrap();
        assert_eq!(
            (task_status.status, task_status.transferred_bytes),
            (TransferStatus::Completed, PAGE as u64),
            "task {task}"
        );
    }
    let (moved, wanted) = (contents(&local), contents(&remote));
    for layer in 0..LAYERS {
        let pages = page_offset(layer, 0)..page_offset(layer, PAGES_PER_LAYER);
        assert!(moved[pages.clone()] == wanted[pages], "layer {layer}");
        // The gap after the layer's pages is not part of any request: still zero.
        let gap = page_offset(layer, PAGES_PER_LAYER)..(layer + 1) * LAYER_STRIDE;
        assert!(moved[gap].iter().all(|&b| b == 0), "layer {layer}'s gap");
    }
    tcp_slices(&initiator)
}

#[test]
fn shuffled_pages_land_where_each_request_says_in_slices_cut_from_each_layers_run() {
    let layer_run = PAGES_PER_LAYER * PAGE;
    let merged = read_shuffled_pages(true);
    // Each layer is one run cut at the slice size: no slice per page, none across layers.
    assert_eq!(
        merged as usize,
        LAYERS * split(layer_run, TCP_SLICE, 0).count()
    );
    let unmerged = read_shuffled_pages(false);
    assert_eq!(unmerged as usize, LAYERS * PAGES_PER_LAYER);
}

#[test]
fn pages_written_in_runs_in_a_random_order_land_at_the_target() {
    let (initiator, _target, peer, local, remote) = tcp_pair(true);
    fill(&local, 0xC3);
    // Runs of 8 consecutive pages, the runs in a shuffled order.
    let runs = LAYERS * PAGES_PER_LAYER / 8;
    let order: Vec<usize> = shuffled(runs, 7)
        .into_iter()
        .flat_map(|run| {
            (run * 8..run * 8 + 8).map(|i| (i % PAGES_PER_LAYER) * LAYERS + i / PAGES_PER_LAYER)
        })
        .collect();
    let write = |local, remote, len| TransferRequest::write(local, peer, remote, len);
    let requests = page_requests(&order, write, &local, &remote);
    let batch = run_to_completion(&initiator, &requests);
    let status = batch.status();
    assert_eq!(status.transferred_bytes, (requests.len() * PAGE) as u64);
    let (sent, landed) = (contents(&local), contents(&remote));
    for &n in &order[..runs * 8] {
        let offset = page_offset(n % LAYERS, n / LAYERS);
        assert!(
            sent[offset..offset + PAGE] == landed[offset..offset + PAGE],
            "page {n}"
        );
    }
}

/// An engine over the holding transport (4 KiB slices), with a local buffer and a target
/// range for `tasks` contiguous requests of `len` bytes each, submitted in reverse order:
/// `(engine, transport, batch, source of request 0, the requests)`.
fn held_run(
    tasks: usize,
    len: usize,
) -> (
    TransferEngine,
    HoldingTransport,
    Batch,
    OwnedBuffer,
    Vec<TransferRequest>,
) {
    let (engine, transport) = holding::holding_engine();
    let buffer = engine.allocate(2 * tasks * len, "cpu:0").unwrap();
    let target = (buffer.addr() + tasks * len) as u64;
    let requests = holding::neighbours_last_first(buffer.addr(), target, tasks, len);
    let batch = engine.allocate_batch(tasks).unwrap();
    engine.submit(&batch, &requests).unwrap();
    (engine, transport, batch, buffer, requests)
}

/// Bytes of `[start, start + len)` inside `slice`'s local range.
fn overlap(slice: &Slice, start: usize, len: usize) -> u64 {
    let from = start.max(slice.local_addr);
    let to = (start + len).min(slice.local_addr + slice.len);
    to.saturating_sub(from) as u64
}

#[test]
fn a_failed_slice_of_a_merged_run_fails_exactly_the_tasks_whose_bytes_it_held() {
    let (engine, transport, batch, _buffer, requests) = held_run(10, 1000);
    let mut slices = transport.take();
    // 10 000 bytes as one run in 4 KiB slices, not ten slices of 1000.
    assert_eq!(slices.len(), split(10_000, 4096, 0).count());
    slices.sort_by_key(|s| s.local_addr);
    let failed = slices.remove(1);
    let (failed_start, failed_len) = (failed.local_addr, failed.len);
    let completed: Vec<(usize, usize)> = slices.iter().map(|s| (s.local_addr, s.len)).collect();
    let credited = |request: &TransferRequest| -> u64 {
        completed
            .iter()
            .map(|&(start, len)| {
                let from = start.max(request.source);
                let to = (start + len).min(request.source + request.length);
                to.saturating_sub(from) as u64
            })
            .sum()
    };
    let in_failed: Vec<bool> = requests
        .iter()
        .map(|r| overlap(&failed, r.source, r.length) > 0)
        .collect();
    failed.fail_unsent(TransferError::Dropped("on purpose".into()));
    for slice in slices {
        slice.complete();
    }
    let status = batch.wait(Duration::from_secs(10));
    assert_eq!(status.failed, in_failed.iter().filter(|&&f| f).count());
    assert!(status.failed > 1 && status.completed > 1, "{status:?}");
    for (task, request) in requests.iter().enumerate() {
        let task_status = batch.task_status(task).unwrap();
        if in_failed[task] {
            assert!(
                matches!(
                    task_status.status,
                    TransferStatus::Failed(TransferError::Dropped(_))
                ),
                "task {task} held bytes of [{failed_start:#x}, +{failed_len}): {task_status:?}"
            );
            assert!(!task_status.remote_may_change, "no byte of it left");
        } else {
            assert_eq!(task_status.status, TransferStatus::Completed, "task {task}");
        }
        // What the completed slices held of each task, failed or not.
        assert_eq!(
            task_status.transferred_bytes,
            credited(request),
            "task {task}"
        );
    }
    // The slices count once each, however many tasks they held bytes of.
    let hold = &engine.stats().transports[0];
    assert_eq!((hold.slices, hold.failures), (2, 1));
    assert_eq!(
        hold.bytes,
        completed.iter().map(|c| c.1 as u64).sum::<u64>()
    );
    // Every task counted finished once, the failed ones and those a slice ended together.
    engine
        .free_batch(&batch)
        .expect("no task left unfinished, none counted twice");
}

#[test]
fn a_canceled_merged_run_shows_every_task_canceled_once_its_slices_are_cut_off() {
    let (engine, transport, batch, buffer, _requests) = held_run(6, 1500);
    assert_eq!(batch.cancel(), 6);
    assert!(transport.take().is_empty(), "cancel cut every slice off");
    for task in 0..6 {
        assert_eq!(
            batch.task_status(task).unwrap().status,
            TransferStatus::Canceled
        );
    }
    engine.free_batch(&batch).unwrap();
    drop(buffer);
}

#[test]
fn a_run_canceled_after_some_of_its_slices_moved_shows_each_task_canceled_with_its_bytes() {
    let (engine, transport, batch, _buffer, requests) = held_run(6, 1500);
    let mut slices = transport.take();
    slices.sort_by_key(|s| s.local_addr);
    assert_eq!(slices.len(), 3, "9000 bytes in 4 KiB slices");
    let moved = slices.remove(0);
    let (moved_start, moved_len) = (moved.local_addr, moved.len);
    transport.held.lock().unwrap().extend(slices);
    moved.complete();
    // No task of the run ends before the run does: every one is still running.
    for task in 0..requests.len() {
        let status = batch.task_status(task).unwrap().status;
        assert_eq!(status, TransferStatus::Pending, "task {task}");
    }
    assert_eq!(batch.cancel(), 6);
    assert!(
        transport.take().is_empty(),
        "cancel cut the held slices off"
    );
    for (task, request) in requests.iter().enumerate() {
        let status = batch.task_status(task).unwrap();
        assert_eq!(status.status, TransferStatus::Canceled, "task {task}");
        let from = request.source.max(moved_start);
        let to = (request.source + request.length).min(moved_start + moved_len);
        assert_eq!(
            status.transferred_bytes,
            to.saturating_sub(from) as u64,
            "task {task}: the bytes of it the moved slice held"
        );
    }
    let hold = &engine.stats().transports[0];
    assert_eq!((hold.slices, hold.bytes), (1, moved_len as u64));
    engine
        .free_batch(&batch)
        .expect("no task left unfinished, none counted twice");
}

#[test]
fn a_merged_run_cut_in_pieces_completes_its_tasks_together_once_all_its_pieces_have() {
    let (engine, transport, batch, _buffer, requests) = held_run(5, 1000);
    let mut pieces = Vec::new();
    for slice in transport.take() {
        // Cuts at 512-byte multiples: some through a task, some between two.
        slice.cut(7, 512, |_, piece| pieces.push(piece));
    }
    let piece_count = pieces.len() as u64;
    assert!(piece_count > 2, "{piece_count} pieces");
    pieces.sort_by_key(|p| p.local_addr);
    let last = pieces.pop().unwrap();
    for piece in pieces {
        piece.complete();
    }
    // The run's tasks end together, when its last piece lets go: even those the last
    // piece holds no bytes of are pending until then.
    for task in 0..requests.len() {
        let status = batch.task_status(task).unwrap();
        assert_eq!(status.status, TransferStatus::Pending, "task {task}");
    }
    last.complete();
    let status = batch.wait(Duration::from_secs(10));
    assert_eq!(status.completed, 5);
    assert_eq!(status.transferred_bytes, 5000);
    for task in 0..requests.len() {
        assert_eq!(batch.task_status(task).unwrap().transferred_bytes, 1000);
    }
    // Each piece counts as a slice of the transport, once; the tasks' times count once each.
    let stats = engine.stats();
    let hold = &stats.transports[0];
    assert_eq!(
        (hold.slices, hold.bytes, hold.failures),
        (piece_count, 5000, 0)
    );
    let timed: u64 = stats.latency.iter().map(|l| l.count).sum();
    assert_eq!(timed, 5, "{:?}", stats.latency);
    engine
        .free_batch(&batch)
        .expect("no task left unfinished, none counted twice");
}

#[test]
fn a_run_of_requests_that_start_where_slices_do_fails_only_the_task_of_a_failed_slice() {
    // Six neighbours of two 4 KiB slices each, then of one, merged into one run: every slice
    // lies inside one request, so it is that request's alone.
    for len in [8192, 4096] {
        let per_task = (len / 4096) as u64;
        let (engine, transport, batch, _buffer, requests) = held_run(6, len);
        let mut slices = transport.take();
        assert_eq!(slices.len() as u64, 6 * per_task);
        slices.sort_by_key(|s| s.local_addr);
        for slice in &slices {
            let holders = requests
                .iter()
                .filter(|r| overlap(slice, r.source, r.length) > 0)
                .count();
            assert_eq!(holders, 1, "slice at {:#x}", slice.local_addr);
        }
        let failed = slices.remove(5);
        let failed_task = requests
            .iter()
            .position(|r| overlap(&failed, r.source, r.length) > 0)
            .unwrap();
        failed.fail(TransferError::Dropped("on purpose".into()));
        for slice in slices {
            slice.complete();
        }
        let status = batch.wait(Duration::from_secs(10));
        assert_eq!((status.completed, status.failed), (5, 1), "{status:?}");
        for task in 0..requests.len() {
            let task_status = batch.task_status(task).unwrap();
            if task == failed_task {
                assert!(
                    matches!(
                        task_status.status,
                        TransferStatus::Failed(TransferError::Dropped(_))
                    ),
                    "{task_status:?}"
                );
                assert!(task_status.remote_may_change, "a write whose bytes left");
                assert_eq!(task_status.transferred_bytes, (per_task - 1) * 4096);
            } else {
                assert_eq!(task_status.status, TransferStatus::Completed, "task {task}");
                assert_eq!(task_status.transferred_bytes, len as u64, "task {task}");
            }
        }
        let hold = &engine.stats().transports[0];
        let done = 6 * per_task - 1;
        assert_eq!(
            (hold.slices, hold.failures, hold.bytes),
            (done, 1, done * 4096)
        );
    }
}

#[test]
fn a_slice_that_ends_many_tasks_completes_every_one_of_them_once() {
    // One 4 KiB slice holding bytes of 40, then of 100 tasks: more than a slice keeps on the
    // stack, and more than its first spill makes room for.
    for tasks in [40, 100] {
        let len = 4000 / tasks;
        let (engine, transport, batch, _buffer, _requests) = held_run(tasks, len);
        let slices = transport.take();
        assert_eq!(
            slices.len(),
            1,
            "{tasks} requests of {len} bytes are one slice"
        );
        for slice in slices {
            slice.complete();
        }
        let status = batch.wait(Duration::from_secs(10));
        assert_eq!(status.completed, tasks);
        assert_eq!(status.transferred_bytes, (tasks * len) as u64);
        engine
            .free_batch(&batch)
            .expect("no task left unfinished, none counted twice");
    }
}

#[test]
fn a_batch_of_merged_runs_and_lone_requests_counts_each_slice_and_task_once() {
    let (engine, transport) = holding::holding_engine();
    let buffer = engine.allocate(64 << 10, "cpu:0").unwrap();
    let target = (buffer.addr() + (32 << 10)) as u64;
    // Four neighbours (one run of 4000 bytes: one slice), then two requests with gaps
    // between them (a slice each).
    let mut requests = holding::neighbours_last_first(buffer.addr(), target, 4, 1000);
    for at in [8 << 10, 16 << 10] {
        requests.push(TransferRequest::write(
            buffer.addr() + at,
            SegmentId::LOCAL,
            target + at as u64,
            3000,
        ));
    }
    let batch = engine.allocate_batch(requests.len()).unwrap();
    engine.submit(&batch, &requests).unwrap();
    let slices = transport.take();
    assert_eq!(
        slices.len(),
        3,
        "one slice for the run, one per lone request"
    );
    for slice in slices {
        slice.complete();
    }
    let status = batch.wait(Duration::from_secs(10));
    assert_eq!(status.completed, 6);
    let stats = engine.stats();
    let hold = &stats.transports[0];
    assert_eq!((hold.slices, hold.bytes), (3, 4000 + 2 * 3000));
    let timed: u64 = stats.latency.iter().map(|l| l.count).sum();
    assert_eq!(timed, 6, "each task timed once: {:?}", stats.latency);
    engine.free_batch(&batch).unwrap();
    drop(batch);
    // Gone, the batch's tally joins the engine's totals once.
    let hold = &engine.stats().transports[0];
    assert_eq!((hold.slices, hold.bytes), (3, 10_000));
}

/// Batches of many thousand pages, one after another on one engine, of other lengths and
/// with one request in the middle that fails: each batch's tasks start as new whatever the
/// batch before left in the room the engine keeps for large batches (task tables, the
/// parts of merged runs), and every byte lands.
#[test]
fn large_batches_one_after_another_each_start_with_every_task_new() {
    const SMALL_PAGE: usize = 256;
    const MOST: usize = 6000;
    let target = tcp_engine(true);
    let initiator = tcp_engine(true);
    let remote = target.allocate(MOST * SMALL_PAGE, "cpu:0").unwrap();
    let local = initiator.allocate(MOST * SMALL_PAGE, "cpu:0").unwrap();
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    for (round, (pages, failing)) in [(MOST, None), (MOST - 700, Some(2500)), (MOST, None)]
        .into_iter()
        .enumerate()
    {
        let salt = round as u8 * 0x3B + 1;
        fill(&local, salt);
        let requests: Vec<TransferRequest> = (0..pages)
            .map(|page| {
                let offset = page * SMALL_PAGE;
                let len = if Some(page) == failing { 0 } else { SMALL_PAGE };
                TransferRequest::write(
                    local.addr() + offset,
                    peer,
                    (remote.addr() + offset) as u64,
                    len,
                )
            })
            .collect();
        let batch = initiator.allocate_batch(pages).unwrap();
        initiator.submit(&batch, &requests).unwrap();
        let status = batch.wait(Duration::from_secs(60));
        let expected = if failing.is_some() {
            BatchState::Failed
        } else {
            BatchState::Completed
        };
        assert_eq!(status.state, expected, "round {round}: {status:?}");
        for page in 0..pages {
            let task = batch.task_status(page).unwrap();
            if Some(page) == failing {
                assert_eq!(
                    task.status,
                    TransferStatus::Failed(TransferError::ZeroLength),
                    "round {round}"
                );
            } else {
                assert_eq!(
                    (task.status, task.transferred_bytes),
                    (TransferStatus::Completed, SMALL_PAGE as u64),
                    "round {round}, page {page}"
                );
            }
        }
        initiator.free_batch(&batch).unwrap();
        drop(batch);
        let landed = contents(&remote);
        for page in (0..pages).filter(|&page| Some(page) != failing) {
            let offset = page * SMALL_PAGE;
            assert!(
                (offset..offset + SMALL_PAGE).all(|i| landed[i] == pattern(i, salt)),
                "round {round}: page {page} did not land"
            );
        }
    }
}

/// One batch of runs submitted from this thread, its slices held.
struct InFlight {
    batch: Batch,
    requests: Vec<TransferRequest>,
    slices: Vec<Slice>,
}

/// Runs are made again in place once their tasks have ended: batches of merged runs
/// submitted from one thread, up to three of them in flight at once, each resolved
/// (its slices completed or failed in a random order) while others are held, and batches of
/// more runs than the thread keeps. Every task of every batch ends with its own status and
/// the bytes of its own slices that moved, whatever the runs it was in did before.
#[test]
fn runs_of_batches_in_flight_together_stay_their_own_and_runs_made_again_carry_nothing_over() {
    // 300 runs of at most 21 parts (with the gap) fit in the 2 MiB each side has.
    const PART: usize = 256;
    let (engine, transport) = holding::holding_engine();
    let buffer = engine.allocate(4 << 20, "cpu:0").unwrap();
    let target = (buffer.addr() + (2 << 20)) as u64;
    let mut below = tern_testkit::random::below_from(0x5EED_0F2B);
    let mut in_flight: Vec<InFlight> = Vec::new();
    let mut resolved = 0;
    while resolved < 40 {
        if in_flight.len() < 3 && below(2) == 0 {
            // Runs of 2 to 20 neighbours, a gap after each: up to 300 runs a batch.
            let most = if below(4) == 0 { 300 } else { 12 };
            let runs = 1 + below(most) as usize;
            let mut requests = Vec::new();
            let mut at = 0;
            for _ in 0..runs {
                let parts = 2 + below(19) as usize;
                let mut run = holding::neighbours_last_first(
                    buffer.addr() + at,
                    target + at as u64,
                    parts,
                    PART,
                );
                requests.append(&mut run);
                at += (parts + 1) * PART;
            }
            let batch = engine.allocate_batch(requests.len()).unwrap();
            engine.submit(&batch, &requests).unwrap();
            let slices = transport.take();
            assert!(slices.len() >= runs, "a slice or more a run");
            in_flight.push(InFlight {
                batch,
                requests,
                slices,
            });
            continue;
        }
        if in_flight.is_empty() {
            continue;
        }
        let InFlight {
            batch,
            requests,
            mut slices,
        } = in_flight.swap_remove(below(in_flight.len() as u64) as usize);
        // A random order; about one slice in eight fails.
        for i in (1..slices.len()).rev() {
            slices.swap(i, below(i as u64 + 1) as usize);
        }
        let mut failed = Vec::new();
        let mut moved = vec![0u64; requests.len()];
        for slice in slices {
            let (start, len) = (slice.local_addr, slice.len);
            if below(8) == 0 {
                failed.push((start, len));
                slice.fail_unsent(TransferError::Dropped("on purpose".into()));
            } else {
                for (task, request) in requests.iter().enumerate() {
                    moved[task] += overlap(&slice, request.source, request.length);
                }
                slice.complete();
            }
        }
        batch.wait(Duration::from_secs(10));
        for (task, request) in requests.iter().enumerate() {
            let status = batch.task_status(task).unwrap();
            let in_failed = failed.iter().any(|&(start, len)| {
                start < request.source + request.length && request.source < start + len
            });
            if in_failed {
                assert!(
                    matches!(
                        status.status,
                        TransferStatus::Failed(TransferError::Dropped(_))
                    ),
                    "batch {resolved}, task {task}: {status:?}"
                );
            } else {
                assert_eq!(
                    status.status,
                    TransferStatus::Completed,
                    "batch {resolved}, task {task}"
                );
            }
            assert_eq!(
                status.transferred_bytes, moved[task],
                "batch {resolved}, task {task}"
            );
        }
        engine
            .free_batch(&batch)
            .expect("no task left unfinished, none counted twice");
        resolved += 1;
    }
}

/// How long a wait that asked for `asked` took, and what it showed.
fn timed_wait(batch: &Batch, asked: Duration) -> (Duration, tern_engine::BatchStatus) {
    let started = std::time::Instant::now();
    let status = batch.wait(asked);
    (started.elapsed(), status)
}

/// What "within its timeout" allows for on a shared machine: far below the drain time, which
/// is what a wait took before it kept its timeout.
const WAIT_SLACK: Duration = Duration::from_millis(500);

#[test]
fn a_wait_keeps_its_timeout_while_a_run_with_a_failed_task_still_moves() {
    // Ten tasks in one run of 4 KiB slices, one per task: the first slice fails, the rest
    // are held (moving, as far as the engine knows).
    let (engine, transport, batch, _buffer, requests) = held_run(10, 4096);
    let mut slices = transport.take();
    assert_eq!(slices.len(), 10);
    slices.sort_by_key(|s| s.local_addr);
    let first = slices.remove(0);
    let failed_task = requests
        .iter()
        .position(|r| overlap(&first, r.source, r.length) > 0)
        .unwrap();
    first.fail_unsent(TransferError::Dropped("on purpose".into()));
    let cut_offs_before = transport.cut_offs.load(std::sync::atomic::Ordering::SeqCst);
    // A caller polling with short waits: each returns within its timeout.
    for asked in [Duration::ZERO, Duration::from_millis(10), Duration::ZERO] {
        let (took, status) = timed_wait(&batch, asked);
        assert!(took < asked + WAIT_SLACK, "wait({asked:?}) took {took:?}");
        assert_eq!(
            status.pending, 10,
            "the run's tasks end together: {status:?}"
        );
    }
    for _ in 0..20 {
        let _ = batch.status();
        let _ = batch.wait(Duration::from_millis(5));
    }
    // Nothing of an ended task is left to cut off: the run's other slices carry live tasks.
    assert_eq!(
        transport.cut_offs.load(std::sync::atomic::Ordering::SeqCst),
        cut_offs_before,
        "waiters asked for cut-offs that could not hasten anything"
    );
    assert_eq!(transport.take().len(), 0, "the held slices are the test's");
    for slice in slices {
        slice.complete();
    }
    let status = batch.wait(Duration::from_secs(10));
    assert_eq!((status.completed, status.failed), (9, 1), "{status:?}");
    assert!(matches!(
        batch.task_status(failed_task).unwrap().status,
        TransferStatus::Failed(TransferError::Dropped(_))
    ));
    engine.free_batch(&batch).unwrap();
}

#[test]
fn a_wait_keeps_its_timeout_while_timed_out_slices_have_not_let_go() {
    let (engine, transport, batch, _buffer, _requests) = held_run(4, 4096);
    // A transport that does not give slices back when asked.
    transport
        .deaf
        .store(true, std::sync::atomic::Ordering::SeqCst);
    batch.set_deadline(Some(std::time::Instant::now()));
    let (took, status) = timed_wait(&batch, Duration::from_millis(20));
    assert!(
        took < Duration::from_millis(20) + WAIT_SLACK,
        "wait(20 ms) took {took:?}"
    );
    assert_eq!(status.pending, 4, "timed out, slices still out: {status:?}");
    assert!(
        transport.cut_offs.load(std::sync::atomic::Ordering::SeqCst) > 0,
        "the timed-out tasks' slices were asked to be cut off"
    );
    // Once they let go, the tasks show their end.
    for slice in transport.take() {
        slice.cut_off(false);
    }
    let status = batch.wait(Duration::from_secs(10));
    assert_eq!((status.failed, status.pending), (4, 0), "{status:?}");
    for task in 0..4 {
        assert_eq!(
            batch.task_status(task).unwrap().status,
            TransferStatus::Timeout
        );
    }
    engine.free_batch(&batch).unwrap();
}
