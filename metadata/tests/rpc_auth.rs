//! The handshake RPC with a cluster secret, over real loopback sockets: clients that know the
//! secret are served; plain Mooncake clients, clients with another secret, and replayed,
//! reflected or truncated authentication frames are refused before the handler sees a byte,
//! with one logged line each. Also: a secured client against a plain server, a fake server
//! replaying a challenge, and the `MC_HANDSHAKE_MAX_LENGTH` bound on both sides.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tern_metadata::auth::{
    self, AuthError, AuthFrame, CHALLENGE_LEN, Channel, ClientExchange, ClusterSecret, FrameKind,
    ServerExchange,
};
use tern_metadata::net::PortChoice;
use tern_metadata::rpc::{
    self, DEFAULT_MAX_FRAME, FrameError, RpcClientConfig, RpcError, RpcServer, RpcServerConfig,
    RpcType,
};
use tern_testkit::logs;
use tern_testkit::wire::{self, drain};

const SECRET: &str = "correct horse battery staple";

type Calls = Arc<Mutex<Vec<(RpcType, Vec<u8>)>>>;

/// A server that records every request its handler sees and answers each.
fn server(secret: Option<&str>) -> (RpcServer, Calls) {
    let calls: Calls = Arc::default();
    let seen = calls.clone();
    let handler = move |ty: RpcType, body: &[u8]| {
        seen.lock().push((ty, body.to_vec()));
        Ok(match ty {
            RpcType::Metadata => b"{\"name\":\"the descriptor\"}".to_vec(),
            _ => b"{\"status\":\"success\"}".to_vec(),
        })
    };
    let config = RpcServerConfig {
        ports: PortChoice::Fixed(0),
        secret: secret.map(|s| ClusterSecret::new(s.as_bytes()).unwrap()),
        ..RpcServerConfig::default()
    };
    let server = RpcServer::start("127.0.0.1".parse().unwrap(), config, Arc::new(handler)).unwrap();
    (server, calls)
}

fn client(secret: Option<&str>) -> RpcClientConfig {
    RpcClientConfig {
        connect_timeout: Duration::from_secs(2),
        io_timeout: Duration::from_secs(5),
        secret: secret.map(|s| ClusterSecret::new(s.as_bytes()).unwrap()),
        ..RpcClientConfig::default()
    }
}

fn frame(ty: RpcType, body: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::new();
    rpc::write_frame(&mut bytes, ty, body).unwrap();
    bytes
}

fn connect(server: &RpcServer) -> TcpStream {
    wire::connect(server.local_addr())
}

/// A connection the server's log lines name alone (see [`wire::connect_as_named_peer`]).
fn connect_named(server: &RpcServer) -> TcpStream {
    wire::connect_as_named_peer(server.local_addr())
}

/// What a raw client of `server` claims: the endpoint it dialed.
fn dialed(server: &RpcServer) -> auth::Claims {
    auth::Claims {
        dialed: server.local_addr().to_string(),
        ..auth::Claims::default()
    }
}

fn secret() -> ClusterSecret {
    ClusterSecret::new(SECRET.as_bytes()).unwrap()
}

#[test]
fn clients_with_the_secret_are_served() {
    logs::capture();
    let (server, calls) = server(Some(SECRET));
    let endpoint = server.local_addr().to_string();
    let config = client(Some(SECRET));
    let reply = rpc::call(&endpoint, RpcType::Metadata, b"{}", &config).unwrap();
    assert_eq!(reply, b"{\"name\":\"the descriptor\"}");
    rpc::call(&endpoint, RpcType::Probe, b"{}", &config).unwrap();
    let notify = br#"{"name":"n","notify_msg":"hi"}"#;
    rpc::call(&endpoint, RpcType::Notify, notify, &config).unwrap();
    let calls = calls.lock();
    assert_eq!(
        calls.iter().map(|(ty, _)| *ty).collect::<Vec<_>>(),
        [RpcType::Metadata, RpcType::Probe, RpcType::Notify]
    );
    assert_eq!(calls[2].1, notify);
}

