//! The RDMA transport between two machines with two NICs each, in the two-node Soft-RoCE
//! setup (`cargo xtask softroce --two-nodes`, run by `cargo xtask test`): striping over both
//! NICs, failover when a link goes down mid-transfer, a peer killed mid-transfer, and the
//! etcd store carrying the rkeys. Both nodes run the same test; `TERN_NODE` says which side
//! each is (b is the target, a the initiator); they coordinate through files in
//! `TERN_SYNC`, named after the test, so the whole binary may run in one boot:
//!
//! ```text
//! exe=$(cargo test -p tern-transport-rdma --test two_node --no-run 2>&1 | grep -o 'target/.*two_node-[^)]*')
//! cargo xtask softroce --two-nodes "$exe --include-ignored --test-threads=1" \
//!     "$exe --include-ignored --test-threads=1"
//! ```
//!
//! Elsewhere every test does nothing.

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use support::{builder, rdma_with, spawn_helper, until_stdin_closes};
use tern_engine::{
    NicStats, OwnedBuffer, SegmentDesc, SegmentId, TransferEngine, TransferEngineBuilder,
    TransferError, TransferRequest, TransferStatus,
};
use tern_testkit::etcd::{Etcd, etcdctl};
use tern_transport_rdma::RdmaTransport;

const MIB: usize = 1 << 20;
/// Both NICs of a node, in the order of every key array.
const DEVICES: [&str; 2] = ["rxe0", "rxe1"];
/// How long one side waits for the other at any step (the guests are emulated).
const STEP: Duration = Duration::from_secs(150);
/// The role of the helper process that serves as a killable target.
const TARGET_ROLE: &str = "two-node-target";

/// This node in the two-node setup, for one test.
struct Node {
    /// `a` (initiator) or `b` (target).
    name: String,
    sync: PathBuf,
    /// Link 0's address: the handshake RPC listens there.
    addr0: String,
    peer_addr0: String,
    test: &'static str,
    started: Instant,
}

impl Node {
    /// This node, with logs and a watchdog set up; `None` outside the two-node setup.
    fn get(test: &'static str, limit: Duration) -> Option<Self> {
        let Ok(name) = std::env::var("TERN_NODE") else {
            eprintln!("{test}: not in the two-node setup; nothing to do");
            return None;
        };
        support::setup(test, limit);
        let var = |key: &str| std::env::var(key).unwrap_or_else(|_| panic!("{key} is not set"));
        let node = Self {
            name,
            sync: PathBuf::from(var("TERN_SYNC")),
            addr0: var("TERN_ADDR0"),
            peer_addr0: var("TERN_PEER_ADDR0"),
            test,
            started: Instant::now(),
        };
        node.note("starts");
        Some(node)
    }

    fn is_initiator(&self) -> bool {
        self.name == "a"
    }

    fn note(&self, what: &str) {
        eprintln!(
            "[{} {:7.2} s] {}: {what}",
            self.name,
            self.started.elapsed().as_secs_f64(),
            self.test
        );
    }

    /// Tells the other node `what` (the file `<test>.<what>`, written whole).
    fn publish(&self, what: &str, text: &str) {
        let name = format!("{}.{what}", self.test);
        let tmp = self.sync.join(format!(".{name}.{}.tmp", self.name));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(tmp, self.sync.join(name)).unwrap();
    }

