//! Mooncake's HTTP metadata protocol: `GET|PUT|DELETE <url>?key=<escaped key>`, 200 means
//! success, 404 means not found. [`HttpStore`] is the client; [`HttpMetadataServer`] is a
//! small in-memory server any node (a Mooncake node included) can point at.
//!
//! HTTP has no leases or watches: keys are deleted on clean shutdown only, as in Mooncake.
//!
//! With a cluster secret, the client seals every value it writes and checks every value it
//! reads ([`crate::seal`]), and sends a delete token with every DELETE; the server, given the
//! secret, refuses writes whose value does not verify or is older than the value it holds for
//! the key (or last deleted there), and deletes without a token for the very value held. The
//! server holds at most [`MAX_ENTRIES`] keys and serves at most `max_connections` clients at
//! once, each request within a deadline from its first byte. Every Tern HTTP listener also
//! answers `GET /metrics` (Prometheus text): the server its own counts, a
//! [`MetricsServer`] whatever it is given to render.

use std::collections::{HashMap, VecDeque};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::auth::ClusterSecret;
use crate::error::MetadataError;
use crate::keyed::{Codec, KeyValue, KeyedStore};
use crate::keys;
use crate::net::{Acceptor, Dial, Replayed, ServeLimits, Served, dial};
use crate::seal::{self, Order, Succession};

/// Most keys the server holds by default; a PUT of a new key beyond it is refused (507).
pub const MAX_ENTRIES: usize = 65536;

/// Longest request, status or header line accepted.
const MAX_LINE: usize = 16 * 1024;

/// Largest request or response body accepted (descriptors of huge nodes stay far below).
const MAX_BODY: usize = 32 << 20;

