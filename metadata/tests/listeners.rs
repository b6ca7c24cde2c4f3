//! Every listener holds up against slow and greedy clients, over real loopback sockets: a
//! client that trickles a frame one byte at a time is dropped at the frame deadline (not kept
//! alive by its trickle), hundreds of silent connections neither keep an honest client out
//! nor outlive the exchange timeout, one connection beyond the limit is closed once its
//! request is in (and a silent one never takes a slot), a store sends again what a full
//! server dropped (and fails typed if it stays full), and dropping a server cuts its
//! connections and returns. Also the secured HTTP metadata server: it stores only sealed
//! values, deletes only with a token, and holds a bounded table.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tern_metadata::auth::ClusterSecret;
use tern_metadata::http::{HttpMetadataServer, HttpServerConfig, HttpStore};
use tern_metadata::net::{PortChoice, ServeLimits};
use tern_metadata::rpc::{self, RpcClientConfig, RpcServer, RpcServerConfig, RpcType};
use tern_metadata::seal::{self, SealError};
use tern_metadata::{MetadataError, MetadataStore, SegmentDesc};
use tern_testkit::logs;
use tern_testkit::wire::closed_within;

const GOLDEN_TCP: &str = include_str!("golden/mooncake-tcp-segment.json");

/// Tight limits: requests within 1 s of their first byte, 2 connections at once (and 2
/// still opening), 30 s to open.
fn limits() -> ServeLimits {
    ServeLimits {
        max_connections: 2,
        max_opening: 2,
        exchange_timeout: Duration::from_secs(30),
        frame_deadline: Duration::from_secs(1),
        idle_timeout: Duration::from_secs(30),
        write_timeout: Duration::from_secs(5),
    }
}

fn rpc_server() -> RpcServer {
    let handler = |_: RpcType, _: &[u8]| Ok(b"{\"status\":\"success\"}".to_vec());
    let config = RpcServerConfig {
        ports: PortChoice::Fixed(0),
        limits: limits(),
        ..RpcServerConfig::default()
    };
    RpcServer::start("127.0.0.1".parse().unwrap(), config, Arc::new(handler)).unwrap()
}

fn http_server(secret: Option<&str>, max_entries: usize) -> HttpMetadataServer {
    let config = HttpServerConfig {
        limits: limits(),
        secret: secret.map(|s| ClusterSecret::new(s.as_bytes()).unwrap()),
        max_entries,
    };
    HttpMetadataServer::start_with("127.0.0.1:0".parse().unwrap(), config).unwrap()
}

/// Sends `frame` one byte every 300 ms; returns how many bytes went out before the server
/// closed the connection (all of them if it never did).
fn trickle(addr: SocketAddr, frame: &[u8]) -> usize {
    let mut stream = TcpStream::connect(addr).unwrap();
    for (sent, byte) in frame.iter().enumerate() {
        if closed_within(&mut stream, Duration::from_millis(300))
            || stream.write_all(&[*byte]).is_err()
        {
            return sent;
        }
    }
    frame.len()
}

fn rpc_frame(ty: RpcType, body: &[u8]) -> Vec<u8> {
    let mut bytes = Vec::new();
    rpc::write_frame(&mut bytes, ty, body).unwrap();
    bytes
}

#[test]
fn a_trickling_client_is_dropped_at_the_frame_deadline_on_every_listener() {
    logs::capture();
    let rpc = rpc_server();
    // A Probe frame with a padded body: 8 + 1 + 20 bytes, 8.7 s at this pace.
    let probe = rpc_frame(RpcType::Probe, b"{}                  ");
    let sent = trickle(rpc.local_addr(), &probe);
    assert!(
        sent < probe.len(),
        "the RPC server took a trickled frame whole"
    );
    // The same frame sent at once is served.
    let config = RpcClientConfig::default();
    rpc::call(
        &rpc.local_addr().to_string(),
        RpcType::Probe,
        b"{}",
        &config,
    )
    .unwrap();

    let http = http_server(None, 16);
    let request = b"GET /metadata?key=some-key HTTP/1.1\r\nHost: x\r\n\r\n";
    let sent = trickle(http.local_addr(), request);
    assert!(
        sent < request.len(),
        "the HTTP server took a trickled request whole"
    );
    let mut whole = TcpStream::connect(http.local_addr()).unwrap();
    whole.write_all(request).unwrap();
    let mut reply = String::new();
    whole.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 404"), "{reply}");
}

