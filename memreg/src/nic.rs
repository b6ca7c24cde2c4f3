//! One region registered on many RDMA devices at once (feature `verbs`).
//!
//! Every buffer is registered on every NIC, as Mooncake does, so any NIC can serve any slice;
//! the registrations run in parallel, one thread per device, because pinning and mapping a
//! large region is slow and each device does it on its own.

use std::sync::Arc;

use tern_verbs::{Access, MemoryRegion, ProtectionDomain, VerbsError};

use crate::region::RegionPin;

/// A region's memory regions, one per protection domain (device), in the order given. It
/// holds a pin, so the region cannot be unregistered while the NICs may still touch it.
#[derive(Debug)]
pub struct NicRegistration {
    mrs: Vec<MemoryRegion>,
    pin: RegionPin,
}

impl NicRegistration {
    /// Registers the pinned region on every domain in `pds`, in parallel. All or none: on a
    /// failure the registrations that succeeded are undone and the first error returned.
    pub fn register(
        pin: RegionPin,
        pds: &[Arc<ProtectionDomain>],
        access: Access,
    ) -> Result<Self, VerbsError> {
        let (addr, len) = (pin.info().addr, pin.info().len);
        let results: Vec<Result<MemoryRegion, VerbsError>> = std::thread::scope(|scope| {
            let workers: Vec<_> = pds
                .iter()
                .map(|pd| {
                    scope.spawn(move || {
                        // SAFETY: `pin` keeps the region registered, hence its memory valid,
                        // for as long as the returned registration (which owns the pin and
                        // drops the MRs first) lives.
                        unsafe { MemoryRegion::register(pd, addr as *mut u8, len, access) }
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| {
                    w.join().unwrap_or(Err(VerbsError::InvalidRequest(
                        "registration thread panicked",
                    )))
                })
                .collect()
        });
        let mut mrs = Vec::with_capacity(results.len());
        for result in results {
            mrs.push(result?);
        }
        Ok(Self { mrs, pin })
    }

    /// Local keys, one per device.
    pub fn lkeys(&self) -> Vec<u32> {
        self.mrs.iter().map(MemoryRegion::lkey).collect()
    }

    /// Remote keys, one per device (what a descriptor's `rkey` array holds).
    pub fn rkeys(&self) -> Vec<u32> {
        self.mrs.iter().map(MemoryRegion::rkey).collect()
    }

    /// The memory regions.
    pub fn regions(&self) -> &[MemoryRegion] {
        &self.mrs
    }

    /// The pinned region.
    pub fn pin(&self) -> &RegionPin {
        &self.pin
    }
}

impl Drop for NicRegistration {
    fn drop(&mut self) {
        // The MRs go before the pin (field order would too; this says it on purpose).
        self.mrs.clear();
    }
}
