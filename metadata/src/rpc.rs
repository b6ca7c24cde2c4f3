//! The handshake RPC: one short TCP connection per call, frames of
//! `u64 LE length | type byte | JSON`, where `length` counts the type byte and the JSON.
//! The reply echoes the request's type. Types: Connection 0, Metadata 1, Notify 2, Probe 3.
//! A frame whose first body byte is `{` is a legacy frame without a type byte (Connection).

use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use crate::net::{Acceptor, PortChoice, bind_listener};

/// Default and minimum frame size limit (1 MiB), as in Mooncake.
pub const DEFAULT_MAX_FRAME: usize = 1 << 20;

/// Kinds of handshake RPC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum RpcType {
    /// RDMA QP exchange (`HandShakeDesc`).
    Connection = 0,
    /// P2P mode: fetch the server's segment descriptor.
    Metadata = 1,
    /// Out-of-band small message.
    Notify = 2,
    /// Liveness probe.
    Probe = 3,
}

impl RpcType {
    /// The type for a wire byte.
    pub fn from_byte(byte: u8) -> Option<Self> {
        Some(match byte {
            0 => Self::Connection,
            1 => Self::Metadata,
            2 => Self::Notify,
            3 => Self::Probe,
            _ => return None,
        })
    }
}

/// A frame that could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The socket failed or closed mid-frame.
    #[error("handshake frame I/O: {0}")]
    Io(#[from] io::Error),
    /// A frame announced zero bytes.
    #[error("handshake frame of length zero")]
    ZeroLength,
    /// A frame announced more than the limit; raise the limit or fix the peer.
    #[error("handshake frame of {len} bytes exceeds the {max}-byte limit")]
    TooLong {
        /// Announced length.
        len: u64,
        /// Limit in force.
        max: usize,
    },
    /// The type byte is none of Connection, Metadata, Notify, Probe.
    #[error("unknown handshake frame type {0}")]
    UnknownType(u8),
}

/// Writes one frame.
pub fn write_frame(w: &mut impl Write, ty: RpcType, body: &[u8]) -> io::Result<()> {
    let mut frame = Vec::with_capacity(9 + body.len());
    frame.extend_from_slice(&(body.len() as u64 + 1).to_le_bytes());
    frame.push(ty as u8);
    frame.extend_from_slice(body);
    w.write_all(&frame)?;
    w.flush()
}

/// Reads one frame of at most `max` bytes.
pub fn read_frame(r: &mut impl Read, max: usize) -> Result<(RpcType, Vec<u8>), FrameError> {
    let mut len = [0u8; 8];
    r.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len == 0 {
        return Err(FrameError::ZeroLength);
    }
    if len > max as u64 {
        return Err(FrameError::TooLong { len, max });
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    match body[0] {
        b'{' => Ok((RpcType::Connection, body)),
        byte => {
            let ty = RpcType::from_byte(byte).ok_or(FrameError::UnknownType(byte))?;
            body.remove(0);
            Ok((ty, body))
        }
    }
}

/// A handshake RPC call that failed. Each variant names the peer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// The peer's name did not resolve.
    #[error("cannot resolve {peer:?}: {source}")]
    Dns {
        /// Peer as given.
        peer: String,
        /// Resolver error.
        source: io::Error,
    },
    /// No address of the peer accepted a connection in time; is it up?
    #[error("cannot connect to {peer}: {source}")]
    Connect {
        /// Peer as given.
        peer: String,
        /// Last connect error.
        source: io::Error,
    },
    /// The exchange failed after connecting (peer died, timed out, or sent a bad frame).
    #[error("handshake with {peer} failed: {source}")]
    Exchange {
        /// Peer as given.
        peer: String,
        /// What failed.
        source: FrameError,
    },
    /// The reply's type byte did not echo the request's.
    #[error("{peer} answered a {sent:?} request with {got:?}")]
    TypeMismatch {
        /// Peer as given.
        peer: String,
        /// Type sent.
        sent: RpcType,
        /// Type received.
        got: RpcType,
    },
    /// The peer answered but refused the request.
    #[error("{peer} rejected the {ty:?} request: {reason}")]
    Rejected {
        /// Peer as given.
        peer: String,
        /// Request type.
        ty: RpcType,
        /// The peer's reason.
        reason: String,
    },
}