#[test]
fn plain_and_wrong_secret_clients_are_refused_before_the_handler() {
    logs::capture();
    let (server, calls) = server(Some(SECRET));
    let endpoint = server.local_addr().to_string();

    // A client without the secret (a Mooncake node, or Tern without one): no reply at all.
    match rpc::call(&endpoint, RpcType::Metadata, b"{}", &client(None)) {
        Err(RpcError::NoReply { .. }) => {}
        other => panic!("a plain client got {other:?}"),
    }
    // A client with another secret refuses the server's challenge, typed.
    match rpc::call(&endpoint, RpcType::Probe, b"{}", &client(Some("another"))) {
        Err(RpcError::Auth {
            source: AuthError::BadProof,
            ..
        }) => {}
        other => panic!("a client with another secret got {other:?}"),
    }

    // A raw Mooncake Metadata request: no descriptor, no byte; one line naming the peer.
    let mut raw = connect_named(&server);
    let peer = raw.local_addr().unwrap().to_string();
    raw.write_all(&frame(RpcType::Metadata, b"{}")).unwrap();
    assert!(drain(&mut raw).is_empty(), "a plain client was answered");
    let lines = logs::mentioning(&peer);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("WARN"), "{}", lines[0]);
    assert!(lines[0].contains("refused") && lines[0].contains("plain frame"));

    // A client with another secret, by hand: the line says it never proved itself.
    let mut other = connect_named(&server);
    let peer = other.local_addr().unwrap().to_string();
    let wrong = ClusterSecret::new(b"another").unwrap();
    assert!(matches!(
        auth::client_handshake(&mut other, &wrong, Channel::Rpc, dialed(&server)),
        Err(AuthError::BadProof)
    ));
    drop(other);
    let lines = logs::mentioning(&peer);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("before proving"), "{}", lines[0]);

    assert!(calls.lock().is_empty(), "the handler saw a request");
}

#[test]
fn replayed_reflected_and_truncated_frames_are_refused() {
    logs::capture();
    let (server, calls) = server(Some(SECRET));
    let key = secret();

    // A genuine exchange, recorded: Hello, Challenge, Proof, then a Probe that is answered.
    let (exchange, hello) =
        ClientExchange::with_nonce(&key, Channel::Rpc, dialed(&server), [9; 32]);
    let mut first = connect(&server);
    first.write_all(&hello).unwrap();
    let mut challenge = [0u8; CHALLENGE_LEN];
    first.read_exact(&mut challenge).unwrap();
    let proof = exchange.finish(&challenge).unwrap();
    first.write_all(&proof).unwrap();
    first.write_all(&frame(RpcType::Probe, b"{}")).unwrap();
    let (ty, reply) = rpc::read_frame(&mut first, DEFAULT_MAX_FRAME).unwrap();
    assert_eq!(
        (ty, reply.as_slice()),
        (RpcType::Probe, &b"{\"status\":\"success\"}"[..])
    );
    drop(first);
    assert_eq!(calls.lock().len(), 1);

    // The same Hello and Proof replayed: the server's fresh nonce makes the Proof stale.
    let mut replay = connect_named(&server);
    let peer = replay.local_addr().unwrap().to_string();
    replay.write_all(&hello).unwrap();
    let mut fresh = [0u8; CHALLENGE_LEN];
    replay.read_exact(&mut fresh).unwrap();
    assert_ne!(fresh, challenge, "a server nonce was reused");
    replay.write_all(&proof).unwrap();
    let _ = replay.write_all(&frame(RpcType::Metadata, b"{}"));
    assert!(drain(&mut replay).is_empty(), "a replay was answered");
    let lines = logs::mentioning(&peer);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("does not match"), "{}", lines[0]);

    // The server's own MAC reflected back as the client's proof.
    let mut reflect = connect_named(&server);
    let peer = reflect.local_addr().unwrap().to_string();
    let (_, hello) = ClientExchange::start(&key, Channel::Rpc, dialed(&server)).unwrap();
    reflect.write_all(&hello).unwrap();
    let mut challenge = [0u8; CHALLENGE_LEN];
    reflect.read_exact(&mut challenge).unwrap();
    let Ok(AuthFrame::Challenge { mac, .. }) = auth::decode_frame(&challenge) else {
        panic!("not a challenge")
    };
    let reflected = AuthFrame::Proof {
        channel: Channel::Rpc,
        mac,
    };
    reflect.write_all(&reflected.encode()).unwrap();
    let _ = reflect.write_all(&frame(RpcType::Probe, b"{}"));
    assert!(
        drain(&mut reflect).is_empty(),
        "a reflected MAC was accepted"
    );
    assert_eq!(logs::mentioning(&peer).len(), 1);

    // A Hello cut short, then the write side closed.
    let mut cut = connect_named(&server);
    let peer = cut.local_addr().unwrap().to_string();
    cut.write_all(&hello[..30]).unwrap();
    cut.shutdown(Shutdown::Write).unwrap();
    assert!(drain(&mut cut).is_empty());
    let lines = logs::mentioning(&peer);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("after 30 of the 59 bytes"),
        "{}",
        lines[0]
    );

    // A Proof cut short.
    let mut cut = connect(&server);
    let (exchange, hello) = ClientExchange::start(&key, Channel::Rpc, dialed(&server)).unwrap();
    cut.write_all(&hello).unwrap();
    let mut challenge = [0u8; CHALLENGE_LEN];
    cut.read_exact(&mut challenge).unwrap();
    let proof = exchange.finish(&challenge).unwrap();
    cut.write_all(&proof[..40]).unwrap();
    cut.shutdown(Shutdown::Write).unwrap();
    assert!(drain(&mut cut).is_empty());

    // A Hello meant for a data connection, and a Proof where the Hello belongs.
    for wrong_first in [
        ClientExchange::start(&key, Channel::TcpData, dialed(&server))
            .unwrap()
            .1,
        AuthFrame::Proof {
            channel: Channel::Rpc,
            mac: [0; 32],
        }
        .encode(),
    ] {
        let mut stream = connect(&server);
        stream.write_all(&wrong_first).unwrap();
        let _ = stream.write_all(&frame(RpcType::Probe, b"{}"));
        assert!(drain(&mut stream).is_empty());
    }

    assert_eq!(calls.lock().len(), 1, "only the genuine Probe");
}

