//! Faults while transfers are in flight, over TCP on the host: the target process killed or
//! stopped mid-batch, connections reset under a transfer, an RPC port nobody listens on.
//! Every task ends in a typed status within its deadline, every completed block carries the
//! right bytes, and the engine serves new transfers afterwards. (Links taken down and peers
//! killed over RDMA are in transport-rdma's two-node suite.)

#[path = "support/target.rs"]
mod support;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::{Target, send_signal, target_byte};
use tern_engine::{
    Batch, EngineError, OwnedBuffer, SegmentId, TransferEngine, TransferError, TransferRequest,
    TransferStatus,
};
use tern_metadata::http::{HttpMetadataServer, HttpStore};
use tern_metadata::{MetadataError, MetadataStore};
use tern_transport_tcp::TcpTransport;

const MIB: usize = 1 << 20;

/// Each request its own task, as submitted: these tests count what each block did when a
/// fault struck, and merged, a run's blocks would end together with the run.
fn engine(metadata: &str) -> TransferEngine {
    TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .metadata(metadata)
        .merge_requests(false)
        .transport(TcpTransport::default())
        .build()
        .unwrap()
}

/// Waits for `batch`, which must end within `limit` (its deadline is shorter).
fn wait_at_most(batch: &Batch, limit: Duration) {
    let started = Instant::now();
    batch.wait(limit + Duration::from_secs(30));
    assert!(started.elapsed() < limit, "took {:?}", started.elapsed());
}

/// Every task has ended, in one of `allowed` ways; returns the completed task numbers.
fn settled(batch: &Batch, allowed: &dyn Fn(&TransferStatus) -> bool) -> Vec<usize> {
    let status = batch.status();
    assert_eq!(status.pending, 0, "tasks still pending: {status:?}");
    (0..status.submitted)
        .filter(|&task| {
            let status = batch.task_status(task).unwrap().status;
            assert!(allowed(&status), "task {task} ended {status}");
            status == TransferStatus::Completed
        })
        .collect()
}

/// `count` reads of 1 MiB, request `i` moving block `i % blocks` of the target's buffer into
/// the same block of `local`.
fn reads(
    local: &OwnedBuffer,
    peer: SegmentId,
    remote: u64,
    blocks: usize,
    count: usize,
) -> Vec<TransferRequest> {
    (0..count)
        .map(|i| {
            let block = i % blocks;
            TransferRequest::read(
                local.addr() + block * MIB,
                peer,
                remote + (block * MIB) as u64,
                MIB,
            )
        })
        .collect()
}

/// Block `i` of `local` holds what the target keeps there.
fn block_is_right(local: &OwnedBuffer, i: usize) -> bool {
    let mut bytes = vec![0u8; MIB];
    local.read_at(i * MIB, &mut bytes).unwrap();
    bytes
        .iter()
        .enumerate()
        .all(|(j, b)| *b == target_byte(i * MIB + j))
}

/// A `tern-bench` target with 64 MiB, an engine that opened it, the remote buffer's address,
/// and 64 MiB of local memory to read into.
fn reader_of_a_target() -> (Target, TransferEngine, SegmentId, u64, OwnedBuffer) {
    let target = Target::start(
        &["--local_server_name=127.0.0.1", "--buffer_size=67108864"],
        &[],
    );
    let engine = engine("P2PHANDSHAKE");
    let peer = engine.open_segment(&target.segment).unwrap();
    let remote = engine.segment(peer).unwrap().desc.buffers[0].addr;
    let local = engine.allocate(64 * MIB, "cpu:0").unwrap();
    (target, engine, peer, remote, local)
}

#[test]
fn a_target_killed_mid_batch_leaves_typed_statuses_intact_blocks_and_a_working_engine() {
    let (mut target, engine, peer, remote, local) = reader_of_a_target();
    // 1 GiB in all: far more than can finish before the signal lands.
    let batch = engine.allocate_batch(1024).unwrap();
    batch.set_deadline(Some(Instant::now() + Duration::from_secs(30)));
    engine
        .submit(&batch, &reads(&local, peer, remote, 64, 1024))
        .unwrap();
    send_signal(target.child.id(), "KILL");
    wait_at_most(&batch, Duration::from_secs(35));
    let completed = settled(&batch, &|s| {
        matches!(
            s,
            TransferStatus::Completed | TransferStatus::Failed(TransferError::Connection { .. })
        )
    });
    for &i in &completed {
        assert!(
            block_is_right(&local, i % 64),
            "completed read {i} holds other bytes"
        );
    }
    // The statistics name the dead peer and what went wrong with it.
    let stats = engine.stats();
    let tcp = &stats.transports[0];
    assert_eq!(tcp.slices as usize, completed.len(), "{tcp:?}");
    assert!(tcp.failures > 0, "{tcp:?}");
    let dead = &tcp.peers[0];
    assert!(
        dead.endpoints == 0 && dead.last_error.is_some(),
        "the dead peer: {dead:?}"
    );
    // A new target is served at once, and its bytes are right.
    let fresh = Target::start(
        &["--local_server_name=127.0.0.1", "--buffer_size=8388608"],
        &[],
    );
    let peer = engine.open_segment(&fresh.segment).unwrap();
    let remote = engine.segment(peer).unwrap().desc.buffers[0].addr;
    let batch = engine.allocate_batch(8).unwrap();
    engine
        .submit(&batch, &reads(&local, peer, remote, 8, 8))
        .unwrap();
    batch.wait(Duration::from_secs(60));
    assert_eq!(
        settled(&batch, &|s| *s == TransferStatus::Completed).len(),
        8
    );
    assert!((0..8).all(|i| block_is_right(&local, i)));
    let _ = target.child.wait();
}

