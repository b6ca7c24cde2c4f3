//! A write sent again on a new connection is final once it shows Completed: no byte of its
//! first send, held back on the dropped connection's way to the target, lands after it.
//!
//! The lagging path is a relay in front of the target's data port that holds what the first
//! connection's client sends until the test lets it go. Write A (one batch) and write B
//! (another) go out on the lane's one connection and are held there; B is canceled, so the
//! lane drops the connection and sends A again on a new one, which the relay passes on at
//! once. Then either the held bytes go within the drain time — A may complete only after
//! them, and write C over A's range, made after A completed, is what the range keeps — or
//! they are held past it, and A must not show Completed as if final.

use std::time::{Duration, Instant};

use tern_engine::{
    Batch, DRAIN, OwnedBuffer, SegmentId, TransferEngine, TransferError, TransferRequest,
    TransferStatus,
};
use tern_metadata::MetadataStore;
use tern_metadata::http::{HttpMetadataServer, HttpStore};
use tern_testkit::relay::HoldingRelay;
use tern_transport_tcp::{TcpConfig, TcpTransport};

const LEN: usize = 64 << 10;

struct Stand {
    relay: HoldingRelay,
    initiator: TransferEngine,
    peer: SegmentId,
    /// The target's memory: A's range at 0, B's at `LEN`.
    remote: OwnedBuffer,
    /// A's bytes at 0, B's at `LEN`, C's at `2 * LEN`.
    local: OwnedBuffer,
    _target: TransferEngine,
    _server: HttpMetadataServer,
}

fn filled(byte: u8) -> Vec<u8> {
    (0..LEN).map(|i| byte ^ (i % 251) as u8).collect()
}

/// A target, the relay in front of its data port (published as segment "via-relay"), and an
/// initiator with one connection to it that opened that segment.
fn stand() -> Stand {
    let server = HttpMetadataServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
    let url = format!("http://{}/metadata", server.local_addr());
    let target = TransferEngine::builder()
        .local_server_name("resend-target")
        .advertise_address("127.0.0.1")
        .metadata(&url)
        .transport(TcpTransport::default())
        .build()
        .unwrap();
    let remote = target.allocate(2 * LEN, "cpu:0").unwrap();
    remote.write_at(0, &vec![0u8; 2 * LEN]).unwrap();
    let store = HttpStore::new(&url).unwrap();
    let mut desc = store.fetch_segment("resend-target").unwrap();
    let relay = HoldingRelay::start(format!("127.0.0.1:{}", desc.tcp_data_port).parse().unwrap());
    desc.name = "via-relay".into();
    desc.tcp_data_port = relay.addr().port();
    store.publish_segment("via-relay", &desc).unwrap();
    let rpc = store.rpc_meta("resend-target").unwrap();
    store.publish_rpc_meta("via-relay", &rpc).unwrap();
    let initiator = TransferEngine::builder()
        .local_server_name("resend-initiator")
        .advertise_address("127.0.0.1")
        .metadata(&url)
        .transport(TcpTransport::new(TcpConfig {
            connections_per_peer: 1,
            ..TcpConfig::default()
        }))
        .build()
        .unwrap();
    let peer = initiator.open_segment("via-relay").unwrap();
    let local = initiator.allocate(3 * LEN, "cpu:0").unwrap();
    local.write_at(0, &filled(0xa0)).unwrap();
    local.write_at(LEN, &filled(0xb0)).unwrap();
    local.write_at(2 * LEN, &filled(0xc0)).unwrap();
    Stand {
        relay,
        initiator,
        peer,
        remote,
        local,
        _target: target,
        _server: server,
    }
}

impl Stand {
    /// Write `from` (an offset into local memory) over the remote range at `to`, in a batch
    /// of its own.
    fn write(&self, from: usize, to: usize) -> Batch {
        let batch = self.initiator.allocate_batch(1).unwrap();
        let request = TransferRequest::write(
            self.local.addr() + from,
            self.peer,
            (self.remote.addr() + to) as u64,
            LEN,
        );
        self.initiator.submit(&batch, &[request]).unwrap();
        batch
    }

