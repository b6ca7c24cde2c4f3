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

mod client;
mod escape;
mod listener;
mod metrics;
mod parse;
mod server;
mod table;

pub use client::{HttpKv, HttpStore};
pub use escape::{escape, unescape};
pub use listener::{METRICS_CONTENT_TYPE, METRICS_PATH};
pub use metrics::{MetricsServer, RenderMetrics};
pub use parse::{HttpRequest, MetadataRequest, parse_http_request, parse_request, parse_response};
pub use server::{HttpMetadataServer, HttpServerConfig, MAX_ENTRIES};