/// A gate handlers wait at until it is opened.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    changed: Condvar,
    waiting: Mutex<usize>,
}

/// Opens its gate when dropped: a failing test does not leave handlers waiting (and the
/// server's drop, which joins them, hanging).
struct OpensOnDrop(Arc<Gate>);

impl Drop for OpensOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

impl Gate {
    fn pass(&self) {
        *self.waiting.lock() += 1;
        let mut open = self.open.lock();
        self.changed.wait_while(&mut open, |open| !*open);
    }

    fn waiting(&self) -> usize {
        *self.waiting.lock()
    }

    fn open(&self) {
        *self.open.lock() = true;
        self.changed.notify_all();
    }
}

/// Waits (up to 10 s) until `done` holds.
fn eventually(what: &str, done: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < until, "{what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn one_connection_beyond_the_limit_is_closed_once_its_request_is_in_and_the_slot_comes_back() {
    logs::capture();
    let gate = Arc::new(Gate::default());
    let holding = gate.clone();
    let handler = move |_: RpcType, _: &[u8]| {
        holding.pass();
        Ok(b"{\"status\":\"success\"}".to_vec())
    };
    let config = RpcServerConfig {
        ports: PortChoice::Fixed(0),
        limits: limits(),
        ..RpcServerConfig::default()
    };
    let rpc = RpcServer::start("127.0.0.1".parse().unwrap(), config, Arc::new(handler)).unwrap();
    let addr = rpc.local_addr();
    let _opens = OpensOnDrop(gate.clone());
    // Two clients whose requests are in hold both slots (their handlers wait at the gate).
    let probe = rpc_frame(RpcType::Probe, b"{}");
    let mut held: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut stream = TcpStream::connect(addr).unwrap();
            stream.write_all(&probe).unwrap();
            stream
        })
        .collect();
    eventually("both requests reached the handler", || gate.waiting() == 2);
    // A third request is closed unanswered (after the 50 ms a finishing connection gets).
    let mut third = TcpStream::connect(addr).unwrap();
    third.write_all(&probe).unwrap();
    assert!(
        closed_within(&mut third, Duration::from_secs(5)),
        "a third request was kept"
    );
    assert!(
        !logs::mentioning("connections already").is_empty(),
        "the refusal was not logged"
    );
    // A silent connection is not refused: it has not taken a slot, only a place to open.
    let mut silent = TcpStream::connect(addr).unwrap();
    assert!(
        !closed_within(&mut silent, Duration::from_millis(500)),
        "a connection still opening was refused"
    );
    // The held ones are answered and leave: the slot comes back, and the silent
    // connection, sending its request now, is served.
    gate.open();
    for stream in &mut held {
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut reply = Vec::new();
        stream.read_to_end(&mut reply).unwrap();
        assert!(!reply.is_empty(), "a held request was not answered");
    }
    drop(held);
    // Their threads see the close and give their slots back.
    std::thread::sleep(Duration::from_millis(300));
    silent.write_all(&probe).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut reply = Vec::new();
    silent.read_to_end(&mut reply).unwrap();
    assert!(!reply.is_empty(), "a freed slot was not reused");
}

#[test]
fn a_connection_beyond_the_opening_budget_takes_the_place_of_the_oldest_silent_one() {
    logs::capture();
    let http = http_server(None, 16);
    let addr = http.local_addr();
    // Two silent clients take both places to open (for 30 s each).
    let mut quiet = silent(addr, 2);
    std::thread::sleep(Duration::from_millis(200));
    // A third is let in at once, and served; the oldest silent one is closed for it.
    let request = b"GET /metadata?key=some-key HTTP/1.1\r\nHost: x\r\n\r\n";
    let mut third = TcpStream::connect(addr).unwrap();
    third.write_all(request).unwrap();
    let mut reply = String::new();
    third.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 404"), "{reply}");
    assert!(
        closed_within(&mut quiet[0], Duration::from_secs(5)),
        "the oldest silent connection kept its place"
    );
    assert!(
        !logs::mentioning("still opening; closing the oldest").is_empty(),
        "the displacement was not logged"
    );
}

/// `n` connections to `addr` that never send a byte.
fn silent(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    (0..n).map(|_| TcpStream::connect(addr).unwrap()).collect()
}

