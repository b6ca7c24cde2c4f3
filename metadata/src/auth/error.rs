//! Why an exchange failed, or a secret could not be had.

use std::io;
use std::path::PathBuf;

use super::{CLUSTER_SECRET_ENV, CLUSTER_SECRET_FILE_ENV, Channel, FrameKind, VERSION};

/// Why an exchange failed, or a secret could not be had.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// The secret given (or found in the environment or file) is empty; give at least one
    /// byte — 32 random bytes, e.g. `openssl rand -hex 32`, is what it should be.
    #[error("the cluster secret is empty")]
    EmptySecret,
    /// Both `TERN_CLUSTER_SECRET` and `TERN_CLUSTER_SECRET_FILE` are set; unset one.
    #[error("both {CLUSTER_SECRET_ENV} and {CLUSTER_SECRET_FILE_ENV} are set; set one")]
    TwoSecrets,
    /// The secret file could not be read; check the path and its permissions.
    #[error("reading the cluster secret from {path:?}: {source}")]
    SecretFile {
        /// The file.
        path: PathBuf,
        /// Why it could not be read.
        source: io::Error,
    },
    /// The operating system gave no random bytes for a nonce; nothing was sent.
    #[error("no random bytes from the operating system: {0}")]
    Random(String),
    /// The bytes do not start with `TERNAUTH`: the peer speaks plain Mooncake (it has no
    /// cluster secret, or is a Mooncake node), or is not a Tern node at all.
    #[error(
        "the peer sent a plain frame, not a Tern authentication frame (no cluster secret there?)"
    )]
    NotAuthFrame,
    /// A frame of the wrong length (cut short, or with bytes after its end).
    #[error("authentication frame of {got} bytes, expected {expected}")]
    BadLength {
        /// Bytes the frame must have.
        expected: usize,
        /// Bytes it had.
        got: usize,
    },
    /// The peer speaks another version of the exchange; upgrade the older node.
    #[error("authentication version {0} is not spoken here (this node speaks {VERSION})")]
    UnsupportedVersion(u8),
    /// The channel byte is none of RPC, TCP data, shared memory.
    #[error("unknown authentication channel {0}")]
    UnknownChannel(u8),
    /// The kind byte is none of Hello, Challenge, Proof.
    #[error("unknown authentication frame kind {0:#04x}")]
    UnknownKind(u8),
    /// Bytes that must be zero are not: not a frame this version writes.
    #[error("reserved bytes of an authentication frame are not zero")]
    ReservedNotZero,
    /// A Hello's strings are not UTF-8.
    #[error("an authentication hello whose names are not UTF-8")]
    BadClaim,
    /// The client wants another segment than this node's: its metadata points it at the wrong
    /// node (a stale or forged entry, or a relay). Check the metadata store.
    #[error("the peer wants segment {wanted:?}, but this is {here:?}")]
    NotThisSegment {
        /// The segment the client asked for.
        wanted: String,
        /// This node's segment.
        here: String,
    },
    /// The client dialed another endpoint than the one this node advertises: something
    /// between them forwards the connection (a relay, or address translation). Make the
    /// advertised address (`MC_TCP_BIND_ADDRESS`) the one peers dial.
    #[error("the peer dialed {dialed}, but this node is {here}")]
    NotThisEndpoint {
        /// The endpoint the client dialed.
        dialed: String,
        /// This node's advertised endpoint.
        here: String,
    },
    /// A well-formed frame arrived out of turn.
    #[error("expected an authentication {expected:?}, got a {got:?}")]
    UnexpectedFrame {
        /// What this side waited for.
        expected: FrameKind,
        /// What came.
        got: FrameKind,
    },
    /// A frame for another kind of connection (an RPC frame on a data connection or back).
    #[error("authentication frame for the {got:?} channel on a {expected:?} connection")]
    WrongChannel {
        /// This connection's channel.
        expected: Channel,
        /// The frame's.
        got: Channel,
    },
    /// The peer's MAC does not match: it has another cluster secret (or none), or replays a
    /// recorded exchange. Give both nodes the same secret.
    #[error(
        "the peer's proof does not match this node's cluster secret (another secret, or a replay)"
    )]
    BadProof,
    /// The peer closed the connection while this side waited for a frame. A node without a
    /// secret closes right after a Hello; one with another secret closes after the Challenge.
    #[error("{}", closed_reason(*waiting_for, *received))]
    PeerClosed {
        /// The frame this side waited for.
        waiting_for: FrameKind,
        /// Bytes of it that had arrived.
        received: usize,
    },
    /// The peer sent nothing (or not all of a frame) in time.
    #[error("the peer did not send its authentication {waiting_for:?} in time")]
    Timeout {
        /// The frame this side waited for.
        waiting_for: FrameKind,
    },
    /// The socket failed.
    #[error("authentication I/O: {0}")]
    Io(io::Error),
}

fn closed_reason(waiting_for: FrameKind, received: usize) -> String {
    match (waiting_for, received) {
        (FrameKind::Challenge, 0) => "the peer closed the connection instead of answering our \
            authentication hello: it runs without a cluster secret (a plain Mooncake or Tern \
            node), or refused us"
            .to_owned(),
        (FrameKind::Proof, 0) => "the peer closed the connection before proving it knows the \
            cluster secret (a peer with another secret refuses our challenge this way)"
            .to_owned(),
        (kind, received) => format!(
            "the peer closed the connection after {received} of the {} bytes of its \
             authentication {kind:?}",
            kind.frame_len()
        ),
    }
}

impl AuthError {
    /// Whether the peer connected and closed without sending a byte: a port probe or a
    /// listener's own wake-up, nothing to refuse or log.
    pub fn is_silent_close(&self) -> bool {
        matches!(
            self,
            Self::PeerClosed {
                waiting_for: FrameKind::Hello,
                received: 0
            }
        )
    }
}
