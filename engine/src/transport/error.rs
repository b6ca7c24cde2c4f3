//! [`TransportError`]: a transport's failures outside any one transfer.

/// A transport failure outside any one transfer (start-up, registration, allocation).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// A listener could not be bound or a socket set up; the message names the address.
    #[error("{context}: {message}")]
    Io {
        /// What was being done.
        context: String,
        /// The operating system's error.
        message: String,
    },
    /// A device (NIC, shared-memory socket) could not be opened or used.
    #[error("device {device}: {message}")]
    Device {
        /// Which device.
        device: String,
        /// What failed.
        message: String,
    },
    /// Memory could not be registered with (or allocated by) the transport.
    #[error("memory at {addr:#x} (+{len}): {message}")]
    Memory {
        /// Start of the memory.
        addr: usize,
        /// Its length.
        len: usize,
        /// What failed.
        message: String,
    },
    /// The transport was used out of turn (started twice, used before it started).
    #[error("{0}")]
    State(String),
}