/// How many of `streams` the server has not closed within `wait` (from now, for all).
fn still_open_after(streams: &mut [TcpStream], wait: Duration) -> usize {
    let until = Instant::now() + wait;
    let mut open = 0;
    for stream in streams {
        let left = until
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        if !closed_within(stream, left) {
            open += 1;
        }
    }
    open
}

/// Hundreds of connections that say nothing, to an RPC listener with a secret: an honest
/// client's call is served while they sit there (the accept thread is not held up by them,
/// and they take no slot), and each of them is closed once the exchange timeout (1 s) has
/// passed, long before the idle timeout (30 s). With a small opening budget the newcomer
/// takes the place of the oldest silent one instead.
#[test]
fn silent_connections_cannot_hold_the_rpc_listener_and_are_closed_at_the_exchange_timeout() {
    logs::capture();
    let secret = ClusterSecret::new(SECRET.as_bytes()).unwrap();
    for max_opening in [512, 16] {
        let config = RpcServerConfig {
            ports: PortChoice::Fixed(0),
            limits: ServeLimits {
                max_connections: 4,
                max_opening,
                exchange_timeout: Duration::from_secs(1),
                frame_deadline: Duration::from_secs(5),
                idle_timeout: Duration::from_secs(30),
                write_timeout: Duration::from_secs(5),
            },
            secret: Some(secret.clone()),
            ..RpcServerConfig::default()
        };
        let handler = |_: RpcType, _: &[u8]| Ok(b"{\"status\":\"success\"}".to_vec());
        let rpc =
            RpcServer::start("127.0.0.1".parse().unwrap(), config, Arc::new(handler)).unwrap();
        let mut quiet = silent(rpc.local_addr(), 300);
        let client = RpcClientConfig {
            secret: Some(secret.clone()),
            ..RpcClientConfig::default()
        };
        let reply = rpc::call(
            &rpc.local_addr().to_string(),
            RpcType::Probe,
            b"{}",
            &client,
        )
        .unwrap_or_else(|e| panic!("budget {max_opening}: an honest call was kept out: {e}"));
        assert!(!reply.is_empty());
        let open = still_open_after(&mut quiet, Duration::from_secs(20));
        assert_eq!(
            open, 0,
            "budget {max_opening}: silent connections still open"
        );
    }
    assert!(
        !logs::mentioning("did not complete their opening").is_empty(),
        "the expiry was not logged"
    );
    assert!(
        !logs::mentioning("still opening; closing the oldest").is_empty(),
        "the displacement was not logged"
    );
}

#[test]
fn a_store_sends_again_what_a_full_server_dropped_and_fails_typed_when_it_stays_full() {
    logs::capture();
    let config = HttpServerConfig {
        limits: ServeLimits {
            write_timeout: Duration::from_secs(30),
            ..limits()
        },
        secret: None,
        max_entries: 16,
    };
    let http = HttpMetadataServer::start_with("127.0.0.1:0".parse().unwrap(), config).unwrap();
    let desc = SegmentDesc::from_json(GOLDEN_TCP.as_bytes()).unwrap();
    let client = store(&http, None);
    // Both slots held for good by clients whose requests are in (silent ones hold none):
    // each asked for a value larger than the socket buffers take and reads nothing of the
    // answer, so the server's write waits (up to its 30 s write timeout). The store's
    // request is dropped every time, and that is an error.
    let big = "x".repeat(30 << 20);
    assert!(put(&http, "big", &big, "").starts_with("HTTP/1.1 200"));
    let held: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut stream = TcpStream::connect(http.local_addr()).unwrap();
            stream
                .write_all(b"GET /metadata?key=big HTTP/1.1\r\n\r\n")
                .unwrap();
            // The answer has begun: the request holds its slot.
            stream.peek(&mut [0u8; 1]).unwrap();
            stream
        })
        .collect();
    match client.publish_segment("node-a", &desc) {
        Err(MetadataError::Store { .. }) => {}
        other => panic!("a server that stays full: {other:?}"),
    }
    // A slot frees after the first attempt was dropped (the server waits 50 ms for one),
    // while the store is sending again: the publish goes through.
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        drop(held);
    });
    client.publish_segment("node-a", &desc).unwrap();
    release.join().unwrap();
    assert_eq!(client.fetch_segment("node-a").unwrap(), desc);
}

