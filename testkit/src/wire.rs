//! Raw sockets for tests that speak a protocol by hand: connect with a bound on reads, and
//! take everything a server sends until it closes.

use std::io::Read;
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

/// A connection to `addr` whose reads give up after 10 s (a test must fail, not hang).
pub fn connect(addr: impl ToSocketAddrs) -> TcpStream {
    let stream = TcpStream::connect(addr).expect("the server accepts connections");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("a read timeout");
    stream
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
