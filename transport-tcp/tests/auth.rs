//! Engines with a cluster secret, over real loopback sockets: two with the same secret move
//! bytes over TCP and answer RPCs (open_segment, notify, probe); an engine without it or with
//! another, and raw clients speaking plain Mooncake frames, are refused on the RPC port and on
//! the TCP data port with one logged line each and nothing served — no descriptor, no bytes,
//! no memory changed; replayed and truncated authentication frames likewise; a secured engine
//! against a plain one fails with a typed error. The secret also comes from the environment.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};

use std::time::Duration;

use tern_engine::{
    EngineError, OwnedBuffer, StoreOptions, TransferEngine, TransferEngineBuilder, TransferError,
    TransferRequest, TransferStatus,
};
use tern_metadata::MetadataError;
use tern_metadata::auth::{
    self, AuthError, CHALLENGE_LEN, Channel, Claims, ClientExchange, ClusterSecret, FrameKind,
};
use tern_metadata::rpc::{self, RpcError, RpcType};
use tern_metadata::seal::SealError;
use tern_testkit::etcd::{self, unique};
use tern_testkit::logs;
use tern_testkit::wire::{self, drain};
use tern_transport_tcp::{Header, OP_READ, OP_V2, OP_WRITE, STATUS_MAGIC, TcpTransport};

const SECRET: &str = "tern-test-cluster-secret";
const PATTERN: u8 = 0xAB;

/// Builds `builder` with `secret` (none: plain Mooncake).
fn with_secret(builder: TransferEngineBuilder, secret: Option<&str>) -> TransferEngine {
    let builder = builder
        .transfer_timeout(Some(Duration::from_secs(10)))
        .transport(TcpTransport::default());
    match secret {
        Some(secret) => builder.cluster_secret(secret),
        None => builder,
    }
    .build()
    .unwrap()
}

/// A P2P engine on loopback with `secret` (none: plain Mooncake).
fn engine(secret: Option<&str>) -> TransferEngine {
    with_secret(
        TransferEngine::builder().local_server_name("127.0.0.1"),
        secret,
    )
}

/// An etcd engine named `name` with `secret`: its descriptor can be read without its RPC.
fn etcd_engine(endpoint: &str, name: &str, secret: Option<&str>) -> TransferEngine {
    with_secret(
        TransferEngine::builder()
            .local_server_name(name)
            .advertise_address("127.0.0.1")
            .metadata(format!("etcd://{endpoint}"))
            .store_options(StoreOptions::default()),
        secret,
    )
}

/// A target buffer filled with [`PATTERN`].
fn patterned(target: &TransferEngine) -> OwnedBuffer {
    let buffer = target.allocate(1 << 20, "cpu:0").unwrap();
    buffer.write_at(0, &vec![PATTERN; 1 << 20]).unwrap();
    buffer
}

fn untouched(buffer: &OwnedBuffer) -> bool {
    let mut back = vec![0u8; 1 << 20];
    buffer.read_at(0, &mut back).unwrap();
    back.iter().all(|&b| b == PATTERN)
}

fn raw(port: u16) -> TcpStream {
    wire::connect(("127.0.0.1", port))
}

/// A connection the server's log lines name alone (see [`wire::connect_as_named_peer`]).
fn raw_named(port: u16) -> TcpStream {
    wire::connect_as_named_peer(([127, 0, 0, 1], port).into())
}

fn header(size: u64, addr: u64, opcode: u8) -> [u8; 24] {
    Header { size, addr, opcode }.encode()
}

fn failure(engine: &TransferEngine, request: TransferRequest) -> TransferError {
    match engine.transfer_sync(request) {
        Err(EngineError::TransferFailed {
            status: TransferStatus::Failed(error),
        }) => error,
        other => panic!("expected a failed transfer, got {other:?}"),
    }
}

