//! Why shared memory could not be made, adopted or used.

use std::io;

/// Why shared memory could not be made, adopted or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// A system call failed; the message names it and the operating system's reason.
    #[error("{call}: {source}")]
    Os {
        /// The call.
        call: &'static str,
        /// Its error.
        source: io::Error,
    },
    /// A memfd of zero bytes, or a name with a NUL byte, was asked for.
    #[error("invalid shared memory request: {0}")]
    Invalid(String),
    /// A file descriptor received from a peer is not a memfd sealed against shrinking (a
    /// pipe, a socket, a regular file, an unsealed memfd): mapping it could fault (SIGBUS)
    /// once the peer truncated it, so it is refused.
    #[error("the file descriptor is not a memfd sealed against shrinking: {0}")]
    NotSealedMemfd(String),
    /// A memfd received from a peer is smaller than the buffer it is said to hold.
    #[error("the memfd holds {size} bytes, fewer than the {needed} claimed")]
    TooSmall {
        /// Its size.
        size: u64,
        /// The bytes it was said to hold.
        needed: u64,
    },
    /// The process named is this process itself, or has no number here (another PID
    /// namespace): cross-memory attach into it is refused.
    #[error("cross-memory attach into process {0} is refused: it is this process or unknown")]
    NotAPeer(i32),
}

pub(super) fn os(call: &'static str) -> ShmError {
    ShmError::Os {
        call,
        source: io::Error::last_os_error(),
    }
}
