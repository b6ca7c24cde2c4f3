//! The handshake RPC: one short TCP connection per call, frames of
//! `u64 LE length | type byte | JSON`, where `length` counts the type byte and the JSON.
//! The reply echoes the request's type. Types: Connection 0, Metadata 1, Notify 2, Probe 3.
//! A frame whose first body byte is `{` is a legacy frame without a type byte (Connection).
//!
//! Frames are bounded by `MC_HANDSHAKE_MAX_LENGTH` on both sides (as Mooncake: default and
//! minimum 1 MiB, maximum 128 MiB). With a cluster secret ([`RpcClientConfig::secret`],
//! [`RpcServerConfig::secret`]) every connection opens with the [`auth`] exchange and the
//! server reads no frame from a peer that has not proved it knows the secret; without one the
//! bytes are Mooncake's and nothing else.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::auth::{self, AuthError, Channel, ClusterSecret, Identity};
use crate::net::{
    Acceptor, Dial, DialAuth, DialError, PortChoice, Replayed, ServeLimits, Served, bind_listener,
    dial,
};

/// Default and minimum frame size limit (1 MiB), as in Mooncake.
pub const DEFAULT_MAX_FRAME: usize = 1 << 20;
/// Largest frame size limit that may be configured (128 MiB), as in Mooncake.
pub const MAX_FRAME_CEILING: usize = 128 << 20;
/// Environment variable with the frame size limit in bytes (Mooncake's).
pub const MAX_FRAME_ENV: &str = "MC_HANDSHAKE_MAX_LENGTH";

/// Reads a frame size limit as Mooncake does: bytes, from [`DEFAULT_MAX_FRAME`] to
/// [`MAX_FRAME_CEILING`]. `None` (unset) gives the default; anything else is `Err` with the
/// reason, and the caller keeps the default.
pub fn parse_max_frame(value: Option<&str>) -> Result<usize, String> {
    let Some(value) = value else {
        return Ok(DEFAULT_MAX_FRAME);
    };
    match value.trim().parse::<usize>() {
        Ok(n) if (DEFAULT_MAX_FRAME..=MAX_FRAME_CEILING).contains(&n) => Ok(n),
        Ok(n) => Err(format!(
            "{MAX_FRAME_ENV}={n} is outside {DEFAULT_MAX_FRAME}..={MAX_FRAME_CEILING}"
        )),
        Err(_) => Err(format!(
            "{MAX_FRAME_ENV}={value:?} is not a number of bytes"
        )),
    }
}

/// The frame size limit from `MC_HANDSHAKE_MAX_LENGTH`, read once per process (as Mooncake);
/// a bad value is logged once and the default kept.
pub fn max_frame_from_env() -> usize {
    static LIMIT: OnceLock<usize> = OnceLock::new();
    *LIMIT.get_or_init(|| {
        let value = std::env::var(MAX_FRAME_ENV).ok();
        parse_max_frame(value.as_deref()).unwrap_or_else(|reason| {
            tracing::warn!("{reason}; using {DEFAULT_MAX_FRAME} bytes");
            DEFAULT_MAX_FRAME
        })
    })
}