#[test]
fn engines_with_the_same_secret_move_bytes_and_answer_rpcs() {
    logs::capture();
    let target = engine(Some(SECRET));
    let initiator = engine(Some(SECRET));
    let remote = target.allocate(4 << 20, "cpu:0").unwrap();
    let local = initiator.allocate(4 << 20, "cpu:0").unwrap();
    let peer = initiator.open_segment(target.segment_name()).unwrap();

    let data: Vec<u8> = (0..(2 << 20) as u32).map(|i| (i % 251) as u8).collect();
    local.write_at(0, &data).unwrap();
    let far = remote.addr() as u64 + 12_345;
    let moved = initiator
        .transfer_sync(TransferRequest::write(local.addr(), peer, far, data.len()))
        .unwrap();
    assert_eq!(moved, data.len() as u64);
    let mut landed = vec![0u8; data.len()];
    remote.read_at(12_345, &mut landed).unwrap();
    assert!(landed == data, "the write did not land intact");
    initiator
        .transfer_sync(TransferRequest::read(
            local.addr() + (2 << 20),
            peer,
            far,
            data.len(),
        ))
        .unwrap();
    let mut back = vec![0u8; data.len()];
    local.read_at(2 << 20, &mut back).unwrap();
    assert!(back == data, "the read did not come back intact");

    initiator.send_notify(peer, "auth-test", "hello").unwrap();
    let notes = target.get_notifies();
    assert_eq!(notes.len(), 1);
    assert_eq!(
        (notes[0].name.as_str(), notes[0].notify_msg.as_str()),
        ("auth-test", "hello")
    );
    initiator.probe(peer).unwrap();
}

#[test]
fn peers_without_the_secret_get_nothing_from_the_rpc_port() {
    logs::capture();
    let target = engine(Some(SECRET));
    let _buffer = patterned(&target);

    // A Tern engine without a secret, and one with another: no descriptor.
    let plain = engine(None);
    match plain.open_segment(target.segment_name()) {
        Err(EngineError::Metadata(MetadataError::Rpc(RpcError::NoReply { .. }))) => {}
        other => panic!("a plain engine opened a secured segment: {other:?}"),
    }
    let stranger = engine(Some("some other secret"));
    match stranger.open_segment(target.segment_name()) {
        Err(EngineError::Metadata(MetadataError::Rpc(RpcError::Auth {
            source: AuthError::BadProof,
            ..
        }))) => {}
        other => panic!("an engine with another secret opened it: {other:?}"),
    }

    // Raw Mooncake frames: Metadata gets no descriptor, Notify queues nothing.
    let port = target.rpc_port();
    for (ty, body) in [
        (RpcType::Metadata, &b"{}"[..]),
        (
            RpcType::Notify,
            &br#"{"name":"x","notify_msg":"sneaky"}"#[..],
        ),
        (RpcType::Probe, &b"{}"[..]),
    ] {
        let mut stream = raw_named(port);
        let me = stream.local_addr().unwrap().to_string();
        let mut frame = Vec::new();
        rpc::write_frame(&mut frame, ty, body).unwrap();
        stream.write_all(&frame).unwrap();
        assert!(drain(&mut stream).is_empty(), "{ty:?} was answered");
        let lines = logs::mentioning(&me);
        assert_eq!(lines.len(), 1, "one line per refused connection: {lines:?}");
        assert!(lines[0].contains("WARN") && lines[0].contains("refused"));
    }
    assert!(
        target.get_notifies().is_empty(),
        "a refused notify was queued"
    );
}

