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
    /// The DMA-BUF the regions were imported from, if any (dropped after them).
    _dmabuf: Option<std::os::fd::OwnedFd>,
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
    register_each(pin, pds, None, |pd| {
        // SAFETY: the memory regions made here are attached to the pinned region (or
        // dropped at once on failure), so they are deregistered when the region is
        // unregistered or dropped: while they live, the region is registered (or alive, for
        // an owned one), hence its memory valid.
        unsafe { MemoryRegion::register(pd, addr as *mut u8, len, access) }
    })
}

/// Why device memory could not be registered on the NICs: neither way worked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "device memory at {addr:#x} (+{len}) cannot be registered on the NICs: by dma-buf: \
     {dmabuf}; by nvidia_peermem: {peermem}"
)]
pub struct DeviceRegistrationError {
    /// Start of the memory.
    pub addr: usize,
    /// Its length.
    pub len: usize,
    /// Why the dma-buf way failed (the driver's export, or the NIC's import).
    pub dmabuf: String,
    /// Why the nvidia_peermem way failed (the module is not loaded, or registration failed).
    pub peermem: String,
}

/// Whether `nvidia_peermem` (or the older `nv_peer_mem`) is loaded, by `/proc/modules`:
/// with it, NICs register GPU memory by its virtual address like host memory.
pub fn peermem_loaded() -> bool {
    std::fs::read_to_string("/proc/modules").is_ok_and(|modules| {
        modules.lines().any(|l| {
            let name = l.split_whitespace().next().unwrap_or("");
            name == "nvidia_peermem" || name == "nv_peer_mem"
        })
    })
}

/// Registers a pinned region of device memory on every domain in `pds`: by dma-buf (one
/// descriptor of the whole allocation from the driver, imported by each NIC at the region's
/// offset and addressed by its device address), else, where `nvidia_peermem` is loaded, by
/// its address as host memory is; all or none, as [`register_on_devices`].
pub fn register_device_on_devices(
    pin: &RegionPin,
    pds: &[Arc<ProtectionDomain>],
    access: Access,
) -> Result<NicKeys, DeviceRegistrationError> {
    let (addr, len) = (pin.info().addr, pin.info().len);
    let failed = |dmabuf: String, peermem: String| DeviceRegistrationError {
        addr,
        len,
        dmabuf,
        peermem,
    };
    let Some(device) = pin.device() else {
        return Err(failed(
            "not device memory".into(),
            "not device memory".into(),
        ));
    };
    let dmabuf = match device.dmabuf(addr as u64, len as u64) {
        Ok((fd, offset)) => {
            let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
            register_each(pin, pds, Some(fd), |pd| {
                // SAFETY: the descriptor is a DMA-BUF of the allocation holding the region
                // (the driver's export), kept with the memory regions, and the memory behind
                // it stays allocated while they live: they are attached to the pinned region
                // and deregistered with it, before it can be freed.
                unsafe { MemoryRegion::register_dmabuf(pd, raw, offset, len, addr as u64, access) }
            })
            .map_err(|e| format!("the NIC refused the import: {e}"))
        }
        Err(e) => Err(format!("the driver's export failed: {e}")),
    };
    let dmabuf = match dmabuf {
        Ok(keys) => return Ok(keys),
        Err(why) => why,
    };
    if !peermem_loaded() {
        return Err(failed(dmabuf, "the module is not loaded".into()));
    }
    register_each(pin, pds, None, |pd| {
        // SAFETY: as in `register_on_devices`; nvidia_peermem pins the device pages behind
        // the virtual range for the NIC while the memory region lives.
        unsafe { MemoryRegion::register(pd, addr as *mut u8, len, access) }
    })
    .map_err(|e| failed(dmabuf, format!("registration failed: {e}")))
}

/// Makes one memory region per domain with `register`, in parallel, and attaches them (and
/// `keep`, a descriptor they rest on) to the pinned region.
fn register_each(
    pin: &RegionPin,
    pds: &[Arc<ProtectionDomain>],
    keep: Option<std::os::fd::OwnedFd>,
    register: impl Fn(&Arc<ProtectionDomain>) -> Result<MemoryRegion, VerbsError> + Sync,
) -> Result<NicKeys, VerbsError> {
    let register = &register;
    let results: Vec<Result<MemoryRegion, VerbsError>> = std::thread::scope(|scope| {
        let workers: Vec<_> = pds
            .iter()
            .map(|pd| scope.spawn(move || register(pd)))
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
    pin.attach(Box::new(Registration {
        _mrs: mrs,
        _dmabuf: keep,
    }));
    Ok(keys)
}
