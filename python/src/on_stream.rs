//! Transfers ordered on the caller's CUDA stream: the drop-in's `transfer_*_on_cuda`.
//!
//! Mooncake enqueues a host callback that submits, busy-polls and calls `_exit(1)` on a
//! failure. Here the call returns at once with a [`StreamTransfer`]: the transfer starts once
//! the stream's earlier work is done and the stream's later work waits for it on the device
//! (`tern_engine::TransferEngine::submit_on_stream`); no host thread blocks, and a failure is
//! raised by `StreamTransfer.wait()`, logged, and lets the stream go on.

use std::time::Duration;

use pyo3::prelude::*;
use tern_engine::TransferRequest;

use crate::core::Core;
use crate::errors::engine_error;

/// A transfer ordered on a CUDA stream.
#[pyclass(name = "StreamTransfer", module = "tern._tern", frozen)]
pub(crate) struct StreamTransfer {
    inner: tern_engine::StreamTransfer,
}

#[pymethods]
impl StreamTransfer {
    /// Whether it is over (moved or failed).
    fn done(&self) -> bool {
        self.inner.is_done()
    }

    /// Waits until it is over (at most `timeout` seconds; `None`: as long as it takes) and
    /// returns the bytes moved; raises the transfer's error when it failed, `TimeoutError`
    /// when it is still in flight after `timeout`.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<u64> {
        let limit = match timeout {
            Some(t) if t.is_finite() && t >= 0.0 => Duration::from_secs_f64(t),
            Some(t) => return Err(crate::errors::invalid(py, format!("timeout {t}"))),
            None => Duration::from_secs(u64::from(u32::MAX)),
        };
        match py.detach(|| self.inner.wait(limit)) {
            Some(Ok(bytes)) => Ok(bytes),
            Some(Err(error)) => Err(engine_error(py, &error)),
            None => Err(pyo3::exceptions::PyTimeoutError::new_err(
                "the transfer on the stream is still in flight",
            )),
        }
    }
}

/// Orders `requests` to `target` on `stream_ptr`. A failure to start (the segment does not
/// open, the stream or driver refuses) is a `RuntimeError`, as in Mooncake.
pub(crate) fn submit(
    py: Python<'_>,
    core: &Core,
    target: &str,
    mut requests: Vec<TransferRequest>,
    stream_ptr: u64,
) -> PyResult<StreamTransfer> {
    let started = py.detach(|| -> Result<tern_engine::StreamTransfer, String> {
        let engine = &core.engine;
        let segment = engine.open_segment(target).map_err(|e| e.to_string())?;
        let stream = crate::raw::caller_stream(stream_ptr).map_err(|e| e.to_string())?;
        for request in &mut requests {
            request.target = segment;
        }
        engine
            .submit_on_stream(&stream, requests)
            .map_err(|e| e.to_string())
    });
    match started {
        Ok(inner) => Ok(StreamTransfer { inner }),
        Err(reason) => Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
            "ordering a transfer to {target} on CUDA stream {stream_ptr:#x}: {reason}"
        ))),
    }
}
