//! Owned, aligned, zeroed memory, and parallel pre-touch of it.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::MemoryError;
use crate::shm::{MemFd, ShmError};

/// The page size Tern aligns buffers to.
pub const PAGE_SIZE: usize = 4096;

/// An owned, page-aligned, zero-filled allocation that never moves.
///
/// The address stays fixed for the buffer's life, which is what registration needs: peers
/// are told the address and write to it later.
#[derive(Debug)]
pub struct AlignedBuffer {
    ptr: NonNull<u8>,
    layout: Layout,
    storage: Storage,
}

/// Size of the huge pages [`AlignedBuffer::huge`] asks for.
pub const HUGE_PAGE_SIZE: usize = 2 << 20;

/// Where an [`AlignedBuffer`]'s bytes come from.
#[derive(Debug)]
enum Storage {
    /// The global allocator.
    Heap,
    /// An anonymous mapping of explicit (hugetlbfs) huge pages, `mapped` bytes long.
    HugeTlb { mapped: usize },
    /// A shared mapping of all of a sealed memfd, which same-host peers may map too.
    Memfd { memfd: Arc<MemFd> },
}

// SAFETY: the buffer is plain owned bytes with no thread affinity; all access to its contents
// goes through raw copies of its methods or through `Region`, which documents its rules.
unsafe impl Send for AlignedBuffer {}
// SAFETY: see `Send`; `&self` methods copy through raw pointers only (never references), and
// concurrent copies leave bytes unspecified, never UB for this process, as with DMA.
unsafe impl Sync for AlignedBuffer {}

impl AlignedBuffer {
    /// Allocates `len` zeroed bytes aligned to [`PAGE_SIZE`]. `None` when `len` is zero or
    /// the allocation fails.
    pub fn new(len: usize) -> Option<Self> {
        Self::with_alignment(len, PAGE_SIZE)
    }

