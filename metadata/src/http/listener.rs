//! What every Tern HTTP listener runs: one request per connection, read within a deadline
//! from its first byte, answered by the listener's own function.

use std::io::{self, BufReader, Write};
use std::net::TcpListener;
use std::sync::Arc;

use prometheus_client::encoding::prometheus_text;

use super::{HttpRequest, parse_http_request};
use crate::net::{Acceptor, Replayed, ServeLimits, Served};

/// The path every Tern HTTP listener serves its metrics on.
pub const METRICS_PATH: &str = "/metrics";

/// The `Content-Type` of metrics (Prometheus text format 0.0.4).
pub const METRICS_CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// What an HTTP listener answers: status, content type and body.
pub(super) struct Reply {
    pub(super) status: u16,
    pub(super) content_type: &'static str,
    pub(super) body: Vec<u8>,
}

impl Reply {
    pub(super) fn json(status: u16, body: impl Into<Vec<u8>>) -> Self {
        Self {
            status,
            content_type: "application/json",
            body: body.into(),
        }
    }
}

/// Serves one request per connection on `listener`, each answered by `answer`.
pub(super) fn serve_http(
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
    let Some(first) = served.await_opening_byte("http request") else {
        return;
    };
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
