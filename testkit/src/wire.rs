//! Raw sockets for tests that speak a protocol by hand: connect with a bound on reads, take
//! everything a server sends until it closes, and see whether a server closed a connection
//! in time.

use socket2::{Domain, Protocol, Socket, Type};
use std::io::{ErrorKind, Read};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

/// A connection to `addr` whose reads give up after 10 s (a test must fail, not hang).
pub fn connect(addr: impl ToSocketAddrs) -> TcpStream {
    with_read_bound(TcpStream::connect(addr).expect("the server accepts connections"))
}

/// `stream`, whose reads give up after 10 s.
fn with_read_bound(stream: TcpStream) -> TcpStream {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("a read timeout");
    stream
}

/// As [`connect`], from a loopback address (127.77.x.y) no other connection of this process
/// has used, so that the server's log lines about this peer name it alone: a peer's port is
/// no such name, as connections to other servers of a test binary, whose tests run side by
/// side, may share it.
pub fn connect_as_named_peer(addr: SocketAddr) -> TcpStream {
    static NEXT: AtomicU16 = AtomicU16::new(1);
    let [high, low] = NEXT.fetch_add(1, Ordering::Relaxed).to_be_bytes();
    let source = SocketAddr::from(([127, 77, high, low], 0));
    let socket = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).expect("a socket");
    socket
        .bind(&source.into())
        .expect("a loopback source address");
    socket
        .connect(&addr.into())
        .expect("the server accepts connections");
    with_read_bound(TcpStream::from(socket))
}

/// Everything the server sends until it closes (a reset counts as a close).
pub fn drain(stream: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return got,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
        }
    }
}

/// A stream whose reads can be given a time limit: TCP and Unix sockets alike.
pub trait TimedRead: Read {
    /// As [`TcpStream::set_read_timeout`].
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()>;
}

impl TimedRead for TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        TcpStream::set_read_timeout(self, timeout)
    }
}

impl TimedRead for UnixStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        UnixStream::set_read_timeout(self, timeout)
    }
}

/// Whether the server has closed `stream` (a read sees the end, or an error) within `wait`;
/// what it sends meanwhile is read and dropped.
pub fn closed_within(stream: &mut impl TimedRead, wait: Duration) -> bool {
    stream.set_read_timeout(Some(wait)).unwrap();
    let mut buf = [0u8; 256];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false;
            }
            Err(_) => return true,
        }
    }
}

/// Whether the server has closed `stream` by `until` (as [`closed_within`]).
pub fn closed_by(stream: &mut impl TimedRead, until: Instant) -> bool {
    let left = until
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    closed_within(stream, left)
}

/// How many of `streams` the server has not closed by `until`.
pub fn still_open(streams: &mut [impl TimedRead], until: Instant) -> usize {
    streams
        .iter_mut()
        .map(|s| closed_by(s, until))
        .filter(|closed| !closed)
        .count()
}
