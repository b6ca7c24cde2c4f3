//! Silent connections cannot hold a node's listeners, over real loopback sockets: with
//! hundreds of connections that say nothing on the TCP data port (many more than the node
//! serves at once) and on the handshake RPC port, an engine with the cluster secret still
//! opens the node's segment and moves bytes both ways, and each silent connection is closed
//! once the exchange timeout has passed (1 s on the data port, set through the config; the
//! RPC listener's default 5 s), long before the data port's idle timeout of 300 s.

use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use tern_engine::{TransferEngine, TransferRequest};
use tern_testkit::logs;
use tern_transport_tcp::{TcpConfig, TcpTransport};

const SECRET: &str = "tern-tcp-silent-secret";

fn engine(config: TcpConfig) -> TransferEngine {
    TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .cluster_secret(SECRET)
        .transfer_timeout(Some(Duration::from_secs(20)))
        .transport(TcpTransport::new(config))
        .build()
        .unwrap()
}

/// `n` connections to `addr` that never send a byte.
fn silent(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    (0..n).map(|_| TcpStream::connect(addr).unwrap()).collect()
}

/// Whether the node has closed `stream` (a read sees the end, or an error) by `until`.
fn closed_by(stream: &mut TcpStream, until: Instant) -> bool {
    let left = until
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left)).unwrap();
    let mut buf = [0u8; 256];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return false;
            }
            Err(_) => return true,
        }
    }
}

#[test]
fn silent_connections_keep_no_initiator_out_and_are_closed_at_the_exchange_timeout() {
    logs::capture();
    let target = engine(TcpConfig {
        max_inbound: 8,
        exchange_timeout: Duration::from_secs(1),
        ..TcpConfig::default()
    });
    let data_port = target.local_descriptor().tcp_data_port;
    let localhost = |port| SocketAddr::from(([127, 0, 0, 1], port));
    let mut quiet = silent(localhost(data_port), 300);
    quiet.extend(silent(localhost(target.rpc_port()), 300));

    // While they sit there, an initiator opens the segment (over the RPC port) and moves
    // bytes both ways (its lanes over the data port).
    let initiator = engine(TcpConfig::default());
    let remote = target.allocate(1 << 20, "cpu:0").unwrap();
    let local = initiator.allocate(2 << 20, "cpu:0").unwrap();
    let peer = initiator
        .open_segment(target.segment_name())
        .expect("the RPC port kept an honest initiator out");
    let data: Vec<u8> = (0..1 << 20).map(|i| (i % 253) as u8).collect();
    local.write_at(0, &data).unwrap();
    initiator
        .transfer_sync(TransferRequest::write(
            local.addr(),
            peer,
            remote.addr() as u64,
            1 << 20,
        ))
        .expect("a write with silent connections on the data port");
    initiator
        .transfer_sync(TransferRequest::read(
            local.addr() + (1 << 20),
            peer,
            remote.addr() as u64,
            1 << 20,
        ))
        .expect("a read with silent connections on the data port");
    let mut back = vec![0u8; 1 << 20];
    local.read_at(1 << 20, &mut back).unwrap();
    assert!(back == data, "the bytes changed on the way");

    // Every silent connection is closed, once its opening has outlasted the timeout.
    let until = Instant::now() + Duration::from_secs(30);
    let open = quiet
        .iter_mut()
        .map(|s| closed_by(s, until))
        .filter(|closed| !closed)
        .count();
    assert_eq!(open, 0, "silent connections still open");
    assert!(
        !logs::mentioning("did not complete their opening").is_empty(),
        "the closing was not logged"
    );
}
