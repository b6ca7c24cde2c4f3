//! Transfers that wait: one request or a batch, written, read or by opcode, with an
//! optional `TransferNotify` sent once the bytes have landed. Each returns 0 when every
//! byte has moved, else -1 (the reason logged).

use pyo3::prelude::*;
use tern_engine::Opcode;

use super::MooncakeEngine;
use super::moving::{Call, batch, notify_parts, one, opcode_of};
use crate::core::Failure;
use crate::descriptors;
use crate::errors::log_failure;

impl MooncakeEngine {
    /// Runs requests to `target` and waits, then sends `notify`, if any: 0, or -1.
    fn transfer(&self, py: Python<'_>, call: Call<'_>, notify: Option<(String, String)>) -> i32 {
        let Some(mut call) = self.checked(py, call) else {
            return -1;
        };
        if call.requests.is_empty() && notify.is_none() {
            return 0;
        }
        let outcome = py.detach(|| -> Result<(), Failure> {
            let core = &call.state.core;
            let segment = if call.requests.is_empty() {
                core.engine.open_segment(&call.target)?
            } else {
                core.run_to(&call.target, &mut call.requests)?
            };
            if let Some((name, message)) = &notify {
                core.engine.send_notify(segment, name, message)?;
            }
            Ok(())
        });
        descriptors::give_back(std::mem::take(&mut call.requests));
        match outcome {
            Ok(()) => 0,
            Err(failure) => {
                call.log_failure(py, failure);
                -1
            }
        }
    }

    /// The end of the methods that wait without notifying.
    fn wait(&self, py: Python<'_>, call: Call<'_>) -> PyResult<i32> {
        Ok(self.transfer(py, call, None))
    }

    /// The end of the methods with an optional `TransferNotify`; a notify that is not one
    /// fails the call before anything else is looked at.
    fn wait_notify(
        &self,
        py: Python<'_>,
        call: Call<'_>,
        notify: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<i32> {
        match notify.map(notify_parts).transpose() {
            Ok(notify) => Ok(self.transfer(py, call, notify)),
            Err(reason) => {
                log_failure(py, &format!("{}: {reason}", call.method));
                Ok(-1)
            }
        }
    }
}

moving_methods! {
    /// Writes and waits: 0 when every byte has landed at the peer, else -1.
    fn transfer_sync_write(buffer, peer_buffer_address, length: u64) -> i32
        = wait(one(Ok(Opcode::Write)));

    /// Reads and waits: 0 when every byte has arrived, else -1.
    fn transfer_sync_read(buffer, peer_buffer_address, length: u64) -> i32
        = wait(one(Ok(Opcode::Read)));

    /// One transfer with an opcode (`TransferOpcode.Read`/`.Write`) and an optional
    /// `TransferNotify` sent once the bytes have landed: 0, or -1.
    fn transfer_sync(
        buffer, peer_buffer_address, length: u64,
        opcode: i64, notify: Option<&Bound<'_, PyAny>> = None,
    ) -> i32 = wait_notify(one(opcode_of(opcode)), notify);

    /// A batch of writes, waited for: 0 when every byte has landed at the peer, else -1.
    fn batch_transfer_sync_write(buffers, peer_buffer_addresses, lengths: &Bound<'_, PyAny>)
        -> i32 = wait(batch(Ok(Opcode::Write)));

    /// A batch of reads, waited for: 0, or -1.
    fn batch_transfer_sync_read(buffers, peer_buffer_addresses, lengths: &Bound<'_, PyAny>)
        -> i32 = wait(batch(Ok(Opcode::Read)));

    /// A batch with an opcode and an optional notify: 0, or -1.
    fn batch_transfer_sync(
        buffers, peer_buffer_addresses, lengths: &Bound<'_, PyAny>,
        opcode: i64, notify: Option<&Bound<'_, PyAny>> = None,
    ) -> i32 = wait_notify(batch(opcode_of(opcode)), notify);
}
