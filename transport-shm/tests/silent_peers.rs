//! Silent connections cannot hold a node's same-host socket, over a real abstract Unix
//! socket: with hundreds of connections that say nothing (more than the node serves at
//! once), a peer that proves the cluster secret and greets is welcomed at once, an engine
//! moves bytes to the node over shared memory, and each silent connection is closed once the
//! exchange timeout (set to 1 s here) has passed.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::{Duration, Instant};

use tern_engine::{TransferEngine, TransferRequest, TransferStatus};
use tern_metadata::auth::{self, Channel, Claims, ClusterSecret};
use tern_testkit::wire::{closed_by, still_open};
use tern_transport_shm::wire::{Frame, FrameReader, MAGIC, NONCE_LEN};
use tern_transport_shm::{ShmConfig, ShmTransport};
#[path = "../../testkit/include/transfers.rs"]
mod transfers;
use transfers::secured_engine;

const SECRET: &str = "tern-shm-silent-secret";

/// An engine whose only transport is shared memory, with the test's secret.
fn engine(config: ShmConfig) -> TransferEngine {
    secured_engine(SECRET, ShmTransport::new(config))
}

fn socket_of(target: &TransferEngine) -> String {
    target.local_descriptor().tern["shm"]["socket"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn connect(socket: &str) -> UnixStream {
    UnixStream::connect_addr(&SocketAddr::from_abstract_name(socket.as_bytes()).unwrap()).unwrap()
}

#[test]
fn silent_connections_keep_no_peer_off_the_socket_and_are_closed_at_the_exchange_timeout() {
    let target = engine(ShmConfig {
        max_inbound: 4,
        exchange_timeout: Duration::from_secs(1),
        ..ShmConfig::default()
    });
    let socket = socket_of(&target);
    let remote = target.allocate(1 << 20, "cpu:0").unwrap();
    let mut quiet: Vec<UnixStream> = (0..300).map(|_| connect(&socket)).collect();

    // A peer that proves the secret and greets, by hand, is welcomed while they sit there.
    let mut honest = connect(&socket);
    honest
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let claims = Claims {
        client_segment: "honest".into(),
        server_segment: target.segment_name().into(),
        dialed: socket.clone(),
    };
    let secret = ClusterSecret::new(SECRET.as_bytes()).unwrap();
    auth::client_handshake(&mut honest, &secret, Channel::Shm, claims)
        .expect("an honest peer's proof was not taken");
    let hello = Frame::Hello {
        magic: MAGIC,
        version: tern_transport_shm::identity::VERSION as u16,
        nonce: [5; NONCE_LEN],
        client_segment: "honest".into(),
        server_segment: target.segment_name().into(),
    };
    tern_transport_shm::wire::send(&honest, &hello.encode()).unwrap();
    let welcome = FrameReader::new().next(&honest);
    assert!(
        matches!(welcome, Ok(Some(Frame::Welcome { .. }))),
        "an honest peer was not welcomed: {welcome:?}"
    );

    // An engine moves bytes to the node over shared memory, both ways.
    let initiator = engine(ShmConfig::default());
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    let local = initiator.allocate(2 << 20, "cpu:0").unwrap();
    let data: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    local.write_at(0, &data).unwrap();
    for request in [
        TransferRequest::write(local.addr(), peer, remote.addr() as u64, 1 << 20),
        TransferRequest::read(
            local.addr() + (1 << 20),
            peer,
            remote.addr() as u64,
            1 << 20,
        ),
    ] {
        let batch = initiator.allocate_batch(1).unwrap();
        initiator.submit(&batch, &[request]).unwrap();
        batch.wait(Duration::from_secs(30));
        assert_eq!(
            batch.task_status(0).unwrap().status,
            TransferStatus::Completed,
            "a transfer with silent connections on the socket"
        );
    }
    let mut back = vec![0u8; 1 << 20];
    local.read_at(1 << 20, &mut back).unwrap();
    assert!(back == data, "the bytes changed on the way");

    // Every silent connection is closed, once its opening has outlasted the timeout.
    let open = still_open(&mut quiet, Instant::now() + Duration::from_secs(20));
    assert_eq!(open, 0, "silent connections still open");
    // The honest one, past its opening, is not.
    assert!(
        !closed_by(&mut honest, Instant::now() + Duration::from_millis(200)),
        "the welcomed peer was closed"
    );
}