/// Percent-encodes everything but RFC 3986 unreserved characters.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// Decodes `%XX` escapes and `+` (as space); `None` on a malformed escape or bad UTF-8.
pub fn unescape(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// The HTTP store (client side): Mooncake's HTTP protocol under [`KeyedStore`].
pub type HttpStore = KeyedStore<HttpKv>;

/// The key-value half of [`HttpStore`]: one short connection per request.
#[derive(Debug, Clone)]
pub struct HttpKv {
    url: String,
    host: String,
    port: u16,
    path: String,
    connect_timeout: Duration,
    timeout: Duration,
    /// Signs deletes (values are sealed by the codec, with the same sealer).
    sealer: Option<Arc<seal::Sealer>>,
}

impl HttpStore {
    /// A store at `http://host:port/path`. `https://` is not supported.
    pub fn new(url: &str) -> Result<Self, MetadataError> {
        let bad = || MetadataError::BadConnectionString(url.to_owned());
        if url.starts_with("https://") {
            return Err(MetadataError::Unsupported {
                kind: "https",
                conn: url.to_owned(),
            });
        }
        let rest = url.strip_prefix("http://").ok_or_else(bad)?;
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (host, port) = match crate::net::split_host_port(authority) {
            Some((host, port)) => (host.to_owned(), port),
            None if !authority.is_empty() && !authority.contains(':') => (authority.to_owned(), 80),
            None => return Err(bad()),
        };
        let kv = HttpKv {
            url: url.to_owned(),
            host,
            port,
            path: format!("/{path}"),
            connect_timeout: Duration::from_millis(1500),
            timeout: Duration::from_secs(3),
            sealer: None,
        };
        let codec = Codec {
            cluster_id: std::env::var(keys::CLUSTER_ID_ENV)
                .ok()
                .filter(|c| !c.is_empty()),
            sealer: None,
        };
        Ok(Self {
            kv,
            codec: Arc::new(codec),
        })
    }

    /// Scopes every key by `cluster_id` (`None`: unscoped).
    pub fn set_cluster_id(&mut self, cluster_id: Option<String>) {
        Arc::make_mut(&mut self.codec).cluster_id = cluster_id.filter(|c| !c.is_empty());
    }

    /// Seals what is written, checks what is read and signs deletes with `secret`, in an
    /// incarnation of its own: a store is one life of a node ([`seal::Sealer`]).
    pub fn set_secret(&mut self, secret: Option<ClusterSecret>) {
        let sealer = secret.map(|secret| Arc::new(seal::Sealer::new(secret)));
        Arc::make_mut(&mut self.codec).sealer = sealer.clone();
        self.kv.sealer = sealer;
    }
}

impl HttpKv {
    fn store_error(&self, message: impl std::fmt::Display) -> MetadataError {
        MetadataError::Store {
            endpoint: self.url.clone(),
            message: message.to_string(),
        }
    }

    /// One request; returns the status code and body. Every request here is idempotent
    /// (GET, PUT of a whole value, DELETE), so one the server dropped before answering — a
    /// server at its connection limit closes new connections, one restarting resets them —
    /// is sent again on a fresh connection, at most [`RESENDS`] times, waiting twice as long each.
    fn request(
        &self,
        method: &str,
        key: &str,
        body: Option<&str>,
        token: Option<&str>,
    ) -> Result<(u16, Vec<u8>), MetadataError> {
        let mut resends = 0;
        loop {
            match self.request_once(method, key, body, token) {
                Ok(reply) => return Ok(reply),
                Err(Attempt::Dropped(e)) if resends < RESENDS => {
                    tracing::debug!("{method} {key:?}: {e}; sending again");
                    std::thread::sleep(RESEND_PAUSE * (1 << resends));
                    resends += 1;
                }
                Err(Attempt::Dropped(e) | Attempt::Failed(e)) => return Err(e),
            }
        }
    }

    fn request_once(
        &self,
        method: &str,
        key: &str,
        body: Option<&str>,
        token: Option<&str>,
    ) -> Result<(u16, Vec<u8>), Attempt> {
        let authority = format!("{}:{}", self.host, self.port);
        let dialing = Dial {
            endpoint: &authority,
            connect_timeout: self.connect_timeout,
            auth: None,
        };
        let mut stream = dial(&dialing, self.timeout).map_err(|e| {
            Attempt::Failed(match e {
                crate::net::DialError::Connect(e) => self.store_error(format!("unreachable: {e}")),
                e => self.store_error(e),
            })
        })?;
        let body = body.unwrap_or("");
        let token = token
            .map(|token| format!("{}: {token}\r\n", seal::DELETE_HEADER))
            .unwrap_or_default();
        let request = format!(
            "{method} {}?key={} HTTP/1.1\r\nHost: {authority}\r\nContent-Type: application/json\r\n{token}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.path,
            escape(key),
            body.len()
        );
        let dropped = |e: io::Error| Attempt::Dropped(self.store_error(e));
        stream.write_all(request.as_bytes()).map_err(dropped)?;
        let mut reader = BufReader::new(stream);
        // Not one byte of an answer: the server dropped the request.
        match reader.fill_buf() {
            Ok([]) => return Err(dropped(io::ErrorKind::UnexpectedEof.into())),
            Ok(_) => {}
            Err(e) => return Err(dropped(e)),
        }
        parse_response(&mut reader).map_err(|e| Attempt::Failed(self.store_error(e)))
    }
}

/// How often a request the server dropped unanswered is sent again.
const RESENDS: u32 = 4;
/// The pause before the first resend (then doubling: 20, 40, 80, 160 ms).
const RESEND_PAUSE: Duration = Duration::from_millis(20);

/// Why one attempt at a request failed.
enum Attempt {
    /// The connection broke before any byte of an answer: worth sending again.
    Dropped(MetadataError),
    /// Anything else (unreachable, a broken answer): final.
    Failed(MetadataError),
}

impl KeyValue for HttpKv {
    fn kind(&self) -> &'static str {
        "http"
    }

    fn put(&self, key: String, value: String) -> Result<(), MetadataError> {
        match self.request("PUT", &key, Some(&value), None)? {
            (200, _) => Ok(()),
            (status, body) => Err(self.store_error(format!(
                "PUT {key:?} answered {status}: {}",
                String::from_utf8_lossy(&body)
            ))),
        }
    }

    fn delete(&self, key: &str) -> Result<(), MetadataError> {
        // The token names the value this node last wrote there; without one (this node wrote
        // none), the value found there.
        let token = match &self.sealer {
            None => None,
            Some(sealer) => match sealer.delete_token(key) {
                Some(token) => Some(token),
                None => match self.get(key)? {
                    None => return Ok(()),
                    Some(value) => {
                        Some(sealer.delete_token_for(key, &value).map_err(|source| {
                            MetadataError::Seal {
                                key: key.to_owned(),
                                source,
                            }
                        })?)
                    }
                },
            },
        };
        match self.request("DELETE", key, None, token.as_deref())? {
            (200 | 404, _) => {
                if let Some(sealer) = &self.sealer {
                    sealer.forget_sealed(key);
                }
                Ok(())
            }
            (status, body) => Err(self.store_error(format!(
                "DELETE {key:?} answered {status}: {}",
                String::from_utf8_lossy(&body)
            ))),
        }
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetadataError> {
        match self.request("GET", key, None, None)? {
            (200, body) => Ok(Some(body)),
            (404, _) => Ok(None),
            (status, _) => Err(self.store_error(format!("GET {key:?} answered {status}"))),
        }
    }
}

/// Reads a status line (or request line) and headers. For a response the first value is the
/// status code; for a request it is 0 and the line is returned as the `:line` header.
fn read_head(
    reader: &mut impl BufRead,
    response: bool,
) -> Result<(u16, HashMap<String, String>), String> {
    let mut line = String::new();
    let mut headers = HashMap::new();
    // Bounded like every header line: a peer sending one endless line gets an error, not
    // our memory.
    reader
        .take(MAX_LINE as u64)
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    if line.len() >= MAX_LINE && !line.ends_with('\n') {
        return Err(format!(
            "request or status line longer than {MAX_LINE} bytes"
        ));
    }
    if line.is_empty() {
        return Err("connection closed before a reply".into());
    }
    // HTTP separates a request or status line's parts with ASCII spaces and ends it with
    // CR LF; other whitespace (U+2001, say) is part of a word, not a separator (found by
    // fuzzing: `GET /metrics\u{2001}…` was taken for `GET /metrics`).
    let first = line
        .trim_end_matches(|c: char| c.is_ascii_whitespace())
        .to_owned();
    // Only a reply's first line is a status line: a request whose method happens to read
    // "HTTP/…" is still a request (found by fuzzing).
    let status = if response {
        first
            .strip_prefix("HTTP/")
            .and_then(|rest| rest.split_ascii_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad status line {first:?}"))?
    } else {
        0
    };
    headers.insert(":line".to_owned(), first);
    loop {
        line.clear();
        reader
            .take(MAX_LINE as u64)
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        if headers.len() > 100 {
            return Err("too many headers".into());
        }
        if let Some((name, value)) = header.split_once(':') {
            headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_owned());
        }
    }
    Ok((status, headers))
}

fn read_body(
    reader: &mut impl Read,
    headers: &HashMap<String, String>,
    to_eof: bool,
) -> Result<Vec<u8>, String> {
    let mut body = Vec::new();
    match headers.get("content-length") {
        Some(len) => {
            let len: usize = len
                .parse()
                .map_err(|_| format!("bad Content-Length {len:?}"))?;
            if len > MAX_BODY {
                return Err(format!("body of {len} bytes is too large"));
            }
            // Grows with the bytes that arrive: a bare `Content-Length` costs nothing.
            reader
                .take(len as u64)
                .read_to_end(&mut body)
                .map_err(|e| e.to_string())?;
            if body.len() != len {
                return Err(format!("body ended after {} of {len} bytes", body.len()));
            }
        }
        None if to_eof => {
            reader
                .take(MAX_BODY as u64 + 1)
                .read_to_end(&mut body)
                .map_err(|e| e.to_string())?;
            if body.len() > MAX_BODY {
                return Err("body too large".into());
            }
        }
        None => {}
    }
    Ok(body)
}

/// An in-memory HTTP metadata server speaking Mooncake's protocol, with its own metrics at
/// `GET /metrics` (Prometheus text: requests by method and status, keys and bytes held).
/// Stops when dropped (connections cut, threads joined).
#[derive(Debug)]
pub struct HttpMetadataServer {
    acceptor: Acceptor,
}

/// The server's settings.
#[derive(Debug, Clone)]
pub struct HttpServerConfig {
    /// Connections at once and the deadline of each request.
    pub limits: ServeLimits,
    /// With a secret, writes must carry a valid seal and deletes a valid token.
    pub secret: Option<ClusterSecret>,
    /// Most keys held ([`MAX_ENTRIES`]).
    pub max_entries: usize,
}

impl Default for HttpServerConfig {
    fn default() -> Self {
        Self {
            limits: ServeLimits::default(),
            secret: None,
            max_entries: MAX_ENTRIES,
        }
    }
}

/// The path every Tern HTTP listener serves its metrics on.
pub const METRICS_PATH: &str = "/metrics";

/// The `Content-Type` of metrics (Prometheus text format 0.0.4).
pub const METRICS_CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// Renders the metrics a listener serves at [`METRICS_PATH`], on each request.
pub type RenderMetrics = Arc<dyn Fn() -> String + Send + Sync>;

/// What an HTTP listener answers: status, content type and body.
struct Reply {
    status: u16,
    content_type: &'static str,
    body: Vec<u8>,
}

impl Reply {
    fn json(status: u16, body: impl Into<Vec<u8>>) -> Self {
        Self {
            status,
            content_type: "application/json",
            body: body.into(),
        }
    }
}

/// The metadata server's own counts.
#[derive(Debug)]
struct ServerMetrics {
    registry: Registry,
    requests: Family<Vec<(&'static str, String)>, Counter>,
    entries: Gauge,
    bytes: Gauge,
}

impl ServerMetrics {
    fn new() -> Self {
        let requests = Family::<Vec<(&'static str, String)>, Counter>::default();
        let (entries, bytes) = (Gauge::default(), Gauge::default());
        let mut registry = Registry::with_prefix("tern_metadata");
        registry.register(
            "requests",
            "Requests answered, by method and status",
            requests.clone(),
        );
        registry.register("entries", "Keys held", entries.clone());
        registry.register("bytes", "Bytes of values held", bytes.clone());
        Self {
            registry,
            requests,
            entries,
            bytes,
        }
    }

    fn render(&self) -> String {
        let mut text = String::new();
        if let Err(e) = prometheus_text::encode(&mut text, &self.registry) {
            tracing::error!("http metadata: rendering metrics: {e}");
        }
        text
    }
}

#[derive(Debug, Default)]
struct Table {
    entries: HashMap<String, Vec<u8>>,
    /// Bytes of all values held.
    bytes: usize,
    /// With a secret: the order of the value held at each key, or of the one last deleted
    /// there (a tombstone).
    orders: HashMap<String, HeldOrder>,
    /// Tombstones in the order they were made, to forget the oldest first.
    tombstones: VecDeque<(String, Order)>,
}

/// The order a key's value has, or had until it was deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HeldOrder {
    order: Order,
    deleted: bool,
}

impl HttpMetadataServer {
    /// Binds `addr` (port 0 picks one) and serves, without a secret.
    pub fn start(addr: SocketAddr) -> io::Result<Self> {
        Self::start_with(addr, HttpServerConfig::default())
    }

    /// Binds `addr` (port 0 picks one) and serves with `config`.
    pub fn start_with(addr: SocketAddr, config: HttpServerConfig) -> io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let table = Mutex::new(Table::default());
        let metrics = ServerMetrics::new();
        let (secret, max_entries) = (config.secret.clone(), config.max_entries);
        let answer = move |request: HttpRequest| match request {
            HttpRequest::Metrics => Reply {
                status: 200,
                content_type: METRICS_CONTENT_TYPE,
                body: metrics.render().into_bytes(),
            },
            HttpRequest::Metadata(request) => {
                let method = request.method.clone();
                let reply = handle_request(request, &table, secret.as_ref(), max_entries, &metrics);
                let method = match method.as_str() {
                    "GET" | "PUT" | "DELETE" => method,
                    _ => "other".to_owned(),
                };
                metrics
                    .requests
                    .get_or_create(&vec![
                        ("method", method),
                        ("status", reply.status.to_string()),
                    ])
                    .inc();
                reply
            }
        };
        let acceptor = serve_http(listener, "tern-http-metadata", config.limits, answer)?;
        Ok(Self { acceptor })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.acceptor.local_addr()
    }
}

/// An HTTP listener that serves only metrics, at [`METRICS_PATH`] (what `tern-bench
/// --metrics_addr` runs). Stops when dropped.
#[derive(Debug)]
pub struct MetricsServer {
    acceptor: Acceptor,
}

impl MetricsServer {
    /// Binds `addr` (port 0 picks one) and answers `GET /metrics` with what `render` returns.
    pub fn start(addr: SocketAddr, render: RenderMetrics) -> io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let answer = move |request: HttpRequest| match request {
            HttpRequest::Metrics => Reply {
                status: 200,
                content_type: METRICS_CONTENT_TYPE,
                body: render().into_bytes(),
            },
            HttpRequest::Metadata(_) => Reply {
                status: 404,
                content_type: "text/plain",
                body: format!("only GET {METRICS_PATH} is served here").into_bytes(),
            },
        };
        let acceptor = serve_http(listener, "tern-metrics", ServeLimits::default(), answer)?;
        Ok(Self { acceptor })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.acceptor.local_addr()
    }
}

