//! Pins: holds on registered regions that keep their memory valid while a transfer touches
//! it, and what a request shares between its pieces to hold one.

use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{Attachment, MemoryError, Region, RegionInfo, RegionSlice};
use crate::device::DeviceRange;

/// A hold on a registered region: while any pin lives, the region cannot be unregistered,
/// so its memory stays valid. Transports read and write region memory only through pins.
#[derive(Debug)]
pub struct RegionPin {
    region: Arc<Region>,
}

impl Clone for RegionPin {
    fn clone(&self) -> Self {
        Self::new(self.region.clone())
    }
}

impl Drop for RegionPin {
    fn drop(&mut self) {
        self.region.pins.fetch_sub(1, Ordering::AcqRel);
    }
}

impl RegionPin {
    pub(super) fn new(region: Arc<Region>) -> Self {
        region.pins.fetch_add(1, Ordering::AcqRel);
        Self { region }
    }

    /// The pinned region's facts.
    pub fn info(&self) -> &RegionInfo {
        &self.region.info
    }

    /// Ties `attachment` to the region: it is dropped when the region is unregistered
    /// ([`MemoryRegistry::unregister`](crate::MemoryRegistry::unregister) returning `Ok`),
    /// or when the region itself goes (an owned region removed while transfers still held
    /// it), always before the region's memory is released. A device registration of the region's memory lives here, so it
    /// can never outlive the memory.
    pub fn attach(&self, attachment: Attachment) {
        self.region.attachments.lock().push(attachment);
    }

    /// Whether the pinned region is device memory (reached only through a [`Stage`](crate::Stage) or
    /// the copies of [`RegionPin::copy_to_slice`] and [`RegionPin::copy_from_slice`]).
    pub fn is_device(&self) -> bool {
        self.region.device.is_some()
    }

    /// The device of a pinned device region, `None` for host memory.
    pub fn device(&self) -> Option<&'static tern_cuda::Device> {
        self.region.device
    }

    fn offset_of(&self, addr: usize, len: usize) -> Result<usize, MemoryError> {
        let info = &self.region.info;
        let offset = addr.wrapping_sub(info.addr);
        let inside = addr >= info.addr && offset.checked_add(len).is_some_and(|e| e <= info.len);
        if !inside {
            return Err(MemoryError::OutOfRange {
                addr,
                len,
                region_addr: info.addr,
                region_len: info.len,
            });
        }
        Ok(offset)
    }

    /// The checked device range `[addr, addr + len)`, or `None` for host memory.
    pub(crate) fn device_range(
        &self,
        addr: usize,
        len: usize,
    ) -> Result<Option<DeviceRange>, MemoryError> {
        let Some(device) = self.region.device else {
            return Ok(None);
        };
        self.offset_of(addr, len)?;
        if len == 0 {
            return Err(MemoryError::ZeroLength { addr });
        }
        Ok(Some(DeviceRange {
            device,
            addr: addr as u64,
            len,
        }))
    }

    /// The bytes `[addr, addr + len)` of the pinned region, checked to lie inside it. Device
    /// memory has none to give: the CPU does not touch it ([`MemoryError::DeviceMemory`]).
    pub fn slice(&self, addr: usize, len: usize) -> Result<RegionSlice<'_>, MemoryError> {
        let region = &*self.region;
        let offset = self.offset_of(addr, len)?;
        if region.device.is_some() {
            return Err(MemoryError::DeviceMemory { addr, len });
        }
        // SAFETY: `offset + len <= info.len` (checked), so the result stays inside the
        // allocation `base` points to (a registered range is one allocation or mapping, by
        // `Region::from_raw`'s contract or by ownership of the buffer).
        let ptr = unsafe { region.base.add(offset) };
        Ok(RegionSlice {
            ptr,
            len,
            _pin: PhantomData,
        })
    }

    /// Copies `dst.len()` bytes starting at `addr` out of the region (by a device copy for
    /// device memory).
    pub fn copy_to_slice(&self, addr: usize, dst: &mut [u8]) -> Result<(), MemoryError> {
        if dst.is_empty() {
            return self.offset_of(addr, 0).map(drop);
        }
        if let Some(range) = self.device_range(addr, dst.len())? {
            // SAFETY: the range lies in this pinned device region (checked), which stays
            // allocated while pinned; `dst` is an exclusive borrow of host memory.
            return unsafe {
                range
                    .device
                    .copy_to_host(dst.as_mut_ptr(), range.addr, range.len)
            }
            .map_err(|reason| MemoryError::Device { addr, reason });
        }
        self.slice(addr, dst.len())?.copy_to(dst);
        Ok(())
    }

    /// Copies `src` into the region starting at `addr` (by a device copy for device memory).
    pub fn copy_from_slice(&self, addr: usize, src: &[u8]) -> Result<(), MemoryError> {
        if src.is_empty() {
            return self.offset_of(addr, 0).map(drop);
        }
        if let Some(range) = self.device_range(addr, src.len())? {
            // SAFETY: the range lies in this pinned device region (checked), which stays
            // allocated while pinned and which registration made writable by Tern; `src` is
            // a borrow of host memory.
            return unsafe {
                range
                    .device
                    .copy_from_host(range.addr, src.as_ptr(), range.len)
            }
            .map_err(|reason| MemoryError::Device { addr, reason });
        }
        self.slice(addr, src.len())?.copy_from(src);
        Ok(())
    }
}

/// Something that holds a [`RegionPin`] for as long as it lives: what a transfer shares
/// between the pieces of one request (one pin per request, not per piece).
///
/// The pin returned must be one `self` owns for its whole life (a field, never replaced),
/// which safe code cannot get wrong: a shared reference obtained from `&self` points into
/// memory `self` keeps alive, and nothing can drop it while `self` is shared.
pub trait HoldsPin: Send + Sync + 'static {
    /// The pin held.
    fn pin(&self) -> &RegionPin;
}

/// A shared owner of a [`HoldsPin`]: while any clone lives, the pin lives, so the region
/// stays registered and its memory valid. What a transport hands a device as the keeper of
/// a work request's memory (`tern_verbs::MemoryGuard`, feature `verbs`).
#[derive(Debug)]
pub struct Pinned<T: HoldsPin>(pub Arc<T>);

impl<T: HoldsPin> Clone for Pinned<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T: HoldsPin> Pinned<T> {
    /// The pin held.
    pub fn pin(&self) -> &RegionPin {
        self.0.pin()
    }
}
