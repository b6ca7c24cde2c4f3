//! What goes wrong with registered memory.

use crate::map::MapError;

/// What went wrong with registered memory. Each variant names the addresses involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// A region of zero bytes was given; register at least one byte.
    #[error("zero-length memory region at {addr:#x}")]
    ZeroLength {
        /// Start address given.
        addr: usize,
    },
    /// `addr + len` overflows the address space; the range is invalid.
    #[error("memory range at {addr:#x} with length {len} overflows the address space")]
    Overflow {
        /// Start address given.
        addr: usize,
        /// Length given.
        len: usize,
    },
    /// The range overlaps a region that is already registered; unregister that one first
    /// or register a disjoint range.
    #[error("memory [{addr:#x}, +{len}) overlaps the registered region at {existing:#x}")]
    Overlap {
        /// Start address given.
        addr: usize,
        /// Length given.
        len: usize,
        /// Start of the registered region it overlaps.
        existing: usize,
    },
    /// No registered region contains the whole range; register the memory first, or keep
    /// the transfer inside one region.
    #[error("memory [{addr:#x}, +{len}) is not inside one registered region")]
    NotRegistered {
        /// Start address given.
        addr: usize,
        /// Length given.
        len: usize,
    },
    /// The region exists but was registered without remote access, so peers may not touch it.
    #[error("memory region at {addr:#x} is not remote-accessible")]
    NotRemoteAccessible {
        /// Start of the region.
        addr: usize,
    },
    /// The region is still used by transfers in flight; wait for them (or cancel them and
    /// wait) before unregistering.
    #[error("memory region at {addr:#x} is in use by {pins} transfer(s) in flight")]
    InUse {
        /// Start of the region.
        addr: usize,
        /// Transfers still holding it.
        pins: usize,
    },
    /// An access reached outside the pinned region (a bug in the caller's range arithmetic).
    #[error("access [{addr:#x}, +{len}) is outside region [{region_addr:#x}, +{region_len})")]
    OutOfRange {
        /// Start of the access.
        addr: usize,
        /// Length of the access.
        len: usize,
        /// Start of the region.
        region_addr: usize,
        /// Length of the region.
        region_len: usize,
    },
    /// The CPU was asked to touch device memory, which only the driver's copies may reach (a
    /// transport that cannot stage device memory declines it).
    #[error("[{addr:#x}, +{len}) is device memory, which the CPU does not touch")]
    DeviceMemory {
        /// Start of the access.
        addr: usize,
        /// Length of the access.
        len: usize,
    },
    /// Device memory could not be used: no CUDA driver, or a driver call failed.
    #[error("device memory at {addr:#x}: {reason}")]
    Device {
        /// Start of the memory.
        addr: usize,
        /// What the driver said (or that there is none).
        reason: tern_cuda::CudaError,
    },
    /// The location a region was registered with is not where its memory is.
    #[error(
        "memory at {addr:#x} was registered as {location} but is {found}; register it with its own location or `*`"
    )]
    LocationMismatch {
        /// Start of the memory.
        addr: usize,
        /// The location given.
        location: String,
        /// What the memory is.
        found: String,
    },
}

impl From<MapError> for MemoryError {
    fn from(error: MapError) -> Self {
        match error {
            MapError::ZeroLength { start } => Self::ZeroLength { addr: start },
            MapError::Overflow { start, len } => Self::Overflow { addr: start, len },
            MapError::Overlap {
                start,
                len,
                existing,
            } => Self::Overlap {
                addr: start,
                len,
                existing,
            },
        }
    }
}
