//! Registered memory: regions, the registry, and pins.
//!
//! The bytes of a registered region are shared: a peer may write them over the network while
//! the application reads them, just as an RDMA NIC would. Tern therefore treats them as raw
//! bytes, never as Rust objects: no `&[u8]` or `&mut [u8]` is ever made over them. They are
//! reached through a [`RegionSlice`] — a pointer and a length, with the provenance of the
//! region's own base pointer — by system calls (`recv`, `sendmsg`) that the kernel carries
//! out, and by raw copies to and from the caller's own buffers. Concurrent transfers to
//! overlapping bytes leave those bytes unspecified (as with DMA); they never touch memory
//! outside a registered region.

use std::any::Any;
use std::io::{self, Read, Write};
use std::marker::PhantomData;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::buffer::AlignedBuffer;
use crate::device::DeviceRange;
use crate::map::{MapError, RegionMap};
pub use tern_cuda::MemoryKind;

/// What went wrong with registered memory. Each variant names the addresses involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MemoryError {
    /// A region of zero bytes was given; register at least one byte.
    #[error("zero-length memory region at {addr:#x}")]
    ZeroLength {
        /// Start address given.
        addr: usize,
    },
    /// `addr + len` overflows the address space; the range is invalid.
    #[error("memory range at {addr:#x} with length {len} overflows the address space")]
    Overflow {
        /// Start address given.
        addr: usize,
        /// Length given.
        len: usize,
    },
    /// The range overlaps a region that is already registered; unregister that one first
    /// or register a disjoint range.
    #[error("memory [{addr:#x}, +{len}) overlaps the registered region at {existing:#x}")]
    Overlap {
        /// Start address given.
        addr: usize,
        /// Length given.
        len: usize,
        /// Start of the registered region it overlaps.
        existing: usize,
    },
    /// No registered region contains the whole range; register the memory first, or keep
    /// the transfer inside one region.
    #[error("memory [{addr:#x}, +{len}) is not inside one registered region")]
    NotRegistered {
        /// Start address given.
        addr: usize,
        /// Length given.
        len: usize,
    },
    /// The region exists but was registered without remote access, so peers may not touch it.
    #[error("memory region at {addr:#x} is not remote-accessible")]
    NotRemoteAccessible {
        /// Start of the region.
        addr: usize,
    },
    /// The region is still used by transfers in flight; wait for them (or cancel them and
    /// wait) before unregistering.
    #[error("memory region at {addr:#x} is in use by {pins} transfer(s) in flight")]
    InUse {
        /// Start of the region.
        addr: usize,
        /// Transfers still holding it.
        pins: usize,
    },
    /// An access reached outside the pinned region (a bug in the caller's range arithmetic).
    #[error("access [{addr:#x}, +{len}) is outside region [{region_addr:#x}, +{region_len})")]
    OutOfRange {
        /// Start of the access.
        addr: usize,
        /// Length of the access.
        len: usize,
        /// Start of the region.
        region_addr: usize,
        /// Length of the region.
        region_len: usize,
    },
    /// The CPU was asked to touch device memory, which only the driver's copies may reach (a
    /// transport that cannot stage device memory declines it).
    #[error("[{addr:#x}, +{len}) is device memory, which the CPU does not touch")]
    DeviceMemory {
        /// Start of the access.
        addr: usize,
        /// Length of the access.
        len: usize,
    },
    /// Device memory could not be used: no CUDA driver, or a driver call failed.
    #[error("device memory at {addr:#x}: {reason}")]
    Device {
        /// Start of the memory.
        addr: usize,
        /// What the driver said (or that there is none).
        reason: tern_cuda::CudaError,
    },
    /// The location a region was registered with is not where its memory is.
    #[error(
        "memory at {addr:#x} was registered as {location} but is {found}; register it with its own location or `*`"
    )]
    LocationMismatch {
        /// Start of the memory.
        addr: usize,
        /// The location given.
        location: String,
        /// What the memory is.
        found: String,
    },
}