#[test]
fn the_data_port_refuses_peers_without_the_secret_and_touches_no_memory() {
    logs::capture();
    let target = engine(Some(SECRET));
    let buffer = patterned(&target);
    let base = buffer.addr() as u64;
    let port = target.local_descriptor().tcp_data_port;
    let key = ClusterSecret::new(SECRET.as_bytes()).unwrap();

    // Plain Mooncake v2 write: no status, no byte written; one line naming the peer.
    let mut stream = raw_named(port);
    let me = stream.local_addr().unwrap().to_string();
    stream
        .write_all(&header(4096, base, OP_WRITE | OP_V2))
        .unwrap();
    let _ = stream.write_all(&[0u8; 4096]);
    assert!(drain(&mut stream).is_empty(), "a plain write got an answer");
    let lines = logs::mentioning(&me);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("WARN") && lines[0].contains("refused, nothing served"));
    // Plain v2 and v1 reads: no bytes of memory leave.
    for opcode in [OP_READ | OP_V2, OP_READ] {
        let mut stream = raw(port);
        stream.write_all(&header(4096, base, opcode)).unwrap();
        assert!(drain(&mut stream).is_empty(), "a plain read got bytes");
    }

    // Another secret: the client refuses the server's challenge and sends nothing more.
    let mut stream = raw(port);
    let wrong = ClusterSecret::new(b"wrong").unwrap();
    assert!(matches!(
        auth::client_handshake(&mut stream, &wrong, Channel::TcpData, dialed(port)),
        Err(AuthError::BadProof)
    ));

    // A genuine exchange, recorded, then a read that works (the harness is sound).
    let (exchange, hello) =
        ClientExchange::with_nonce(&key, Channel::TcpData, dialed(port), [3; 32]);
    let mut genuine = raw(port);
    genuine.write_all(&hello).unwrap();
    let mut challenge = [0u8; CHALLENGE_LEN];
    genuine.read_exact(&mut challenge).unwrap();
    let proof = exchange.finish(&challenge).unwrap();
    genuine.write_all(&proof).unwrap();
    genuine
        .write_all(&header(16, base, OP_READ | OP_V2))
        .unwrap();
    let mut reply = [0u8; 24];
    genuine.read_exact(&mut reply).unwrap();
    assert_eq!(&reply[..8], &STATUS_MAGIC.to_le_bytes());
    assert_eq!(&reply[8..], &[PATTERN; 16]);
    drop(genuine);

    // That exchange replayed, then a write: refused, memory unchanged.
    let mut replay = raw_named(port);
    let me = replay.local_addr().unwrap().to_string();
    replay.write_all(&hello).unwrap();
    let mut fresh = [0u8; CHALLENGE_LEN];
    replay.read_exact(&mut fresh).unwrap();
    assert_ne!(fresh, challenge);
    replay.write_all(&proof).unwrap();
    let _ = replay.write_all(&header(4096, base, OP_WRITE | OP_V2));
    let _ = replay.write_all(&[0u8; 4096]);
    assert!(drain(&mut replay).is_empty(), "a replayed proof was served");
    let lines = logs::mentioning(&me);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("does not match"), "{}", lines[0]);

    // A Hello cut short; an RPC-channel Hello on the data port.
    let mut cut = raw(port);
    cut.write_all(&hello[..40]).unwrap();
    cut.shutdown(Shutdown::Write).unwrap();
    assert!(drain(&mut cut).is_empty());
    let mut crossed = raw(port);
    let (_, rpc_hello) = ClientExchange::start(&key, Channel::Rpc, dialed(port)).unwrap();
    crossed.write_all(&rpc_hello).unwrap();
    assert!(drain(&mut crossed).is_empty());

    assert!(untouched(&buffer), "a refused peer changed memory");
}

/// What a raw client that dialed the data port on loopback claims.
fn dialed(port: u16) -> Claims {
    Claims {
        dialed: format!("127.0.0.1:{port}"),
        ..Claims::default()
    }
}

#[test]
fn over_etcd_unauthenticated_engines_are_refused_on_the_data_port_and_secured_ones_fail_typed() {
    logs::capture();
    let (endpoint, _own) = etcd::shared();
    // Over etcd the descriptor comes from the store, so the data port itself is what refuses
    // a node without the secret.
    let secured_name = unique("secured");
    let secured = etcd_engine(&endpoint, &secured_name, Some(SECRET));
    let buffer = patterned(&secured);
    let plain_name = unique("plain");
    let plain = etcd_engine(&endpoint, &plain_name, None);
    let plain_buffer = patterned(&plain);
    let stranger = etcd_engine(&endpoint, &unique("stranger"), Some("another secret"));

    let local = plain.allocate(1 << 20, "cpu:0").unwrap();
    local.write_at(0, &[0x11; 4096]).unwrap();
    let peer = plain.open_segment(&secured_name).unwrap();
    let error = failure(
        &plain,
        TransferRequest::write(local.addr(), peer, buffer.addr() as u64, 4096),
    );
    assert!(
        matches!(error, TransferError::Connection { .. }),
        "{error:?}"
    );
    let error = failure(
        &plain,
        TransferRequest::read(local.addr(), peer, buffer.addr() as u64, 4096),
    );
    assert!(
        matches!(error, TransferError::Connection { .. }),
        "{error:?}"
    );
    assert!(plain.send_notify(peer, "x", "y").is_err());
    assert!(plain.probe(peer).is_err());
    assert!(untouched(&buffer), "an unauthenticated write landed");
    assert!(secured.get_notifies().is_empty());

    // With secrets, descriptors are sealed: one sealed with another secret, or not sealed at
    // all, is refused when the segment is opened, before any connection.
    match stranger.open_segment(&secured_name) {
        Err(EngineError::Metadata(MetadataError::Seal {
            source: SealError::BadMac,
            ..
        })) => {}
        other => panic!("{other:?}"),
    }
    match secured.open_segment(&plain_name) {
        Err(EngineError::Metadata(MetadataError::Seal {
            source: SealError::Unsigned,
            ..
        })) => {}
        other => panic!("{other:?}"),
    }
    assert!(untouched(&plain_buffer));
}

