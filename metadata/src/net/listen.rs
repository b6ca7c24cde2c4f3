//! What an [`Acceptor`](super::Acceptor) serves: TCP and Unix listeners, and how their
//! connections are set up and cut.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::time::Duration;

use super::READ_TICK;

/// A listener an [`Acceptor`](super::Acceptor) serves: a TCP socket, or a Unix one.
pub trait Listen: Send + 'static {
    /// The connections it accepts.
    type Stream: ServeStream;
    /// Its address.
    type Addr: Clone + std::fmt::Debug + Send + Sync + 'static;
    /// Its address, as bound.
    fn address(&self) -> io::Result<Self::Addr>;
    /// Waits for the next connection; returns it and who connected (for log lines).
    fn next_connection(&self) -> io::Result<(Self::Stream, String)>;
    /// Unblocks a thread waiting in `next_connection` on `addr` (by connecting once).
    fn wake(addr: &Self::Addr);
}

/// A connection an [`Acceptor`](super::Acceptor) serves.
pub trait ServeStream: Read + Write + Send + Sized + 'static {
    /// Sets the connection up as every served one is (no Nagle where there is one, reads
    /// that wake every [`READ_TICK`], writes bounded by `write_timeout`); returns a second
    /// handle to it, to cut it with.
    fn prepare(&self, write_timeout: Duration) -> io::Result<Self>;
    /// Shuts the connection down both ways: a read blocked on it returns at once.
    fn cut(&self);
}

impl Listen for TcpListener {
    type Stream = TcpStream;
    type Addr = SocketAddr;

    fn address(&self) -> io::Result<SocketAddr> {
        self.local_addr()
    }

    fn next_connection(&self) -> io::Result<(TcpStream, String)> {
        let (stream, peer) = self.accept()?;
        Ok((stream, peer.to_string()))
    }

    fn wake(addr: &SocketAddr) {
        wake_acceptor(*addr);
    }
}

impl ServeStream for TcpStream {
    fn prepare(&self, write_timeout: Duration) -> io::Result<Self> {
        self.set_nodelay(true)?;
        self.set_read_timeout(Some(READ_TICK))?;
        self.set_write_timeout(Some(write_timeout))?;
        self.try_clone()
    }

    fn cut(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

impl Listen for UnixListener {
    type Stream = UnixStream;
    type Addr = UnixAddr;

    fn address(&self) -> io::Result<UnixAddr> {
        self.local_addr()
    }

    fn next_connection(&self) -> io::Result<(UnixStream, String)> {
        let (stream, peer) = self.accept()?;
        Ok((stream, format!("{peer:?}")))
    }

    fn wake(addr: &UnixAddr) {
        let _ = UnixStream::connect_addr(addr);
    }
}

impl ServeStream for UnixStream {
    fn prepare(&self, write_timeout: Duration) -> io::Result<Self> {
        self.set_read_timeout(Some(READ_TICK))?;
        self.set_write_timeout(Some(write_timeout))?;
        self.try_clone()
    }

    fn cut(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

/// Unblocks a thread sitting in `accept` on `local` by connecting to it once.
pub fn wake_acceptor(local: SocketAddr) {
    let mut target = local;
    if target.ip().is_unspecified() {
        target.set_ip(IpAddr::from([127, 0, 0, 1]));
    }
    let _ = TcpStream::connect_timeout(&target, Duration::from_secs(1));
}
