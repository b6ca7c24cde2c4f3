//! Managed buffers (memory the engine allocates, registers and owns) and the copies into
//! and out of registered or managed memory by address, which go through a pin of the region
//! ([`crate::raw::LocalMemory`]).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::MooncakeEngine;
use crate::errors::log_failure;

/// Copies at least this long run without the GIL.
const COPY_WITHOUT_GIL: usize = 64 << 10;

/// Runs a copy of `len` bytes: without the GIL when it is long, with it when releasing
/// would cost more than the copy.
fn copy<T: Send>(py: Python<'_>, len: usize, copy: impl Send + FnOnce() -> T) -> T {
    if len >= COPY_WITHOUT_GIL {
        py.detach(copy)
    } else {
        copy()
    }
}

#[pymethods]
impl MooncakeEngine {
    /// Allocates and registers `length` bytes owned by the engine: their address, or 0.
    fn allocate_managed_buffer(&self, py: Python<'_>, length: u64) -> u64 {
        let Some(state) = self.ready(py, "allocate_managed_buffer") else {
            return 0;
        };
        match py.detach(|| state.memory.allocate(&state.core.engine, length as usize)) {
            Ok(addr) => addr as u64,
            Err(e) => {
                log_failure(py, &format!("allocate_managed_buffer({length}): {e}"));
                0
            }
        }
    }

    /// Frees a managed buffer: 0, or -1 for an address that is not one (logged).
    fn free_managed_buffer(&self, py: Python<'_>, buffer_addr: u64, length: u64) -> i32 {
        self.coded(py, "free_managed_buffer", |state| {
            state.memory.free(buffer_addr as usize, length as usize)
        })
    }

    /// Copies `length` bytes of `src` to `dest_address`, inside registered or managed
    /// memory: 0, or -1.
    fn write_bytes_to_buffer(
        &self,
        py: Python<'_>,
        dest_address: u64,
        src: &Bound<'_, PyBytes>,
        length: u64,
    ) -> i32 {
        let Some(state) = self.ready(py, "write_bytes_to_buffer") else {
            return -1;
        };
        let data = src.as_bytes();
        let Some(data) = data.get(..length as usize) else {
            log_failure(
                py,
                &format!(
                    "write_bytes_to_buffer: length {length} is more than the {} bytes given",
                    data.len()
                ),
            );
            return -1;
        };
        let written = copy(py, data.len(), || {
            state
                .memory
                .write(&state.core.engine, dest_address as usize, data)
        });
        match written {
            Ok(()) => 0,
            Err(e) => {
                log_failure(py, &format!("write_bytes_to_buffer: {e}"));
                -1
            }
        }
    }

    /// Copies `length` bytes at `source_address` (registered or managed memory) out; raises
    /// ValueError where Mooncake would read arbitrary memory.
    fn read_bytes_from_buffer<'py>(
        &self,
        py: Python<'py>,
        source_address: u64,
        length: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let Some(state) = self.ready(py, "read_bytes_from_buffer") else {
            return Err(PyValueError::new_err(
                "read_bytes_from_buffer: called before initialize",
            ));
        };
        let mut out = vec![0u8; length as usize];
        let read = copy(py, out.len(), || {
            state
                .memory
                .read(&state.core.engine, source_address as usize, &mut out)
        });
        match read {
            Ok(()) => Ok(PyBytes::new(py, &out)),
            Err(e) => {
                log_failure(py, &format!("read_bytes_from_buffer: {e}"));
                Err(PyValueError::new_err(format!(
                    "read_bytes_from_buffer: {e}"
                )))
            }
        }
    }
}
