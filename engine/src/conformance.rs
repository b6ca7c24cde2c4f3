//! The conformance suite every transport must pass.
//!
//! A transport crate runs it against real engines in a few lines:
//!
//! ```ignore
//! #[test]
//! fn conformance() {
//!     tern_engine::conformance::run_all(&|| {
//!         TransferEngine::builder()
//!             .local_server_name("127.0.0.1")
//!             .transport(MyTransport::default())
//!     })
//!     .unwrap();
//! }
//! ```
//!
//! Each check builds fresh engines from the factory (two per check: an initiator and a
//! target), moves real bytes and verifies them. Checks return a [`ConformanceFailure`]
//! naming the check instead of panicking.

use std::time::{Duration, Instant};

use crate::{
    BatchState, EngineError, OwnedBuffer, SegmentId, TransferEngine, TransferEngineBuilder,
    TransferError, TransferRequest, TransferStatus,
};

/// Makes an engine builder with the transport under test installed.
pub type EngineFactory<'a> = &'a dyn Fn() -> TransferEngineBuilder;

/// A check that failed.
#[derive(Debug)]
pub struct ConformanceFailure {
    /// Which check.
    pub check: &'static str,
    /// What went wrong.
    pub message: String,
}

impl std::fmt::Display for ConformanceFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "conformance check {:?} failed: {}",
            self.check, self.message
        )
    }
}

impl std::error::Error for ConformanceFailure {}

type Check = Result<(), String>;

/// One named check of the suite.
type NamedCheck = (&'static str, fn(EngineFactory<'_>) -> Check);

macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+));
        }
    };
}

fn err<E: std::fmt::Display>(context: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{context}: {e}")
}

/// Every check, in order; stops at the first failure.
pub fn run_all(make: EngineFactory<'_>) -> Result<(), ConformanceFailure> {
    let checks: [NamedCheck; 7] = [
        ("read_write_sizes", read_write_sizes),
        ("many_tasks", many_tasks),
        ("bad_requests", bad_requests),
        ("stale_range_rejected_by_peer", stale_range_rejected_by_peer),
        ("local_segment", local_segment),
        ("notify", notify),
        ("peer_gone", peer_gone),
    ];
    for (check, run) in checks {
        run(make).map_err(|message| ConformanceFailure { check, message })?;
    }
    Ok(())
}

/// Deterministic bytes for `(seed, index)`.
pub fn pattern_byte(seed: u64, index: usize) -> u8 {
    let x = (index as u64 ^ seed.rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 56) as u8
}

fn fill(buffer: &OwnedBuffer, offset: usize, len: usize, seed: u64) -> Check {
    let bytes: Vec<u8> = (0..len).map(|i| pattern_byte(seed, i)).collect();
    buffer.write_at(offset, &bytes).map_err(err("fill"))
}

fn check_pattern(buffer: &OwnedBuffer, offset: usize, len: usize, seed: u64, what: &str) -> Check {
    let mut bytes = vec![0u8; len];
    buffer
        .read_at(offset, &mut bytes)
        .map_err(err("read back"))?;
    if let Some(i) = (0..len).find(|&i| bytes[i] != pattern_byte(seed, i)) {
        return Err(format!("{what}: byte {i} of {len} differs"));
    }
    Ok(())
}

struct Pair {
    initiator: TransferEngine,
    target: TransferEngine,
    peer: SegmentId,
}

fn pair(make: EngineFactory<'_>) -> Result<Pair, String> {
    let target = make().build().map_err(err("building the target engine"))?;
    let initiator = make()
        .build()
        .map_err(err("building the initiator engine"))?;
    let peer = initiator
        .open_segment(target.segment_name())
        .map_err(err("opening the target segment"))?;
    Ok(Pair {
        initiator,
        target,
        peer,
    })
}

impl Pair {
    /// A buffer on each side: what the initiator moves from or into, and the target's range.
    fn buffers(&self, local: usize, remote: usize) -> Result<(OwnedBuffer, OwnedBuffer), String> {
        let local = self
            .initiator
            .allocate(local, "cpu:0")
            .map_err(err("allocate local"))?;
        let remote = self
            .target
            .allocate(remote, "cpu:0")
            .map_err(err("allocate remote"))?;
        Ok((local, remote))
    }
}

