//! The engine's transport conformance suite, on real loopback sockets.

use tern_engine::{TransferEngine, TransferRequest, conformance};
use tern_transport_tcp::{TcpConfig, TcpTransport};

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
    local.write_at(0, &data).unwrap();
    initiator
        .transfer_sync(TransferRequest::write(
            local.addr(),
            peer,
            remote.addr() as u64,
            4 << 20,
        ))
        .unwrap();
    initiator
        .transfer_sync(TransferRequest::read(
            local.addr() + (4 << 20),
            peer,
            remote.addr() as u64,
            4 << 20,
        ))
        .unwrap();
    let mut back = vec![0u8; 4 << 20];
    local.read_at(4 << 20, &mut back).unwrap();
    assert!(back == data, "v1 read-after-write returned other bytes");
}
