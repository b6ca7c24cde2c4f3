//! What every method that moves bytes shares: its requests, built from Mooncake's arguments
//! (one transfer, or three lists of a batch), the checks before they go, and the shape of the
//! method itself, which `moving_methods!` writes out once for all of them.

use std::fmt;
use std::sync::Arc;

use pyo3::prelude::*;
use tern_engine::{Opcode, SegmentId, TransferRequest};

use super::{Initialized, MooncakeEngine};
use crate::descriptors;
use crate::errors::log_failure;

/// A call's requests, their `target` set once the segment is open; or why the call fails.
pub(super) type Requests = Result<Vec<TransferRequest>, String>;

/// `TransferOpcode`'s values.
pub(super) fn opcode_of(value: i64) -> Result<Opcode, String> {
    match value {
        0 => Ok(Opcode::Read),
        1 => Ok(Opcode::Write),
        _ => Err(format!("opcode {value} is neither Read (0) nor Write (1)")),
    }
}

fn request(opcode: Opcode, buffer: u64, peer_buffer_address: u64, length: u64) -> TransferRequest {
    TransferRequest {
        opcode,
        source: buffer as usize,
        target: SegmentId::LOCAL,
        target_offset: peer_buffer_address,
        length: length as usize,
    }
}

/// One request, for the single-transfer methods.
pub(super) fn one(
    opcode: Result<Opcode, String>,
    buffer: u64,
    peer_buffer_address: u64,
    length: u64,
) -> PyResult<Requests> {
    Ok(opcode.map(|opcode| vec![request(opcode, buffer, peer_buffer_address, length)]))
}

/// A batch's three arguments (lists of int, or buffers of uint64) as requests, read in
/// place. A wrong type raises, as it would for a typed argument; a bad opcode (then the
/// lists are not read) or arguments of different lengths fail the call instead.
pub(super) fn batch(
    opcode: Result<Opcode, String>,
    buffers: &Bound<'_, PyAny>,
    peer_buffer_addresses: &Bound<'_, PyAny>,
    lengths: &Bound<'_, PyAny>,
) -> PyResult<Requests> {
    let opcode = match opcode {
        Ok(opcode) => opcode,
        Err(reason) => return Ok(Err(reason)),
    };
    descriptors::requests(
        request(opcode, 0, 0, 0),
        ["buffers", "peer addresses", "lengths"],
        [buffers, peer_buffer_addresses, lengths],
    )
}

/// `TransferNotify`'s two strings.
pub(super) fn notify_parts(notify: &Bound<'_, PyAny>) -> Result<(String, String), String> {
    let part = |attr: &str| -> Result<String, String> {
        notify
            .getattr(attr)
            .and_then(|v| v.extract::<String>())
            .map_err(|_| format!("notify.{attr} must be a str"))
    };
    Ok((part("name")?, part("msg")?))
}

/// A call of a method that moves bytes, as the method hands it to its end.
pub(super) struct Call<'a> {
    /// The Python method's name, for log lines and errors.
    pub(super) method: &'a str,
    /// `target_hostname`.
    pub(super) target: Option<String>,
    pub(super) requests: Requests,
}

/// A call that may go: the running engine, the target's name and the requests.
pub(super) struct Checked<'a> {
    pub(super) method: &'a str,
    pub(super) state: Arc<Initialized>,
    pub(super) target: String,
    pub(super) requests: Vec<TransferRequest>,
}

impl Checked<'_> {
    /// Logs why the call failed after it went.
    pub(super) fn log_failure(&self, py: Python<'_>, failure: impl fmt::Display) {
        log_failure(
            py,
            &format!("{} to {}: {failure}", self.method, self.target),
        );
    }
}

impl MooncakeEngine {
    /// The checks of a call that returns a code: the engine is initialized, there is a
    /// target, the requests were built. `None` (the reason logged) when one fails.
    pub(super) fn checked<'a>(&self, py: Python<'_>, call: Call<'a>) -> Option<Checked<'a>> {
        let Call {
            method,
            target,
            requests,
        } = call;
        let state = self.ready(py, method)?;
        let Some(target) = target else {
            log_failure(py, &format!("{method}: target_hostname is None"));
            return None;
        };
        match requests {
            Ok(requests) => Some(Checked {
                method,
                state,
                target,
                requests,
            }),
            Err(reason) => {
                log_failure(py, &format!("{method} to {target}: {reason}"));
                None
            }
        }
    }
}

/// Writes out methods that move bytes, each a Python method with Mooncake's positional
/// arguments (`target_hostname`, the three of one transfer or of a batch, what the method
/// adds, and the ignored `transport_hint`) in a `#[pymethods]` block of its own:
///
/// ```text
/// /// Docstring.
/// fn NAME(BUFFER, PEER, LENGTH: TYPE, EXTRA: TYPE = DEFAULT, ...) -> RETURNS
///     = END(BUILD(OPCODE), PASSED, ...);
/// ```
///
/// The method builds its requests with `BUILD` ([`one`] or [`batch`]) and hands them as a
/// [`Call`], with the `PASSED` extras, to the `MooncakeEngine` method `END` (which waits,
/// submits or orders them on a stream), whose value it returns.
macro_rules! moving_methods {
    ($(
        $(#[doc = $doc:literal])*
        fn $name:ident(
            $buffer:ident, $peer:ident, $length:ident: $arg:ty
            $(, $extra:ident: $extra_ty:ty $(= $default:tt)?)* $(,)?
        ) -> $ret:ty = $end:ident($build:ident($opcode:expr) $(, $pass:ident)*);
    )*) => {
        #[::pyo3::pymethods]
        impl $crate::mooncake::MooncakeEngine {$(
            $(#[doc = $doc])*
            #[pyo3(signature = (
                target_hostname, $buffer, $peer, $length,
                $($extra $(= $default)?,)* transport_hint = None
            ))]
            #[allow(clippy::too_many_arguments)]
            fn $name(
                &self,
                py: ::pyo3::Python<'_>,
                target_hostname: ::std::option::Option<::std::string::String>,
                $buffer: $arg,
                $peer: $arg,
                $length: $arg,
                $($extra: $extra_ty,)*
                transport_hint: ::std::option::Option<&str>,
            ) -> ::pyo3::PyResult<$ret> {
                let _ = transport_hint;
                let call = $crate::mooncake::moving::Call {
                    method: stringify!($name),
                    target: target_hostname,
                    requests: $build($opcode, $buffer, $peer, $length)?,
                };
                self.$end(py, call $(, $pass)*)
            }
        )*}
    };
}