    /// Allocates `len` zeroed bytes aligned to `align` (a power of two).
    pub fn with_alignment(len: usize, align: usize) -> Option<Self> {
        if len == 0 {
            return None;
        }
        let layout = Layout::from_size_align(len, align.max(PAGE_SIZE)).ok()?;
        // SAFETY: `layout` has a non-zero size (checked above) as `alloc_zeroed` requires.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        NonNull::new(raw).map(|ptr| Self {
            ptr,
            layout,
            storage: Storage::Heap,
        })
    }

    /// `len` zeroed bytes on 2 MiB huge pages: explicit huge pages (`MAP_HUGETLB`) when the
    /// kernel has enough reserved, else 2 MiB-aligned memory marked for transparent huge
    /// pages (`MADV_HUGEPAGE`). Fewer pages mean fewer NIC translation entries.
    pub fn huge(len: usize) -> Option<Self> {
        if len == 0 {
            return None;
        }
        let mapped = len.checked_next_multiple_of(HUGE_PAGE_SIZE)?;
        // SAFETY: an anonymous private mapping with no address hint; the result is checked.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB,
                -1,
                0,
            )
        };
        if raw != libc::MAP_FAILED {
            let layout = Layout::from_size_align(len, HUGE_PAGE_SIZE).ok()?;
            return NonNull::new(raw.cast()).map(|ptr| Self {
                ptr,
                layout,
                storage: Storage::HugeTlb { mapped },
            });
        }
        let buffer = Self::with_alignment(len, HUGE_PAGE_SIZE)?;
        // SAFETY: advice about memory this buffer owns; failure only means no THP.
        unsafe { libc::madvise(buffer.ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        Some(buffer)
    }

    /// `len` zeroed bytes in a sealed memfd of their own (its size rounded up to
    /// [`PAGE_SIZE`]), mapped shared: memory a same-host peer can map once it is handed the
    /// descriptor ([`AlignedBuffer::memfd`]), so that a transfer is one `memcpy` there.
    /// `name` shows in `/proc/<pid>/maps` as `/memfd:<name>`.
    pub fn shared(len: usize, name: &str) -> Result<Self, ShmError> {
        let mapped = len
            .checked_next_multiple_of(PAGE_SIZE)
            .filter(|&m| m > 0)
            .ok_or_else(|| ShmError::Invalid(format!("a shared buffer of {len} bytes")))?;
        let layout = Layout::from_size_align(len, PAGE_SIZE)
            .map_err(|e| ShmError::Invalid(e.to_string()))?;
        let memfd = Arc::new(MemFd::create(name, mapped)?);
        let ptr = memfd.map_raw(mapped)?;
        Ok(Self {
            ptr,
            layout,
            storage: Storage::Memfd { memfd },
        })
    }

    /// The memfd holding the bytes, for a buffer made by [`AlignedBuffer::shared`].
    pub fn memfd(&self) -> Option<&Arc<MemFd>> {
        match &self.storage {
            Storage::Memfd { memfd } => Some(memfd),
            Storage::Heap | Storage::HugeTlb { .. } => None,
        }
    }

    /// Whether the bytes sit on explicit (hugetlbfs) huge pages.
    pub fn is_huge_tlb(&self) -> bool {
        matches!(self.storage, Storage::HugeTlb { .. })
    }

    /// Start address.
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Raw pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Always false: a buffer has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    // No `as_slice`/`as_mut_slice`: a buffer made by `shared` lives in a memfd that a
    // same-host peer maps and writes whenever it likes, and any registered buffer is written
    // by peers and NICs. A `&[u8]` or `&mut [u8]` promises that nothing else writes the bytes
    // while it lives (`std::slice::from_raw_parts`'s contract), which safe code in another
    // mapping breaks at will; so the bytes are reached only by copies through raw pointers,
    // which promise nothing about other writers.

    /// The pointer to `offset..offset + len`, or why that is outside the buffer.
    fn at(&self, offset: usize, len: usize) -> Result<*mut u8, MemoryError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(MemoryError::OutOfRange {
                addr: self.addr().wrapping_add(offset),
                len,
                region_addr: self.addr(),
                region_len: self.len(),
            });
        }
        // SAFETY: `offset + len <= self.len()` (checked), so the pointer stays inside the
        // allocation (`pointer::add` requires staying in bounds).
        Ok(unsafe { self.ptr.as_ptr().add(offset) })
    }

    /// Copies `src` into the buffer at `offset` (one `memcpy`).
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<(), MemoryError> {
        let dst = self.at(offset, src.len())?;
        // SAFETY: `dst` is valid for `src.len()` writes (inside the buffer, checked by `at`,
        // and the buffer lives as long as `self`); `src` is a borrow of other memory: a
        // caller cannot hold a Rust reference into this buffer, since none is handed out.
        // Others writing these bytes at once leave them unspecified, as with DMA; no Rust
        // reference to them exists to be invalidated.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` of the buffer into `dst` (one `memcpy`).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<(), MemoryError> {
        let src = self.at(offset, dst.len())?;
        // SAFETY: `src` is valid for `dst.len()` reads (checked by `at`); `dst` is the caller's
        // exclusive borrow of other memory (no reference into this buffer is handed out).
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Sets every byte of the buffer to `byte` (one `memset`).
    pub fn fill(&self, byte: u8) {
        // SAFETY: `ptr` is valid for `len` writes for as long as `self` lives; no Rust
        // reference into the buffer exists (none is handed out).
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr(), byte, self.len()) };
    }

    /// Faults every page in with `threads` threads, each rewriting the first byte of every
    /// page of its own chunk, so that later transfers and registrations do not pay for page
    /// faults. Contents are kept.
    pub fn pretouch(&mut self, threads: usize) {
        let threads = threads.max(1);
        let len = self.len();
        let chunk = len.div_ceil(threads).next_multiple_of(PAGE_SIZE);
        let buffer = &*self;
        std::thread::scope(|scope| {
            for from in (0..len).step_by(chunk) {
                let to = (from + chunk).min(len);
                scope.spawn(move || {
                    for page in (from..to).step_by(PAGE_SIZE) {
                        // SAFETY: `page < len`, so the pointer stays inside the buffer, which
                        // outlives the scope (`&mut self` is held across it, so nothing else
                        // of this process copies meanwhile); the chunks are disjoint, so no
                        // two threads touch one byte. Volatile, so neither access is elided:
                        // the write is what faults the page in for writing.
                        unsafe {
                            let byte = buffer.ptr.as_ptr().add(page);
                            byte.write_volatile(byte.read_volatile());
                        }
                    }
                });
            }
        });
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        match &self.storage {
            // SAFETY: `ptr` came from `alloc_zeroed` with exactly `self.layout`; freed once.
            Storage::Heap => unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) },
            // SAFETY: `ptr` starts a mapping of `mapped` bytes; unmapped once.
            Storage::HugeTlb { mapped } => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), *mapped);
            },
            // SAFETY: `ptr` starts a mapping of all of the memfd (`shared`); unmapped once.
            // The memfd itself closes when its last holder lets go.
            Storage::Memfd { memfd } => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), memfd.len());
            },
        }
    }
}

/// When to pre-touch a buffer before registering it.
///
/// The default follows Mooncake's trigger: buffers of at least 4 GiB, on hosts with at least
/// 4 cores and at least one NIC to register on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PretouchPolicy {
    /// Smallest buffer that is pre-touched.
    pub min_len: usize,
    /// Fewest cores on which pre-touch pays off.
    pub min_cores: usize,
    /// Fewest NICs the buffer will be registered on.
    pub min_nics: usize,
    /// Upper bound on threads used.
    pub max_threads: usize,
}

impl Default for PretouchPolicy {
    fn default() -> Self {
        Self {
            min_len: 4 << 30,
            min_cores: 4,
            min_nics: 1,
            max_threads: 16,
        }
    }
}

impl PretouchPolicy {
    /// A policy that always pre-touches, with up to `max_threads` threads.
    pub fn always(max_threads: usize) -> Self {
        Self {
            min_len: 0,
            min_cores: 0,
            min_nics: 0,
            max_threads,
        }
    }

