//! Why the transport could not start.

use tern_engine::TransportError;

use crate::PROTOCOL;
use crate::config::PtracePolicy;

/// Why the transport could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// `/proc` did not tell the boot ID, network namespace or host name.
    #[error("reading this host's identity from /proc: {0}")]
    Identity(std::io::Error),
    /// The abstract socket could not be bound.
    #[error("binding the shared-memory socket {socket:?}: {source}")]
    Bind {
        /// Its name.
        socket: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A copy thread could not be started (the process is out of threads or memory).
    #[error("starting a copy thread: {0}")]
    Thread(std::io::Error),
    /// The ptrace setting asked for could not be applied.
    #[error("applying {policy:?}: {source}")]
    Ptrace {
        /// What was asked.
        policy: PtracePolicy,
        /// The operating system's error.
        source: std::io::Error,
    },
}

impl From<ShmError> for TransportError {
    fn from(e: ShmError) -> Self {
        TransportError::Device {
            device: PROTOCOL.into(),
            message: e.to_string(),
        }
    }
}
