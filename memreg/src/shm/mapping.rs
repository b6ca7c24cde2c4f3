//! Mappings of memfds, reached only by copies to and from region slices.

use std::ptr::NonNull;

use super::{MemFd, ShmError};
use crate::region::{MemoryError, RegionSlice};

/// A mapping of a whole [`MemFd`] (typically a peer's), shared, readable and writable. Its
/// bytes are written by other processes at any time, so they are reached only by copies to
/// and from [`RegionSlice`]s. Unmapped on drop; while it lives the memory stays valid,
/// whatever the peer does (the memfd cannot shrink, and the mapping holds its pages).
#[derive(Debug)]
pub struct SharedMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is reached only through raw copies (never references), valid from any
// thread until it is unmapped in `drop`, which `&self` methods cannot race with.
unsafe impl Send for SharedMapping {}
// SAFETY: see Send; concurrent copies into shared memory leave bytes unspecified, never UB
// for this process, as with DMA.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Maps all of `memfd`.
    pub fn map(memfd: &MemFd) -> Result<Self, ShmError> {
        let ptr = memfd.map_raw(memfd.len())?;
        Ok(Self {
            ptr,
            len: memfd.len(),
        })
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Where it is mapped in this process (for messages and `/proc/self/maps`).
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    fn at(&self, offset: usize, len: usize) -> Result<*mut u8, MemoryError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(MemoryError::OutOfRange {
                addr: self.addr().wrapping_add(offset),
                len,
                region_addr: self.addr(),
                region_len: self.len,
            });
        }
        // SAFETY: `offset + len <= self.len` (checked), so the pointer stays in the mapping.
        Ok(unsafe { self.ptr.as_ptr().add(offset) })
    }

    /// Copies `src` into the mapping at `offset` (one `memcpy`).
    pub fn write_from(&self, offset: usize, src: RegionSlice<'_>) -> Result<(), MemoryError> {
        let dst = self.at(offset, src.len())?;
        // SAFETY: `dst` is valid for `src.len()` writes (inside the live mapping, checked by
        // `at`); `src` is valid for reads (a pinned region's bytes). Neither is a Rust
        // reference; they are distinct mappings, so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` of the mapping into `dst` (one `memcpy`).
    pub fn read_into(&self, offset: usize, dst: RegionSlice<'_>) -> Result<(), MemoryError> {
        let src = self.at(offset, dst.len())?;
        // SAFETY: `src` is valid for `dst.len()` reads (inside the live mapping); `dst` is
        // valid for writes (a pinned region). Distinct mappings: no overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `len` bytes between `[offset, offset + len)` of the mapping and `[addr, addr +
    /// len)` of a pinned region of device memory (`to_mapping`: from the device), with the
    /// GPU's copy engine, after what `order` asks of the device's earlier work; both ranges
    /// are checked first.
    pub fn copy_with_device(
        &self,
        offset: usize,
        pin: &crate::RegionPin,
        addr: usize,
        len: usize,
        to_mapping: bool,
        order: tern_cuda::DeviceOrder,
    ) -> Result<(), MemoryError> {
        let mapped = self.at(offset, len)? as u64;
        let range = pin
            .device_range(addr, len)?
            .ok_or(MemoryError::DeviceMemory { addr, len })?;
        let (dst, src) = if to_mapping {
            (mapped, range.addr)
        } else {
            (range.addr, mapped)
        };
        // SAFETY: the mapping's range is inside the live mapping (checked by `at`, and
        // `&self` keeps it mapped); the device range lies in the pinned device region
        // (checked), which stays allocated while pinned. What else writes either meanwhile is
        // the caller's to order, as for every transfer.
        unsafe { range.device.copy_any(dst, src, len, order) }
            .map_err(|reason| MemoryError::Device { addr, reason })
    }

    /// Copies `src` into the mapping at `offset` (for tests and probes).
    pub fn write_bytes(&self, offset: usize, src: &[u8]) -> Result<(), MemoryError> {
        let dst = self.at(offset, src.len())?;
        // SAFETY: `dst` is valid for `src.len()` writes (checked); `src` is a Rust borrow of
        // this process's own memory, not of the mapping.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` out into `dst` (for tests and probes).
    pub fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<(), MemoryError> {
        let src = self.at(offset, dst.len())?;
        // SAFETY: `src` is valid for `dst.len()` reads (checked); `dst` is the caller's
        // exclusive borrow of other memory.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: `ptr` starts a mapping of `len` bytes made by `map`; unmapped once, and no
        // copy can run (they borrow `self`).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;

    use super::*;

    #[test]
    fn memfds_are_sealed_mapped_and_shared_between_mappings() {
        let memfd = MemFd::create("tern-test", 8192).unwrap();
        assert_eq!(memfd.len(), 8192);
        let a = SharedMapping::map(&memfd).unwrap();
        let b = SharedMapping::map(&memfd).unwrap();
        assert_ne!(a.addr(), b.addr());
        a.write_bytes(100, b"shared").unwrap();
        let mut out = [0u8; 6];
        b.read_bytes(100, &mut out).unwrap();
        assert_eq!(&out, b"shared");
        assert!(a.write_bytes(8190, b"abc").is_err());
        // Its size is sealed.
        let file = File::from(memfd.as_fd().try_clone_to_owned().unwrap());
        assert!(file.set_len(4096).is_err());
        assert!(MemFd::create("x", 0).is_err());
        assert!(MemFd::create("bad\0name", 10).is_err());
    }
}
