//! Engine errors as Python sees them: one log line on Python's `logging` (logger `tern`) for
//! the drop-in's integer codes, and typed exceptions (`tern.TransferError` and its
//! subclasses, defined in `tern/_errors.py`) for the Pythonic API.

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyModule};
use tern_engine::{EngineError, TransferError, TransferStatus};
use tern_metadata::MetadataError;

use crate::core::Failure;

static LOGGER: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
static ERRORS: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// Logs one warning line on the `tern` logger. A broken logging setup must not turn a
/// failure code into an exception, so errors of logging itself are printed and dropped.
pub(crate) fn log_failure(py: Python<'_>, message: &str) {
    let logged = LOGGER
        .get_or_try_init(py, || {
            py.import("logging")?
                .call_method1("getLogger", ("tern",))
                .map(Bound::unbind)
        })
        .and_then(|logger| logger.bind(py).call_method1("warning", ("%s", message)));
    if let Err(e) = logged {
        e.print(py);
    }
}

/// The Python class for an engine error, by name in `tern._errors`.
fn class_for(error: &EngineError) -> &'static str {
    match error {
        EngineError::InvalidArgument(_) | EngineError::Device { .. } => "InvalidArgument",
        EngineError::TooManyRequests { .. } => "TooManyRequests",
        EngineError::AddressNotRegistered { .. } => "AddressNotRegistered",
        EngineError::AddressOverlapped { .. } => "AddressOverlapped",
        EngineError::RegionInUse { .. } => "RegionInUse",
        EngineError::BatchBusy { .. } => "BatchBusy",
        EngineError::BatchFreed => "BatchFreed",
        EngineError::UnknownSegment(_) => "UnknownSegment",
        EngineError::Metadata(MetadataError::Rpc(_)) => "ConnectionFailed",
        EngineError::Metadata(MetadataError::SegmentNotFound(_)) => "UnknownSegment",
        EngineError::Metadata(_) => "MetadataError",
        EngineError::TransferFailed { status } => status_class(status),
        _ => "TransportFailed",
    }
}

fn status_class(status: &TransferStatus) -> &'static str {
    match status {
        TransferStatus::Timeout => "TransferTimeout",
        TransferStatus::Canceled => "Canceled",
        TransferStatus::Failed(error) => match error {
            TransferError::ZeroLength => "InvalidArgument",
            TransferError::SourceNotRegistered { .. } => "AddressNotRegistered",
            TransferError::UnknownSegment(_) => "UnknownSegment",
            TransferError::SegmentVanished(_) => "SegmentVanished",
            TransferError::TargetOutOfRange { .. } => "TargetOutOfRange",
            TransferError::NoCommonTransport { .. } => "NoCommonTransport",
            TransferError::RemoteRejected { .. } => "RemoteRejected",
            TransferError::Connection { .. } => "ConnectionFailed",
            TransferError::Protocol { .. } => "ProtocolError",
            _ => "Dropped",
        },
        _ => "TransferError",
    }
}

fn make(py: Python<'_>, class: &str, message: String, task: Option<usize>) -> PyErr {
    let built = (|| -> PyResult<PyErr> {
        let module = ERRORS.get_or_try_init(py, || py.import("tern._errors").map(Bound::unbind))?;
        let cls = module.bind(py).getattr(class)?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("task", task)?;
        Ok(PyErr::from_value(cls.call((message,), Some(&kwargs))?))
    })();
    built.unwrap_or_else(|e| e)
}

/// The typed exception for an engine error.
pub(crate) fn engine_error(py: Python<'_>, error: &EngineError) -> PyErr {
    make(py, class_for(error), error.to_string(), None)
}

/// The typed exception for a failed transfer.
pub(crate) fn failure(py: Python<'_>, failure: &Failure) -> PyErr {
    match failure {
        Failure::Engine(error) => engine_error(py, error),
        Failure::Task { index, status } => {
            make(py, status_class(status), failure.to_string(), Some(*index))
        }
    }
}

/// An `InvalidArgument` with a message.
pub(crate) fn invalid(py: Python<'_>, message: impl Into<String>) -> PyErr {
    make(py, "InvalidArgument", message.into(), None)
}

/// A `TransportFailed` with a message (an engine that cannot start, a waker that cannot be
/// made).
pub(crate) fn transport_failed(py: Python<'_>, message: impl Into<String>) -> PyErr {
    make(py, "TransportFailed", message.into(), None)
}