/// Client timeouts and limits.
#[derive(Debug, Clone)]
pub struct RpcClientConfig {
    /// Bound on connecting (Mooncake: 5 s).
    pub connect_timeout: Duration,
    /// Bound on each read and write after connecting.
    pub io_timeout: Duration,
    /// Largest reply accepted.
    pub max_frame: usize,
}

impl Default for RpcClientConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(60),
            max_frame: 128 << 20,
        }
    }
}

/// One RPC: connects to `peer` (`host:port`), sends a frame, returns the reply body.
pub fn call(
    peer: &str,
    ty: RpcType,
    body: &[u8],
    config: &RpcClientConfig,
) -> Result<Vec<u8>, RpcError> {
    let addrs: Vec<SocketAddr> = peer
        .to_socket_addrs()
        .map_err(|source| RpcError::Dns {
            peer: peer.to_owned(),
            source,
        })?
        .collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    let mut stream = None;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, config.connect_timeout) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = e,
        }
    }
    let mut stream = stream.ok_or_else(|| RpcError::Connect {
        peer: peer.to_owned(),
        source: last,
    })?;
    let exchange = |e: FrameError| RpcError::Exchange {
        peer: peer.to_owned(),
        source: e,
    };
    let io_err = |e: io::Error| exchange(FrameError::Io(e));
    stream.set_nodelay(true).map_err(io_err)?;
    stream
        .set_read_timeout(Some(config.io_timeout))
        .map_err(io_err)?;
    stream
        .set_write_timeout(Some(config.io_timeout))
        .map_err(io_err)?;
    write_frame(&mut stream, ty, body).map_err(io_err)?;
    let (got, reply) = read_frame(&mut stream, config.max_frame).map_err(exchange)?;
    if got != ty {
        return Err(RpcError::TypeMismatch {
            peer: peer.to_owned(),
            sent: ty,
            got,
        });
    }
    Ok(reply)
}

/// Answers requests; `Err` drops the connection after logging the reason.
pub trait RpcHandler: Send + Sync + 'static {
    /// The reply body to a request of type `ty` with body `body`.
    fn handle(&self, ty: RpcType, body: &[u8]) -> Result<Vec<u8>, String>;
}

impl<F> RpcHandler for F
where
    F: Fn(RpcType, &[u8]) -> Result<Vec<u8>, String> + Send + Sync + 'static,
{
    fn handle(&self, ty: RpcType, body: &[u8]) -> Result<Vec<u8>, String> {
        self(ty, body)
    }
}

/// Server limits.
#[derive(Debug, Clone)]
pub struct RpcServerConfig {
    /// Where to bind.
    pub ports: PortChoice,
    /// Largest request accepted (at least [`DEFAULT_MAX_FRAME`]).
    pub max_frame: usize,
    /// How long a connection may stay silent (Mooncake: 5 s).
    pub idle_timeout: Duration,
    /// Connections served at once; more are closed at once.
    pub max_connections: usize,
}

impl Default for RpcServerConfig {
    fn default() -> Self {
        Self {
            ports: PortChoice::default(),
            max_frame: DEFAULT_MAX_FRAME,
            idle_timeout: Duration::from_secs(5),
            max_connections: 256,
        }
    }
}

/// A running handshake RPC server. Stops when dropped.
#[derive(Debug)]
pub struct RpcServer {
    acceptor: Acceptor,
}

impl RpcServer {
    /// Binds on `ip` and serves `handler` on a background thread.
    pub fn start(
        ip: IpAddr,
        config: RpcServerConfig,
        handler: Arc<dyn RpcHandler>,
    ) -> io::Result<Self> {
        let listener = bind_listener(ip, config.ports)?;
        Self::serve(listener, config, handler)
    }

