//! The registry: the set of registered regions, and the only place pins on raw regions come
//! from.

use std::sync::Arc;

use parking_lot::RwLock;

use super::{MemoryError, MemoryKind, Region, RegionInfo, RegionPin};
use crate::map::RegionMap;

/// The set of registered regions of one process (or one engine).
#[derive(Debug, Default)]
pub struct MemoryRegistry {
    /// Every change is a single call on the map, so a panic elsewhere never leaves it half
    /// changed for the next holder of the lock.
    regions: RwLock<RegionMap<Arc<Region>>>,
}

impl MemoryRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a region; fails on zero length, overflow or overlap and changes nothing then.
    ///
    /// A region whose location is `"*"` is named after the NUMA node of its first page
    /// (`cpu:<node>`), as Mooncake does, when the kernel can tell.
    pub fn register(&self, mut region: Region) -> Result<Arc<Region>, MemoryError> {
        if region.owner.is_none() {
            crate::device::resolve(&mut region)?;
        }
        if region.info.kind == MemoryKind::Host
            && matches!(region.info.location.as_str(), "*" | "cpu:*")
        {
            region.info.location = crate::numa::resolve_location("*", region.info.addr);
        }
        let region = Arc::new(region);
        self.regions
            .write()
            .insert(region.addr(), region.len(), region.clone())?;
        Ok(region)
    }

    /// Removes the region starting at `addr`, unless a transfer still holds it.
    ///
    /// Pins are only taken under the registry's read lock (or cloned from a live pin), so
    /// with the write lock held the count cannot rise from zero: once this returns `Ok`, no
    /// transfer touches the memory any more.
    pub fn unregister(&self, addr: usize) -> Result<Arc<Region>, MemoryError> {
        let mut removed = self.unregister_all(&[addr])?;
        removed
            .pop()
            .ok_or(MemoryError::NotRegistered { addr, len: 0 })
    }

    /// Removes every region starting at one of `addrs`, or none: if any address is unknown or
    /// its region is in use, nothing is removed and the first problem is returned.
    pub fn unregister_all(&self, addrs: &[usize]) -> Result<Vec<Arc<Region>>, MemoryError> {
        let mut regions = self.regions.write();
        for &addr in addrs {
            let (_, region) = regions
                .get(addr)
                .ok_or(MemoryError::NotRegistered { addr, len: 0 })?;
            let pins = region.pin_count();
            if pins > 0 {
                return Err(MemoryError::InUse { addr, pins });
            }
        }
        // Checked above under the same write lock, so every removal succeeds. No pin is left,
        // so no transfer uses the attachments (device registrations) any more: they go now,
        // before the caller may free raw memory.
        let removed: Vec<Arc<Region>> = addrs
            .iter()
            .filter_map(|&addr| regions.remove(addr).map(|(_, r)| r))
            .collect();
        for region in &removed {
            region.detach_all();
        }
        Ok(removed)
    }

    /// Removes an owned region even while pinned: its memory lives inside the region, so
    /// transfers still holding pins finish safely. Raw regions are left alone (`None`).
    pub fn remove_owned(&self, addr: usize) -> Option<Arc<Region>> {
        let mut regions = self.regions.write();
        let owned = regions.get(addr).is_some_and(|(_, r)| r.is_owned());
        if owned {
            regions.remove(addr).map(|(_, r)| r)
        } else {
            None
        }
    }

    /// Pins the region that contains all of `[addr, addr + len)`.
    pub fn pin(&self, addr: usize, len: usize) -> Result<RegionPin, MemoryError> {
        let regions = self.regions.read();
        let (_, _, region) = regions
            .find_containing(addr, len)
            .ok_or(MemoryError::NotRegistered { addr, len })?;
        Ok(RegionPin::new(region.clone()))
    }

    /// Pins the region containing `[addr, addr + len)` for a peer: it must also be
    /// remote-accessible.
    pub fn pin_remote(&self, addr: usize, len: usize) -> Result<RegionPin, MemoryError> {
        let pin = self.pin(addr, len)?;
        if !pin.info().remote_accessible {
            return Err(MemoryError::NotRemoteAccessible {
                addr: pin.info().addr,
            });
        }
        Ok(pin)
    }

    /// Whether some region overlaps `[addr, addr + len)`.
    pub fn overlaps(&self, addr: usize, len: usize) -> Result<bool, MemoryError> {
        Ok(self.regions.read().first_overlap(addr, len)?.is_some())
    }

    /// The facts of every region, in address order.
    pub fn snapshot(&self) -> Vec<RegionInfo> {
        self.regions
            .read()
            .iter()
            .map(|(_, _, r)| r.info.clone())
            .collect()
    }

    /// Number of registered regions.
    pub fn len(&self) -> usize {
        self.regions.read().len()
    }

    /// Whether no region is registered.
    pub fn is_empty(&self) -> bool {
        self.regions.read().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::AlignedBuffer;

    fn owned(len: usize, remote: bool) -> Region {
        Region::owned(AlignedBuffer::new(len).unwrap(), "cpu:0", remote)
    }

    #[test]
    fn pins_block_unregister_until_dropped() {
        let registry = MemoryRegistry::new();
        let region = registry.register(owned(8192, true)).unwrap();
        let addr = region.addr();
        let pin = registry.pin(addr + 10, 100).unwrap();
        let second = pin.clone();
        assert_eq!(
            registry.unregister(addr).unwrap_err(),
            MemoryError::InUse { addr, pins: 2 }
        );
        drop(pin);
        drop(second);
        registry.unregister(addr).unwrap();
        assert_eq!(
            registry.unregister(addr).unwrap_err(),
            MemoryError::NotRegistered { addr, len: 0 }
        );
        assert!(registry.is_empty());
    }

    #[test]
    fn registry_rejects_overlap_and_unknown_ranges() {
        let registry = MemoryRegistry::new();
        let region = registry.register(owned(8192, false)).unwrap();
        let addr = region.addr();
        // SAFETY: never accessed; the registration is rejected before any pin can exist.
        let overlapping = unsafe { Region::from_raw((addr + 4096) as *mut u8, 8192, "*", true) };
        assert!(matches!(
            registry.register(overlapping),
            Err(MemoryError::Overlap { existing, .. }) if existing == addr
        ));
        assert!(matches!(
            registry.pin(addr + 8000, 500),
            Err(MemoryError::NotRegistered { .. })
        ));
        assert_eq!(
            registry.pin_remote(addr, 1).unwrap_err(),
            MemoryError::NotRemoteAccessible { addr }
        );
    }

    #[test]
    fn owned_regions_can_be_removed_while_pinned_and_stay_valid() {
        let registry = MemoryRegistry::new();
        let region = registry.register(owned(4096, true)).unwrap();
        let base = region.addr();
        drop(region);
        let pin = registry.pin(base, 10).unwrap();
        assert!(registry.remove_owned(base).is_some());
        pin.copy_from_slice(base, b"still ok").unwrap();
        assert!(registry.pin(base, 1).is_err());
    }
}
