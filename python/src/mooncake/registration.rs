//! Registering memory the caller owns and keeps valid until it unregisters it (Mooncake's
//! contract: see [`crate::raw::LocalMemory::register_promised`]), one region or several, all
//! or none: 0, or a negative Mooncake code.

use pyo3::prelude::*;

use super::MooncakeEngine;
use crate::core::unregister_settled;
use crate::descriptors::U64s;
use crate::errors::log_failure;

impl MooncakeEngine {
    /// Registers `(address, length)` ranges, all or none.
    fn register_ranges(
        &self,
        py: Python<'_>,
        ranges: Vec<(usize, usize)>,
        location: Option<String>,
    ) -> i32 {
        let location = location.unwrap_or_else(|| "*".to_owned());
        self.coded(py, "register_memory", |state| {
            state
                .memory
                .register_promised(&state.core.engine, &ranges, &location)
        })
    }

    /// Unregisters regions by start address, all or none.
    fn unregister_addrs(&self, py: Python<'_>, addrs: &[usize]) -> i32 {
        self.coded(py, "unregister_memory", |state| {
            unregister_settled(&state.core.engine, addrs)
        })
    }
}

#[pymethods]
impl MooncakeEngine {
    /// Registers memory the caller owns and keeps valid until it unregisters it: 0, or a
    /// negative Mooncake code (-1 invalid argument, -7 overlapped, ...).
    #[pyo3(signature = (buffer_addr, capacity, location = None))]
    fn register_memory(
        &self,
        py: Python<'_>,
        buffer_addr: u64,
        capacity: u64,
        location: Option<String>,
    ) -> i32 {
        self.register_ranges(
            py,
            vec![(buffer_addr as usize, capacity as usize)],
            location,
        )
    }

    /// Unregisters the region starting at `buffer_addr`: 0, or a negative code.
    fn unregister_memory(&self, py: Python<'_>, buffer_addr: u64) -> i32 {
        self.unregister_addrs(py, &[buffer_addr as usize])
    }

    /// Registers several regions, all or none: 0, or a negative code.
    #[pyo3(signature = (buffer_addresses, capacities, location = None))]
    fn batch_register_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: &Bound<'_, PyAny>,
        capacities: &Bound<'_, PyAny>,
        location: Option<String>,
    ) -> PyResult<i32> {
        let addrs = U64s::of(buffer_addresses, "buffer_addresses")?;
        let capacities = U64s::of(capacities, "capacities")?;
        if addrs.len() != capacities.len() {
            if self.ready(py, "register_memory").is_some() {
                log_failure(
                    py,
                    &format!(
                        "batch_register_memory: {} addresses but {} capacities",
                        addrs.len(),
                        capacities.len()
                    ),
                );
            }
            return Ok(-1);
        }
        let mut ranges = vec![(0, 0); addrs.len()];
        addrs.fill(&mut ranges, |r, v| r.0 = v as usize)?;
        capacities.fill(&mut ranges, |r, v| r.1 = v as usize)?;
        Ok(self.register_ranges(py, ranges, location))
    }

    /// Unregisters several regions, all or none: 0, or a negative code.
    fn batch_unregister_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: &Bound<'_, PyAny>,
    ) -> PyResult<i32> {
        let addrs = U64s::of(buffer_addresses, "buffer_addresses")?;
        let mut out = vec![0; addrs.len()];
        addrs.fill(&mut out, |slot, v| *slot = v as usize)?;
        Ok(self.unregister_addrs(py, &out))
    }
}