/// Serves one request per connection on `listener`, each answered by `answer`.
fn serve_http(
    listener: TcpListener,
    name: &str,
    limits: ServeLimits,
    answer: impl Fn(HttpRequest) -> Reply + Send + Sync + 'static,
) -> io::Result<Acceptor> {
    let serve = move |served: Served| serve_one(served, &answer);
    Acceptor::serve(listener, name, limits, Arc::new(serve))
}

fn serve_one(mut served: Served, answer: &impl Fn(HttpRequest) -> Reply) {
    let peer = served.peer.clone();
    let mut first = [0u8; 1];
    match served.await_frame(&mut first) {
        Ok(1..) => {}
        Ok(0) => return,
        Err(e) => {
            tracing::warn!("http: {peer}: {e} before its request");
            return;
        }
    }
    let Ok(mut writer) = served.stream.try_clone() else {
        return;
    };
    // The whole request within the deadline from its first byte.
    let mut frame = served.frame();
    let mut reader = BufReader::new(Replayed::new(&first, &mut frame));
    let reply = match parse_http_request(&mut reader) {
        // The request is in: the connection takes a slot of the listener's (or is closed).
        Ok(_) if !frame.opened() => return,
        Ok(request) => answer(request),
        Err(message) => {
            tracing::warn!("http: bad request from {peer}: {message}");
            Reply::json(400, message)
        }
    };
    let reason = match reply.status {
        200 => "OK",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        507 => "Insufficient Storage",
        _ => "Bad Request",
    };
    let head = format!(
        "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        reply.status,
        reply.content_type,
        reply.body.len()
    );
    let _ = writer.write_all(head.as_bytes());
    let _ = writer.write_all(&reply.body);
}