impl From<MapError> for MemoryError {
    fn from(error: MapError) -> Self {
        match error {
            MapError::ZeroLength { start } => Self::ZeroLength { addr: start },
            MapError::Overflow { start, len } => Self::Overflow { addr: start, len },
            MapError::Overlap {
                start,
                len,
                existing,
            } => Self::Overlap {
                addr: start,
                len,
                existing,
            },
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// The public facts of a region: where it is, how long, where it lives, who may touch it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    /// Start address.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Location as Mooncake names it: `cpu:<numa>`, `cuda:<n>`, or `*`.
    pub location: String,
    /// Whether peers may read and write it.
    pub remote_accessible: bool,
    /// Host or device memory: every transport asks this, none guesses.
    pub kind: MemoryKind,
}

/// Something that must live exactly as long as a region is registered (a device's
/// registration of the region's memory, say).
type Attachment = Box<dyn Any + Send + Sync>;

/// A range of memory Tern may move bytes to and from.
#[derive(Debug)]
pub struct Region {
    pub(crate) info: RegionInfo,
    /// The start, as the pointer it was registered with: every access derives from it.
    base: NonNull<u8>,
    /// Dropped when the region is unregistered, or with the region; declared before `owner`
    /// so that they go before the memory they describe.
    attachments: Mutex<Vec<Attachment>>,
    pub(crate) owner: Option<AlignedBuffer>,
    /// The device whose memory this is, for device regions.
    pub(crate) device: Option<&'static tern_cuda::Device>,
    pins: AtomicUsize,
}

// SAFETY: the region's bytes are only reached through raw pointers derived from `base` by
// copies and system calls (module docs), never through references, so no thread affinity or
// aliasing assumption attaches to them; the rest is plain data, atomics and a mutex.
unsafe impl Send for Region {}
// SAFETY: see Send.
unsafe impl Sync for Region {}

impl Region {
    /// A region over memory Tern does not own.
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must be valid for reads and writes by any thread from now until
    /// the region has been unregistered from every [`MemoryRegistry`] it was added to and
    /// every [`RegionPin`] on it has been dropped ([`MemoryRegistry::unregister`] returning
    /// `Ok` guarantees both). The caller must not rely on Rust's aliasing guarantees for those
    /// bytes meanwhile: peers may change them at any time.
    pub unsafe fn from_raw(
        addr: *mut u8,
        len: usize,
        location: impl Into<String>,
        remote_accessible: bool,
    ) -> Self {
        Self {
            info: RegionInfo {
                addr: addr as usize,
                len,
                location: location.into(),
                remote_accessible,
                kind: MemoryKind::Host,
            },
            base: NonNull::new(addr).unwrap_or(NonNull::dangling()),
            attachments: Mutex::new(Vec::new()),
            owner: None,
            device: None,
            pins: AtomicUsize::new(0),
        }
    }

    /// A region over a buffer it owns; the memory lives as long as the region.
    pub fn owned(
        buffer: AlignedBuffer,
        location: impl Into<String>,
        remote_accessible: bool,
    ) -> Self {
        Self {
            info: RegionInfo {
                addr: buffer.addr(),
                len: buffer.len(),
                location: location.into(),
                remote_accessible,
                kind: MemoryKind::Host,
            },
            base: NonNull::new(buffer.as_ptr()).unwrap_or(NonNull::dangling()),
            attachments: Mutex::new(Vec::new()),
            owner: Some(buffer),
            device: None,
            pins: AtomicUsize::new(0),
        }
    }

    /// The region's facts.
    pub fn info(&self) -> &RegionInfo {
        &self.info
    }

    /// Start address.
    pub fn addr(&self) -> usize {
        self.info.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.info.len
    }

    /// Whether the region has zero bytes (never true once registered).
    pub fn is_empty(&self) -> bool {
        self.info.len == 0
    }

    /// Whether the region owns its memory (and so outlives any registry entry safely).
    pub fn is_owned(&self) -> bool {
        self.owner.is_some()
    }

    /// Transfers currently holding the region.
    pub fn pin_count(&self) -> usize {
        self.pins.load(Ordering::Acquire)
    }

    /// Drops everything attached to the region.
    fn detach_all(&self) {
        let detached = std::mem::take(&mut *lock(&self.attachments));
        drop(detached);
    }

    /// Pins an owned region directly (its owner reading or writing its own bytes). Raw
    /// regions can only be pinned through their registry, which is what makes
    /// [`MemoryRegistry::unregister`]'s in-use check sound; for them this returns `None`.
    pub fn pin_owned(self: &Arc<Self>) -> Option<RegionPin> {
        self.is_owned().then(|| RegionPin::new(self.clone()))
    }
}

/// Registration of memory Tern does not own, for anything that keeps a [`MemoryRegistry`]
/// behind a safe [`RegisterRaw::register_region`]. The raw-pointer entry points live here, in
/// the crate allowed `unsafe`, so implementors write no `unsafe` themselves.
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
    fn new(region: Arc<Region>) -> Self {
        region.pins.fetch_add(1, Ordering::AcqRel);
        Self { region }
    }

    /// The pinned region's facts.
    pub fn info(&self) -> &RegionInfo {
        &self.region.info
    }

    /// Ties `attachment` to the region: it is dropped when the region is unregistered
    /// ([`MemoryRegistry::unregister`] returning `Ok`), or when the region itself goes (an
    /// owned region removed while transfers still held it), always before the region's
    /// memory is released. A device registration of the region's memory lives here, so it
    /// can never outlive the memory.
    pub fn attach(&self, attachment: Attachment) {
        lock(&self.region.attachments).push(attachment);
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

    /// Copies `[addr, addr + len)` of this pinned region to `[offset, offset + len)` of a
    /// same-host peer's device memory mapped here (`to_peer`), or back, with the GPU's copy
    /// engine; both ranges are checked first. The CPU touches neither side.
    pub fn copy_with_peer_device(
        &self,
        addr: usize,
        len: usize,
        peer: &tern_cuda::PeerMemory,
        offset: u64,
        to_peer: bool,
    ) -> Result<(), MemoryError> {
        let local = match self.device_range(addr, len)? {
            Some(range) => range.addr,
            None => self.slice(addr, len)?.as_ptr() as u64,
        };
        let inside = offset
            .checked_add(len as u64)
            .is_some_and(|end| end <= peer.len());
        if !inside {
            return Err(MemoryError::OutOfRange {
                addr: offset as usize,
                len,
                region_addr: 0,
                region_len: peer.len() as usize,
            });
        }
        let remote = peer.addr() + offset;
        let (dst, src) = if to_peer {
            (remote, local)
        } else {
            (local, remote)
        };
        // SAFETY: the local range lies in this pinned region (checked above), which stays
        // registered, allocated and writable by Tern while pinned; the peer's range lies in
        // memory this process mapped or opened and holds through the borrow of `peer`
        // (checked above). The peer's bytes change only by copies like this one, and what
        // the local side holds meanwhile is the caller's to order, as for every transfer.
        unsafe { peer.device().copy_any(dst, src, len) }
            .map_err(|reason| MemoryError::Device { addr, reason })
    }

    /// Copies `[src_addr, src_addr + len)` of this pinned region to `[dst_addr, dst_addr +
    /// len)` of `dst` when either is device memory, with the GPU's copy engine (two regions
    /// of one process: unified addressing reaches both). Both ranges are checked first.
    pub fn copy_to_with_device(
        &self,
        src_addr: usize,
        dst: &RegionPin,
        dst_addr: usize,
        len: usize,
    ) -> Result<(), MemoryError> {
        let address = |pin: &RegionPin,
                       addr: usize|
         -> Result<(u64, Option<&'static tern_cuda::Device>), MemoryError> {
            Ok(match pin.device_range(addr, len)? {
                Some(range) => (range.addr, Some(range.device)),
                None => (pin.slice(addr, len)?.as_ptr() as u64, None),
            })
        };
        let (from, from_device) = address(self, src_addr)?;
        let (to, to_device) = address(dst, dst_addr)?;
        let Some(device) = to_device.or(from_device) else {
            return Err(MemoryError::DeviceMemory {
                addr: src_addr,
                len,
            });
        };
        // SAFETY: both ranges lie in pinned regions (checked above), which stay registered,
        // allocated and writable by Tern while pinned; what else touches them meanwhile is
        // the caller's to order, as for every transfer.
        unsafe { device.copy_any(to, from, len) }.map_err(|reason| MemoryError::Device {
            addr: dst_addr,
            reason,
        })
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

    fn slice_io(&self, addr: usize, len: usize) -> io::Result<RegionSlice<'_>> {
        self.slice(addr, len)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    }

    /// Fills `[addr, addr + len)` straight from `source` (no staging copy for sockets).
    pub fn read_exact_from(
        &self,
        addr: usize,
        len: usize,
        source: &mut impl RegionIo,
    ) -> io::Result<()> {
        let mut rest = self.slice_io(addr, len)?;
        while !rest.is_empty() {
            match source.read_into(rest) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => rest = rest.skip(n.min(rest.len())),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Sends `prefix` and then `[addr, addr + len)` to `sink`, gathered into as few system
    /// calls as it allows (a request header and its body in one packet).
    pub fn write_prefixed_to(
        &self,
        prefix: &[u8],
        addr: usize,
        len: usize,
        sink: &mut impl RegionIo,
    ) -> io::Result<()> {
        let (mut head, mut body) = (prefix, self.slice_io(addr, len)?);
        while !head.is_empty() || !body.is_empty() {
            let written = match sink.write_from(head, body) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            let from_head = written.min(head.len());
            head = &head[from_head..];
            body = body.skip((written - from_head).min(body.len()));
        }
        Ok(())
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

/// Some bytes of a pinned region: a pointer (with the provenance of the region's base) and a
/// length, never a Rust reference, since peers, NICs and other connections may write these
/// bytes at any moment. Valid for as long as the pin it came from is borrowed.
#[derive(Debug, Clone, Copy)]
pub struct RegionSlice<'a> {
    ptr: NonNull<u8>,
    len: usize,
    _pin: PhantomData<&'a RegionPin>,
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

    /// One `recv(2)` from `fd` into the slice; returns the bytes received (0: end of stream).
    pub fn recv_from(&self, fd: BorrowedFd<'_>) -> io::Result<usize> {
        // SAFETY: the kernel writes at most `len` bytes at `ptr`, all inside the pinned region
        // (valid for writes while pinned); no Rust reference to those bytes exists.
        let got = unsafe { libc::recv(fd.as_raw_fd(), self.ptr.as_ptr().cast(), self.len, 0) };
        if got < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(got as usize)
    }

    /// One `sendmsg(2)` of `prefix` and then the slice to `fd` (without SIGPIPE); returns the
    /// bytes sent, prefix included.
    pub fn send_to(&self, fd: BorrowedFd<'_>, prefix: &[u8]) -> io::Result<usize> {
        let mut iov = [
            libc::iovec {
                iov_base: prefix.as_ptr().cast_mut().cast(),
                iov_len: prefix.len(),
            },
            libc::iovec {
                iov_base: self.ptr.as_ptr().cast(),
                iov_len: self.len,
            },
        ];
        let skip = usize::from(prefix.is_empty());
        // SAFETY: msghdr is plain data; zero is valid (no name, no control data).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov[skip..].as_mut_ptr();
        msg.msg_iovlen = 2 - skip;
        // SAFETY: both iovecs describe readable memory for the call's duration: `prefix` is
        // borrowed, the slice lies in the pinned region; the kernel only reads them.
        let sent = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(sent as usize)
    }
}

/// What [`wait_ready`] found a file descriptor ready for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ready {
    /// Readable (data, or the peer closed).
    pub read: bool,
    /// Writable.
    pub write: bool,
    /// An error or hang-up is pending (the next read or write reports it).
    pub failed: bool,
}

/// Waits up to `timeout` (`None`: for ever) until `fd` is readable (if `read`) or writable
/// (if `write`): one `poll(2)`. Returns what it is ready for; nothing on timeout.
pub fn wait_ready(
    fd: BorrowedFd<'_>,
    read: bool,
    write: bool,
    timeout: Option<std::time::Duration>,
) -> io::Result<Ready> {
    let mut events = 0;
    if read {
        events |= libc::POLLIN;
    }
    if write {
        events |= libc::POLLOUT;
    }
    let mut pollfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events,
        revents: 0,
    };
    let millis = timeout.map_or(-1, |t| {
        t.as_millis().clamp(0, i32::MAX as u128) as libc::c_int
    });
    // SAFETY: one valid pollfd for the duration of the call; the fd is borrowed, so open.
    let got = unsafe { libc::poll(&mut pollfd, 1, millis) };
    if got < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(Ready::default())
        } else {
            Err(e)
        };
    }
    let revents = pollfd.revents;
    Ok(Ready {
        read: revents & libc::POLLIN != 0,
        write: revents & libc::POLLOUT != 0,
        failed: revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0,
    })
}

/// One `recv(2)` from `fd` into `buf` that does not wait (`MSG_DONTWAIT`): what has arrived,
/// up to `buf.len()`; `WouldBlock` if nothing has, 0 at end of stream.
pub fn recv_now(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: the kernel writes at most `buf.len()` bytes into `buf`, which is borrowed
    // mutably for the call; the fd is borrowed, so open.
    let got = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(got as usize)
}

/// A byte stream that registered memory is read into and written from without a Rust
/// reference to it: sockets through [`RegionSlice::recv_from`] and
/// [`RegionSlice::send_to`], anything else through [`Staged`]'s bounce buffer.
pub trait RegionIo {
    /// Reads some bytes into `dst`; returns how many (0 at end of stream).
    fn read_into(&mut self, dst: RegionSlice<'_>) -> io::Result<usize>;

    /// Writes `prefix` and then `src`, as much as one call takes; returns how many bytes.
    fn write_from(&mut self, prefix: &[u8], src: RegionSlice<'_>) -> io::Result<usize>;
}

impl RegionIo for std::net::TcpStream {
    fn read_into(&mut self, dst: RegionSlice<'_>) -> io::Result<usize> {
        dst.recv_from(self.as_fd())
    }

    fn write_from(&mut self, prefix: &[u8], src: RegionSlice<'_>) -> io::Result<usize> {
        src.send_to(self.as_fd(), prefix)
    }
}

impl RegionIo for std::os::unix::net::UnixStream {
    fn read_into(&mut self, dst: RegionSlice<'_>) -> io::Result<usize> {
        dst.recv_from(self.as_fd())
    }

    fn write_from(&mut self, prefix: &[u8], src: RegionSlice<'_>) -> io::Result<usize> {
        src.send_to(self.as_fd(), prefix)
    }
}

/// Any `Read + Write` as a [`RegionIo`], through a bounce buffer: one more copy, for tests,
/// fuzzing and in-memory streams.
#[derive(Debug)]
pub struct Staged<T> {
    /// The stream.
    pub inner: T,
    bounce: Vec<u8>,
}

impl<T> Staged<T> {
    /// Wraps `inner`.
    pub fn new(inner: T) -> Self {
        Self {
            inner,
            bounce: Vec::new(),
        }
    }
}

/// The bounce buffer's size: bytes moved per call.
const BOUNCE: usize = 64 << 10;

impl<T: Read> Read for Staged<T> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read(buf)
    }
}

impl<T: Write> Write for Staged<T> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<T: Read + Write> RegionIo for Staged<T> {
    fn read_into(&mut self, dst: RegionSlice<'_>) -> io::Result<usize> {
        self.bounce.resize(dst.len().min(BOUNCE), 0);
        let got = self.inner.read(&mut self.bounce)?;
        Ok(dst.copy_from(&self.bounce[..got]))
    }

