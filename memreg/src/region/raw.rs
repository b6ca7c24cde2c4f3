//! Registration of memory Tern does not own, behind a safe entry point for implementors.

use super::Region;

/// Registration of memory Tern does not own, for anything that keeps a
/// [`MemoryRegistry`](crate::MemoryRegistry) behind a safe [`RegisterRaw::register_region`].
/// The raw-pointer entry points live here, in the crate allowed `unsafe`, so implementors
/// write no `unsafe` themselves.
pub trait RegisterRaw {
    /// What registration fails with.
    type Error;

    /// Registers a region (built safely, or with [`Region::from_raw`]).
    fn register_region(&self, region: Region) -> Result<(), Self::Error>;

    /// Registers several regions at once: all or none.
    fn register_regions(&self, regions: Vec<Region>) -> Result<(), Self::Error>;

    /// Registers `len` bytes at `ptr` that the caller owns.
    ///
    /// # Safety
    ///
    /// As [`Region::from_raw`]: the memory must stay valid for reads and writes until it has
    /// been unregistered successfully, and nothing may rely on Rust aliasing guarantees for
    /// it meanwhile (peers write it at any time).
    unsafe fn register_memory(
        &self,
        ptr: *mut u8,
        len: usize,
        location: &str,
        remote_accessible: bool,
    ) -> Result<(), Self::Error> {
        // SAFETY: the caller upholds `Region::from_raw`'s contract, which this function's
        // contract repeats word for word.
        let region = unsafe { Region::from_raw(ptr, len, location, remote_accessible) };
        self.register_region(region)
    }

    /// Registers several `(ptr, len)` ranges with one location: all or none.
    ///
    /// # Safety
    ///
    /// As [`RegisterRaw::register_memory`], for every range.
    unsafe fn register_memory_batch(
        &self,
        ranges: &[(*mut u8, usize)],
        location: &str,
        remote_accessible: bool,
    ) -> Result<(), Self::Error> {
        let regions = ranges
            .iter()
            // SAFETY: the caller upholds `Region::from_raw`'s contract for every range.
            .map(|&(ptr, len)| unsafe { Region::from_raw(ptr, len, location, remote_accessible) })
            .collect();
        self.register_regions(regions)
    }
}