/// What a client asked of a Tern HTTP listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HttpRequest {
    /// A request of Mooncake's metadata protocol.
    Metadata(MetadataRequest),
    /// `GET /metrics`.
    Metrics,
}

/// A request to the HTTP metadata server, as read off the wire by [`parse_request`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetadataRequest {
    /// The request line's method, as sent (`GET`, `PUT`, `DELETE`; others are answered 405).
    pub method: String,
    /// The unescaped value of the `key` query parameter; never empty.
    pub key: String,
    /// The body (`Content-Length` bytes; empty without that header).
    pub body: Vec<u8>,
    /// The delete token header ([`seal::DELETE_HEADER`]), if sent.
    pub token: Option<String>,
}

/// Reads one request of Mooncake's HTTP metadata protocol (`<METHOD> <path>?key=<escaped
/// key> HTTP/1.1`, headers, and a `Content-Length` body) or a `GET /metrics` from bytes a
/// client sent: what every Tern HTTP listener runs on each connection, public so that it can
/// be fuzzed. `Err` names what is wrong (the server answers it with a 400). It only reads; it
/// must not act on the request.
pub fn parse_http_request(reader: &mut impl BufRead) -> Result<HttpRequest, String> {
    let (_, headers) = read_head(reader, false)?;
    let line = headers.get(":line").cloned().unwrap_or_default();
    let mut parts = line.split_ascii_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    // A method is a token: visible ASCII.
    if !method.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!("bad method {method:?}"));
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    if method == "GET" && path == METRICS_PATH {
        return Ok(HttpRequest::Metrics);
    }
    let key = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("key="))
        .and_then(unescape)
        .filter(|k| !k.is_empty())
        .ok_or_else(|| format!("no key in {target:?}"))?;
    let body = read_body(reader, &headers, false)?;
    let token = headers
        .get(&seal::DELETE_HEADER.to_ascii_lowercase())
        .cloned();
    Ok(HttpRequest::Metadata(MetadataRequest {
        method: method.to_owned(),
        key,
        body,
        token,
    }))
}