    fn write_from(&mut self, prefix: &[u8], src: RegionSlice<'_>) -> io::Result<usize> {
        if !prefix.is_empty() {
            return self.inner.write(prefix);
        }
        self.bounce.resize(src.len().min(BOUNCE), 0);
        let n = src.copy_to(&mut self.bounce);
        self.inner.write(&self.bounce[..n])
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

/// The set of registered regions of one process (or one engine).
#[derive(Debug, Default)]
pub struct MemoryRegistry {
    regions: RwLock<RegionMap<Arc<Region>>>,
}

impl MemoryRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn read(&self) -> RwLockReadGuard<'_, RegionMap<Arc<Region>>> {
        // A poisoned lock only means a panic elsewhere; the map itself is always consistent
        // because every mutation is a single BTreeMap call.
        self.regions.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, RegionMap<Arc<Region>>> {
        self.regions.write().unwrap_or_else(|p| p.into_inner())
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
        self.write()
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
        let mut regions = self.write();
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
        let mut regions = self.write();
        let owned = regions.get(addr).is_some_and(|(_, r)| r.is_owned());
        if owned {
            regions.remove(addr).map(|(_, r)| r)
        } else {
            None
        }
    }

    /// Pins the region that contains all of `[addr, addr + len)`.
    pub fn pin(&self, addr: usize, len: usize) -> Result<RegionPin, MemoryError> {
        let regions = self.read();
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
        Ok(self.read().first_overlap(addr, len)?.is_some())
    }

    /// The facts of every region, in address order.
    pub fn snapshot(&self) -> Vec<RegionInfo> {
        self.read().iter().map(|(_, _, r)| r.info.clone()).collect()
    }

    /// Number of registered regions.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// Whether no region is registered.
    pub fn is_empty(&self) -> bool {
        self.read().is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn pinned_access_is_range_checked_and_moves_bytes() {
        let registry = MemoryRegistry::new();
        let region = registry.register(owned(4096, true)).unwrap();
        let base = region.addr();
        let pin = registry.pin(base, 4096).unwrap();
        pin.copy_from_slice(base + 100, b"hello").unwrap();
        let mut out = [0u8; 5];
        pin.copy_to_slice(base + 100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        let mut sink = Staged::new(std::io::Cursor::new(Vec::new()));
        pin.write_prefixed_to(b">", base + 100, 5, &mut sink)
            .unwrap();
        assert_eq!(sink.inner.get_ref(), b">hello");
        let mut source = Staged::new(std::io::Cursor::new(b"world!".to_vec()));
        pin.read_exact_from(base + 4090, 6, &mut source).unwrap();
        pin.copy_to_slice(base + 4090, &mut out).unwrap();
        assert_eq!(&out, b"world");
        assert!(matches!(
            pin.copy_from_slice(base + 4095, b"xy"),
            Err(MemoryError::OutOfRange { .. })
        ));
        assert!(
            pin.write_prefixed_to(&[], usize::MAX, 2, &mut sink)
                .is_err()
        );
        assert!(pin.slice(base - 1, 1).is_err());
        assert!(pin.slice(base, usize::MAX).is_err());
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