/// Runs one request and checks that it completed and that `holder` then carries the pattern
/// `seed` at `offset`.
fn run_and_check(
    engine: &TransferEngine,
    request: TransferRequest,
    (holder, offset, seed): (&OwnedBuffer, usize, u64),
    what: &str,
) -> Check {
    let status = run_one(engine, request)?;
    ensure!(status == TransferStatus::Completed, "{what} ended {status}");
    check_pattern(holder, offset, request.length, seed, what)
}

fn run_one(engine: &TransferEngine, request: TransferRequest) -> Result<TransferStatus, String> {
    let batch = engine.allocate_batch(1).map_err(err("allocate_batch"))?;
    engine.submit(&batch, &[request]).map_err(err("submit"))?;
    batch.wait(Duration::from_secs(60));
    batch
        .task_status(0)
        .map(|s| s.status)
        .ok_or_else(|| "task status missing".to_owned())
}

/// The largest size [`read_write_sizes`] moves unless [`LARGEST_ENV`] says otherwise.
pub const LARGEST: usize = 64 << 20;

/// Names a smaller largest size (bytes, 4 MiB at least) for runs where every byte costs
/// dozens of times its native price (`cargo xtask memcheck` sets 8 MiB: the 64 MiB round
/// took most of the suite's four minutes under valgrind, on the paths 8 MiB takes too).
pub const LARGEST_ENV: &str = "TERN_CONFORMANCE_LARGEST_BYTES";

fn largest() -> usize {
    std::env::var(LARGEST_ENV)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .map_or(LARGEST, |bytes| bytes.clamp(4 << 20, LARGEST))
}

/// Writes then reads back sizes from 1 B to 64 MiB ([`LARGEST_ENV`]) at unaligned offsets.
pub fn read_write_sizes(make: EngineFactory<'_>) -> Check {
    let pair = pair(make)?;
    let largest = largest();
    let span = largest + 4096;
    let (local, remote) = pair.buffers(span, span)?;
    for (round, &len) in [1usize, 4096, 4099, 65536, 1 << 20, 3 << 20, largest]
        .iter()
        .enumerate()
    {
        let (local_off, remote_off) = if len == largest { (3, 1) } else { (7, 13) };
        let (local_addr, remote_addr) = (
            local.addr() + local_off,
            (remote.addr() + remote_off) as u64,
        );
        let seed = 1000 + round as u64;
        fill(&local, local_off, len, seed)?;
        // The write proves the target got the bytes; clearing the source then lets the read
        // prove they came back.
        for (request, holder, offset) in [
            (
                TransferRequest::write(local_addr, pair.peer, remote_addr, len),
                &remote,
                remote_off,
            ),
            (
                TransferRequest::read(local_addr, pair.peer, remote_addr, len),
                &local,
                local_off,
            ),
        ] {
            let what = format!("{:?} of {len} B", request.opcode);
            run_and_check(&pair.initiator, request, (holder, offset, seed), &what)?;
            local
                .write_at(local_off, &vec![0u8; len])
                .map_err(err("clear"))?;
        }
    }
    Ok(())
}

/// 256 tasks in one batch, reads and writes mixed, each verified.
pub fn many_tasks(make: EngineFactory<'_>) -> Check {
    const TASKS: usize = 256;
    const BLOCK: usize = 4096 + 17;
    let pair = pair(make)?;
    let (initiator, peer) = (&pair.initiator, pair.peer);
    let (local, remote) = pair.buffers(TASKS * BLOCK, TASKS * BLOCK)?;
    let mut requests = Vec::with_capacity(TASKS);
    for task in 0..TASKS {
        let offset = task * BLOCK;
        let (local_addr, remote_addr) = (local.addr() + offset, (remote.addr() + offset) as u64);
        let (source, request) = if task % 2 == 0 {
            let write = TransferRequest::write(local_addr, peer, remote_addr, BLOCK);
            (&local, write)
        } else {
            let read = TransferRequest::read(local_addr, peer, remote_addr, BLOCK);
            (&remote, read)
        };
        fill(source, offset, BLOCK, task as u64)?;
        requests.push(request);
    }
    let batch = initiator
        .allocate_batch(TASKS)
        .map_err(err("allocate_batch"))?;
    initiator.submit(&batch, &requests).map_err(err("submit"))?;
    let status = batch.wait(Duration::from_secs(60));
    ensure!(
        status.state == BatchState::Completed && status.completed == TASKS,
        "batch ended {status:?}"
    );
    ensure!(
        status.transferred_bytes == (TASKS * BLOCK) as u64,
        "moved {} bytes, expected {}",
        status.transferred_bytes,
        TASKS * BLOCK
    );
    for task in 0..TASKS {
        let holder = if task % 2 == 0 { &remote } else { &local };
        check_pattern(
            holder,
            task * BLOCK,
            BLOCK,
            task as u64,
            &format!("task {task}"),
        )?;
    }
    initiator.free_batch(&batch).map_err(err("free_batch"))?;
    ensure!(
        matches!(initiator.free_batch(&batch), Err(EngineError::BatchFreed)),
        "a second free_batch succeeded"
    );
    Ok(())
}

