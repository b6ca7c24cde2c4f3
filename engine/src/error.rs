//! Errors of the engine API, and why a task failed.

use std::io;

use tern_memreg::MemoryError;
use tern_metadata::MetadataError;

use crate::types::SegmentId;

/// An engine call that failed. Nothing was changed when a call returns an error, unless the
/// variant says otherwise.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// An argument was invalid (empty name, zero length, zero capacity ...); the message says
    /// which.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Device memory cannot be used: no CUDA driver on this host, or a driver call failed.
    #[error("device memory at {addr:#x}: {source}")]
    Device {
        /// Start of the memory.
        addr: usize,
        /// What the driver said, or that there is none.
        source: tern_cuda::CudaError,
    },
    /// More requests were submitted than the batch was allocated for; allocate a larger batch
    /// or submit into another.
    #[error(
        "batch of capacity {capacity} has room for {room} more request(s), {requested} submitted"
    )]
    TooManyRequests {
        /// The batch's capacity.
        capacity: usize,
        /// Free slots left before this call.
        room: usize,
        /// Requests in this call.
        requested: usize,
    },
    /// The address is not the start of a registered region (unregister) or not inside one.
    #[error("address {addr:#x} is not registered")]
    AddressNotRegistered {
        /// Address given.
        addr: usize,
    },
    /// The new region overlaps a registered one; unregister that first.
    #[error("memory [{addr:#x}, +{len}) overlaps the registered region at {existing:#x}")]
    AddressOverlapped {
        /// Start given.
        addr: usize,
        /// Length given.
        len: usize,
        /// The region it overlaps.
        existing: usize,
    },
    /// The region is used by transfers in flight; wait for (or cancel and wait for) them.
    #[error("memory region at {addr:#x} is in use by {pins} transfer(s) in flight")]
    RegionInUse {
        /// Region start.
        addr: usize,
        /// Transfers holding it.
        pins: usize,
    },
    /// The batch still has tasks in flight; wait for them or cancel it first.
    #[error("batch has {pending} task(s) still in flight")]
    BatchBusy {
        /// Tasks not finished.
        pending: usize,
    },
    /// The batch was freed; allocate a new one.
    #[error("batch was freed")]
    BatchFreed,
    /// The segment ID is not open in this engine.
    #[error("segment {0} is not open")]
    UnknownSegment(SegmentId),
    /// A transport could not be started, or failed to register or allocate memory.
    #[error("{protocol} transport: {source}")]
    Transport {
        /// The transport's protocol.
        protocol: &'static str,
        /// What failed.
        source: crate::transport::TransportError,
    },
    /// The metadata store or a peer's handshake RPC failed.
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// A socket could not be set up (bind, address lookup).
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        source: io::Error,
    },
    /// A transfer finished without success (only from the synchronous helpers).
    #[error("transfer {status}")]
    TransferFailed {
        /// How it ended.
        status: crate::TransferStatus,
    },
}

impl EngineError {
    /// Mooncake's numeric error code for this error (`ERR_*` in `error.h`), for C and Python
    /// faces that speak those codes.
    pub fn mooncake_code(&self) -> i32 {
        match self {
            Self::InvalidArgument(_) | Self::BatchFreed | Self::UnknownSegment(_) => -1,
            Self::Device { .. } => -1,
            Self::RegionInUse { .. } => -1,
            Self::TooManyRequests { .. } => -2,
            Self::AddressNotRegistered { .. } => -3,
            Self::BatchBusy { .. } => -4,
            Self::AddressOverlapped { .. } => -7,
            Self::Metadata(MetadataError::Rpc(_)) => -102,
            Self::Metadata(MetadataError::Descriptor { .. }) => -103,
            Self::Metadata(_) => -200,
            Self::Transport { .. } => -201,
            Self::Io { .. } => -102,
            Self::TransferFailed { .. } => -800,
        }
    }
}

impl From<MemoryError> for EngineError {
    fn from(error: MemoryError) -> Self {
        match error {
            MemoryError::ZeroLength { addr } => {
                Self::InvalidArgument(format!("zero-length memory region at {addr:#x}"))
            }
            MemoryError::Overflow { addr, len } => Self::InvalidArgument(format!(
                "memory at {addr:#x} with length {len} overflows the address space"
            )),
            MemoryError::Overlap {
                addr,
                len,
                existing,
            } => Self::AddressOverlapped {
                addr,
                len,
                existing,
            },
            MemoryError::InUse { addr, pins } => Self::RegionInUse { addr, pins },
            MemoryError::NotRegistered { addr, .. } => Self::AddressNotRegistered { addr },
            MemoryError::Device { addr, reason } => Self::Device {
                addr,
                source: reason,
            },
            other => Self::InvalidArgument(other.to_string()),
        }
    }
}

/// Why one task failed. Carried in [`crate::TransferStatus::Failed`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The request had length zero.
    #[error("zero-length request")]
    ZeroLength,
    /// The source range is not inside one registered local region.
    #[error("source [{addr:#x}, +{len}) is not inside one registered region")]
    SourceNotRegistered {
        /// Source address.
        addr: usize,
        /// Length.
        len: usize,
    },
    /// The target segment is not open.
    #[error("segment {0} is not open")]
    UnknownSegment(SegmentId),
    /// The segment was open, but its node withdrew it (shut down, or its lease expired after
    /// it died). It becomes usable again if the node publishes it again.
    #[error("segment {0:?} vanished from the metadata store")]
    SegmentVanished(String),
    /// The target range is not inside one buffer of the target's descriptor.
    #[error("target [{addr:#x}, +{len}) is not inside one buffer of segment {segment:?}")]
    TargetOutOfRange {
        /// Segment name.
        segment: String,
        /// Remote address.
        addr: u64,
        /// Length.
        len: usize,
    },
    /// No installed transport speaks any protocol of the target segment.
    #[error("no installed transport speaks {protocols:?} of segment {segment:?}")]
    NoCommonTransport {
        /// Segment name.
        segment: String,
        /// Its protocols.
        protocols: Vec<String>,
    },
    /// The request is longer than one task may be (1 TiB); split it.
    #[error("a request of {len} bytes is longer than the {max} a task may move")]
    TooLarge {
        /// Its length.
        len: usize,
        /// The most a task may move.
        max: u64,
    },
    /// Every transport that reaches the peer declined the slice (memory it cannot reach, a
    /// path it cannot open); `reason` is the last one's.
    #[error("no transport could carry a slice to {segment}: {reason}")]
    Declined {
        /// Segment name.
        segment: String,
        /// Why the last transport declined.
        reason: String,
    },
    /// The peer refused the range (not registered or not remote-accessible there).
    #[error("{peer} rejected [{addr:#x}, +{len})")]
    RemoteRejected {
        /// Peer data endpoint.
        peer: String,
        /// Remote address.
        addr: u64,
        /// Length.
        len: usize,
    },
    /// The peer could not be reached, or the connection broke mid-transfer.
    #[error("connection to {peer} failed: {message}")]
    Connection {
        /// Peer data endpoint.
        peer: String,
        /// What happened.
        message: String,
    },
    /// The peer spoke the data protocol wrongly.
    #[error("protocol error with {peer}: {message}")]
    Protocol {
        /// Peer data endpoint.
        peer: String,
        /// What was wrong.
        message: String,
    },
    /// A transport dropped the work without finishing it (it was shutting down).
    #[error("transport dropped the transfer: {0}")]
    Dropped(String),
}