#[test]
fn dropping_a_server_cuts_its_connections_and_returns() {
    logs::capture();
    let rpc = rpc_server();
    let http = http_server(None, 16);
    let mut clients = vec![
        TcpStream::connect(rpc.local_addr()).unwrap(),
        TcpStream::connect(http.local_addr()).unwrap(),
    ];
    // Mid-frame on both.
    clients[0].write_all(&[9, 0, 0]).unwrap();
    clients[1].write_all(b"GET /meta").unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let started = Instant::now();
    drop(rpc);
    drop(http);
    for client in &mut clients {
        assert!(closed_within(client, Duration::from_secs(5)));
    }
    // The drop waited for the connection threads rather than leaving them behind.
    assert!(started.elapsed() < Duration::from_secs(20));
}

const SECRET: &str = "tern-http-seal-secret";

fn store(server: &HttpMetadataServer, secret: Option<&str>) -> HttpStore {
    let mut store = HttpStore::new(&format!(
        "http://127.0.0.1:{}/metadata",
        server.local_addr().port()
    ))
    .unwrap();
    store.set_secret(secret.map(|s| ClusterSecret::new(s.as_bytes()).unwrap()));
    store
}

fn raw(server: &HttpMetadataServer, request: &str) -> String {
    let mut stream = TcpStream::connect(server.local_addr()).unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    reply
}

fn put(server: &HttpMetadataServer, key: &str, body: &str, extra: &str) -> String {
    raw(
        server,
        &format!(
            "PUT /metadata?key={} HTTP/1.1\r\n{extra}Content-Length: {}\r\n\r\n{body}",
            tern_metadata::http::escape(key),
            body.len()
        ),
    )
}

#[test]
fn a_secured_http_server_stores_only_sealed_values_and_deletes_only_with_a_token() {
    logs::capture();
    let server = http_server(Some(SECRET), 3);
    let desc = SegmentDesc::from_json(GOLDEN_TCP.as_bytes()).unwrap();
    // A node with the secret: publishes, reads back, removes.
    let sealed = store(&server, Some(SECRET));
    sealed.publish_segment("node-a", &desc).unwrap();
    assert_eq!(sealed.fetch_segment("node-a").unwrap(), desc);

    // Without the secret, or with another: refused, and nothing changes.
    for secret in [None, Some("another")] {
        let error = store(&server, secret)
            .publish_segment("node-a", &desc)
            .unwrap_err();
        assert!(error.to_string().contains("403"), "{secret:?}: {error}");
    }
    // A raw write of the sealed value with one buffer address changed.
    let key = "mooncake/ram/node-a";
    let value = seal::seal(
        &ClusterSecret::new(SECRET.as_bytes()).unwrap(),
        key,
        &desc.to_json(),
    )
    .unwrap();
    let addr = desc.buffers[0].addr;
    let altered = value.replace(
        &format!("\"addr\":{addr}"),
        &format!("\"addr\":{}", addr + 64),
    );
    assert_ne!(altered, value);
    let reply = put(&server, key, &altered, "");
    assert!(reply.starts_with("HTTP/1.1 403"), "{reply}");
    // The value sealed for node-a, moved to node-b's key.
    let reply = put(&server, "mooncake/ram/node-b", &value, "");
    assert!(reply.starts_with("HTTP/1.1 403"), "{reply}");
    assert_eq!(sealed.fetch_segment("node-a").unwrap(), desc);

    // Deletes: none without a token, none with a forged one; the node's own works.
    let escaped = tern_metadata::http::escape(key);
    for extra in ["", "X-Tern-Auth: 1800000000.00ff\r\n"] {
        let reply = raw(
            &server,
            &format!("DELETE /metadata?key={escaped} HTTP/1.1\r\n{extra}\r\n"),
        );
        assert!(reply.starts_with("HTTP/1.1 403"), "{extra:?}: {reply}");
    }
    assert!(sealed.fetch_segment("node-a").is_ok());
    sealed.remove_segment("node-a").unwrap();
    assert!(matches!(
        sealed.fetch_segment("node-a"),
        Err(MetadataError::SegmentNotFound(_))
    ));

    // The table is bounded: a fourth key is refused, an existing one may change.
    for name in ["a", "b", "c"] {
        sealed.publish_segment(name, &desc).unwrap();
    }
    let error = sealed.publish_segment("d", &desc).unwrap_err();
    assert!(error.to_string().contains("507"), "{error}");
    sealed.publish_segment("a", &desc).unwrap();
}