/// [`parse_http_request`] of a metadata request: a `GET /metrics` is an error here.
pub fn parse_request(reader: &mut impl BufRead) -> Result<MetadataRequest, String> {
    match parse_http_request(reader)? {
        HttpRequest::Metadata(request) => Ok(request),
        HttpRequest::Metrics => Err(format!("no key in {METRICS_PATH:?}")),
    }
}

/// Reads the server's reply to one request (status line, headers, and a body of
/// `Content-Length` bytes or up to the end of the stream): what [`HttpStore`] runs on every
/// reply, public so that it can be fuzzed. Returns the status code and the body; it only
/// reads.
pub fn parse_response(reader: &mut impl BufRead) -> Result<(u16, Vec<u8>), String> {
    let (status, headers) = read_head(reader, true)?;
    let body = read_body(reader, &headers, true)?;
    Ok((status, body))
}

fn handle_request(
    request: MetadataRequest,
    table: &Mutex<Table>,
    secret: Option<&ClusterSecret>,
    max_entries: usize,
    metrics: &ServerMetrics,
) -> Reply {
    let MetadataRequest {
        method,
        key,
        body,
        token,
    } = request;
    let refused = |what: &str, e: seal::SealError| {
        tracing::warn!("http metadata: refusing {what} {key:?}: {e}");
        Reply::json(403, format!("{what} refused: {e}"))
    };
    // The MACs first, outside the lock; the orders against what is held, under it.
    let order = match (method.as_str(), secret) {
        ("PUT", Some(secret)) => match seal::verify(secret, &key, &body) {
            Ok(order) => Some(order),
            Err(e) => return refused("PUT", e),
        },
        ("DELETE", Some(secret)) => {
            let checked = token
                .as_deref()
                .ok_or(seal::SealError::BadToken("no token"))
                .and_then(|token| seal::verify_delete(secret, &key, token));
            match checked {
                Ok(order) => Some(order),
                Err(e) => return refused("DELETE", e),
            }
        }
        _ => None,
    };
    let mut table = table.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(order) = order
        && let Err(e) = table.admit(&method, &key, &body, order)
    {
        return match e {
            // Nothing held to delete: as without a secret.
            Admission::NothingHeld => Reply::json(404, "metadata not found"),
            Admission::Refused(e) => refused(&method, e),
        };
    }
    let reply = match method.as_str() {
        "GET" => match table.entries.get(&key) {
            Some(value) => Reply::json(200, value.clone()),
            None => Reply::json(404, "metadata not found"),
        },
        "PUT" if table.entries.len() >= max_entries && !table.entries.contains_key(&key) => {
            tracing::warn!("http metadata: {max_entries} keys held; refusing a new one");
            Reply::json(507, "metadata table full")
        }
        "PUT" => {
            table.bytes += body.len();
            if let Some(order) = order {
                table.orders.insert(
                    key.clone(),
                    HeldOrder {
                        order,
                        deleted: false,
                    },
                );
            }
            if let Some(old) = table.entries.insert(key, body) {
                table.bytes -= old.len();
            }
            Reply::json(200, "metadata updated")
        }
        "DELETE" => match table.entries.remove(&key) {
            Some(old) => {
                table.bytes -= old.len();
                if let Some(order) = order {
                    table.bury(key, order, max_entries);
                }
                Reply::json(200, "metadata deleted")
            }
            None => Reply::json(404, "metadata not found"),
        },
        _ => Reply::json(405, "method not allowed"),
    };
    metrics.entries.set(table.entries.len() as i64);
    metrics.bytes.set(table.bytes as i64);
    reply
}