    /// Serves `handler` on an already bound listener (`config.ports` is ignored), for callers
    /// that need the port before the handler exists.
    pub fn serve(
        listener: TcpListener,
        config: RpcServerConfig,
        handler: Arc<dyn RpcHandler>,
    ) -> io::Result<Self> {
        let name = format!("tern-rpc-{}", listener.local_addr()?.port());
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let acceptor = Acceptor::spawn(listener, name, stop, move |listener| {
            accept_loop(listener, config, handler, flag)
        })?;
        Ok(Self { acceptor })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.acceptor.local_addr()
    }
}

fn accept_loop(
    listener: TcpListener,
    config: RpcServerConfig,
    handler: Arc<dyn RpcHandler>,
    stop: Arc<AtomicBool>,
) {
    let active = Arc::new(AtomicUsize::new(0));
    let max_frame = config.max_frame.max(DEFAULT_MAX_FRAME);
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let stream = match conn {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("handshake accept failed: {e}");
                continue;
            }
        };
        if active.load(Ordering::Acquire) >= config.max_connections {
            tracing::warn!("handshake server busy; dropping a connection");
            continue;
        }
        active.fetch_add(1, Ordering::AcqRel);
        let (handler, active, timeout) = (handler.clone(), active.clone(), config.idle_timeout);
        let spawned = std::thread::Builder::new()
            .name("tern-rpc-conn".into())
            .spawn(move || {
                serve_connection(stream, &*handler, max_frame, timeout);
                active.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            tracing::warn!("handshake server cannot spawn a thread: {e}");
        }
    }
}

fn serve_connection(
    mut stream: TcpStream,
    handler: &dyn RpcHandler,
    max: usize,
    timeout: Duration,
) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "?".to_owned(), |a| a.to_string());
    let _ = stream.set_read_timeout(Some(timeout));
    let _ = stream.set_write_timeout(Some(timeout));
    let _ = stream.set_nodelay(true);
    let (ty, body) = match read_frame(&mut stream, max) {
        Ok(frame) => frame,
        // A bare connect-and-close (a port probe, or the shutdown wake-up) is not worth a line.
        Err(FrameError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => return,
        Err(e) => {
            tracing::warn!("handshake from {peer}: {e}; dropping the connection");
            return;
        }
    };
    match handler.handle(ty, &body) {
        Ok(reply) => {
            if let Err(e) = write_frame(&mut stream, ty, &reply) {
                tracing::warn!("handshake reply to {peer}: {e}");
            }
            let _ = stream.shutdown(Shutdown::Write);
            // Wait for the client to close first so its reply is never cut by a reset.
            let _ = stream.read(&mut [0u8; 1]);
        }
        Err(reason) => {
            tracing::warn!("handshake {ty:?} from {peer}: {reason}; dropping the connection")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_frames_are_typed() {
        let mut wire = Vec::new();
        write_frame(&mut wire, RpcType::Notify, b"{\"a\":1}").unwrap();
        assert_eq!(&wire[..8], &8u64.to_le_bytes());
        assert_eq!(wire[8], 2);
        let (ty, body) = read_frame(&mut &wire[..], DEFAULT_MAX_FRAME).unwrap();
        assert_eq!((ty, body.as_slice()), (RpcType::Notify, &b"{\"a\":1}"[..]));

        let legacy = [&3u64.to_le_bytes()[..], b"{ }"].concat();
        let (ty, body) = read_frame(&mut &legacy[..], DEFAULT_MAX_FRAME).unwrap();
        assert_eq!((ty, body.as_slice()), (RpcType::Connection, &b"{ }"[..]));

        let zero = 0u64.to_le_bytes();
        assert!(matches!(
            read_frame(&mut &zero[..], 64),
            Err(FrameError::ZeroLength)
        ));
        let absurd = u64::MAX.to_le_bytes();
        assert!(matches!(
            read_frame(&mut &absurd[..], 64),
            Err(FrameError::TooLong { .. })
        ));
        let unknown = [&2u64.to_le_bytes()[..], &[9, b'x']].concat();
        assert!(matches!(
            read_frame(&mut &unknown[..], 64),
            Err(FrameError::UnknownType(9))
        ));
        let truncated = [&10u64.to_le_bytes()[..], &[1, b'{']].concat();
        assert!(matches!(
            read_frame(&mut &truncated[..], 64),
            Err(FrameError::Io(_))
        ));
    }
}
