//! A transfer that times out or is canceled while its peer stalls gives the caller's memory
//! back: once the call reports Timeout or Canceled, no byte lands in the local buffer, even
//! when the peer wakes up and sends the rest, and unregistering the buffer succeeds at once.
//! The peer is a real engine in a child process (this test binary run again), stopped with
//! SIGSTOP in the middle of a read and continued after the call returned.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tern_engine::{SegmentId, TransferEngine, TransferRequest, TransferStatus};
use tern_transport_tcp::{TcpConfig, TcpTransport};

const MIB: usize = 1 << 20;
const TARGET_ENV: &str = "TERN_CUT_OFF_TARGET";
/// What the child's buffer holds, and so what a read brings.
const LEN: usize = 64 * MIB;

fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13) ^ 0x5a)
        .collect()
}

/// The target, run as a child: an engine with a patterned buffer, which prints where it is
/// and lives until its standard input closes.
#[test]
fn stalling_target_child() {
    if std::env::var_os(TARGET_ENV).is_none() {
        return;
    }
    let engine = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(TcpTransport::new(TcpConfig {
            socket_buffer_bytes: Some(64 << 10),
            ..TcpConfig::default()
        }))
        .build()
        .unwrap();
    let buffer = engine.allocate(LEN, "cpu:0").unwrap();
    buffer.write_at(0, &pattern(LEN)).unwrap();
    println!("TERN-TARGET {} {}", engine.segment_name(), buffer.addr());
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
}

/// The child target: stopped and continued at will.
struct Target {
    child: Child,
    segment: String,
    addr: u64,
}

impl Target {
    fn start() -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["stalling_target_child", "--exact", "--nocapture"])
            .env(TARGET_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let line = lines
            .find_map(|l| l.ok().filter(|l| l.starts_with("TERN-TARGET ")))
            .expect("the target child printed where it is");
        let mut words = line.split_whitespace().skip(1);
        let segment = words.next().unwrap().to_owned();
        let addr = words.next().unwrap().parse().unwrap();
        Self {
            child,
            segment,
            addr,
        }
    }

    fn stop(&self) {
        tern_testkit::process::stop(self.child.id());
    }

    fn resume(&self) {
        tern_testkit::process::resume(self.child.id());
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.resume();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn initiator() -> TransferEngine {
    TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(TcpTransport::new(TcpConfig {
            connections_per_peer: 2,
            socket_buffer_bytes: Some(64 << 10),
            slice_size: 4 * MIB,
            ..TcpConfig::default()
        }))
        .build()
        .unwrap()
}

#[path = "../../testkit/include/local.rs"]
mod local;
use local::Local;
#[path = "../../testkit/include/deadline.rs"]
mod deadline;
use deadline::{assert_read_timed_out, assert_write_timed_out, submit_alone, wait_past_deadline};

/// The child target, an initiator that opened its segment, and `len` bytes of watched
/// memory registered with the initiator.
fn connected(len: usize) -> (Target, TransferEngine, SegmentId, Local) {
    let target = Target::start();
    let engine = initiator();
    let peer = engine.open_segment(&target.segment).unwrap();
    let local = Local::register(&engine, len);
    (target, engine, peer, local)
}

/// Submits a read of the whole target buffer and stops the target as soon as part of it
/// arrived; returns the batch, or None if the read completed first.
fn read_then_stall(
    engine: &TransferEngine,
    target: &Target,
    peer: SegmentId,
    local: &Local,
) -> Option<tern_engine::Batch> {
    let batch = submit_alone(
        engine,
        TransferRequest::read(local.addr(), peer, target.addr, LEN),
    );
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let status = batch.task_status(0).unwrap();
        if status.status == TransferStatus::Completed {
            return None;
        }
        if status.transferred_bytes > 0 || Instant::now() > until {
            break;
        }
        std::thread::yield_now();
    }
    target.stop();
    if batch.task_status(0).unwrap().status == TransferStatus::Completed {
        // The read finished while the stop was on its way.
        target.resume();
        return None;
    }
    Some(batch)
}

