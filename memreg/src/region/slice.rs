//! Slices: some bytes of a pinned region, as a pointer and a length, moved by copies.

use std::marker::PhantomData;
use std::ptr::NonNull;

use super::RegionPin;

/// Some bytes of a pinned region: a pointer (with the provenance of the region's base) and a
/// length, never a Rust reference, since peers, NICs and other connections may write these
/// bytes at any moment. Valid for as long as the pin it came from is borrowed.
#[derive(Debug, Clone, Copy)]
pub struct RegionSlice<'a> {
    pub(super) ptr: NonNull<u8>,
    pub(super) len: usize,
    pub(super) _pin: PhantomData<&'a RegionPin>,
}

impl<'a> RegionSlice<'a> {
    /// Bytes in the slice.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slice has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The slice without its first `n` bytes (empty when `n >= len`).
    pub fn skip(self, n: usize) -> Self {
        let n = n.min(self.len);
        Self {
            // SAFETY: `n <= len`, so the pointer stays inside (or one past) the slice.
            ptr: unsafe { self.ptr.add(n) },
            len: self.len - n,
            _pin: PhantomData,
        }
    }

    /// `len` bytes of a staging buffer from `offset`, for a socket to fill or drain.
    pub(crate) fn staged(
        buffer: &'a mut tern_cuda::PinnedBuffer,
        offset: usize,
        len: usize,
    ) -> Self {
        let bytes = &mut buffer.bytes_mut()[offset..offset + len];
        Self {
            ptr: NonNull::new(bytes.as_mut_ptr()).unwrap_or(NonNull::dangling()),
            len: bytes.len(),
            _pin: PhantomData,
        }
    }

    /// The first byte, for the system calls and copies of this crate.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Copies `src` into the start of this slice (`min` of both lengths; the two may
    /// overlap, as two ranges of one region may); returns how many bytes.
    pub fn copy_from_region(&self, src: RegionSlice<'_>) -> usize {
        let n = src.len.min(self.len);
        // SAFETY: both point into pinned regions, valid for `n` reads (src) and writes
        // (self); `ptr::copy` allows overlap.
        unsafe { std::ptr::copy(src.ptr.as_ptr(), self.ptr.as_ptr(), n) };
        n
    }

    /// The first `n` bytes (all of them when `n >= len`).
    pub fn take(self, n: usize) -> Self {
        Self {
            len: n.min(self.len),
            ..self
        }
    }

    /// Copies the first `dst.len()` bytes (at most `len`) into `dst`; returns how many.
    pub fn copy_to(&self, dst: &mut [u8]) -> usize {
        let n = dst.len().min(self.len);
        // SAFETY: the source is valid for `n` reads (inside a pinned region, whose bytes stay
        // valid while pinned); `dst` is the caller's exclusive borrow, which cannot overlap
        // registered memory handed out as a slice (none ever is).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), dst.as_mut_ptr(), n) };
        n
    }

    /// Copies `src` (at most `len` bytes of it) to the start of the slice; returns how many.
    pub fn copy_from(&self, src: &[u8]) -> usize {
        let n = src.len().min(self.len);
        // SAFETY: the destination is valid for `n` writes (inside a pinned region); `src` is
        // a Rust borrow, so it is not registered memory reached through a reference.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr(), n) };
        n
    }
}
