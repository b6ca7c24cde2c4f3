//! What a listener holds its clients to ([`ServeLimits`]) and the connection it hands its
//! handler ([`Served`]).

use std::io::{self, Read};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::deadline::DeadlineRead;
use super::slots::Opening;
use crate::auth;

/// What every listener holds its clients to.
///
/// A connection first goes through its opening: its first frame (and, with a cluster
/// secret, the proof before it) until its handler says it is in ([`Served::opened`]). Silent
/// or trickling connections only ever hold opening places, which are bounded by
/// [`exchange_timeout`](Self::exchange_timeout) each and given up to newer connections, so
/// they never take a slot of [`max_connections`](Self::max_connections) from a peer that
/// completes its opening.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// Connections served at once past their opening. One more that completes its opening
    /// waits up to 50 ms, on its own thread, for one of them to finish (a connection that
    /// has sent its last answer holds its slot a moment after its client has it), and is
    /// then closed, with one log line.
    pub max_connections: usize,
    /// Connections in their opening at once. A new connection beyond this closes the oldest
    /// of them at once (the accept thread never waits for a place): a newcomer is always
    /// let in, and a place is taken from the connection that has had longest to open.
    pub max_opening: usize,
    /// How long a connection may take from being accepted to the end of its opening; one
    /// that has not completed it by then is closed.
    pub exchange_timeout: Duration,
    /// A frame (a request header, an RPC frame, an HTTP request) must arrive whole within
    /// this of its first byte, however the bytes trickle in.
    pub frame_deadline: Duration,
    /// How long a connection may sit idle between frames (before its first, the exchange
    /// timeout holds).
    pub idle_timeout: Duration,
    /// How long one write may block on a peer that does not read.
    pub write_timeout: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            max_opening: 256,
            exchange_timeout: auth::EXCHANGE_TIMEOUT,
            frame_deadline: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(30),
        }
    }
}

/// A connection an [`Acceptor`](super::Acceptor) hands its handler: no Nagle (on TCP), reads
/// that wake every [`READ_TICK`](super::READ_TICK), writes bounded by the listener's
/// `write_timeout`, and until its handler calls [`opened`](Self::opened), every read bounded by
/// the exchange timeout from accept.
#[derive(Debug)]
pub struct Served<S = TcpStream> {
    /// The connection.
    pub stream: S,
    /// Who connected, for log lines.
    pub peer: String,
    /// The listener's limits.
    pub limits: ServeLimits,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) opening: Opening,
}

impl<S> Served<S> {
    /// Whether the listener is shutting down (its handler should return).
    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// The listener's stop flag, to look at after the connection is gone.
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        self.stop.clone()
    }

    /// Says the connection has completed its opening (its first frame is in, and with a
    /// cluster secret the peer proved it): from now on it holds one of the listener's
    /// `max_connections` slots, and the exchange timeout no longer applies. Waits up to
    /// 50 ms for a slot when all are taken; `false` when none freed (or the connection was
    /// closed meanwhile, for taking too long): the connection is closed and its handler
    /// must return without serving it.
    pub fn opened(&self) -> bool {
        self.opening.open()
    }

    /// Until when the connection may still complete its opening; `None` once it has.
    pub fn opening_deadline(&self) -> Option<Instant> {
        self.opening.deadline()
    }

    /// `deadline`, or the end of the opening if that comes first.
    fn bounded(&self, deadline: Instant) -> Instant {
        self.opening_deadline()
            .map_or(deadline, |opening| opening.min(deadline))
    }
}

impl<S: Read> Served<S> {
    /// Reads the start of a frame into `start` (as much of it as has arrived, at least one
    /// byte), waiting up to the idle timeout (the opening's end, for the first frame);
    /// returns how many bytes, 0 when the peer closed (or the listener stopped, or the
    /// connection was closed for not opening in time) before sending one.
    pub fn await_frame(&mut self, start: &mut [u8]) -> io::Result<usize> {
        let deadline = self.bounded(Instant::now() + self.limits.idle_timeout);
        let stop = self.stop.clone();
        let mut reader = DeadlineRead::new(&mut self.stream, deadline).stop_on(&stop);
        match reader.read(start) {
            Err(e)
                if e.kind() == io::ErrorKind::ConnectionAborted && stop.load(Ordering::Acquire) =>
            {
                Ok(0)
            }
            other => other,
        }
    }

    /// The first byte of a connection's first request, or `None` when there is none to serve:
    /// the peer closed before sending one (a bare connect-and-close, a port probe, the
    /// shutdown wake-up: no refusal, nothing logged), or the wait failed (logged as `what`'s).
    pub fn await_opening_byte(&mut self, what: &str) -> Option<[u8; 1]> {
        self.opening_byte().unwrap_or_else(|e| {
            tracing::warn!(
                "{what} from {}: {e} before its request; dropping it",
                self.peer
            );
            None
        })
    }

    /// As [`await_opening_byte`](Self::await_opening_byte), with the failed wait given back
    /// instead of logged: for a handler whose refusal reason it is.
    pub fn opening_byte(&mut self) -> io::Result<Option<[u8; 1]>> {
        let mut first = [0u8; 1];
        Ok((self.await_frame(&mut first)? > 0).then_some(first))
    }

    /// The stream, read under a deadline of `frame_deadline` from now (or the opening's end,
    /// if that comes first): what a handler reads the rest of a frame through.
    pub fn frame(&mut self) -> DeadlineRead<'_, S> {
        let deadline = self.bounded(Instant::now() + self.limits.frame_deadline);
        DeadlineRead {
            inner: &mut self.stream,
            deadline,
            stop: None,
            opening: Some(&self.opening),
        }
    }
}