/// Invalid requests fail as tasks with the right reason, before anything is sent, and do not
/// disturb the valid request beside them.
pub fn bad_requests(make: EngineFactory<'_>) -> Check {
    let pair = pair(make)?;
    let (initiator, peer) = (&pair.initiator, pair.peer);
    let (local, remote) = pair.buffers(1 << 16, 1 << 16)?;
    let remote_addr = remote.addr() as u64;
    let unregistered = vec![0u8; 4096];
    let requests = [
        TransferRequest::write(local.addr(), peer, remote_addr, 0),
        TransferRequest::write(unregistered.as_ptr() as usize, peer, remote_addr, 16),
        TransferRequest::write(local.addr() + (1 << 16) - 8, peer, remote_addr, 16),
        TransferRequest::write(local.addr() - 8, peer, remote_addr, 16),
        TransferRequest::write(local.addr(), peer, remote_addr + (1 << 16) - 8, 16),
        TransferRequest::write(local.addr(), peer, remote_addr - 8, 16),
        TransferRequest::read(local.addr(), peer, u64::MAX - 4, 16),
        TransferRequest::read(local.addr(), SegmentId(u64::MAX), remote_addr, 16),
        TransferRequest::write(local.addr(), peer, remote_addr, 4096),
    ];
    // Twice: as listed (each bad request checked in full), then each after the valid one,
    // so that it meets the way the one before went (the check's shortcut).
    let (bad, valid) = requests.split_at(requests.len() - 1);
    let valid = valid[0];
    let after_valid: Vec<TransferRequest> = bad.iter().flat_map(|&bad| [valid, bad]).collect();
    let capacity = requests.len() + after_valid.len();
    let batch = initiator
        .allocate_batch(capacity)
        .map_err(err("allocate_batch"))?;
    ensure!(
        matches!(
            initiator.submit(&batch, &vec![valid; capacity + 1]),
            Err(EngineError::TooManyRequests { .. })
        ),
        "over-capacity submit was accepted"
    );
    initiator.submit(&batch, &requests).map_err(err("submit"))?;
    initiator
        .submit(&batch, &after_valid)
        .map_err(err("submit"))?;
    let status = batch.wait(Duration::from_secs(60));
    ensure!(
        status.failed == 2 * bad.len() && status.completed == 1 + bad.len(),
        "batch ended {status:?}"
    );
    type IsReason = fn(&TransferError) -> bool;
    let source_not_registered: IsReason =
        |e| matches!(e, TransferError::SourceNotRegistered { .. });
    let target_out_of_range: IsReason = |e| matches!(e, TransferError::TargetOutOfRange { .. });
    let failed_as: [(&str, IsReason); 8] = [
        ("zero length", |e| *e == TransferError::ZeroLength),
        ("unregistered source", source_not_registered),
        ("source past its region", source_not_registered),
        ("source before its region", source_not_registered),
        ("target past its buffer", target_out_of_range),
        ("target before its buffer", target_out_of_range),
        ("target at the end of memory", target_out_of_range),
        ("unknown segment", |e| {
            matches!(e, TransferError::UnknownSegment(_))
        }),
    ];
    // The bad ones as listed, then the valid one; then, in pairs, the valid one and a bad one.
    let n = bad.len();
    let valid_tasks = std::iter::once(n).chain((0..n).map(|i| n + 1 + 2 * i));
    let bad_tasks = (0..n)
        .map(|i| (i, i))
        .chain((0..n).map(|i| (n + 2 + 2 * i, i)));
    for (task, i) in bad_tasks {
        let (what, wanted) = failed_as[i];
        let status = batch.task_status(task).map(|s| s.status);
        ensure!(
            matches!(&status, Some(TransferStatus::Failed(e)) if wanted(e)),
            "task {task} ({what}): {status:?}"
        );
    }
    for task in valid_tasks {
        let status = batch.task_status(task).map(|s| s.status);
        ensure!(
            status == Some(TransferStatus::Completed),
            "valid request (task {task}): {status:?}"
        );
    }
    Ok(())
}

