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
//!
//! A region ([`Region`], here) is kept by the registry ([`MemoryRegistry`], `registry`) and
//! reached through pins ([`RegionPin`], `pin`), which give out slices ([`RegionSlice`],
//! `slice`) for copies and for streams ([`RegionIo`], `io`), or move device memory with the
//! GPU's copy engine (`device_copy`). Memory Tern does not own comes in by [`RegisterRaw`]
//! (`raw`); what goes wrong is a [`MemoryError`] (`error`).

use std::any::Any;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::buffer::AlignedBuffer;

mod device_copy;
mod error;
mod io;
mod pin;
mod raw;
mod registry;
mod slice;

pub use error::MemoryError;
pub(crate) use io::write_some;
pub use io::{MAX_FRAMES_PER_SEND, RegionIo, Staged, send_frames, skip_sent_frames};
pub use pin::{HoldsPin, Pinned, RegionPin};
pub use raw::RegisterRaw;
pub use registry::MemoryRegistry;
pub use slice::RegionSlice;
pub use tern_cuda::MemoryKind;

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
        let detached = std::mem::take(&mut *self.attachments.lock());
        drop(detached);
    }

    /// Pins an owned region directly (its owner reading or writing its own bytes). Raw
    /// regions can only be pinned through their registry, which is what makes
    /// [`MemoryRegistry::unregister`]'s in-use check sound; for them this returns `None`.
    pub fn pin_owned(self: &Arc<Self>) -> Option<RegionPin> {
        self.is_owned().then(|| RegionPin::new(self.clone()))
    }
}