/// Why a sealed write or a tokened delete is not applied.
enum Admission {
    /// A delete of a key that holds no value.
    NothingHeld,
    /// Refused, for this reason.
    Refused(seal::SealError),
}

impl Table {
    /// Whether a sealed PUT of `body` (of `order`), or a DELETE with a token naming `order`,
    /// may go ahead given what is held for `key`.
    fn admit(&self, method: &str, key: &str, body: &[u8], order: Order) -> Result<(), Admission> {
        let held = self.orders.get(key);
        match (method, held) {
            ("PUT", None) => Ok(()),
            ("PUT", Some(held)) => match order.succession(&held.order) {
                Succession::Newer => Ok(()),
                // A request sent again (its answer was lost): the very value held.
                Succession::Same
                    if !held.deleted
                        && self.entries.get(key).is_some_and(|v| v[..] == body[..]) =>
                {
                    Ok(())
                }
                _ => Err(Admission::Refused(seal::SealError::Stale {
                    offered: order,
                    held: held.order,
                })),
            },
            ("DELETE", Some(held)) if held.order == order && !held.deleted => Ok(()),
            ("DELETE", Some(held)) if held.order == order => {
                Err(Admission::Refused(seal::SealError::TokenSpent(order)))
            }
            ("DELETE", Some(held)) if !held.deleted => {
                Err(Admission::Refused(seal::SealError::TokenForAnotherValue {
                    named: order,
                    held: held.order,
                }))
            }
            ("DELETE", _) => Err(Admission::NothingHeld),
            _ => Ok(()),
        }
    }

