//! One region registered on many RDMA devices at once (feature `verbs`).
//!
//! Every buffer is registered on every NIC, as Mooncake does, so any NIC can serve any slice;
//! the registrations run in parallel, one thread per device, because pinning and mapping a
//! large region is slow and each device does it on its own. The memory regions are attached
//! to the [`Region`](crate::Region) itself, so they are deregistered exactly when the region
//! is unregistered (or dropped), never later than its memory stays valid.

use std::sync::Arc;

use tern_verbs::{Access, MemoryGuard, MemoryRegion, ProtectionDomain, VerbsError};

use crate::region::RegionPin;

/// The keys of a region registered on several devices, one per device in the order the
/// protection domains were given: `lkeys[i]`/`rkeys[i]` belong to device `i`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicKeys {
    /// Keys local work requests use.
    pub lkeys: Vec<u32>,
    /// Keys peers use (what a descriptor's `rkey` array holds).
    pub rkeys: Vec<u32>,
}

// SAFETY: a pin keeps its region registered (`MemoryRegistry::unregister` refuses while any
// pin lives, and pins are only taken under the registry's lock or cloned from a live pin) and
// the region itself alive (the pin holds its `Arc`). While registered, a raw region's bytes
// are valid for any access by `Region::from_raw`'s contract; an owned region's bytes live in
// its buffer, freed only with the region. Neither is used as Rust objects by Tern (module
// docs of `region`). The span is the region's fixed range.
unsafe impl MemoryGuard for RegionPin {
    fn span(&self) -> (usize, usize) {
        (self.info().addr, self.info().len)
    }
}

// SAFETY: the `Pinned` holds an `Arc` of a `HoldsPin`, which owns a `RegionPin` for its whole
// life (`HoldsPin`'s contract, which safe code cannot break: the reference comes from `&self`);
// while any clone lives, that pin lives, and the pin's guarantees (above) hold.
unsafe impl<T: crate::region::HoldsPin> MemoryGuard for crate::region::Pinned<T> {
    fn span(&self) -> (usize, usize) {
        (self.pin().info().addr, self.pin().info().len)
    }
}

/// The memory regions of one registration, held by the region they describe.
#[derive(Debug)]
struct Registration {
    _mrs: Vec<MemoryRegion>,
}

/// Registers the pinned region on every domain in `pds`, in parallel, and attaches the
/// memory regions to the region. All or none: on a failure the registrations that
/// succeeded are undone and the first error returned.
pub fn register_on_devices(
    pin: &RegionPin,
    pds: &[Arc<ProtectionDomain>],
    access: Access,
) -> Result<NicKeys, VerbsError> {
    let (addr, len) = (pin.info().addr, pin.info().len);
    let results: Vec<Result<MemoryRegion, VerbsError>> = std::thread::scope(|scope| {
        let workers: Vec<_> = pds
            .iter()
            .map(|pd| {
                scope.spawn(move || {
                    // SAFETY: the memory regions made here are attached to the pinned region
                    // below (or dropped at once on failure), so they are deregistered when the
                    // region is unregistered or dropped: while they live, the region is
                    // registered (or alive, for an owned one), hence its memory valid.
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
    let keys = NicKeys {
        lkeys: mrs.iter().map(MemoryRegion::lkey).collect(),
        rkeys: mrs.iter().map(MemoryRegion::rkey).collect(),
    };
    pin.attach(Box::new(Registration { _mrs: mrs }));
    Ok(keys)
}
