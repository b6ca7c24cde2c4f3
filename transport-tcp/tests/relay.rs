//! A party without the cluster secret that gets an honest node to dial it — by writing the
//! metadata store, or from the path — and relays the authentication frames to the real node:
//! it never ends up holding an authenticated connection, on the handshake RPC or on a TCP data
//! connection, whether it forwards the frames untouched or rewrites what the Hello says was
//! dialed. And a descriptor someone altered in the store (one buffer address) is refused by
//! every node with the secret, whether it opens the segment afresh or hears of the change.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use tern_engine::{EngineError, OwnedBuffer, StoreOptions, TransferEngine};
use tern_metadata::MetadataError;
use tern_metadata::auth::{self, AuthError, AuthFrame, Channel, ClusterSecret};
use tern_metadata::net::{Dial, DialAuth, DialError, dial};
use tern_metadata::rpc::{self, RpcClientConfig, RpcError, RpcType};
use tern_metadata::seal::SealError;
use tern_testkit::etcd::{self, unique};
use tern_testkit::logs;
use tern_transport_tcp::TcpTransport;

const SECRET: &str = "tern-relay-test-secret";

fn secured(builder: tern_engine::TransferEngineBuilder) -> TransferEngine {
    builder
        .transfer_timeout(Some(Duration::from_secs(10)))
        .cluster_secret(SECRET)
        .transport(TcpTransport::default())
        .build()
        .unwrap()
}

fn p2p() -> TransferEngine {
    secured(TransferEngine::builder().local_server_name("127.0.0.1"))
}

/// A relay on loopback in front of `target`: every connection it accepts it forwards, byte
/// for byte both ways — but with `rewrite`, it first takes the client's Hello and changes
/// the endpoint it says was dialed to `rewrite`. Counts the bytes the target sent back.
struct Relay {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    from_target: Arc<AtomicUsize>,
    thread: Option<JoinHandle<()>>,
}

impl Relay {
    fn start(target: SocketAddr, rewrite: Option<String>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let from_target = Arc::new(AtomicUsize::new(0));
        let (flag, counted) = (stop.clone(), from_target.clone());
        let thread = std::thread::spawn(move || {
            for client in listener.incoming() {
                if flag.load(Ordering::Acquire) {
                    break;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(target) else {
                    continue;
                };
                let (rewrite, counted) = (rewrite.clone(), counted.clone());
                std::thread::spawn(move || forward(client, server, rewrite.as_deref(), &counted));
            }
        });
        Self {
            addr,
            stop,
            from_target,
            thread: Some(thread),
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = TcpStream::connect(self.addr);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn forward(
    mut client: TcpStream,
    mut server: TcpStream,
    rewrite: Option<&str>,
    back: &AtomicUsize,
) {
    if let Some(endpoint) = rewrite {
        let mut hello = vec![0u8; auth::HELLO_MAX_LEN];
        if client
            .read_exact(&mut hello[..auth::HELLO_FIXED_LEN])
            .is_err()
        {
            return;
        }
        let len = auth::hello_len(&hello).unwrap_or(auth::HELLO_FIXED_LEN);
        if client
            .read_exact(&mut hello[auth::HELLO_FIXED_LEN..len])
            .is_err()
        {
            return;
        }
        let Ok(AuthFrame::Hello {
            channel,
            nonce,
            mut claims,
        }) = auth::decode_frame(&hello[..len])
        else {
            return;
        };
        claims.dialed = endpoint.to_owned();
        let rewritten = AuthFrame::Hello {
            channel,
            nonce,
            claims,
        }
        .encode();
        if server.write_all(&rewritten).is_err() {
            return;
        }
    }
    let (Ok(mut client_in), Ok(mut server_in)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let upstream = std::thread::spawn(move || {
        let _ = io::copy(&mut client_in, &mut server);
        let _ = server.shutdown(Shutdown::Write);
    });
    let mut counting = Counting {
        inner: &mut client,
        count: back,
    };
    let _ = io::copy(&mut server_in, &mut counting);
    let _ = client.shutdown(Shutdown::Write);
    let _ = upstream.join();
}

struct Counting<'a> {
    inner: &'a mut TcpStream,
    count: &'a AtomicUsize,
}

impl Write for Counting<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // Counted before the client can see the bytes, so that a test which reads the count
        // after the client got them never sees less.
        self.count.fetch_add(buf.len(), Ordering::Relaxed);
        let written = self.inner.write(buf);
        let n = *written.as_ref().unwrap_or(&0);
        self.count.fetch_sub(buf.len() - n, Ordering::Relaxed);
        written
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

fn secret() -> ClusterSecret {
    ClusterSecret::new(SECRET.as_bytes()).unwrap()
}

/// `client` dialing `server` on `channel` with the cluster secret, through `relay` (5 s to
/// connect, 5 s for each read and write).
fn dial_through(
    relay: &Relay,
    channel: Channel,
    client: &TransferEngine,
    server: &TransferEngine,
) -> Result<TcpStream, DialError> {
    let key = secret();
    dial(
        &Dial {
            endpoint: &relay.addr.to_string(),
            connect_timeout: Duration::from_secs(5),
            auth: Some(DialAuth {
                secret: &key,
                channel,
                client_segment: client.segment_name(),
                server_segment: server.segment_name(),
            }),
        },
        Duration::from_secs(5),
    )
}

fn data_endpoint(engine: &TransferEngine) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], engine.local_descriptor().tcp_data_port))
}