/// A range the initiator still believes in (stale descriptor) but the target has
/// unregistered is refused by the target, and the path stays usable.
pub fn stale_range_rejected_by_peer(make: EngineFactory<'_>) -> Check {
    let pair = pair(make)?;
    let (initiator, target, peer) = (&pair.initiator, &pair.target, pair.peer);
    let (local, kept) = pair.buffers(1 << 20, 1 << 20)?;
    let dropped = target.allocate(1 << 20, "cpu:0").map_err(err("allocate"))?;
    let dropped_addr = dropped.addr() as u64;
    initiator.refresh_segment(peer).map_err(err("refresh"))?;
    drop(dropped);
    for request in [
        TransferRequest::write(local.addr(), peer, dropped_addr, 1 << 20),
        TransferRequest::read(local.addr(), peer, dropped_addr, 4096),
    ] {
        let status = run_one(initiator, request)?;
        ensure!(
            matches!(
                status,
                TransferStatus::Failed(TransferError::RemoteRejected { .. })
            ),
            "{:?} into an unregistered range ended {status}",
            request.opcode
        );
    }
    fill(&local, 0, 4096, 7)?;
    run_and_check(
        initiator,
        TransferRequest::write(local.addr(), peer, kept.addr() as u64, 4096),
        (&kept, 0, 7),
        "a write after a rejection",
    )
}

/// Transfers to the engine's own segment.
pub fn local_segment(make: EngineFactory<'_>) -> Check {
    let engine = make().build().map_err(err("build"))?;
    ensure!(
        engine
            .open_segment(engine.segment_name())
            .map_err(err("open own segment"))?
            == SegmentId::LOCAL,
        "own segment is not LOCAL"
    );
    let a = engine.allocate(1 << 16, "cpu:0").map_err(err("allocate"))?;
    let b = engine.allocate(1 << 16, "cpu:0").map_err(err("allocate"))?;
    fill(&a, 0, 1 << 16, 42)?;
    let moved = engine
        .transfer_sync(TransferRequest::write(
            a.addr(),
            SegmentId::LOCAL,
            b.addr() as u64,
            1 << 16,
        ))
        .map_err(err("local write"))?;
    ensure!(moved == 1 << 16, "moved {moved} bytes");
    check_pattern(&b, 0, 1 << 16, 42, "local write")
}

/// A notification reaches the peer's queue.
pub fn notify(make: EngineFactory<'_>) -> Check {
    let Pair {
        initiator,
        target,
        peer,
    } = pair(make)?;
    initiator
        .send_notify(peer, "kv-ready", "layer 7")
        .map_err(err("send_notify"))?;
    initiator.probe(peer).map_err(err("probe"))?;
    let received = target.get_notifies();
    ensure!(
        received.len() == 1
            && received[0].name == "kv-ready"
            && received[0].notify_msg == "layer 7",
        "received {received:?}"
    );
    ensure!(
        target.get_notifies().is_empty(),
        "notifies were not drained"
    );
    Ok(())
}

/// A peer that is gone fails the transfer quickly and loudly instead of hanging.
pub fn peer_gone(make: EngineFactory<'_>) -> Check {
    let pair = pair(make)?;
    let (local, remote) = pair.buffers(1 << 20, 1 << 20)?;
    let Pair {
        initiator,
        target,
        peer,
    } = pair;
    let remote_addr = remote.addr();
    initiator.refresh_segment(peer).map_err(err("refresh"))?;
    drop(target);
    let started = Instant::now();
    let status = run_one(
        &initiator,
        TransferRequest::write(local.addr(), peer, remote_addr as u64, 1 << 20),
    )?;
    ensure!(
        matches!(
            status,
            TransferStatus::Failed(TransferError::Connection { .. })
        ),
        "transfer to a dead peer ended {status}"
    );
    ensure!(
        started.elapsed() < Duration::from_secs(20),
        "failing took {:?}",
        started.elapsed()
    );
    ensure!(
        initiator.probe(peer).is_err(),
        "a dead peer answered a probe"
    );
    Ok(())
}
