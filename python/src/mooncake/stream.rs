//! Transfers ordered on a CUDA stream (`transfer_*_on_cuda`): each returns at once with a
//! [`StreamTransfer`], and a failure to start is a `RuntimeError`, as in Mooncake. The
//! ordering itself is in [`crate::on_stream`].

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use tern_engine::Opcode;

use super::MooncakeEngine;
use super::moving::{Call, batch, one};
use crate::on_stream::{self, StreamTransfer};

impl MooncakeEngine {
    /// Orders requests on CUDA stream `stream_ptr`: the end of the methods below.
    fn on_cuda(&self, py: Python<'_>, call: Call<'_>, stream_ptr: u64) -> PyResult<StreamTransfer> {
        let Call {
            method,
            target,
            requests,
        } = call;
        let refuse = |reason: String| PyRuntimeError::new_err(format!("{method}: {reason}"));
        let state = self
            .ready(py, method)
            .ok_or_else(|| refuse("called before initialize".into()))?;
        let target = target.ok_or_else(|| refuse("target_hostname is None".into()))?;
        let requests = requests.map_err(refuse)?;
        on_stream::submit(py, &state.core, &target, requests, stream_ptr)
    }
}

moving_methods! {
    /// A write ordered on CUDA stream `stream_ptr` (0: the current context's default
    /// stream): it starts after the work enqueued there before it, and the work enqueued
    /// after it waits for it. Returns at once with a `StreamTransfer` (Mooncake returns
    /// `None`); a failure is raised by its `wait()`, never by ending the process.
    fn transfer_write_on_cuda(
        buffer, peer_buffer_address, length: u64, stream_ptr: u64 = 0,
    ) -> StreamTransfer = on_cuda(one(Ok(Opcode::Write)), stream_ptr);

    /// A read ordered on CUDA stream `stream_ptr`, as `transfer_write_on_cuda`.
    fn transfer_read_on_cuda(
        buffer, peer_buffer_address, length: u64, stream_ptr: u64 = 0,
    ) -> StreamTransfer = on_cuda(one(Ok(Opcode::Read)), stream_ptr);

    /// A batch of writes ordered on CUDA stream `stream_ptr`, as `transfer_write_on_cuda`.
    fn batch_transfer_write_on_cuda(
        buffers, peer_buffer_addresses, lengths: &Bound<'_, PyAny>, stream_ptr: u64 = 0,
    ) -> StreamTransfer = on_cuda(batch(Ok(Opcode::Write)), stream_ptr);

    /// A batch of reads ordered on CUDA stream `stream_ptr`, as `transfer_write_on_cuda`.
    fn batch_transfer_read_on_cuda(
        buffers, peer_buffer_addresses, lengths: &Bound<'_, PyAny>, stream_ptr: u64 = 0,
    ) -> StreamTransfer = on_cuda(batch(Ok(Opcode::Read)), stream_ptr);
}
