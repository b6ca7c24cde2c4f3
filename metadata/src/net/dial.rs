//! The one way Tern opens a connection to a peer.

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::auth::{self, AuthError, Channel, Claims, ClusterSecret};

/// Why dialing a peer failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DialError {
    /// The name did not resolve.
    #[error("cannot resolve: {0}")]
    Dns(io::Error),
    /// No address accepted the connection in time.
    #[error("connect: {0}")]
    Connect(io::Error),
    /// The connection could not be set up.
    #[error("setting up the connection: {0}")]
    Setup(io::Error),
    /// The cluster-secret exchange failed.
    #[error("authentication failed: {0}")]
    Auth(AuthError),
}

/// How to reach a peer.
#[derive(Debug, Clone, Copy)]
pub struct Dial<'a> {
    /// `host:port`.
    pub endpoint: &'a str,
    /// Bound on connecting, authentication included.
    pub connect_timeout: Duration,
    /// With a secret: the channel, this node's segment, and the segment wanted there (empty
    /// when any will do). The endpoint bound is the address actually connected.
    pub auth: Option<DialAuth<'a>>,
}

/// The cluster-secret part of a [`Dial`].
#[derive(Debug, Clone, Copy)]
pub struct DialAuth<'a> {
    /// The secret.
    pub secret: &'a ClusterSecret,
    /// Which kind of connection.
    pub channel: Channel,
    /// This node's segment name.
    pub client_segment: &'a str,
    /// The segment wanted at the endpoint.
    pub server_segment: &'a str,
}

/// Connects to `dial.endpoint` (each resolved address in turn), turns Nagle off, runs the
/// cluster-secret exchange if asked to (bounded by the connect timeout), and leaves reads
/// bounded by `io_timeout`: the one way Tern opens a connection to a peer.
pub fn dial(dial: &Dial<'_>, io_timeout: Duration) -> Result<TcpStream, DialError> {
    let addrs: Vec<SocketAddr> = dial
        .endpoint
        .to_socket_addrs()
        .map_err(DialError::Dns)?
        .collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    for addr in addrs {
        let mut stream = match TcpStream::connect_timeout(&addr, dial.connect_timeout) {
            Ok(stream) => stream,
            Err(e) => {
                last = e;
                continue;
            }
        };
        stream.set_nodelay(true).map_err(DialError::Setup)?;
        if let Some(auth) = dial.auth {
            let bound = Some(dial.connect_timeout.min(io_timeout));
            stream
                .set_read_timeout(bound)
                .and_then(|()| stream.set_write_timeout(bound))
                .map_err(DialError::Setup)?;
            let claims = Claims {
                client_segment: auth.client_segment.to_owned(),
                server_segment: auth.server_segment.to_owned(),
                dialed: addr.to_string(),
            };
            auth::client_handshake(&mut stream, auth.secret, auth.channel, claims)
                .map_err(DialError::Auth)?;
        }
        stream
            .set_read_timeout(Some(io_timeout))
            .and_then(|()| stream.set_write_timeout(Some(io_timeout)))
            .map_err(DialError::Setup)?;
        return Ok(stream);
    }
    Err(DialError::Connect(last))
}