    /// Keeps the order of the value deleted at `key`, so that neither that value (nor an
    /// older one) can be put back nor its token used again; the oldest of more than
    /// `max_entries` tombstones is forgotten.
    fn bury(&mut self, key: String, order: Order, max_entries: usize) {
        self.orders.insert(
            key.clone(),
            HeldOrder {
                order,
                deleted: true,
            },
        );
        self.tombstones.push_back((key, order));
        while self.tombstones.len() > max_entries.max(1) {
            let Some((key, order)) = self.tombstones.pop_front() else {
                break;
            };
            let buried = HeldOrder {
                order,
                deleted: true,
            };
            if self.orders.get(&key) == Some(&buried) {
                self.orders.remove(&key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_round_trips() {
        let key = "mooncake/c1/ram/10.0.0.1:1234/x y+z";
        assert_eq!(
            escape(key),
            "mooncake%2Fc1%2Fram%2F10.0.0.1%3A1234%2Fx%20y%2Bz"
        );
        assert_eq!(unescape(&escape(key)).as_deref(), Some(key));
        assert_eq!(unescape("%zz"), None);
        assert_eq!(unescape("%4"), None);
    }

    #[test]
    fn an_endless_first_line_is_refused_without_reading_it_all() {
        let mut endless = std::io::BufReader::new(std::io::repeat(b'x'));
        let error = read_head(&mut endless, false).unwrap_err();
        assert!(error.contains("longer than"), "{error}");
    }

    #[test]
    fn a_request_whose_method_reads_like_a_status_line_is_still_a_request() {
        let wire = b"HTTP/1.1 /metadata?key=b%08 HTTP/1.1\r\nContent-Length: 0\r\n\r\n";
        let request = parse_request(&mut &wire[..]).unwrap();
        assert_eq!(
            (request.method.as_str(), request.key.as_str()),
            ("HTTP/1.1", "b\u{8}")
        );
    }

    #[test]
    fn only_ascii_spaces_separate_the_request_line() {
        // Found by fuzzing: U+2001 after the path made `GET /metrics` of another target.
        let wire = "    GET /metrics\u{2001}\u{3}GMT\0\0\x31Oson     ".as_bytes();
        assert!(!matches!(
            parse_http_request(&mut &wire[..]),
            Ok(HttpRequest::Metrics)
        ));
        let wire = "GET /metrics\u{2001}\r\n\r\n".as_bytes();
        assert!(!matches!(
            parse_http_request(&mut &wire[..]),
            Ok(HttpRequest::Metrics)
        ));
        let wire = "GET\u{2001}X /m?key=k HTTP/1.1\r\n\r\n".as_bytes();
        let error = parse_request(&mut &wire[..]).unwrap_err();
        assert!(error.contains("bad method"), "{error}");
        assert!(matches!(
            parse_http_request(&mut &b"GET /metrics HTTP/1.1\r\n\r\n"[..]),
            Ok(HttpRequest::Metrics)
        ));
    }

    #[test]
    fn requests_parse_and_a_short_body_is_named() {
        let wire =
            b"PUT /metadata?key=mooncake%2Fram%2Fa HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}tail";
        let mut reader = &wire[..];
        let request = parse_request(&mut reader).unwrap();
        assert_eq!(
            request,
            MetadataRequest {
                method: "PUT".into(),
                key: "mooncake/ram/a".into(),
                body: b"{}".to_vec(),
                token: None,
            }
        );
        assert_eq!(reader, b"tail");
        // A length the body never reaches, just under the limit (found by fuzzing, where
        // each such request cost a 32 MiB buffer before any byte of it arrived).
        let short = format!(
            "PUT /m?key=k HTTP/1.1\r\nContent-Length: {}\r\n\r\nab",
            MAX_BODY
        );
        let err = parse_request(&mut short.as_bytes()).unwrap_err();
        assert!(
            err.contains(&format!("after 2 of {MAX_BODY} bytes")),
            "{err}"
        );
        let err = parse_request(&mut &b"GET /m HTTP/1.1\r\n\r\n"[..]).unwrap_err();
        assert!(err.contains("no key"), "{err}");
        assert_eq!(
            parse_response(&mut &b"HTTP/1.1 404 Not Found\r\n\r\ngone"[..]).unwrap(),
            (404, b"gone".to_vec())
        );
    }

    #[test]
    fn tombstones_refuse_what_was_deleted_and_the_oldest_is_forgotten_first() {
        let order = |started_ns, counter| Order {
            incarnation: seal::Incarnation {
                started_ns,
                nonce: 7,
            },
            counter,
        };
        let mut table = Table::default();
        for key in ["a", "b"] {
            table.orders.insert(
                key.into(),
                HeldOrder {
                    order: order(10, 1),
                    deleted: false,
                },
            );
        }
        table.bury("a".into(), order(10, 1), 1);
        let stale = |table: &Table, key| {
            matches!(
                table.admit("PUT", key, b"{}", order(10, 1)),
                Err(Admission::Refused(seal::SealError::Stale { .. }))
            )
        };
        assert!(stale(&table, "a"));
        assert!(matches!(
            table.admit("DELETE", "a", b"", order(10, 1)),
            Err(Admission::Refused(seal::SealError::TokenSpent(_)))
        ));
        assert!(table.admit("PUT", "a", b"{}", order(11, 1)).is_ok());
        // One tombstone at most: burying "b" forgets "a"'s.
        table.bury("b".into(), order(10, 1), 1);
        assert!(stale(&table, "b"));
        assert!(!table.orders.contains_key("a"));
        assert!(table.admit("PUT", "a", b"{}", order(10, 1)).is_ok());
    }

    #[test]
    fn urls_parse() {
        let store = HttpStore::new("http://127.0.0.1:8080/metadata").unwrap();
        assert_eq!(
            (
                store.kv.host.as_str(),
                store.kv.port,
                store.kv.path.as_str()
            ),
            ("127.0.0.1", 8080, "/metadata")
        );
        let store = HttpStore::new("http://meta").unwrap();
        assert_eq!((store.kv.port, store.kv.path.as_str()), (80, "/"));
        assert!(HttpStore::new("https://x:1/").is_err());
        assert!(HttpStore::new("http://:5/").is_err());
    }
}
