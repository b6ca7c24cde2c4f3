//! The engine's transport conformance suite, on real loopback sockets.

use tern_engine::{BatchState, TransferEngine, TransferRequest, conformance};
use tern_transport_tcp::{TcpConfig, TcpTransport};
#[path = "../../testkit/include/transfers.rs"]
mod transfers;
use transfers::write_then_read_back;

#[test]
fn tcp_passes_the_conformance_suite() {
    conformance::run_all(&|| {
        TransferEngine::builder()
            .local_server_name("127.0.0.1")
            .transport(TcpTransport::new(TcpConfig::default()))
    })
    .unwrap();
}

/// Legacy v1 peers: no status frames, so a write completes when it leaves the socket. On one
/// connection requests are served in order, so a read after a write sees the written bytes.
#[test]
fn tcp_v1_moves_bytes_in_order_on_one_connection() {
    let make = || {
        TransferEngine::builder()
            .local_server_name("127.0.0.1")
            .transport(TcpTransport::new(TcpConfig {
                proto_version: 1,
                connections_per_peer: 1,
                ..TcpConfig::default()
            }))
    };
    let target = make().build().unwrap();
    let initiator = make().build().unwrap();
    let remote = target.allocate(4 << 20, "cpu:0").unwrap();
    let local = initiator.allocate(8 << 20, "cpu:0").unwrap();
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    let segment = initiator.segment(peer).unwrap();
    assert_eq!(segment.desc.tcp_proto_version, 1);
    let data: Vec<u8> = (0..4 << 20)
        .map(|i| conformance::pattern_byte(9, i))
        .collect();
    let back = write_then_read_back(&initiator, peer, &local, &remote, &data);
    assert!(back == data, "v1 read-after-write returned other bytes");
}

/// Each request uses the newest framing both ends speak: a v3 node and a v2 node (which, as
/// a Mooncake server, drops aligned requests) move bytes both ways, whichever is the target.
///
/// Toward a v1 target the initiator keeps one connection: a v1 write has no status frame and
/// completes once its bytes are in the socket, so only on the same connection is a later read
/// served after the write has landed (on another, the read can overtake it).
#[test]
fn tcp_framings_meet_at_the_older_one() {
    let make = |proto_version, connections_per_peer| {
        TransferEngine::builder()
            .local_server_name("127.0.0.1")
            .transport(TcpTransport::new(TcpConfig {
                proto_version,
                connections_per_peer,
                ..TcpConfig::default()
            }))
            .build()
            .unwrap()
    };
    let lanes = TcpConfig::default().connections_per_peer;
    for (target_version, initiator_version) in [(2, 3), (3, 2), (3, 3), (1, 3)] {
        let target = make(target_version, lanes);
        let initiator_lanes = if target_version == 1 { 1 } else { lanes };
        let initiator = make(initiator_version, initiator_lanes);
        let remote = target.allocate(2 << 20, "cpu:0").unwrap();
        let local = initiator.allocate(4 << 20, "cpu:0").unwrap();
        let peer = initiator.open_segment(target.segment_name()).unwrap();
        let published = initiator.segment(peer).unwrap().desc.tcp_proto_version;
        assert_eq!(published, u32::from(target_version));
        let seed = u64::from(target_version * 4 + initiator_version);
        let data: Vec<u8> = (0..2 << 20)
            .map(|i| conformance::pattern_byte(seed, i))
            .collect();
        local.write_at(0, &data).unwrap();
        // Blocks of 64 KiB and an odd tail, several in flight on each connection.
        let requests = |read: bool| -> Vec<TransferRequest> {
            let mut at = 0;
            let mut out = Vec::new();
            while at < 2 << 20 {
                let len = if at + (65536 + 100) > 2 << 20 {
                    (2 << 20) - at
                } else {
                    65536 + 100
                };
                out.push(if read {
                    TransferRequest::read(
                        local.addr() + (2 << 20) + at,
                        peer,
                        remote.addr() as u64 + at as u64,
                        len,
                    )
                } else {
                    TransferRequest::write(
                        local.addr() + at,
                        peer,
                        remote.addr() as u64 + at as u64,
                        len,
                    )
                });
                at += len;
            }
            out
        };
        for read in [false, true] {
            let batch = initiator.allocate_batch(64).unwrap();
            initiator.submit(&batch, &requests(read)).unwrap();
            let status = batch.wait(std::time::Duration::from_secs(30));
            assert!(
                status.state == BatchState::Completed,
                "v{target_version} target, v{initiator_version} initiator, read {read}: {status:?}"
            );
        }
        let mut back = vec![0u8; 2 << 20];
        local.read_at(2 << 20, &mut back).unwrap();
        assert!(
            back == data,
            "v{target_version} target, v{initiator_version} initiator: bytes changed"
        );
    }
}

/// Memory the target registers after the initiator opened it is reached by the next submit:
/// the request's target lies outside the cached descriptor, so the submit re-fetches it once
/// (no refresh call) and the request moves; a range the target never registered still fails
/// as out of range, after that one re-fetch.
#[test]
fn memory_registered_after_open_is_reached_through_one_refetch() {
    let make = || {
        TransferEngine::builder()
            .local_server_name("127.0.0.1")
            .transport(TcpTransport::new(TcpConfig::default()))
    };
    let target = make().build().unwrap();
    let initiator = make().build().unwrap();
    let first = target.allocate(1 << 20, "cpu:0").unwrap();
    let local = initiator.allocate(2 << 20, "cpu:0").unwrap();
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    let later = target.allocate(1 << 20, "cpu:0").unwrap();
    let outside = later.addr() as u64 + (2 << 20);
    let data: Vec<u8> = (0..1 << 20)
        .map(|i| conformance::pattern_byte(5, i))
        .collect();
    local.write_at(0, &data).unwrap();
    let batch = initiator.allocate_batch(3).unwrap();
    initiator
        .submit(
            &batch,
            &[
                TransferRequest::write(local.addr(), peer, first.addr() as u64, 4096),
                TransferRequest::write(local.addr(), peer, later.addr() as u64, 1 << 20),
                TransferRequest::write(local.addr(), peer, outside, 4096),
            ],
        )
        .unwrap();
    let status = batch.wait(std::time::Duration::from_secs(30));
    assert_eq!((status.completed, status.failed), (2, 1), "{status:?}");
    assert!(matches!(
        batch.task_status(2).unwrap().status,
        tern_engine::TransferStatus::Failed(tern_engine::TransferError::TargetOutOfRange { .. })
    ));
    let mut landed = vec![0u8; 1 << 20];
    later.read_at(0, &mut landed).unwrap();
    assert!(landed == data, "the later buffer holds what was written");
}