#[test]
fn a_secured_engine_against_a_plain_one_fails_with_a_typed_error() {
    logs::capture();
    let plain = engine(None);
    let secured = engine(Some(SECRET));
    match secured.open_segment(plain.segment_name()) {
        Err(EngineError::Metadata(MetadataError::Rpc(RpcError::Auth {
            source:
                AuthError::PeerClosed {
                    waiting_for: FrameKind::Challenge,
                    received: 0,
                },
            peer,
        }))) => assert_eq!(peer, plain.segment_name()),
        other => panic!("{other:?}"),
    }
    // Plain engines still talk to each other (and so to Mooncake nodes).
    let other_plain = engine(None);
    let peer = other_plain.open_segment(plain.segment_name()).unwrap();
    other_plain.probe(peer).unwrap();
}

/// `TERN_CLUSTER_SECRET` and `TERN_CLUSTER_SECRET_FILE` secure an engine built without
/// `cluster_secret`; an empty one fails the build. Run in child processes of this test binary,
/// since a test must not change its own environment.
#[test]
fn the_secret_comes_from_the_environment() {
    if let Ok(mode) = std::env::var("TERN_TEST_SECRET_MODE") {
        let built = TransferEngine::builder()
            .local_server_name("127.0.0.1")
            .transport(TcpTransport::default())
            .build();
        if mode == "empty" {
            assert!(matches!(built, Err(EngineError::InvalidArgument(_))));
            return;
        }
        let target = built.unwrap();
        let endpoint = target.segment_name().to_owned();
        let plain = rpc::RpcClientConfig::default();
        assert!(rpc::call(&endpoint, RpcType::Probe, b"{}", &plain).is_err());
        let keyed = rpc::RpcClientConfig {
            secret: Some(ClusterSecret::new(SECRET.as_bytes()).unwrap()),
            ..plain
        };
        rpc::call(&endpoint, RpcType::Probe, b"{}", &keyed).unwrap();
        return;
    }
    let file = std::env::temp_dir().join(unique("tern-secret"));
    std::fs::write(&file, format!("{SECRET}\n")).unwrap();
    let file = file.to_string_lossy().into_owned();
    for (mode, var, value) in [
        ("direct", auth::CLUSTER_SECRET_ENV, SECRET),
        ("file", auth::CLUSTER_SECRET_FILE_ENV, file.as_str()),
        ("empty", auth::CLUSTER_SECRET_ENV, ""),
    ] {
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "the_secret_comes_from_the_environment"])
            .env_remove(auth::CLUSTER_SECRET_ENV)
            .env_remove(auth::CLUSTER_SECRET_FILE_ENV)
            .env("TERN_TEST_SECRET_MODE", mode)
            .env(var, value)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && stdout.contains("1 passed"),
            "{mode}: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let _ = std::fs::remove_file(&file);
}

/// The whole transport conformance suite (sizes, many tasks, bad addresses, stale
/// descriptors, notifications, a peer that dies) between engines with a secret.
#[test]
fn secured_engines_pass_the_conformance_suite() {
    tern_engine::conformance::run_all(&|| {
        TransferEngine::builder()
            .local_server_name("127.0.0.1")
            .cluster_secret(SECRET)
            .transport(TcpTransport::default())
    })
    .unwrap();
}
