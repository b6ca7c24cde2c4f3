//! The in-memory metadata server: requests checked (with a secret, their seals and tokens)
//! and applied to its table, with its own counts at `GET /metrics`.

use std::io;
use std::net::{SocketAddr, TcpListener};

use parking_lot::Mutex;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::listener::{Reply, serve_http};
use super::table::{Admission, HeldOrder, Table};
use super::{HttpRequest, METRICS_CONTENT_TYPE, MetadataRequest};
use crate::auth::ClusterSecret;
use crate::net::{Acceptor, ServeLimits};
use crate::seal;

/// Most keys the server holds by default; a PUT of a new key beyond it is refused (507).
pub const MAX_ENTRIES: usize = 65536;

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
    let mut table = table.lock();
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
