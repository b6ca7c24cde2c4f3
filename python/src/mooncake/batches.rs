//! Batches submitted without waiting: each gets an id (0 on failure) that
//! `get_batch_transfer_status` waits for and `transfer_check_status` looks at once; both
//! free a batch that has ended, as in Mooncake.

use std::sync::atomic::Ordering;

use pyo3::prelude::*;
use tern_engine::{Batch, BatchState, Opcode, TransferStatus};

use super::moving::{Call, batch, one, opcode_of};
use super::{AsyncBatch, Initialized, MooncakeEngine};
use crate::core::{Failure, first_failure};
use crate::descriptors;
use crate::errors::log_failure;

impl MooncakeEngine {
    /// Submits without waiting; returns a batch id, 0 on failure. The end of the methods
    /// below.
    fn submit(&self, py: Python<'_>, call: Call<'_>) -> PyResult<u64> {
        let Some(mut call) = self.checked(py, call) else {
            return Ok(0);
        };
        let submitted = py.detach(|| -> Result<AsyncBatch, Failure> {
            let engine = &call.state.core.engine;
            let segment = engine.open_segment(&call.target)?;
            if call.requests.is_empty() {
                return Ok(AsyncBatch {
                    batch: None,
                    segment,
                });
            }
            for request in &mut call.requests {
                request.target = segment;
            }
            let batch = engine.allocate_batch(call.requests.len())?;
            if let Err(e) = engine.submit(&batch, &call.requests) {
                let _ = engine.close_segment(segment);
                return Err(e.into());
            }
            Ok(AsyncBatch {
                batch: Some(batch),
                segment,
            })
        });
        descriptors::give_back(std::mem::take(&mut call.requests));
        Ok(match submitted {
            Ok(batch) => {
                let id = call.state.next_batch.fetch_add(1, Ordering::Relaxed);
                call.state.batches.lock().insert(id, batch);
                id
            }
            Err(failure) => {
                call.log_failure(py, failure);
                0
            }
        })
    }

    /// Drops the cached segment of a failed batch and frees the batch once it is idle.
    fn release(state: &Initialized, entry: &AsyncBatch, failed: bool) {
        if failed {
            let _ = state.core.engine.close_segment(entry.segment);
        }
        if let Some(batch) = &entry.batch {
            batch.cancel();
            let _ = state.core.engine.free_batch(batch);
        }
    }
}

moving_methods! {
    /// Submits writes without waiting: a batch id, 0 on failure.
    fn batch_transfer_async_write(buffers, peer_buffer_addresses, lengths: &Bound<'_, PyAny>)
        -> u64 = submit(batch(Ok(Opcode::Write)));

    /// Submits reads without waiting: a batch id, 0 on failure.
    fn batch_transfer_async_read(buffers, peer_buffer_addresses, lengths: &Bound<'_, PyAny>)
        -> u64 = submit(batch(Ok(Opcode::Read)));

    /// Submits with an opcode without waiting: a batch id, 0 on failure.
    fn batch_transfer_async(
        buffers, peer_buffer_addresses, lengths: &Bound<'_, PyAny>, opcode: i64,
    ) -> u64 = submit(batch(opcode_of(opcode)));

    /// One write submitted without waiting: a batch id, 0 on failure.
    fn transfer_submit_write(buffer, peer_buffer_address, length: u64) -> u64
        = submit(one(Ok(Opcode::Write)));
}

#[pymethods]
impl MooncakeEngine {
    /// Waits (sleeping) for every batch: 0 when all completed, -1 when one failed or timed
    /// out or an id is unknown. Finished batches are freed, as in Mooncake.
    fn get_batch_transfer_status(&self, py: Python<'_>, batch_ids: Vec<u64>) -> i32 {
        let Some(state) = self.ready(py, "get_batch_transfer_status") else {
            return -1;
        };
        let entries: Vec<(u64, Option<Batch>)> = {
            let batches = state.batches.lock();
            if let Some(unknown) = batch_ids.iter().find(|id| !batches.contains_key(id)) {
                drop(batches);
                log_failure(
                    py,
                    &format!(
                        "get_batch_transfer_status: unknown or already freed batch id {unknown}"
                    ),
                );
                return -1;
            }
            batch_ids
                .iter()
                .map(|id| (*id, batches[id].batch.clone()))
                .collect()
        };
        let wait = state.core.default_wait();
        let failure = py.detach(|| {
            entries.iter().find_map(|(id, batch)| {
                let batch = batch.as_ref()?;
                state
                    .core
                    .finish(batch, wait)
                    .err()
                    .map(|failure| (*id, failure))
            })
        });
        let finished: Vec<AsyncBatch> = {
            let mut batches = state.batches.lock();
            batch_ids
                .iter()
                .filter_map(|id| batches.remove(id))
                .collect()
        };
        for entry in &finished {
            Self::release(&state, entry, failure.is_some());
        }
        match failure {
            None => 0,
            Some((id, failure)) => {
                log_failure(
                    py,
                    &format!("get_batch_transfer_status: batch {id}: {failure}"),
                );
                -1
            }
        }
    }

    /// One look at a batch: 1 completed (freed), 0 pending, -1 failed or unknown (freed),
    /// -2 timed out (not freed).
    fn transfer_check_status(&self, py: Python<'_>, batch_id: u64) -> i32 {
        let Some(state) = self.ready(py, "transfer_check_status") else {
            return -1;
        };
        let batch = {
            let batches = state.batches.lock();
            match batches.get(&batch_id) {
                Some(entry) => entry.batch.clone(),
                None => {
                    drop(batches);
                    log_failure(
                        py,
                        &format!(
                            "transfer_check_status: unknown or already freed batch id {batch_id}"
                        ),
                    );
                    return -1;
                }
            }
        };
        let (code, failure) = match &batch {
            None => (1, None),
            Some(batch) => match batch.status().state {
                BatchState::Pending => return 0,
                BatchState::Completed => (1, None),
                BatchState::Failed => match first_failure(batch) {
                    Some(Failure::Task {
                        status: TransferStatus::Timeout,
                        ..
                    }) => return -2,
                    failure => (-1, failure),
                },
            },
        };
        // Bound first: the guard is dropped before the batch is released.
        let entry = state.batches.lock().remove(&batch_id);
        if let Some(entry) = entry {
            Self::release(&state, &entry, code != 1);
        }
        if let Some(failure) = failure {
            log_failure(
                py,
                &format!("transfer_check_status: batch {batch_id}: {failure}"),
            );
        }
        code
    }
}
