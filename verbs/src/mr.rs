//! Memory regions: memory the NIC may touch, and the keys that name it.

use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rdma_sys as sys;

use crate::error::{VerbsError, errno};
use crate::pd::ProtectionDomain;

/// Access rights of a memory region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Access {
    /// Peers may RDMA WRITE into it.
    pub remote_write: bool,
    /// Peers may RDMA READ from it.
    pub remote_read: bool,
    /// Ask for PCIe relaxed ordering (dropped silently where unsupported).
    pub relaxed_ordering: bool,
}

impl Access {
    /// Local use only.
    pub const LOCAL: Self = Self {
        remote_write: false,
        remote_read: false,
        relaxed_ordering: false,
    };
    /// Peers may read and write.
    pub const REMOTE: Self = Self {
        remote_write: true,
        remote_read: true,
        relaxed_ordering: false,
    };

    pub(crate) fn bits(self) -> u32 {
        let mut bits = sys::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
        if self.remote_write {
            bits |= sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
        }
        if self.remote_read {
            bits |= sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        }
        bits
    }
}

/// The locked-memory line of /proc/self/limits, e.g. `65536 bytes`.
fn memlock_limit() -> Option<String> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))?;
    let fields: Vec<&str> = line.split_whitespace().collect();
    fields.get(3).map(|soft| match fields.get(5) {
        Some(unit) if *soft != "unlimited" => format!("{soft} {unit}"),
        _ => (*soft).to_owned(),
    })
}

static LIVE_MEMORY_REGIONS: AtomicUsize = AtomicUsize::new(0);

/// Memory regions this process has registered and not yet deregistered.
pub fn live_memory_regions() -> usize {
    LIVE_MEMORY_REGIONS.load(Ordering::Relaxed)
}

/// Registered memory: the NIC may read and write `[addr, addr + len)`.
#[derive(Debug)]
pub struct MemoryRegion {
    mr: NonNull<sys::ibv_mr>,
    pd: Arc<ProtectionDomain>,
    access: Access,
}

// SAFETY: the MR is immutable after registration; released only in Drop.
unsafe impl Send for MemoryRegion {}
// SAFETY: see Send.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    ///
    /// `[addr, addr + len)` must stay mapped and not be freed until this region is dropped:
    /// the NIC (and, with remote access, peers) may read and write it at any time until then.
    pub unsafe fn register(
        pd: &Arc<ProtectionDomain>,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Self, VerbsError> {
        let plain = access.bits();
        let relaxed = plain | sys::ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING.0;
        let attempt = |bits: u32| {
            // SAFETY: the caller keeps the range valid while the MR lives; the PD is alive.
            unsafe { sys::ibv_reg_mr(pd.pd.as_ptr(), addr.cast(), len, bits as c_int) }
        };
        let mut mr = if access.relaxed_ordering {
            attempt(relaxed)
        } else {
            ptr::null_mut()
        };
        if mr.is_null() {
            mr = attempt(plain);
        }
        let Some(mr) = NonNull::new(mr) else {
            let errno = errno();
            const ENOMEM: i32 = 12;
            const EPERM: i32 = 1;
            if (errno == ENOMEM || errno == EPERM)
                && let Some(limit) = memlock_limit().filter(|l| l != "unlimited")
            {
                return Err(VerbsError::MemlockLimit { len, limit });
            }
            return Err(VerbsError::RegMr { len, errno });
        };
        LIVE_MEMORY_REGIONS.fetch_add(1, Ordering::Relaxed);
        Ok(Self {
            mr,
            pd: pd.clone(),
            access,
        })
    }

    /// Registers `len` bytes of a DMA-BUF (device memory such as a GPU's), at `offset` into
    /// the buffer behind `fd`, addressed by peers as `iova`.
    ///
    /// # Safety
    ///
    /// `fd` must be a DMA-BUF file descriptor whose buffer stays allocated until this region
    /// is dropped.
    #[cfg(feature = "dmabuf")]
    pub unsafe fn register_dmabuf(
        pd: &Arc<ProtectionDomain>,
        fd: i32,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<Self, VerbsError> {
        // SAFETY: the caller keeps the DMA-BUF alive while the MR lives; the PD is alive.
        let mr = unsafe {
            sys::ibv_reg_dmabuf_mr(
                pd.pd.as_ptr(),
                offset,
                len,
                iova,
                fd,
                access.bits() as c_int,
            )
        };
        let mr = NonNull::new(mr).ok_or_else(|| VerbsError::RegMr {
            len,
            errno: errno(),
        })?;
        LIVE_MEMORY_REGIONS.fetch_add(1, Ordering::Relaxed);
        Ok(Self {
            mr,
            pd: pd.clone(),
            access,
        })
    }

    /// The key local work requests use.
    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is valid while self lives; the field is immutable.
        unsafe { self.mr.as_ref().lkey }
    }

    /// The key peers use.
    pub fn rkey(&self) -> u32 {
        // SAFETY: as in `lkey`.
        unsafe { self.mr.as_ref().rkey }
    }

    /// Start address.
    pub fn addr(&self) -> usize {
        // SAFETY: as in `lkey`.
        unsafe { self.mr.as_ref().addr as usize }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        // SAFETY: as in `lkey`.
        unsafe { self.mr.as_ref().length }
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The access rights asked for.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The protection domain.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once.
        unsafe { sys::ibv_dereg_mr(self.mr.as_ptr()) };
        LIVE_MEMORY_REGIONS.fetch_sub(1, Ordering::Relaxed);
    }
}
