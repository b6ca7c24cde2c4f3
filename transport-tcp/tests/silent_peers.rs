//! Silent connections cannot hold a node's listeners, over real loopback sockets: with
//! hundreds of connections that say nothing on the TCP data port (many more than the node
//! serves at once) and on the handshake RPC port, an engine with the cluster secret still
//! opens the node's segment and moves bytes both ways, and each silent connection is closed
//! once the exchange timeout has passed (1 s on the data port, set through the config; the
//! RPC listener's default 5 s), long before the data port's idle timeout of 300 s.

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use tern_engine::TransferEngine;
use tern_testkit::logs;
use tern_testkit::wire::still_open;
use tern_transport_tcp::{TcpConfig, TcpTransport};
#[path = "../../testkit/include/transfers.rs"]
mod transfers;
use transfers::{secured_engine, write_then_read_back};

const SECRET: &str = "tern-tcp-silent-secret";

fn engine(config: TcpConfig) -> TransferEngine {
    secured_engine(SECRET, TcpTransport::new(config))
}

/// `n` connections to `addr` that never send a byte.
fn silent(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    (0..n).map(|_| TcpStream::connect(addr).unwrap()).collect()
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
    let back = write_then_read_back(&initiator, peer, &local, &remote, &data);
    assert!(back == data, "the bytes changed on the way");

    // Every silent connection is closed, once its opening has outlasted the timeout.
    let open = still_open(&mut quiet, Instant::now() + Duration::from_secs(30));
    assert_eq!(open, 0, "silent connections still open");
    assert!(
        !logs::mentioning("did not complete their opening").is_empty(),
        "the closing was not logged"
    );
}