fn rpc_endpoint(engine: &TransferEngine) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], engine.rpc_port()))
}

#[test]
fn a_forwarding_relay_is_refused_by_the_node_it_forwards_to() {
    logs::capture();
    let victim = p2p();
    let honest = p2p();
    // The honest node is pointed at the relay, which forwards to the victim's RPC port.
    let relay = Relay::start(rpc_endpoint(&victim), None);
    match honest.open_segment(&relay.addr.to_string()) {
        Err(EngineError::Metadata(MetadataError::Rpc(RpcError::Auth { .. }))) => {}
        other => panic!("opening through a relay: {other:?}"),
    }
    // The victim said why, naming both endpoints, and sent no challenge the relay could use.
    let lines = logs::mentioning(&format!("dialed {}", relay.addr));
    assert!(
        lines
            .iter()
            .any(|l| l.contains(&format!("but this node is {}", rpc_endpoint(&victim)))),
        "{lines:?}"
    );
    assert_eq!(relay.from_target.load(Ordering::Relaxed), 0);

    // The same on the data port: the victim refuses before it reads a header.
    let relay = Relay::start(data_endpoint(&victim), None);
    let attempt = dial_through(&relay, Channel::TcpData, &honest, &victim);
    assert!(
        matches!(attempt, Err(DialError::Auth(AuthError::PeerClosed { .. }))),
        "{attempt:?}"
    );
    assert_eq!(relay.from_target.load(Ordering::Relaxed), 0);
}