#[test]
fn a_target_stopped_mid_batch_times_out_and_is_served_again_once_it_continues() {
    let (mut target, engine, peer, remote, local) = reader_of_a_target();
    let batch = engine.allocate_batch(1024).unwrap();
    let deadline = Duration::from_secs(3);
    batch.set_deadline(Some(Instant::now() + deadline));
    engine
        .submit(&batch, &reads(&local, peer, remote, 64, 1024))
        .unwrap();
    tern_testkit::process::stop(target.child.id());
    let started = Instant::now();
    batch.wait(Duration::from_secs(60));
    let waited = started.elapsed();
    let completed = settled(&batch, &|s| {
        matches!(s, TransferStatus::Completed | TransferStatus::Timeout)
    });
    assert!(
        completed.len() < 1024,
        "everything finished before SIGSTOP landed"
    );
    assert!(
        waited < deadline + Duration::from_secs(2),
        "took {waited:?}"
    );
    for &i in &completed {
        assert!(
            block_is_right(&local, i % 64),
            "completed read {i} holds other bytes"
        );
    }
    send_signal(target.child.id(), "CONT");
    // Once it runs again, new transfers to it complete with the right bytes.
    let local = engine.allocate(8 * MIB, "cpu:0").unwrap();
    let batch = engine.allocate_batch(8).unwrap();
    batch.set_deadline(Some(Instant::now() + Duration::from_secs(60)));
    engine
        .submit(&batch, &reads(&local, peer, remote, 8, 8))
        .unwrap();
    batch.wait(Duration::from_secs(90));
    assert_eq!(
        settled(&batch, &|s| *s == TransferStatus::Completed).len(),
        8
    );
    assert!((0..8).all(|i| block_is_right(&local, i)));
    let (status, said) = target.stop("TERM");
    assert!(status.success(), "{status}: {said}");
}

/// A TCP relay between the initiator and a target's data port that can cut every
/// connection at once (reset: it stops reading and closes with data unread, which makes the
/// kernel send RST) and refuse new ones until it is healed.
struct Relay {
    addr: SocketAddr,
    state: Arc<RelayState>,
    forwarded: Arc<AtomicU64>,
}

#[derive(Default)]
struct RelayState {
    /// Whether new connections are refused and relayed ones are to close.
    cutting: AtomicBool,
    /// Forwarding threads still running, two per relayed connection. Counted under `gate`
    /// with the check of `cutting`, so that a cut sees every connection it must close.
    forwarding: AtomicUsize,
    gate: Mutex<()>,
}