    /// A and B on the wire, held by the relay; B canceled. Returns A's batch.
    fn a_held_and_b_canceled(&self) -> Batch {
        let a = self.write(0, 0);
        let b = self.write(LEN, LEN);
        assert!(
            self.relay.wait_held(2 * LEN, Duration::from_secs(20)),
            "A and B reached the relay ({} bytes held)",
            self.relay.held_bytes()
        );
        assert_eq!(b.cancel(), 1);
        let b_status = b.task_status(0).unwrap();
        assert_eq!(b_status.status, TransferStatus::Canceled, "{b_status:?}");
        assert!(b_status.remote_may_change, "B's bytes are held, not gone");
        a
    }

    fn remote_range(&self, at: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; LEN];
        self.remote.read_at(at, &mut bytes).unwrap();
        bytes
    }
}

fn wait_ended(batch: &Batch, limit: Duration) -> tern_engine::TaskStatus {
    let until = Instant::now() + limit;
    loop {
        let status = batch.task_status(0).unwrap();
        if status.status.is_finished() || Instant::now() > until {
            return status;
        }
        batch.wait(Duration::from_millis(50));
    }
}

#[test]
fn a_write_sent_again_completes_only_once_its_first_send_can_no_longer_land() {
    let stand = stand();
    let a = stand.a_held_and_b_canceled();
    // The held bytes go a while after the cut, well within the drain time.
    let hold = Duration::from_millis(400);
    std::thread::sleep(hold);
    let early = a.task_status(0).unwrap();
    assert!(
        !early.status.is_finished(),
        "A ended while its first send was still held: {early:?}"
    );
    stand.relay.release();
    let a_status = wait_ended(&a, Duration::from_secs(20));
    assert_eq!(a_status.status, TransferStatus::Completed, "{a_status:?}");
    assert!(!a_status.remote_may_change, "{a_status:?}");
    assert!(
        stand.relay.wait_finished(Duration::from_secs(20)),
        "the target closed the held connection"
    );
    assert_eq!(stand.remote_range(0), filled(0xa0), "A landed");
    // The caller reuses A's range at once, as a cache pool does.
    let c = stand.write(2 * LEN, 0);
    let c_status = wait_ended(&c, Duration::from_secs(20));
    assert_eq!(c_status.status, TransferStatus::Completed, "{c_status:?}");
    // Whatever was held has landed by now (the target closed that connection): C stays.
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        stand.remote_range(0) == filled(0xc0),
        "C was overwritten by a stale copy of A"
    );
}

#[test]
fn a_write_whose_first_send_stays_held_past_the_drain_time_is_not_shown_final() {
    let stand = stand();
    let a = stand.a_held_and_b_canceled();
    let started = Instant::now();
    let a_status = wait_ended(&a, DRAIN + Duration::from_secs(20));
    assert!(
        a_status.status.is_finished(),
        "A still pending after {:?}: {a_status:?}",
        started.elapsed()
    );
    assert!(
        a_status.status != TransferStatus::Completed || a_status.remote_may_change,
        "A shown final while its first send is still held: {a_status:?}"
    );
    assert!(
        matches!(
            a_status.status,
            TransferStatus::Failed(TransferError::Connection { .. })
        ),
        "{a_status:?}"
    );
    assert!(a_status.remote_may_change, "{a_status:?}");
    // The lane goes on: a new write over a range nobody else writes completes and lands.
    stand.relay.release();
    assert!(stand.relay.wait_finished(Duration::from_secs(20)));
    let c = stand.write(2 * LEN, LEN);
    let c_status = wait_ended(&c, Duration::from_secs(20));
    assert_eq!(c_status.status, TransferStatus::Completed, "{c_status:?}");
    assert!(stand.remote_range(LEN) == filled(0xc0));
}