    /// A policy that never pre-touches.
    pub fn never() -> Self {
        Self {
            min_len: usize::MAX,
            ..Self::default()
        }
    }

    /// How many threads to pre-touch a buffer of `len` bytes with on a host with `cores`
    /// cores and `nics` NICs; 0 means "do not pre-touch".
    pub fn threads_for(&self, len: usize, cores: usize, nics: usize) -> usize {
        if len < self.min_len || cores < self.min_cores || nics < self.min_nics {
            return 0;
        }
        // Mooncake's rule: 16 threads on very large hosts, else up to 8.
        let wanted = if cores > 64 { 16 } else { cores.min(8) };
        wanted.clamp(1, self.max_threads.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contents(buf: &AlignedBuffer) -> Vec<u8> {
        let mut bytes = vec![0u8; buf.len()];
        buf.read_at(0, &mut bytes).unwrap();
        bytes
    }

    #[test]
    fn buffers_are_aligned_zeroed_and_writable() {
        let len = 3 * PAGE_SIZE + 5;
        let mut buf = AlignedBuffer::new(len).unwrap();
        assert_eq!(buf.addr() % PAGE_SIZE, 0);
        assert!(contents(&buf).iter().all(|&b| b == 0));
        buf.write_at(3 * PAGE_SIZE + 4, &[7]).unwrap();
        buf.write_at(PAGE_SIZE, &[5]).unwrap();
        buf.pretouch(3);
        let seen = contents(&buf);
        assert_eq!(
            (seen[3 * PAGE_SIZE + 4], seen[PAGE_SIZE]),
            (7, 5),
            "pre-touch keeps contents"
        );
        // Copies outside the buffer are refused, not made.
        assert!(matches!(
            buf.write_at(len - 1, &[1, 2]),
            Err(MemoryError::OutOfRange { .. })
        ));
        assert!(buf.read_at(usize::MAX, &mut [0u8; 2]).is_err());
        buf.fill(0x5a);
        assert!(contents(&buf).iter().all(|&b| b == 0x5a));
        assert!(AlignedBuffer::new(0).is_none());
        let huge_aligned = AlignedBuffer::with_alignment(10, 2 << 20).unwrap();
        assert_eq!(huge_aligned.addr() % (2 << 20), 0);
    }

    #[test]
    fn huge_buffers_are_huge_page_aligned_with_or_without_reserved_pages() {
        let buf = AlignedBuffer::huge(3 << 20).unwrap();
        assert_eq!(buf.addr() % HUGE_PAGE_SIZE, 0);
        assert_eq!(buf.len(), 3 << 20);
        buf.write_at((3 << 20) - 1, &[9]).unwrap();
        assert_eq!(contents(&buf)[(3 << 20) - 1], 9);
        let reserved = std::fs::read_to_string("/proc/sys/vm/nr_hugepages")
            .ok()
            .and_then(|n| n.trim().parse::<usize>().ok())
            .unwrap_or(0);
        if reserved == 0 {
            assert!(
                !buf.is_huge_tlb(),
                "no huge pages are reserved, yet MAP_HUGETLB worked"
            );
        }
        assert!(AlignedBuffer::huge(0).is_none());
    }

    #[test]
    fn shared_buffers_live_in_a_memfd_others_can_map() {
        let mut buf = AlignedBuffer::shared(5000, "tern-buffer-test").unwrap();
        assert_eq!((buf.len(), buf.addr() % PAGE_SIZE), (5000, 0));
        assert!(contents(&buf).iter().all(|&b| b == 0));
        buf.write_at(4999, &[42]).unwrap();
        buf.pretouch(2);
        let memfd = buf.memfd().unwrap().clone();
        assert_eq!(memfd.len(), 2 * PAGE_SIZE);
        let other = crate::shm::SharedMapping::map(&memfd).unwrap();
        let mut byte = [0u8; 1];
        other.read_bytes(4999, &mut byte).unwrap();
        assert_eq!(byte[0], 42);
        drop(buf);
        // The memfd outlives the buffer's own mapping while someone holds it.
        other.read_bytes(4999, &mut byte).unwrap();
        assert_eq!(byte[0], 42);
        assert!(AlignedBuffer::new(10).unwrap().memfd().is_none());
        assert!(AlignedBuffer::shared(0, "x").is_err());
    }

    #[test]
    fn default_policy_matches_the_mooncake_trigger() {
        let policy = PretouchPolicy::default();
        assert_eq!(policy.threads_for(4 << 30, 4, 1), 4);
        assert_eq!(policy.threads_for(4 << 30, 128, 1), 16);
        assert_eq!(policy.threads_for((4 << 30) - 1, 8, 1), 0);
        assert_eq!(policy.threads_for(4 << 30, 2, 1), 0);
        assert_eq!(policy.threads_for(4 << 30, 8, 0), 0);
        assert_eq!(
            PretouchPolicy::never().threads_for(usize::MAX - 1, 64, 8),
            0
        );
        assert_eq!(PretouchPolicy::always(2).threads_for(1, 8, 0), 2);
    }
}