    /// Waits for the other node's `what`; fails at once if the other node's test failed.
    fn wait_for(&self, what: &str) -> String {
        let path = self.sync.join(format!("{}.{what}", self.test));
        let other = if self.is_initiator() { "b" } else { "a" };
        let failed = self.sync.join(format!("{}.failed-{other}", self.test));
        let started = Instant::now();
        loop {
            if let Ok(text) = std::fs::read_to_string(&path) {
                return text;
            }
            assert!(
                !failed.exists(),
                "{}: node {other} failed while this node waited for {what}",
                self.test
            );
            assert!(
                started.elapsed() < STEP,
                "{}: the other node never wrote {what}",
                self.test
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// An engine over both NICs whose handshake RPC the other node reaches (P2P: its
    /// segment is `<addr0>:<port>`).
    fn engine(&self, transport: RdmaTransport) -> TransferEngineBuilder {
        builder(transport).local_server_name(self.addr0.clone())
    }

    /// Publishes the target side's verdict (after its own checks) and the initiator waits
    /// for it, so a failure on b fails a too.
    fn verdict(&self, result: Result<(), String>) {
        if self.is_initiator() {
            let theirs = self.wait_for("verdict");
            assert_eq!(theirs, "ok", "node b: {theirs}");
        } else {
            self.publish(
                "verdict",
                result.as_ref().err().map_or("ok", String::as_str),
            );
            if let Err(e) = result {
                panic!("{e}");
            }
        }
    }
}

impl Drop for Node {
    /// A failing test tells the other node, which would otherwise wait for it in vain.
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.publish(&format!("failed-{}", self.name), "");
        }
    }
}

/// An RDMA transport over both NICs, with the environment's other settings.
fn both_nics() -> RdmaTransport {
    rdma_with(|c| c.devices = DEVICES.map(str::to_owned).to_vec())
}

/// The GID Tern picks for `device` now (the best of its table), if any.
fn chosen_gid(device: &str) -> Option<tern_verbs::Gid> {
    tern_verbs::rank_gids(&tern_verbs::read_gid_table(device, 1))
        .first()
        .map(|entry| entry.gid)
}

/// What the engine's RDMA transport says about its peers: retries and each peer's last
/// error, for a failure message.
fn rdma_report(engine: &TransferEngine) -> String {
    let stats = engine.stats();
    let Some(rdma) = stats.transports.first() else {
        return "no transport stats".into();
    };
    let errors: Vec<String> = rdma
        .peers
        .iter()
        .filter_map(|p| p.last_error.as_ref().map(|e| format!("{}: {e}", p.peer)))
        .collect();
    format!("{} retries; last errors {errors:?}", rdma.retries)
}

/// A kernel counter of a device (`/sys/class/infiniband/<dev>/ports/1/hw_counters/<name>`).
fn hw_counter(device: &str, name: &str) -> u64 {
    let path = format!("/sys/class/infiniband/{device}/ports/1/hw_counters/{name}");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.trim()
        .parse()
        .unwrap_or_else(|_| panic!("{path} holds {text:?}"))
}

fn counters(name: &str) -> [u64; 2] {
    DEVICES.map(|d| hw_counter(d, name))
}

/// Bytes Tern moved per NIC, in `DEVICES` order.
fn tern_bytes(stats: &[NicStats]) -> [u64; 2] {
    DEVICES.map(|d| {
        stats
            .iter()
            .find(|s| s.name == d)
            .unwrap_or_else(|| panic!("no stats for {d}: {stats:?}"))
            .bytes
    })
}

fn delta(after: [u64; 2], before: [u64; 2]) -> [u64; 2] {
    [after[0] - before[0], after[1] - before[1]]
}

/// Deterministic contents in 1 MiB chunks: one pattern block, each 4 KiB page stamped with
/// (seed, chunk, page), so a misplaced slice shows. Comparing is a memcmp, which matters in
/// an unoptimised build under emulation.
struct Pattern {
    seed: u64,
    block: Vec<u8>,
}

impl Pattern {
    fn new(seed: u64) -> Self {
        Self {
            seed,
            block: support::pattern(seed, MIB),
        }
    }

    fn chunk(&self, index: usize) -> Vec<u8> {
        let mut bytes = self.block.clone();
        for (page, at) in (0..MIB).step_by(4096).enumerate() {
            for (k, word) in [self.seed, index as u64, page as u64].iter().enumerate() {
                bytes[at + 8 * k..at + 8 * k + 8].copy_from_slice(&word.to_le_bytes());
            }
        }
        bytes
    }

    fn fill(&self, buffer: &OwnedBuffer, chunks: usize) {
        for i in 0..chunks {
            buffer.write_at(i * MIB, &self.chunk(i)).unwrap();
        }
    }

    /// Whether the first `chunks` MiB of `buffer` hold the pattern; names the first that
    /// does not.
    fn check(&self, buffer: &OwnedBuffer, chunks: usize) -> Result<(), String> {
        let mut got = vec![0u8; MIB];
        for i in 0..chunks {
            buffer.read_at(i * MIB, &mut got).unwrap();
            if got != self.chunk(i) {
                let at = got
                    .iter()
                    .zip(self.chunk(i))
                    .position(|(a, b)| *a != b)
                    .unwrap_or(0);
                return Err(format!(
                    "MiB {i} differs from pattern {} at byte {at}",
                    self.seed
                ));
            }
        }
        Ok(())
    }
}

/// `chunks` requests of 1 MiB between `local` and the peer's buffer at `remote`.
fn requests(
    write: bool,
    local: &OwnedBuffer,
    peer: SegmentId,
    remote: u64,
    chunks: std::ops::Range<usize>,
) -> Vec<TransferRequest> {
    chunks
        .map(|i| {
            let (source, target) = (local.addr() + i * MIB, remote + (i * MIB) as u64);
            if write {
                TransferRequest::write(source, peer, target, MIB)
            } else {
                TransferRequest::read(source, peer, target, MIB)
            }
        })
        .collect()
}

/// Runs `requests` as one batch with `deadline`; returns every task's status.
fn run_batch(
    engine: &TransferEngine,
    requests: &[TransferRequest],
    deadline: Duration,
) -> Vec<TransferStatus> {
    let batch = engine.allocate_batch(requests.len()).unwrap();
    batch.set_deadline(Some(Instant::now() + deadline));
    engine.submit(&batch, requests).unwrap();
    batch.wait(deadline + Duration::from_secs(30));
    (0..requests.len())
        .map(|t| batch.task_status(t).unwrap().status)
        .collect()
}

fn assert_all_completed(statuses: &[TransferStatus], what: &str) {
    let bad: Vec<(usize, &TransferStatus)> = statuses
        .iter()
        .enumerate()
        .filter(|(_, s)| **s != TransferStatus::Completed)
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: {} of {} tasks did not complete, first {:?}",
        bad.len(),
        statuses.len(),
        &bad[..bad.len().min(5)]
    );
}