#[test]
fn a_relay_that_rewrites_the_hello_is_refused_by_the_node_that_dialed_it() {
    logs::capture();
    let victim = p2p();
    let honest = p2p();
    let target: OwnedBuffer = victim.allocate(1 << 20, "cpu:0").unwrap();
    target.write_at(0, &[0x5A; 4096]).unwrap();
    for (channel, endpoint) in [
        (Channel::TcpData, data_endpoint(&victim)),
        (Channel::Rpc, rpc_endpoint(&victim)),
    ] {
        // The relay makes the Hello name the victim's own endpoint: the victim answers, but its
        // MAC covers the endpoint it advertises, not the relay the honest node dialed, so the
        // honest node refuses the challenge and proves nothing.
        let relay = Relay::start(endpoint, Some(endpoint.to_string()));
        let attempt = dial_through(&relay, channel, &honest, &victim);
        assert!(
            matches!(attempt, Err(DialError::Auth(AuthError::BadProof))),
            "{channel:?}: {attempt:?}"
        );
        // Only the challenge (88 bytes) came back through the relay.
        assert_eq!(
            relay.from_target.load(Ordering::Relaxed),
            auth::CHALLENGE_LEN,
            "{channel:?}"
        );
    }
    // The RPC client says the same through its own error.
    let relay = Relay::start(
        rpc_endpoint(&victim),
        Some(rpc_endpoint(&victim).to_string()),
    );
    let config = RpcClientConfig {
        secret: Some(secret()),
        local_segment: honest.segment_name().to_owned(),
        ..RpcClientConfig::default()
    };
    match rpc::call_segment(
        &relay.addr.to_string(),
        victim.segment_name(),
        RpcType::Metadata,
        b"{}",
        &config,
    ) {
        Err(RpcError::Auth {
            source: AuthError::BadProof,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    let mut landed = vec![0u8; 4096];
    target.read_at(0, &mut landed).unwrap();
    assert!(landed.iter().all(|&b| b == 0x5A));
}

fn etcd_engine(endpoint: &str, name: &str) -> TransferEngine {
    secured(
        TransferEngine::builder()
            .local_server_name(name)
            .advertise_address("127.0.0.1")
            .metadata(format!("etcd://{endpoint}"))
            .store_options(StoreOptions::default()),
    )
}

#[test]
fn a_descriptor_altered_in_the_store_is_refused() {
    logs::capture();
    let (endpoint, _own) = etcd::shared();
    let name = unique("victim");
    let victim = etcd_engine(&endpoint, &name);
    let buffer = victim.allocate(1 << 20, "cpu:0").unwrap();
    let watcher = etcd_engine(&endpoint, &unique("watcher"));
    let peer = watcher.open_segment(&name).unwrap();
    let genuine = buffer.addr() as u64;
    assert_eq!(watcher.segment(peer).unwrap().desc.buffers[0].addr, genuine);

    // Someone who can write etcd moves the buffer 4 KiB up, keeping the MAC.
    let key = tern_metadata::keys::segment_key(None, &name);
    let stored = etcd::get(&endpoint, &key).expect("the victim's descriptor is in etcd");
    assert!(stored.contains("\"tern_mac\""), "{stored}");
    let needle = format!("\"addr\":{genuine}");
    assert!(stored.contains(&needle), "{stored}");
    let altered = stored.replace(&needle, &format!("\"addr\":{}", genuine + 4096));
    etcd::etcdctl(&endpoint, &["put", &key, &altered]);

    // A node opening the segment now refuses it, or, once the victim has seen its key
    // overwritten and put its own value back, reads the genuine buffer: never the moved one.
    let newcomer = etcd_engine(&endpoint, &unique("newcomer"));
    match newcomer.open_segment(&name) {
        Err(EngineError::Metadata(MetadataError::Seal {
            source: SealError::BadMac,
            key: refused,
        })) => assert_eq!(refused, key),
        Ok(id) => assert_eq!(newcomer.segment(id).unwrap().desc.buffers[0].addr, genuine),
        other => panic!("{other:?}"),
    }
    // The victim heals the key: etcd holds a genuine value again.
    let healed = etcd::eventually(Duration::from_secs(10), || {
        etcd::get(&endpoint, &key).is_some_and(|now| now.contains(&needle))
    });
    assert!(healed.is_some(), "the altered descriptor stayed in etcd");
    // ...and the one that had it open ignores the change and keeps the genuine buffer.
    let noticed = etcd::eventually(Duration::from_secs(10), || {
        !logs::mentioning("ignoring a change").is_empty()
    });
    assert!(noticed.is_some(), "the watch never saw the change");
    assert_eq!(watcher.segment(peer).unwrap().desc.buffers[0].addr, genuine);
}
