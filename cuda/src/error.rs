//! What a CUDA call can fail with.

/// A failure of the CUDA driver or of Tern's use of it. Each variant says what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// No CUDA driver could be loaded: this host has no NVIDIA driver (or `TERN_CUDA_DRIVER`
    /// names a library that is not there). Device memory cannot be used here.
    #[error("no CUDA driver: loading {library} failed: {reason}")]
    DriverMissing {
        /// The library tried.
        library: String,
        /// Why the loader refused it.
        reason: String,
    },
    /// The driver library lacks an entry point Tern needs (a driver older than CUDA 11.7).
    #[error("the CUDA driver {library} has no {symbol}: {reason}; a newer driver is needed")]
    SymbolMissing {
        /// The entry point.
        symbol: &'static str,
        /// The library.
        library: String,
        /// The loader's message.
        reason: String,
    },
    /// A driver library was asked for after another one was loaded (or tried).
    #[error("CUDA driver {wanted} asked for, but {loaded:?} was loaded first")]
    DriverChosen {
        /// The library asked for.
        wanted: String,
        /// The library loaded.
        loaded: String,
    },
    /// A driver call failed.
    #[error("{call} failed: {name} ({code})")]
    Call {
        /// The entry point.
        call: &'static str,
        /// The `CUresult`.
        code: i32,
        /// The driver's name for it (`CUDA_ERROR_INVALID_VALUE`, …).
        name: String,
    },
    /// A device ordinal the driver does not have.
    #[error("no CUDA device {ordinal}: the driver sees {count}")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver sees.
        count: usize,
    },
}