/// A Tern authentication Hello read as a plain frame's length: how a node without a secret
/// recognises a peer that has one.
const HELLO_AS_LENGTH: u64 = u64::from_le_bytes(auth::MAGIC);

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
// Why not TCP's `Staging`: one frame a connection, its length prefix covering a body kept whole.
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
    // Grows with what arrives, so a frame that announces much and sends little costs
    // little.
    let mut body = Vec::new();
    r.take(len).read_to_end(&mut body)?;
    if (body.len() as u64) < len {
        return Err(FrameError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("frame ended after {} of {len} bytes", body.len()),
        )));
    }
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
    /// The peer closed the connection without answering a plain (unauthenticated) request:
    /// it may require a cluster secret that this node lacks (give both the same), or it failed.
    #[error(
        "{peer} closed the connection without answering ({source}); if it requires a cluster \
         secret, give this node the same one"
    )]
    NoReply {
        /// Peer as given.
        peer: String,
        /// How the connection ended.
        source: io::Error,
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
    /// The cluster-secret exchange with the peer failed: it runs without a secret (or is a
    /// Mooncake node), has another secret, or broke the exchange; `source` says which. Give
    /// every node of the cluster the same secret, or none.
    #[error("authenticating to {peer}: {source}")]
    Auth {
        /// Peer as given.
        peer: String,
        /// What failed.
        source: AuthError,
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

/// Client timeouts, limits and credentials.
#[derive(Debug, Clone)]
pub struct RpcClientConfig {
    /// Bound on connecting, authentication included (Mooncake: 5 s).
    pub connect_timeout: Duration,
    /// Bound on each read and write after connecting.
    pub io_timeout: Duration,
    /// Largest reply accepted (default: `MC_HANDSHAKE_MAX_LENGTH`, else 1 MiB).
    pub max_frame: usize,
    /// The cluster secret to prove before sending a request, and to demand of the server;
    /// `None` speaks plain Mooncake.
    pub secret: Option<ClusterSecret>,
    /// This node's segment name, which a secured call claims (empty: none yet).
    pub local_segment: String,
}

impl Default for RpcClientConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(60),
            max_frame: max_frame_from_env(),
            secret: None,
            local_segment: String::new(),
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
    call_segment(peer, "", ty, body, config)
}

/// As [`call`], to the node whose segment is `segment` (bound into the cluster-secret
/// exchange, so a node answering at `peer` under another name is refused; empty: any).
pub fn call_segment(
    peer: &str,
    segment: &str,
    ty: RpcType,
    body: &[u8],
    config: &RpcClientConfig,
) -> Result<Vec<u8>, RpcError> {
    let dialing = Dial {
        endpoint: peer,
        connect_timeout: config.connect_timeout,
        auth: config.secret.as_ref().map(|secret| DialAuth {
            secret,
            channel: Channel::Rpc,
            client_segment: &config.local_segment,
            server_segment: segment,
        }),
    };
    let mut stream = dial(&dialing, config.io_timeout).map_err(|e| match e {
        DialError::Dns(source) => RpcError::Dns {
            peer: peer.to_owned(),
            source,
        },
        DialError::Connect(source) => RpcError::Connect {
            peer: peer.to_owned(),
            source,
        },
        DialError::Auth(source) => RpcError::Auth {
            peer: peer.to_owned(),
            source,
        },
        DialError::Setup(source) => RpcError::Exchange {
            peer: peer.to_owned(),
            source: FrameError::Io(source),
        },
    })?;
    let exchange = |e: FrameError| RpcError::Exchange {
        peer: peer.to_owned(),
        source: e,
    };
    write_frame(&mut stream, ty, body).map_err(|e| exchange(FrameError::Io(e)))?;
    let (got, reply) = read_frame(&mut stream, config.max_frame).map_err(|e| match e {
        // A node that demands a secret closes on a plain request without a word.
        FrameError::Io(source)
            if config.secret.is_none()
                && matches!(
                    source.kind(),
                    io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset
                ) =>
        {
            RpcError::NoReply {
                peer: peer.to_owned(),
                source,
            }
        }
        e => exchange(e),
    })?;
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

/// Server limits and credentials.
#[derive(Debug, Clone)]
pub struct RpcServerConfig {
    /// Where to bind.
    pub ports: PortChoice,
    /// Largest request accepted, held to [`DEFAULT_MAX_FRAME`]..=[`MAX_FRAME_CEILING`]
    /// (default: `MC_HANDSHAKE_MAX_LENGTH`, else 1 MiB).
    pub max_frame: usize,
    /// Connections at once, the deadline of a request (authentication included) from its
    /// first byte, how long a connection may stay silent first (Mooncake: 5 s).
    pub limits: ServeLimits,
    /// The cluster secret every client must prove before a byte of its request is read;
    /// `None` serves plain Mooncake clients.
    pub secret: Option<ClusterSecret>,
    /// This node's segment name, bound into the cluster-secret exchange (empty: the
    /// listener's endpoint, as in P2P mode).
    pub segment: String,
}

impl Default for RpcServerConfig {
    fn default() -> Self {
        Self {
            ports: PortChoice::default(),
            max_frame: max_frame_from_env(),
            limits: ServeLimits::default(),
            secret: None,
            segment: String::new(),
        }
    }
}

/// A running handshake RPC server. Stops when dropped: connections cut, threads joined.
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
        let local = listener.local_addr()?;
        let name = format!("tern-rpc-{}", local.port());
        let max_frame = config.max_frame.clamp(DEFAULT_MAX_FRAME, MAX_FRAME_CEILING);
        let identity = Identity {
            segment: if config.segment.is_empty() {
                local.to_string()
            } else {
                config.segment.clone()
            },
            endpoint: local.to_string(),
        };
        let secret = config.secret.clone();
        let serve = move |served: Served| {
            serve_connection(served, &*handler, max_frame, secret.as_ref(), &identity)
        };
        let acceptor = Acceptor::serve(listener, &name, config.limits, Arc::new(serve))?;
        Ok(Self { acceptor })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.acceptor.local_addr()
    }
}

