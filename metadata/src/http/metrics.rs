//! A listener that serves only metrics.

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;

use super::listener::{Reply, serve_http};
use super::{HttpRequest, METRICS_CONTENT_TYPE, METRICS_PATH};
use crate::net::{Acceptor, ServeLimits};

/// Renders the metrics a listener serves at [`METRICS_PATH`], on each request.
pub type RenderMetrics = Arc<dyn Fn() -> String + Send + Sync>;

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