/// The peer's segment, published by node b as `<segment> <addr>`.
fn open_peer(node: &Node, engine: &TransferEngine) -> (SegmentId, u64) {
    let target = node.wait_for("target");
    let (segment, addr) = target.split_once(' ').unwrap();
    assert!(
        segment.starts_with(&format!("{}:", node.peer_addr0)),
        "b's segment {segment} is on link 0"
    );
    let peer = engine.open_segment(segment).unwrap();
    let desc = engine.segment(peer).unwrap().desc.clone();
    let names: Vec<&str> = desc.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, DEVICES, "b publishes both NICs");
    (peer, addr.parse().unwrap())
}

/// a writes 64 MiB to b in 1 MiB requests and reads it back; both NICs carry traffic, by
/// Tern's count and by the kernel's.
#[test]
#[ignore = "needs two Soft-RoCE nodes: cargo xtask softroce --two-nodes"]
fn striping_uses_both_nics() {
    const CHUNKS: usize = 64;
    let Some(node) = Node::get("striping_uses_both_nics", Duration::from_secs(300)) else {
        return;
    };
    let pattern = Pattern::new(11);
    if !node.is_initiator() {
        let engine = node.engine(both_nics()).build().unwrap();
        let buffer = engine.allocate(CHUNKS * MIB, "cpu:0").unwrap();
        let before = counters("rcvd_pkts");
        node.publish(
            "target",
            &format!("{} {}", engine.segment_name(), buffer.addr()),
        );
        node.wait_for("done");
        let received = delta(counters("rcvd_pkts"), before);
        node.note(&format!("received packets {DEVICES:?}: {received:?}"));
        let result = pattern.check(&buffer, CHUNKS).and_then(|()| {
            // Every write of ~32 MiB per NIC comes in packets of at most 4 KiB.
            let least = (CHUNKS * MIB / 2 / 4096 / 2) as u64;
            if received.iter().all(|&r| r >= least) {
                Ok(())
            } else {
                Err(format!(
                    "b's NICs {DEVICES:?} received {received:?} packets (at least {least} each expected)"
                ))
            }
        });
        return node.verdict(result);
    }
    // What this test checks is the split while both rails work: a path that fails once
    // (a QP whose retries ran out while an emulated guest stalled) is paused for a second,
    // not for the default 30 s that would outlast the test and leave one rail idle.
    let transport = rdma_with(|c| {
        c.devices = DEVICES.map(str::to_owned).to_vec();
        c.rail_pause = Duration::from_secs(1);
    });
    let stats = transport.clone();
    let engine = node.engine(transport).build().unwrap();
    let (peer, remote) = open_peer(&node, &engine);
    let source = engine.allocate(CHUNKS * MIB, "cpu:0").unwrap();
    let back = engine.allocate(CHUNKS * MIB, "cpu:0").unwrap();
    pattern.fill(&source, CHUNKS);

    let (sent_before, bytes_before) = (counters("sent_pkts"), tern_bytes(&stats.nic_stats()));
    let started = Instant::now();
    for quarter in 0..4 {
        let range = quarter * CHUNKS / 4..(quarter + 1) * CHUNKS / 4;
        let statuses = run_batch(
            &engine,
            &requests(true, &source, peer, remote, range),
            Duration::from_secs(120),
        );
        assert_all_completed(&statuses, "writes");
    }
    let wrote = started.elapsed();
    let sent = delta(counters("sent_pkts"), sent_before);
    let written = delta(tern_bytes(&stats.nic_stats()), bytes_before);

    let (rcvd_before, bytes_before) = (counters("rcvd_pkts"), tern_bytes(&stats.nic_stats()));
    let started = Instant::now();
    let statuses = run_batch(
        &engine,
        &requests(false, &back, peer, remote, 0..CHUNKS),
        Duration::from_secs(120),
    );
    assert_all_completed(&statuses, "reads");
    let read = started.elapsed();
    let received = delta(counters("rcvd_pkts"), rcvd_before);
    let fetched = delta(tern_bytes(&stats.nic_stats()), bytes_before);
    node.note(&format!(
        "wrote {CHUNKS} MiB in {:.1} s ({:.1} MB/s), read it back in {:.1} s ({:.1} MB/s)",
        wrote.as_secs_f64(),
        (CHUNKS * MIB) as f64 / wrote.as_secs_f64() / 1e6,
        read.as_secs_f64(),
        (CHUNKS * MIB) as f64 / read.as_secs_f64() / 1e6
    ));
    let report = rdma_report(&engine);
    node.note(&format!(
        "Tern bytes {DEVICES:?}: written {written:?}, read {fetched:?}; kernel packets: sent {sent:?} while writing, received {received:?} while reading; {report}"
    ));
    pattern.check(&back, CHUNKS).unwrap();
    node.publish("done", "");

    let total = (CHUNKS * MIB) as u64;
    assert_eq!(written[0] + written[1], total, "Tern counted the writes");
    assert_eq!(fetched[0] + fetched[1], total, "Tern counted the reads");
    for i in 0..2 {
        // Striped: each NIC carries a fair share, not a trickle.
        assert!(
            written[i] >= total / 4 && fetched[i] >= total / 4,
            "{} carried {} of {total} bytes written, {} read ({report})",
            DEVICES[i],
            written[i],
            fetched[i]
        );
        // The kernel saw them go: data packets of at most 4 KiB each.
        assert!(
            sent[i] >= written[i] / 4096,
            "{} sent {} packets for {} bytes written",
            DEVICES[i],
            sent[i],
            written[i]
        );
        assert!(
            received[i] >= fetched[i] / 4096,
            "{} received {} packets for {} bytes read",
            DEVICES[i],
            received[i],
            fetched[i]
        );
    }
    node.verdict(Ok(()));
}