#[test]
fn a_node_with_the_secret_refuses_altered_values_even_from_a_plain_server() {
    logs::capture();
    let server = http_server(None, 16);
    let desc = SegmentDesc::from_json(GOLDEN_TCP.as_bytes()).unwrap();
    let sealed = store(&server, Some(SECRET));
    sealed.publish_segment("node-a", &desc).unwrap();
    let key = "mooncake/ram/node-a";
    let mut stream = TcpStream::connect(server.local_addr()).unwrap();
    stream
        .write_all(
            format!(
                "GET /metadata?key={} HTTP/1.1\r\n\r\n",
                tern_metadata::http::escape(key)
            )
            .as_bytes(),
        )
        .unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    let stored = reply.split("\r\n\r\n").nth(1).unwrap().to_owned();
    let addr = desc.buffers[0].addr;
    let altered = stored.replace(
        &format!("\"addr\":{addr}"),
        &format!("\"addr\":{}", addr + 64),
    );
    assert!(put(&server, key, &altered, "").starts_with("HTTP/1.1 200"));
    match sealed.fetch_segment("node-a") {
        Err(MetadataError::Seal {
            source: SealError::BadMac,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    // A plain node still reads it (it has no secret to check with), as Mooncake would.
    assert!(store(&server, None).fetch_segment("node-a").is_ok());
}

/// The value of the series `series` (name and labels exactly as rendered) in Prometheus text.
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}

#[test]
fn the_http_server_counts_its_requests_and_holdings_at_get_metrics() {
    logs::capture();
    let server = http_server(None, 16);
    for (key, body) in [("k1", "ab"), ("k2", "cde"), ("k1", "x")] {
        assert!(put(&server, key, body, "").starts_with("HTTP/1.1 200"));
    }
    for (request, status) in [
        ("GET /metadata?key=k2", "200"),
        ("GET /metadata?key=missing", "404"),
        ("DELETE /metadata?key=k2", "200"),
        ("POST /metadata?key=k1", "405"),
    ] {
        let reply = raw(&server, &format!("{request} HTTP/1.1\r\n\r\n"));
        assert!(
            reply.starts_with(&format!("HTTP/1.1 {status}")),
            "{request}: {reply}"
        );
    }
    let reply = raw(&server, "GET /metrics HTTP/1.1\r\n\r\n");
    let (head, text) = reply.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    let requests = |method: &str, status: &str| {
        metric(
            text,
            &format!("tern_metadata_requests_total{{method=\"{method}\",status=\"{status}\"}}"),
        )
    };
    assert_eq!(requests("PUT", "200"), Some(3.0), "{text}");
    assert_eq!(requests("GET", "200"), Some(1.0), "{text}");
    assert_eq!(requests("GET", "404"), Some(1.0), "{text}");
    assert_eq!(requests("DELETE", "200"), Some(1.0), "{text}");
    assert_eq!(requests("other", "405"), Some(1.0), "{text}");
    // k1 is left, holding "x".
    assert_eq!(metric(text, "tern_metadata_entries"), Some(1.0), "{text}");
    assert_eq!(metric(text, "tern_metadata_bytes"), Some(1.0), "{text}");
    assert!(
        text.contains("# TYPE tern_metadata_requests_total counter"),
        "{text}"
    );
}

#[test]
fn a_metrics_server_renders_on_each_request_and_serves_nothing_else() {
    logs::capture();
    let scrapes = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = scrapes.clone();
    let render: tern_metadata::http::RenderMetrics = Arc::new(move || {
        let n = counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        format!("scrapes_total {n}\n")
    });
    let server =
        tern_metadata::http::MetricsServer::start("127.0.0.1:0".parse().unwrap(), render).unwrap();
    let get = |target: &str| {
        let mut stream = TcpStream::connect(server.local_addr()).unwrap();
        write!(stream, "GET {target} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut reply = String::new();
        stream.read_to_string(&mut reply).unwrap();
        reply
    };
    for n in 1..=2 {
        let reply = get("/metrics");
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert_eq!(
            metric(reply.split("\r\n\r\n").nth(1).unwrap(), "scrapes_total"),
            Some(n as f64)
        );
    }
    assert!(get("/metadata?key=a").starts_with("HTTP/1.1 404"));
    assert!(get("/nothing").starts_with("HTTP/1.1 400"));
    assert_eq!(scrapes.load(std::sync::atomic::Ordering::Relaxed), 2);
}