#[test]
fn a_secured_client_against_a_plain_server_gets_a_typed_error() {
    logs::capture();
    let (server, calls) = server(None);
    let endpoint = server.local_addr().to_string();
    match rpc::call(&endpoint, RpcType::Metadata, b"{}", &client(Some(SECRET))) {
        Err(RpcError::Auth {
            source:
                AuthError::PeerClosed {
                    waiting_for: FrameKind::Challenge,
                    received: 0,
                },
            peer,
        }) => assert_eq!(peer, endpoint),
        other => panic!("{other:?}"),
    }
    assert!(calls.lock().is_empty());
    // The plain server says why, in words an operator can act on.
    let lines = logs::mentioning("wants to authenticate with a cluster secret");
    assert!(!lines.is_empty());
    // And plain clients are still served there, byte for byte Mooncake.
    rpc::call(&endpoint, RpcType::Probe, b"{}", &client(None)).unwrap();
}

#[test]
fn a_replayed_challenge_does_not_fool_a_client_and_no_request_leaves() {
    logs::capture();
    let key = secret();
    // A challenge that is genuine, but for another connection's nonce.
    let (_, old_hello) =
        ClientExchange::with_nonce(&key, Channel::Rpc, auth::Claims::default(), [1; 32]);
    let (_, recorded) =
        ServerExchange::accept(&key, Channel::Rpc, &auth::Identity::default(), &old_hello).unwrap();

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    let fake = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut hello = [0u8; auth::HELLO_MAX_LEN];
        stream
            .read_exact(&mut hello[..auth::HELLO_FIXED_LEN])
            .unwrap();
        let len = auth::hello_len(&hello).unwrap();
        stream
            .read_exact(&mut hello[auth::HELLO_FIXED_LEN..len])
            .unwrap();
        stream.write_all(&recorded).unwrap();
        // Whatever the client sends after our replayed challenge.
        drain(&mut stream)
    });
    match rpc::call(&endpoint, RpcType::Notify, b"{}", &client(Some(SECRET))) {
        Err(RpcError::Auth {
            source: AuthError::BadProof,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    let after = fake.join().unwrap();
    assert!(after.is_empty(), "the client sent {} bytes", after.len());
}

#[test]
fn frames_are_bounded_on_the_server_and_the_client() {
    logs::capture();
    let big_reply = vec![b' '; DEFAULT_MAX_FRAME + 1];
    let handler = move |_: RpcType, _: &[u8]| Ok(big_reply.clone());
    let config = RpcServerConfig {
        ports: PortChoice::Fixed(0),
        ..RpcServerConfig::default()
    };
    assert_eq!(config.max_frame, DEFAULT_MAX_FRAME);
    let server = RpcServer::start("127.0.0.1".parse().unwrap(), config, Arc::new(handler)).unwrap();

    // The server refuses a frame over the bound without reading it.
    let mut raw = connect_named(&server);
    let peer = raw.local_addr().unwrap().to_string();
    raw.write_all(&((DEFAULT_MAX_FRAME as u64) + 2).to_le_bytes())
        .unwrap();
    raw.write_all(&[RpcType::Probe as u8]).unwrap();
    assert!(drain(&mut raw).is_empty());
    let lines = logs::mentioning(&peer);
    assert!(lines[0].contains("exceeds"), "{lines:?}");

    // A request right at the bound is read; the client refuses the reply past its bound.
    let body = [
        b"{\"pad\":\"",
        &vec![b'x'; DEFAULT_MAX_FRAME - 11][..],
        b"\"}",
    ]
    .concat();
    assert_eq!(body.len() + 1, DEFAULT_MAX_FRAME);
    let endpoint = server.local_addr().to_string();
    let config = client(None);
    assert_eq!(config.max_frame, DEFAULT_MAX_FRAME);
    match rpc::call(&endpoint, RpcType::Probe, &body, &config) {
        Err(RpcError::Exchange {
            source: FrameError::TooLong { len, max },
            ..
        }) => assert_eq!(
            (len, max),
            (DEFAULT_MAX_FRAME as u64 + 2, DEFAULT_MAX_FRAME)
        ),
        other => panic!("{other:?}"),
    }
    let roomy = RpcClientConfig {
        max_frame: 2 * DEFAULT_MAX_FRAME,
        ..client(None)
    };
    let reply = rpc::call(&endpoint, RpcType::Probe, &body, &roomy).unwrap();
    assert_eq!(reply.len(), DEFAULT_MAX_FRAME + 1);
}

/// `MC_HANDSHAKE_MAX_LENGTH` sets both sides' bound; values outside 1–128 MiB are ignored
/// with a warning. Run in child processes of this test binary: the value is read once per
/// process, and a test must not change its own environment.
#[test]
fn the_frame_bound_comes_from_mc_handshake_max_length() {
    if let Ok(expected) = std::env::var("TERN_TEST_EXPECT_MAX_FRAME") {
        logs::capture();
        let expected: usize = expected.parse().unwrap();
        assert_eq!(RpcServerConfig::default().max_frame, expected);
        assert_eq!(RpcClientConfig::default().max_frame, expected);
        if expected == DEFAULT_MAX_FRAME && std::env::var(rpc::MAX_FRAME_ENV).is_ok() {
            let lines = logs::mentioning(rpc::MAX_FRAME_ENV);
            assert_eq!(lines.len(), 1, "warned once: {lines:?}");
        }
        return;
    }
    for (value, expected) in [
        (Some("4194304"), 4 << 20),
        (Some("134217728"), 128 << 20),
        (Some("999"), DEFAULT_MAX_FRAME),
        (Some("268435456"), DEFAULT_MAX_FRAME),
        (None, DEFAULT_MAX_FRAME),
    ] {
        let mut command = std::process::Command::new(std::env::current_exe().unwrap());
        command
            .args([
                "--exact",
                "the_frame_bound_comes_from_mc_handshake_max_length",
            ])
            .env("TERN_TEST_EXPECT_MAX_FRAME", expected.to_string())
            .env_remove(rpc::MAX_FRAME_ENV);
        if let Some(value) = value {
            command.env(rpc::MAX_FRAME_ENV, value);
        }
        let output = command.output().unwrap();
        assert!(
            output.status.success() && String::from_utf8_lossy(&output.stdout).contains("1 passed"),
            "{value:?}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}
