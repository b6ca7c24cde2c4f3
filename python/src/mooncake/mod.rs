//! `tern.mooncake.TransferEngine`: Mooncake's `mooncake.engine.TransferEngine`, method for
//! method, with Mooncake's positional arguments, defaults and integer return codes. The
//! Python subclass in `tern/mooncake.py` adds `TransferOpcode`, `TransferNotify` and
//! `get_engine`.
//!
//! Where Mooncake dereferences null or bogus pointers (a call before `initialize`, an
//! unknown batch id, lists of different lengths, `None` for a string), this returns the
//! method's failure code and logs one line with the reason. Every call that registers,
//! moves bytes or waits releases the GIL; waits sleep.
//!
//! The methods, one file per idea, each with its own `#[pymethods]` block:
//! - [`setup`]: the constructor, `initialize`, and what the running engine tells about itself;
//! - [`registration`]: registering and unregistering memory the caller owns;
//! - [`buffers`]: managed buffers and the copies into and out of registered memory;
//! - [`moving`]: what every method that moves bytes shares (its requests, its shape);
//! - [`sync`]: transfers that wait, single or in batches;
//! - [`batches`]: batches submitted without waiting, and their status;
//! - [`stream`]: transfers ordered on a CUDA stream;
//! - [`peers`]: probes, segments' buffers and notifications.

#[macro_use]
mod moving;
mod batches;
mod buffers;
mod peers;
mod registration;
mod setup;
mod stream;
mod sync;

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::prelude::*;
use tern_engine::{Batch, EngineError, SegmentId};

use crate::core::Core;
use crate::errors::log_failure;
use crate::raw::LocalMemory;

pub(crate) use setup::local_topology;

/// A batch handed out by id (`batch_transfer_async*`, `transfer_submit_write`).
struct AsyncBatch {
    /// `None` for an empty batch, complete from the start.
    batch: Option<Batch>,
    segment: SegmentId,
}

/// Everything `initialize` makes.
struct Initialized {
    batches: Mutex<HashMap<u64, AsyncBatch>>,
    next_batch: AtomicU64,
    memory: LocalMemory,
    core: Core,
}

/// Mooncake's transfer engine, for `tern.mooncake`.
#[pyclass(name = "MooncakeEngine", module = "tern._tern", subclass, frozen)]
pub(crate) struct MooncakeEngine {
    state: OnceLock<Arc<Initialized>>,
    init: Mutex<()>,
    timeout: Duration,
}

impl MooncakeEngine {
    /// The running engine, or `None` (logged) before `initialize`.
    fn ready(&self, py: Python<'_>, method: &str) -> Option<Arc<Initialized>> {
        let state = self.state.get().cloned();
        if state.is_none() {
            log_failure(py, &format!("{method}: called before initialize"));
        }
        state
    }
}

impl MooncakeEngine {
    /// Runs `call` on the running engine without the GIL: 0, or the error's negative
    /// Mooncake code, the error logged as `method: error`; -1 before `initialize`.
    fn coded(
        &self,
        py: Python<'_>,
        method: &str,
        call: impl Send + FnOnce(&Initialized) -> Result<(), EngineError>,
    ) -> i32 {
        let Some(state) = self.ready(py, method) else {
            return -1;
        };
        match py.detach(|| call(&state)) {
            Ok(()) => 0,
            Err(e) => {
                log_failure(py, &format!("{method}: {e}"));
                e.mooncake_code()
            }
        }
    }
}