fn serve_connection(
    mut served: Served,
    handler: &dyn RpcHandler,
    max: usize,
    secret: Option<&ClusterSecret>,
    me: &Identity,
) {
    let peer = served.peer.clone();
    let Some(first) = served.await_opening_byte("handshake") else {
        return;
    };
    // The whole request — the authentication exchange included — is bound by one deadline
    // from its first byte.
    let mut frame = served.frame();
    let mut stream = Replayed::new(&first, &mut frame);
    if let Some(secret) = secret {
        match auth::server_handshake(&mut stream, secret, Channel::Rpc, me) {
            Ok(_) => {}
            Err(e) => {
                tracing::warn!("handshake RPC from {peer} refused, nothing served: {e}");
                return;
            }
        }
    }
    let (ty, body) = match read_frame(&mut stream, max) {
        Ok(frame) => frame,
        Err(FrameError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => return,
        Err(FrameError::TooLong { len, .. }) if len == HELLO_AS_LENGTH => {
            tracing::warn!(
                "handshake from {peer}: the peer wants to authenticate with a cluster secret \
                 and this node has none; dropping the connection"
            );
            return;
        }
        Err(e) => {
            tracing::warn!("handshake from {peer}: {e}; dropping the connection");
            return;
        }
    };
    // The request is in: from here the connection holds a slot of the listener's own, and
    // is not closed for its opening taking long (nor served if no slot frees).
    if !frame.opened() {
        return;
    }
    let stream = frame.get_mut();
    match handler.handle(ty, &body) {
        Ok(reply) => {
            if let Err(e) = write_frame(stream, ty, &reply) {
                tracing::warn!("handshake reply to {peer}: {e}");
            }
            let _ = stream.shutdown(Shutdown::Write);
            // Wait (a tick at most) for the client to close first so its reply is never cut
            // by a reset.
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

    #[test]
    fn frame_limits_are_read_as_mooncake_reads_them() {
        assert_eq!(parse_max_frame(None), Ok(1 << 20));
        assert_eq!(parse_max_frame(Some("4194304")), Ok(4 << 20));
        assert_eq!(parse_max_frame(Some(" 134217728 ")), Ok(128 << 20));
        for bad in ["1048575", "134217729", "0", "-1", "1MiB", ""] {
            let reason = parse_max_frame(Some(bad)).unwrap_err();
            assert!(reason.contains(MAX_FRAME_ENV), "{bad:?}: {reason}");
        }
    }

    #[test]
    fn a_hello_read_as_a_plain_frame_is_too_long_and_recognised() {
        let hello = auth::AuthFrame::Hello {
            channel: Channel::Rpc,
            nonce: [0; auth::NONCE_LEN],
            claims: auth::Claims::default(),
        }
        .encode();
        match read_frame(&mut &hello[..], MAX_FRAME_CEILING) {
            Err(FrameError::TooLong { len, .. }) => assert_eq!(len, HELLO_AS_LENGTH),
            other => panic!("{other:?}"),
        }
    }
}