/// Holds a network interface down; brings it back up when dropped, whatever happened
/// meanwhile.
struct InterfaceDown(&'static str);

impl InterfaceDown {
    fn new(interface: &'static str) -> Self {
        ip_link(interface, "down");
        Self(interface)
    }
}

impl Drop for InterfaceDown {
    fn drop(&mut self) {
        ip_link(self.0, "up");
    }
}

/// Whether the device's port 1 is ACTIVE (`/sys/class/infiniband/<dev>/ports/1/state` reads
/// `4: ACTIVE`).
fn port_active(device: &str) -> bool {
    std::fs::read_to_string(format!("/sys/class/infiniband/{device}/ports/1/state"))
        .is_ok_and(|state| state.contains("ACTIVE"))
}

fn ip_link(interface: &str, state: &str) {
    let status = Command::new("ip")
        .args(["link", "set", interface, state])
        .status()
        .expect("ip runs");
    assert!(
        status.success(),
        "ip link set {interface} {state}: {status}"
    );
}

/// a writes 192 MiB to b and takes link 1 down while the writes are in flight: every task
/// still completes, over rxe0, and reading it all back over what is left verifies it.
#[test]
#[ignore = "needs two Soft-RoCE nodes: cargo xtask softroce --two-nodes"]
fn failover_when_a_link_goes_down_mid_transfer() {
    const CHUNKS: usize = 192;
    let Some(node) = Node::get(
        "failover_when_a_link_goes_down_mid_transfer",
        Duration::from_secs(360),
    ) else {
        return;
    };
    let pattern = Pattern::new(12);
    if !node.is_initiator() {
        let engine = node.engine(both_nics()).build().unwrap();
        let buffer = engine.allocate(CHUNKS * MIB, "cpu:0").unwrap();
        node.publish(
            "target",
            &format!("{} {}", engine.segment_name(), buffer.addr()),
        );
        node.wait_for("done");
        return node.verdict(pattern.check(&buffer, CHUNKS));
    }
    let transport = both_nics();
    let stats = transport.clone();
    // Each chunk its own task, as submitted: merged, the chunks would make one run whose
    // tasks (and bytes) show only when the whole run ends, and progress is what this test
    // waits for before it breaks the path.
    let engine = node
        .engine(transport)
        .merge_requests(false)
        .build()
        .unwrap();
    let (peer, remote) = open_peer(&node, &engine);
    let source = engine.allocate(CHUNKS * MIB, "cpu:0").unwrap();
    pattern.fill(&source, CHUNKS);

    let batch = engine.allocate_batch(CHUNKS).unwrap();
    let deadline = Duration::from_secs(200);
    batch.set_deadline(Some(Instant::now() + deadline));
    let started = Instant::now();
    engine
        .submit(&batch, &requests(true, &source, peer, remote, 0..CHUNKS))
        .unwrap();
    // Both NICs carry some of it before the link goes.
    let (mut moved, mut per_nic) = (0, [0, 0]);
    while moved < (CHUNKS * MIB / 8) as u64 || per_nic.contains(&0) {
        std::thread::sleep(Duration::from_millis(20));
        per_nic = tern_bytes(&stats.nic_stats());
        moved = batch.status().transferred_bytes;
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no progress: {per_nic:?}"
        );
    }
    let before_down = started.elapsed();
    let gid_before = chosen_gid("rxe1").expect("rxe1 has a usable GID");
    let link = InterfaceDown::new("tern1");
    let down_at = Instant::now();
    let at_down = batch.status();
    let stats_at_down = stats.nic_stats();
    node.note(&format!(
        "tern1 down after {:.1} s: {} of {CHUNKS} tasks completed, {} MiB moved, NICs {stats_at_down:?}",
        before_down.as_secs_f64(),
        at_down.completed,
        at_down.transferred_bytes >> 20
    ));
    assert!(
        at_down.completed < CHUNKS,
        "the transfer finished before the link went down: make it larger"
    );
    // Watch the progress: the longest stretch without a byte completing is the failover's
    // stall.
    let (mut stall, mut last_progress, mut last_bytes) = (Duration::ZERO, down_at, 0);
    let status = loop {
        let status = batch.wait(Duration::from_millis(50));
        let now = Instant::now();
        if status.transferred_bytes != last_bytes {
            last_bytes = status.transferred_bytes;
            last_progress = now;
        }
        stall = stall.max(now - last_progress);
        if status.pending == 0 || now - down_at > deadline + Duration::from_secs(30) {
            break status;
        }
    };
    let failover = down_at.elapsed();
    let statuses: Vec<TransferStatus> = (0..CHUNKS)
        .map(|t| batch.task_status(t).unwrap().status)
        .collect();
    let after = stats.nic_stats();
    node.note(&format!(
        "after the link went down: the rest ({} MiB) took {:.1} s, the longest stall was {:.2} s (the first {} MiB took {:.1} s); {status:?}; NICs {after:?}",
        (CHUNKS as u64 * MIB as u64 - at_down.transferred_bytes) >> 20,
        failover.as_secs_f64(),
        stall.as_secs_f64(),
        at_down.transferred_bytes >> 20,
        before_down.as_secs_f64()
    ));
    assert_all_completed(&statuses, "writes across the failover");
    let rdma = &engine.stats().transports[0];
    assert!(
        rdma.retries > 0,
        "slices moved to rxe0 are retries: {rdma:?}"
    );

    // Read it all back over what is left.
    let back = engine.allocate(CHUNKS * MIB, "cpu:0").unwrap();
    let started = Instant::now();
    let statuses = run_batch(
        &engine,
        &requests(false, &back, peer, remote, 0..CHUNKS),
        Duration::from_secs(150),
    );
    node.note(&format!(
        "read back over rxe0 in {:.1} s; NICs {:?}",
        started.elapsed().as_secs_f64(),
        stats.nic_stats()
    ));
    assert_all_completed(&statuses, "reads with link 1 down");
    pattern.check(&back, CHUNKS).unwrap();
    // The NIC whose port went down is out of the published descriptor (the monitor looks
    // once a second) ...
    let published = |engine: &tern_engine::TransferEngine| -> Vec<String> {
        let desc = engine.local_descriptor();
        desc.devices.iter().map(|d| d.name.clone()).collect()
    };
    assert_eq!(
        published(&engine),
        ["rxe0"],
        "rxe1 is still published while down"
    );
    assert!(
        engine.local_descriptor().buffers[0]
            .rkey
            .as_ref()
            .is_some_and(|k| k.len() == 1),
        "one rkey per published device"
    );
    drop(link);
    // Leave the node as it was, so that the next test starts on two working rails: rxe1's
    // port comes back once tern1 is up, with the GID it had ...
    let up = Instant::now();
    while !port_active("rxe1") || chosen_gid("rxe1") != Some(gid_before) {
        assert!(
            up.elapsed() < Duration::from_secs(60),
            "rxe1's port ({}) or GID ({:?}, was {gid_before}) stays away after tern1 came back up",
            port_active("rxe1"),
            chosen_gid("rxe1")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // ... and carries RDMA again: a fresh transport on rxe1 alone (its own health, no
    // paused paths) writes 1 MiB over rail 1 (chunk 0 again, so b's check still holds).
    {
        let rail1 = rdma_with(|c| c.devices = vec![DEVICES[1].to_owned()]);
        let rail1_stats = rail1.clone();
        let probe = node.engine(rail1).build().unwrap();
        let peer1 = probe
            .open_segment(&engine.segment(peer).unwrap().name)
            .unwrap();
        let chunk = probe.allocate(MIB, "cpu:0").unwrap();
        chunk.write_at(0, &pattern.chunk(0)).unwrap();
        let statuses = run_batch(
            &probe,
            &[TransferRequest::write(chunk.addr(), peer1, remote, MIB)],
            Duration::from_secs(60),
        );
        assert_all_completed(&statuses, "a write over rxe1 once tern1 is back");
        let carried = rail1_stats.nic_stats();
        assert_eq!(
            carried.iter().map(|s| s.bytes).sum::<u64>(),
            MIB as u64,
            "rxe1 carried it: {carried:?}"
        );
    }
    // ... and back in it once the port is up again.
    let up = Instant::now();
    while published(&engine) != ["rxe0", "rxe1"] {
        assert!(
            up.elapsed() < Duration::from_secs(30),
            "rxe1 was not published again: {:?}",
            published(&engine)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    node.publish("done", "");
    node.verdict(Ok(()));
}

/// Helper process for `a_killed_peer_fails_its_tasks_without_a_hang`: an RDMA target on
/// both NICs with a buffer of `TERN_TARGET_MIB` MiB, until its stdin closes (or it is
/// killed).
#[test]
#[ignore = "helper process of a_killed_peer_fails_its_tasks_without_a_hang"]
fn helper_two_node_target() {
    if std::env::var(support::HELPER_ENV).as_deref() != Ok(TARGET_ROLE) {
        return;
    }
    support::setup("helper_two_node_target", Duration::from_secs(600));
    let addr0 = std::env::var("TERN_ADDR0").unwrap();
    let mib: usize = std::env::var("TERN_TARGET_MIB").unwrap().parse().unwrap();
    let engine = builder(both_nics())
        .local_server_name(addr0)
        .build()
        .unwrap();
    let buffer = engine.allocate(mib * MIB, "cpu:0").unwrap();
    println!("buffer: {} {}", engine.segment_name(), buffer.addr());
    until_stdin_closes();
}

/// b's target is a process of its own; b kills it while a's writes are in flight: a's tasks
/// end Failed, with a connection error, well within their deadline.
#[test]
#[ignore = "needs two Soft-RoCE nodes: cargo xtask softroce --two-nodes"]
fn a_killed_peer_fails_its_tasks_without_a_hang() {
    const CHUNKS: usize = 192;
    let Some(node) = Node::get(
        "a_killed_peer_fails_its_tasks_without_a_hang",
        Duration::from_secs(300),
    ) else {
        return;
    };
    if !node.is_initiator() {
        let (mut helper, target) = spawn_helper(
            "helper_two_node_target",
            TARGET_ROLE,
            &[("TERN_TARGET_MIB", &CHUNKS.to_string())],
            "buffer",
        );
        node.publish("target", &target);
        node.wait_for("inflight");
        helper.kill();
        node.note("killed the target");
        node.publish("killed", "");
        node.wait_for("done");
        return node.verdict(Ok(()));
    }
    let transport = both_nics();
    let stats = transport.clone();
    // Each chunk its own task, as submitted: merged, the chunks would make one run whose
    // tasks (and bytes) show only when the whole run ends, and progress is what this test
    // waits for before it breaks the path.
    let engine = node
        .engine(transport)
        .merge_requests(false)
        .build()
        .unwrap();
    let (peer, remote) = open_peer(&node, &engine);
    let source = engine.allocate(CHUNKS * MIB, "cpu:0").unwrap();
    let batch = engine.allocate_batch(CHUNKS).unwrap();
    let deadline = Duration::from_secs(60);
    batch.set_deadline(Some(Instant::now() + deadline));
    let submitted = Instant::now();
    engine
        .submit(&batch, &requests(true, &source, peer, remote, 0..CHUNKS))
        .unwrap();
    while batch.status().transferred_bytes == 0 {
        assert!(
            submitted.elapsed() < Duration::from_secs(30),
            "nothing moved"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    node.publish("inflight", "");
    node.wait_for("killed");
    let killed = Instant::now();
    let at_kill = batch.status();
    node.note(&format!(
        "b killed its target {:.1} s after the submit, with {} of {CHUNKS} tasks completed",
        killed.duration_since(submitted).as_secs_f64(),
        at_kill.completed
    ));
    let status = batch.wait(deadline + Duration::from_secs(30));
    let ended = submitted.elapsed();
    let statuses: Vec<TransferStatus> = (0..CHUNKS)
        .map(|t| batch.task_status(t).unwrap().status)
        .collect();
    node.note(&format!(
        "every task ended {:.1} s after the kill ({:.1} s after the submit): {status:?}; NICs {:?}",
        killed.elapsed().as_secs_f64(),
        ended.as_secs_f64(),
        stats.nic_stats()
    ));
    node.publish("done", "");
    let failed: Vec<&TransferError> = statuses
        .iter()
        .filter_map(|s| match s {
            TransferStatus::Failed(e) => Some(e),
            _ => None,
        })
        .collect();
    if let Some(first) = failed.first() {
        node.note(&format!("first error: {first}"));
    }
    let others: Vec<&TransferStatus> = statuses
        .iter()
        .filter(|s| !matches!(s, TransferStatus::Completed | TransferStatus::Failed(_)))
        .collect();
    assert!(
        others.is_empty(),
        "tasks neither completed nor failed (pending or timed out at the {deadline:?} deadline): {:?}",
        &others[..others.len().min(5)]
    );
    assert!(
        !failed.is_empty(),
        "every task completed: the target died too late"
    );
    assert!(
        ended < deadline,
        "the tasks took {ended:?}, not well within their deadline"
    );
    for error in &failed {
        assert!(
            matches!(error, TransferError::Connection { .. }),
            "a task failed with {error:?}"
        );
    }
    node.verdict(Ok(()));
}

/// Both nodes on an etcd that node a runs in its guest: b's descriptor (its devices, its
/// per-NIC rkeys) travels through etcd, and a opens b by name and moves verified bytes.
#[test]
#[ignore = "needs two Soft-RoCE nodes: cargo xtask softroce --two-nodes"]
fn rkeys_travel_through_etcd_between_two_nodes() {
    const CHUNKS: usize = 16;
    let Some(node) = Node::get(
        "rkeys_travel_through_etcd_between_two_nodes",
        Duration::from_secs(300),
    ) else {
        return;
    };
    let pattern = Pattern::new(13);
    if !node.is_initiator() {
        let endpoint = node.wait_for("etcd");
        let engine = node
            .engine(both_nics())
            .metadata(format!("etcd://{endpoint}"))
            .local_server_name("node-b")
            .advertise_address(node.addr0.clone())
            .build()
            .unwrap();
        assert_eq!(engine.segment_name(), "node-b");
        let buffer = engine.allocate(CHUNKS * MIB, "cpu:0").unwrap();
        node.note("published node-b");
        node.publish("target", "");
        node.wait_for("done");
        let result = pattern.check(&buffer, CHUNKS);
        drop(engine);
        node.publish("left", "");
        return node.verdict(result);
    }
    let started = Instant::now();
    let etcd = Etcd::start_on(node.addr0.parse().expect("link 0's address"));
    node.note(&format!(
        "etcd up at {} in {:.1} s",
        etcd.endpoint,
        started.elapsed().as_secs_f64()
    ));
    node.publish("etcd", &etcd.endpoint);
    let engine = node
        .engine(both_nics())
        .metadata(format!("etcd://{}", etcd.endpoint))
        .local_server_name("node-a")
        .advertise_address(node.addr0.clone())
        .build()
        .unwrap();
    node.wait_for("target");
    let peer = engine.open_segment("node-b").unwrap();
    let segment = engine.segment(peer).unwrap();
    assert_eq!(segment.rpc.ip_or_host_name, node.peer_addr0, "b's address");
    let desc = &segment.desc;
    let names: Vec<&str> = desc.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(names, DEVICES);
    let buffer = desc
        .buffers
        .iter()
        .find(|b| b.length == (CHUNKS * MIB) as u64)
        .expect("b's buffer is in its descriptor");
    let rkeys = buffer.rkey.clone().unwrap_or_default();
    assert_eq!(rkeys.len(), 2, "one rkey per NIC: {buffer:?}");
    let remote = buffer.addr;
    // What etcd itself holds under b's key: the same rkeys.
    let keys = etcdctl(
        &etcd.endpoint,
        &["get", "--prefix", "mooncake/", "--keys-only"],
    );
    let key = keys
        .lines()
        .find(|k| k.ends_with("/ram/node-b"))
        .unwrap_or_else(|| panic!("no node-b key in etcd: {keys}"));
    let value = etcdctl(&etcd.endpoint, &["get", key, "--print-value-only"]);
    let in_etcd = SegmentDesc::from_json(value.trim().as_bytes()).unwrap();
    let stored_rkeys = in_etcd
        .buffers
        .iter()
        .find(|b| b.addr == remote)
        .and_then(|b| b.rkey.clone());
    assert_eq!(stored_rkeys, Some(rkeys.clone()), "{key} in etcd");
    node.note(&format!("{key} in etcd carries rkeys {rkeys:?}"));

    let source = engine.allocate(CHUNKS * MIB, "cpu:0").unwrap();
    let back = engine.allocate(CHUNKS * MIB, "cpu:0").unwrap();
    pattern.fill(&source, CHUNKS);
    let timer = Instant::now();
    let statuses = run_batch(
        &engine,
        &requests(true, &source, peer, remote, 0..CHUNKS),
        Duration::from_secs(120),
    );
    assert_all_completed(&statuses, "writes");
    let statuses = run_batch(
        &engine,
        &requests(false, &back, peer, remote, 0..CHUNKS),
        Duration::from_secs(120),
    );
    assert_all_completed(&statuses, "reads");
    node.note(&format!(
        "wrote and read back {CHUNKS} MiB in {:.1} s",
        timer.elapsed().as_secs_f64()
    ));
    pattern.check(&back, CHUNKS).unwrap();
    node.publish("done", "");
    node.wait_for("left");
    let verdict = node.wait_for("verdict");
    drop(engine);
    drop(etcd);
    assert_eq!(verdict, "ok", "node b: {verdict}");
}

/// a reads 1 MiB from b over rail 1 alone while b's end of link 1 is down: the read's
/// packets leave a and are lost, and with a long ACK timeout a's QP would retry for
/// minutes. At its deadline the task ends as `Timeout`: a's endpoint is cut off (its QPs go
/// to the error state, the flushed request is reaped), so a can unregister the buffer at
/// once, and it stays untouched for two seconds after b's link is back.
#[test]
#[ignore = "needs two Soft-RoCE nodes: cargo xtask softroce --two-nodes"]
fn a_read_stalled_by_a_lost_link_is_cut_off_at_its_deadline() {
    let Some(node) = Node::get(
        "a_read_stalled_by_a_lost_link_is_cut_off_at_its_deadline",
        Duration::from_secs(300),
    ) else {
        return;
    };
    let rail1 = |ack_timeout: u8| {
        rdma_with(move |c| {
            c.devices = vec![DEVICES[1].to_owned()];
            c.ack_timeout = ack_timeout;
        })
    };
    if !node.is_initiator() {
        let engine = node.engine(rail1(14)).build().unwrap();
        let buffer = engine.allocate(MIB, "cpu:0").unwrap();
        buffer.write_at(0, &vec![0x5a; MIB]).unwrap();
        node.publish(
            "target",
            &format!("{} {}", engine.segment_name(), buffer.addr()),
        );
        node.wait_for("connected");
        let gid_before = chosen_gid("rxe1").expect("rxe1 has a usable GID");
        let link = InterfaceDown::new("tern1");
        node.note("tern1 down");
        node.publish("down", "");
        node.wait_for("returned");
        drop(link);
        node.note("tern1 up");
        node.publish("up", "");
        // Leave the node as it was for the next test: rxe1 up, with the GID it had.
        let up = Instant::now();
        while !port_active("rxe1") || chosen_gid("rxe1") != Some(gid_before) {
            assert!(
                up.elapsed() < Duration::from_secs(60),
                "rxe1 stays away after tern1 came back up"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        node.wait_for("done");
        return node.verdict(Ok(()));
    }
    // 4.096 µs × 2^24 ≈ 69 s per try: the QP alone would give up only minutes after the
    // wait below.
    let engine = node.engine(rail1(24)).build().unwrap();
    let target = node.wait_for("target");
    let (segment, addr) = target.split_once(' ').unwrap();
    let remote: u64 = addr.parse().unwrap();
    let peer = engine.open_segment(segment).unwrap();
    let local = Local::register(&engine, MIB);
    engine
        .transfer_sync(TransferRequest::read(local.addr(), peer, remote, 4096))
        .unwrap();
    node.publish("connected", "");
    node.wait_for("down");
    let posted_before = tern_verbs::tracked_in_flight();
    let batch = engine.allocate_batch(1).unwrap();
    engine
        .submit(
            &batch,
            &[TransferRequest::read(local.addr(), peer, remote, MIB)],
        )
        .unwrap();
    let started = Instant::now();
    while tern_verbs::tracked_in_flight() == posted_before {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the read was never posted"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    batch.set_deadline(Some(Instant::now() + Duration::from_millis(500)));
    batch.wait(Duration::from_secs(30));
    let status = batch.task_status(0).unwrap();
    node.note(&format!(
        "returned {:.2} s after submitting: {status:?}",
        started.elapsed().as_secs_f64()
    ));
    let unregistered = engine.unregister_memory(local.addr());
    node.publish("returned", "");
    assert_eq!(status.status, TransferStatus::Timeout, "{status:?}");
    assert!(!status.remote_may_change, "a read changes nothing remote");
    unregistered.expect("unregistering the cut-off read's buffer succeeds at once");
    node.wait_for("up");
    local.assert_untouched("a read stalled by a lost link", || ());
    engine.free_batch(&batch).unwrap();
    node.publish("done", "");
    node.verdict(Ok(()));
}

#[path = "../../testkit/include/local.rs"]
mod local;
use local::Local;