/// The read that `ended` (timed-out, canceled) gave its memory back: the buffer unregisters
/// at once, and for two seconds after, with the peer awake again, nothing writes it.
fn assert_given_back(
    engine: &TransferEngine,
    target: &Target,
    local: &Local,
    batch: &tern_engine::Batch,
    ended: &str,
) {
    engine.unregister_memory(local.addr()).unwrap_or_else(|e| {
        panic!("unregistering the {ended} read's buffer succeeds at once: {e:?}")
    });
    local.assert_untouched(ended, || target.resume());
    engine.free_batch(batch).unwrap();
}

/// [`read_then_stall`] until the stop comes in the middle of the read (20 tries at most).
fn stalled_read(
    engine: &TransferEngine,
    target: &Target,
    peer: SegmentId,
    local: &Local,
) -> tern_engine::Batch {
    let mut tries = 0;
    loop {
        tries += 1;
        assert!(tries <= 20, "the read always completed before the stop");
        if let Some(batch) = read_then_stall(engine, target, peer, local) {
            return batch;
        }
    }
}

#[test]
fn a_read_that_times_out_mid_slice_leaves_the_buffer_alone_and_unpinned() {
    let (target, engine, peer, local) = connected(LEN);
    let batch = stalled_read(&engine, &target, peer, &local);
    let (status, _) = wait_past_deadline(&batch, Duration::from_millis(100));
    assert_read_timed_out(&status);
    assert!(
        status.transferred_bytes < LEN as u64,
        "the stop came after the read"
    );
    assert_given_back(&engine, &target, &local, &batch, "timed-out");
}

#[test]
fn a_read_canceled_mid_slice_leaves_the_buffer_alone_and_unpinned() {
    let (target, engine, peer, local) = connected(LEN);
    let batch = stalled_read(&engine, &target, peer, &local);
    assert_eq!(batch.cancel(), 1);
    let status = batch.task_status(0).unwrap();
    assert_eq!(status.status, TransferStatus::Canceled, "{status:?}");
    assert_given_back(&engine, &target, &local, &batch, "canceled");
}

#[test]
fn a_write_to_a_stopped_peer_that_times_out_says_the_peer_may_still_change() {
    let (target, engine, peer, local) = connected(LEN);
    target.stop();
    let batch = submit_alone(
        &engine,
        TransferRequest::write(local.addr(), peer, target.addr, LEN),
    );
    let (status, _) = wait_past_deadline(&batch, Duration::from_millis(200));
    // Bytes went into the stopped peer's socket: they may land when it runs again.
    assert_write_timed_out(&status);
    engine
        .unregister_memory(local.addr())
        .expect("unregistering the timed-out write's buffer succeeds at once");
    target.resume();
    engine.free_batch(&batch).unwrap();
}

/// How long a timed-out read of a stopped peer takes to return with its memory back, over
/// 100 stalls (run with `--ignored --nocapture`).
#[test]
#[ignore = "a measurement: prints p50/p99"]
fn timed_out_read_latency() {
    let (target, engine, peer, local) = connected(4 * MIB);
    let mut took = Vec::new();
    for _ in 0..100 {
        target.stop();
        let batch = submit_alone(
            &engine,
            TransferRequest::read(local.addr(), peer, target.addr, 4 * MIB),
        );
        let (status, late) = wait_past_deadline(&batch, Duration::from_millis(20));
        assert_eq!(status.status, TransferStatus::Timeout);
        took.push(late);
        engine.free_batch(&batch).unwrap();
        target.resume();
        std::thread::sleep(Duration::from_millis(20));
    }
    engine.unregister_memory(local.addr()).unwrap();
    took.sort();
    println!(
        "tcp: timed-out read back after its deadline: p50 {:?}, p99 {:?}, max {:?}",
        took[49], took[98], took[99]
    );
}
