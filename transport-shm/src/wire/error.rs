//! What can be wrong with bytes read from the socket.

use std::io;

use super::MAX_BODY;

/// What was wrong with bytes read from the socket.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// A kind byte no frame has.
    #[error("unknown frame kind {0:#04x}")]
    UnknownKind(u8),
    /// A body longer than [`MAX_BODY`] (a cluster-secret exchange sent to a node without a
    /// secret reads this way too).
    #[error("frame body of {0} bytes is longer than {MAX_BODY}")]
    TooLong(usize),
    /// A body cut short, or with bytes after its end.
    #[error("malformed {kind} frame: {why}")]
    Malformed {
        /// The frame's kind.
        kind: &'static str,
        /// What was wrong.
        why: String,
    },
    /// The stream ended inside a frame.
    #[error("the peer closed the connection inside a frame")]
    Truncated,
    /// The socket failed (or its read timed out: [`WireError::is_timeout`]).
    #[error("socket: {message}")]
    Io {
        /// What kind of failure.
        kind: io::ErrorKind,
        /// The operating system's words.
        message: String,
    },
}

impl WireError {
    /// Whether this is a read that woke at the stream's read timeout with nothing.
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            Self::Io {
                kind: io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut,
                ..
            }
        )
    }
}