impl Relay {
    fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(RelayState::default());
        let forwarded = Arc::new(AtomicU64::new(0));
        let (relay, count) = (state.clone(), forwarded.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                // Refused before the target sees a connection open and close for it; the
                // check under the gate below is the one a cut relies on.
                if relay.cutting.load(Ordering::Acquire) {
                    continue;
                }
                let Ok(upstream) = TcpStream::connect(target) else {
                    continue;
                };
                let _gate = relay.gate.lock().unwrap();
                if relay.cutting.load(Ordering::Acquire) {
                    continue;
                }
                for (from, to) in [
                    (client.try_clone().unwrap(), upstream.try_clone().unwrap()),
                    (upstream, client),
                ] {
                    let (relay, count) = (relay.clone(), count.clone());
                    relay.forwarding.fetch_add(1, Ordering::AcqRel);
                    std::thread::spawn(move || {
                        pipe(from, to, &relay.cutting, &count);
                        relay.forwarding.fetch_sub(1, Ordering::AcqRel);
                    });
                }
            }
        });
        Self {
            addr,
            state,
            forwarded,
        }
    }

    /// Cuts every relayed connection and returns once all are closed, both directions: a
    /// connection left forwarding one way only would swallow the replies of whatever used it
    /// after a heal.
    fn cut(&self) {
        {
            let _gate = self.state.gate.lock().unwrap();
            self.state.cutting.store(true, Ordering::Release);
        }
        let started = Instant::now();
        while self.state.forwarding.load(Ordering::Acquire) > 0 {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "relayed connections still open 30 s after the cut"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn heal(&self) {
        self.state.cutting.store(false, Ordering::Release);
    }
}

/// Copies `from` to `to` until either side closes or the relay cuts (checked at least every
/// 20 ms, also while `to` does not take the bytes).
fn pipe(mut from: TcpStream, mut to: TcpStream, cut: &AtomicBool, count: &AtomicU64) {
    let pause = Some(Duration::from_millis(20));
    from.set_read_timeout(pause).unwrap();
    to.set_write_timeout(pause).unwrap();
    let mut buf = vec![0u8; 64 << 10];
    while !cut.load(Ordering::Acquire) {
        match from.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => {
                let mut sent = 0;
                while sent < n {
                    if cut.load(Ordering::Acquire) {
                        return;
                    }
                    match to.write(&buf[sent..n]) {
                        Ok(0) => return,
                        Ok(wrote) => sent += wrote,
                        Err(e)
                            if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                        Err(_) => return,
                    }
                }
                count.fetch_add(n as u64, Ordering::Relaxed);
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return,
        }
    }
}

#[test]
fn connections_reset_mid_transfer_fail_typed_and_the_engine_reconnects() {
    let server = HttpMetadataServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
    let url = format!("http://{}/metadata", server.local_addr());
    let target = TransferEngine::builder()
        .local_server_name("relay-target")
        .advertise_address("127.0.0.1")
        .metadata(&url)
        .transport(TcpTransport::default())
        .build()
        .unwrap();
    let remote = target.allocate(64 * MIB, "cpu:0").unwrap();
    // The same segment, published again under another name with the relay as its data port.
    let store = HttpStore::new(&url).unwrap();
    let mut desc = store.fetch_segment("relay-target").unwrap();
    let relay = Relay::start(format!("127.0.0.1:{}", desc.tcp_data_port).parse().unwrap());
    desc.name = "via-relay".into();
    desc.tcp_data_port = relay.addr.port();
    store.publish_segment("via-relay", &desc).unwrap();
    let rpc = store.rpc_meta("relay-target").unwrap();
    store.publish_rpc_meta("via-relay", &rpc).unwrap();

    let initiator = TransferEngine::builder()
        .local_server_name("relay-initiator")
        .advertise_address("127.0.0.1")
        .metadata(&url)
        .merge_requests(false)
        .transport(TcpTransport::default())
        .build()
        .unwrap();
    let peer = initiator.open_segment("via-relay").unwrap();
    let local = initiator.allocate(64 * MIB, "cpu:0").unwrap();
    let pattern: Vec<u8> = (0..64 * MIB).map(|i| (i % 251) as u8).collect();
    local.write_at(0, &pattern).unwrap();
    let writes: Vec<_> = (0..64)
        .map(|i| {
            TransferRequest::write(
                local.addr() + i * MIB,
                peer,
                (remote.addr() + i * MIB) as u64,
                MIB,
            )
        })
        .collect();
    let batch = initiator.allocate_batch(64).unwrap();
    batch.set_deadline(Some(Instant::now() + Duration::from_secs(30)));
    initiator.submit(&batch, &writes).unwrap();
    while relay.forwarded.load(Ordering::Relaxed) < 4 * MIB as u64 {
        std::thread::sleep(Duration::from_millis(1));
    }
    relay.cut();
    wait_at_most(&batch, Duration::from_secs(35));
    let completed = settled(&batch, &|s| {
        matches!(
            s,
            TransferStatus::Completed
                | TransferStatus::Failed(TransferError::Connection { .. })
                | TransferStatus::Failed(TransferError::Protocol { .. })
        )
    });
    assert!(completed.len() < 64, "nothing was cut");
    let mut landed = vec![0u8; MIB];
    for &i in &completed {
        remote.read_at(i * MIB, &mut landed).unwrap();
        assert!(
            landed == pattern[i * MIB..(i + 1) * MIB],
            "completed write {i} did not land"
        );
    }
    // Healed: the engine connects again and moves verified bytes.
    relay.heal();
    let moved = initiator
        .transfer_sync(TransferRequest::write(
            local.addr(),
            peer,
            remote.addr() as u64,
            4 * MIB,
        ))
        .unwrap();
    assert_eq!(moved, 4 * MIB as u64);
    remote.read_at(MIB, &mut landed).unwrap();
    assert!(landed == pattern[MIB..2 * MIB]);
}

#[test]
fn an_rpc_port_nobody_listens_on_is_a_typed_error_at_once() {
    let engine = engine("P2PHANDSHAKE");
    let closed = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let started = Instant::now();
    let error = engine.open_segment(&closed.to_string()).unwrap_err();
    assert!(
        matches!(error, EngineError::Metadata(MetadataError::Rpc(_))),
        "{error:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "took {:?}",
        started.elapsed()
    );
}
