//! Safe, thin wrappers over libibverbs for Tern's RDMA transport.
//!
//! This is the only crate that calls `rdma-sys`: the device list, [`Context`] (an open
//! device), port and GID queries with GID auto-selection, [`ProtectionDomain`],
//! [`MemoryRegion`], [`CompletionQueue`] and RC [`QueuePair`]s with explicit
//! INIT → RTR → RTS transitions, and posting RDMA READ/WRITE (and WRITE_WITH_IMM, SEND)
//! work requests. Every handle owns its verbs object and releases it on drop; children hold
//! an `Arc` of their parent, so a parent always outlives its children. Every failing verb is
//! its own [`VerbsError`] variant carrying `errno`.
//!
//! It must not know about segments, descriptors, batches or policy (which NIC, how many QPs,
//! retries): that belongs to `tern-transport-rdma`.

mod gid;

use std::ffi::CStr;
use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use rdma_sys as sys;

pub use gid::{Gid, GidEntry, GidKind, rank_gids, read_gid_table};

/// `errno` of "function not implemented": what `ibv_get_device_list` reports on kernels
/// built without InfiniBand.
pub const ENOSYS: i32 = 38;

/// Whether a failed `ibv_get_device_list` call (NULL result) with this `errno` means "no
/// devices" rather than a failure worth reporting.
pub fn null_device_list_means_no_devices(errno: i32) -> bool {
    errno == ENOSYS || errno == 0
}

/// A verb that failed. Each variant is one verb and carries `errno`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// `ibv_get_device_list` failed for a reason other than "no RDMA in this kernel".
    #[error("ibv_get_device_list failed (errno {0})")]
    GetDeviceList(i32),
    /// No device has this name; `device_names()` lists what there is.
    #[error("no RDMA device named {0:?}")]
    NoSuchDevice(String),
    /// `ibv_open_device` failed.
    #[error("ibv_open_device({device}) failed (errno {errno})")]
    OpenDevice {
        /// Device name.
        device: String,
        /// errno.
        errno: i32,
    },
    /// `ibv_query_device` failed.
    #[error("ibv_query_device failed (errno {0})")]
    QueryDevice(i32),
    /// `ibv_query_port` failed.
    #[error("ibv_query_port(port {port}) failed (errno {errno})")]
    QueryPort {
        /// Port number.
        port: u8,
        /// errno.
        errno: i32,
    },
    /// `ibv_query_gid` failed.
    #[error("ibv_query_gid(port {port}, index {index}) failed (errno {errno})")]
    QueryGid {
        /// Port number.
        port: u8,
        /// GID index.
        index: u32,
        /// errno.
        errno: i32,
    },
    /// No usable GID on the port (none is RoCE with an address, or the table is empty).
    #[error("no usable GID on {device} port {port}; set the GID index by hand (MC_GID_INDEX)")]
    NoUsableGid {
        /// Device.
        device: String,
        /// Port.
        port: u8,
    },
    /// `ibv_alloc_pd` failed.
    #[error("ibv_alloc_pd failed (errno {0})")]
    AllocPd(i32),
    /// `ibv_reg_mr` failed.
    #[error("ibv_reg_mr of {len} bytes failed (errno {errno})")]
    RegMr {
        /// Bytes asked for.
        len: usize,
        /// errno.
        errno: i32,
    },
    /// `ibv_reg_mr` failed because the locked-memory limit is too low.
    #[error(
        "ibv_reg_mr of {len} bytes failed: the locked-memory limit is {limit}; raise it (`ulimit -l unlimited`, or LimitMEMLOCK= for a service)"
    )]
    MemlockLimit {
        /// Bytes asked for.
        len: usize,
        /// The limit as /proc/self/limits states it.
        limit: String,
    },
    /// `ibv_create_cq` failed.
    #[error("ibv_create_cq({entries} entries) failed (errno {errno})")]
    CreateCq {
        /// Entries asked for.
        entries: i32,
        /// errno.
        errno: i32,
    },
    /// `ibv_poll_cq` failed.
    #[error("ibv_poll_cq failed (returned {0})")]
    PollCq(i32),
    /// `ibv_create_qp` failed.
    #[error("ibv_create_qp failed (errno {0})")]
    CreateQp(i32),
    /// `ibv_modify_qp` to a state failed.
    #[error("ibv_modify_qp to {state} failed (errno {errno})")]
    ModifyQp {
        /// Target state.
        state: &'static str,
        /// errno.
        errno: i32,
    },
    /// `ibv_post_send` failed.
    #[error("ibv_post_send failed (errno {0})")]
    PostSend(i32),
    /// `ibv_post_recv` failed.
    #[error("ibv_post_recv failed (errno {0})")]
    PostRecv(i32),
    /// A work request list or SGE list was invalid before reaching the device.
    #[error("invalid work request: {0}")]
    InvalidRequest(&'static str),
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Names of the RDMA devices on this host; empty (not an error) when the kernel has no RDMA.
pub fn device_names() -> Result<Vec<String>, VerbsError> {
    let mut count: c_int = 0;
    // SAFETY: `count` is a valid out-pointer; the returned list is freed below.
    let list = unsafe { sys::ibv_get_device_list(&mut count) };
    if list.is_null() {
        let errno = errno();
        return if null_device_list_means_no_devices(errno) {
            Ok(Vec::new())
        } else {
            Err(VerbsError::GetDeviceList(errno))
        };
    }
    let names = (0..count.max(0) as usize)
        .map(|i| {
            // SAFETY: the list holds `count` valid device pointers until it is freed, and
            // ibv_get_device_name returns a NUL-terminated string owned by the device.
            unsafe { CStr::from_ptr(sys::ibv_get_device_name(*list.add(i))) }
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    // SAFETY: `list` came from ibv_get_device_list and is freed exactly once.
    unsafe { sys::ibv_free_device_list(list) };
    Ok(names)
}

/// Facts of a device that bound what may be created on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Largest memory region.
    pub max_mr_size: u64,
    /// Queue pairs.
    pub max_qp: i32,
    /// Work requests per queue.
    pub max_qp_wr: i32,
    /// SGEs per work request.
    pub max_sge: i32,
    /// Entries per completion queue.
    pub max_cqe: i32,
}

/// Facts of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortInfo {
    /// Whether the port is ACTIVE.
    pub active: bool,
    /// Active MTU as the verbs enum (1 = 256 … 5 = 4096).
    pub active_mtu: u32,
    /// LID (0 on RoCE).
    pub lid: u16,
    /// GID table length.
    pub gid_table_len: i32,
    /// Link layer (1 = InfiniBand, 2 = Ethernet).
    pub link_layer: u8,
}

impl PortInfo {
    /// The active MTU in bytes.
    pub fn mtu_bytes(&self) -> u32 {
        128 << self.active_mtu.min(5)
    }
}

/// An open RDMA device.
#[derive(Debug)]
pub struct Context {
    ctx: NonNull<sys::ibv_context>,
    name: String,
}

// SAFETY: libibverbs contexts are thread-safe; the pointer is only released in Drop.
unsafe impl Send for Context {}
// SAFETY: see Send; all methods take &self and call thread-safe verbs.
unsafe impl Sync for Context {}

impl Context {
    /// Opens the device called `name`.
    pub fn open(name: &str) -> Result<Arc<Self>, VerbsError> {
        let mut count: c_int = 0;
        // SAFETY: `count` is a valid out-pointer; the list is freed before returning.
        let list = unsafe { sys::ibv_get_device_list(&mut count) };
        if list.is_null() {
            let errno = errno();
            return Err(if null_device_list_means_no_devices(errno) {
                VerbsError::NoSuchDevice(name.to_owned())
            } else {
                VerbsError::GetDeviceList(errno)
            });
        }
        let mut opened = Err(VerbsError::NoSuchDevice(name.to_owned()));
        for i in 0..count.max(0) as usize {
            // SAFETY: index within the list's `count` entries, each a valid device.
            let device = unsafe { *list.add(i) };
            // SAFETY: as in `device_names`.
            let device_name = unsafe { CStr::from_ptr(sys::ibv_get_device_name(device)) };
            if device_name.to_bytes() == name.as_bytes() {
                // SAFETY: `device` is valid while the list lives; the context outlives it.
                let ctx = unsafe { sys::ibv_open_device(device) };
                opened = NonNull::new(ctx)
                    .map(|ctx| {
                        Arc::new(Self {
                            ctx,
                            name: name.to_owned(),
                        })
                    })
                    .ok_or_else(|| VerbsError::OpenDevice {
                        device: name.to_owned(),
                        errno: errno(),
                    });
                break;
            }
        }
        // SAFETY: `list` came from ibv_get_device_list; contexts stay valid after freeing it.
        unsafe { sys::ibv_free_device_list(list) };
        opened
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's limits.
    pub fn limits(&self) -> Result<DeviceLimits, VerbsError> {
        // SAFETY: ibv_device_attr is plain data; zero is a valid bit pattern.
        let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is a valid out-pointer.
        let rc = unsafe { sys::ibv_query_device(self.ctx.as_ptr(), &mut attr) };
        if rc != 0 {
            return Err(VerbsError::QueryDevice(rc));
        }
        Ok(DeviceLimits {
            max_mr_size: attr.max_mr_size,
            max_qp: attr.max_qp,
            max_qp_wr: attr.max_qp_wr,
            max_sge: attr.max_sge,
            max_cqe: attr.max_cqe,
        })
    }

    /// Facts of port `port` (1-based).
    pub fn port(&self, port: u8) -> Result<PortInfo, VerbsError> {
        // SAFETY: ibv_port_attr is plain data; zero is a valid bit pattern.
        let mut attr: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `attr` is a valid out-pointer of the size passed.
        let rc = unsafe { sys::___ibv_query_port(self.ctx.as_ptr(), port, &mut attr) };
        if rc != 0 {
            return Err(VerbsError::QueryPort { port, errno: rc });
        }
        Ok(PortInfo {
            active: attr.state == sys::ibv_port_state::IBV_PORT_ACTIVE,
            active_mtu: attr.active_mtu,
            lid: attr.lid,
            gid_table_len: attr.gid_tbl_len,
            link_layer: attr.link_layer,
        })
    }

    /// GID `index` of `port`.
    pub fn gid(&self, port: u8, index: u32) -> Result<Gid, VerbsError> {
        // SAFETY: ibv_gid is 16 plain bytes.
        let mut gid: sys::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `gid` is a valid out-pointer.
        let rc = unsafe { sys::ibv_query_gid(self.ctx.as_ptr(), port, index as c_int, &mut gid) };
        if rc != 0 {
            return Err(VerbsError::QueryGid {
                port,
                index,
                errno: errno(),
            });
        }
        // SAFETY: every bit pattern of the union is a valid [u8; 16].
        Ok(Gid(unsafe { gid.raw }))
    }

    /// The GID to use on `port`: `index` when given, else the best entry of the table
    /// (RoCE v2, IPv4-mapped, with a netdev, never link-local; see [`rank_gids`]).
    pub fn select_gid(&self, port: u8, index: Option<u32>) -> Result<GidEntry, VerbsError> {
        if let Some(index) = index {
            let gid = self.gid(port, index)?;
            return Ok(GidEntry {
                index,
                gid,
                kind: GidKind::Unknown,
                netdev: None,
            });
        }
        let table = read_gid_table(&self.name, port);
        rank_gids(&table)
            .first()
            .cloned()
            .ok_or_else(|| VerbsError::NoUsableGid {
                device: self.name.clone(),
                port,
            })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: children hold an Arc of the context, so none is alive; closed once.
        unsafe { sys::ibv_close_device(self.ctx.as_ptr()) };
    }
}

/// A protection domain.
#[derive(Debug)]
pub struct ProtectionDomain {
    pd: NonNull<sys::ibv_pd>,
    context: Arc<Context>,
}

// SAFETY: verbs objects are thread-safe; the pointer is released only in Drop.
unsafe impl Send for ProtectionDomain {}
// SAFETY: see Send.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    /// Allocates a protection domain on `context`.
    pub fn new(context: &Arc<Context>) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: the context is open for as long as the Arc lives.
        let pd = unsafe { sys::ibv_alloc_pd(context.ctx.as_ptr()) };
        NonNull::new(pd)
            .map(|pd| {
                Arc::new(Self {
                    pd,
                    context: context.clone(),
                })
            })
            .ok_or_else(|| VerbsError::AllocPd(errno()))
    }

    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: MRs and QPs hold an Arc of the PD, so none is alive; freed once.
        unsafe { sys::ibv_dealloc_pd(self.pd.as_ptr()) };
    }
}

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

    fn bits(self) -> u32 {
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
        NonNull::new(mr)
            .map(|mr| Self {
                mr,
                pd: pd.clone(),
                access,
            })
            .ok_or_else(|| VerbsError::RegMr {
                len,
                errno: errno(),
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
    }
}

/// Outcome of one work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The caller's `wr_id`.
    pub wr_id: u64,
    /// `Ok` or the verbs status code and its name.
    pub status: Result<(), CompletionError>,
    /// Bytes (receives and reads).
    pub byte_len: u32,
    /// The QP it belongs to.
    pub qp_num: u32,
    /// The immediate value of a receive completed by WRITE_WITH_IMM or SEND_WITH_IMM.
    pub imm: Option<u32>,
}

impl Completion {
    /// An empty slot for [`CompletionQueue::poll`] to fill.
    pub const EMPTY: Self = Self {
        wr_id: 0,
        status: Ok(()),
        byte_len: 0,
        qp_num: 0,
        imm: None,
    };
}

/// A failed completion: the status code (`IBV_WC_*`) with libibverbs' name for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompletionError {
    /// `ibv_wc_status` value.
    pub code: u32,
    /// e.g. "remote access error".
    pub name: &'static str,
}

impl CompletionError {
    /// `IBV_WC_REM_ACCESS_ERR`: the peer refused the key, address or rights.
    pub const REMOTE_ACCESS: u32 = sys::ibv_wc_status::IBV_WC_REM_ACCESS_ERR;
    /// `IBV_WC_WR_FLUSH_ERR`: the QP went to the error state before this ran.
    pub const FLUSHED: u32 = sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
    /// `IBV_WC_LOC_PROT_ERR`: a local key did not cover the local buffer.
    pub const LOCAL_PROTECTION: u32 = sys::ibv_wc_status::IBV_WC_LOC_PROT_ERR;
}

impl std::fmt::Display for CompletionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name, self.code)
    }
}

fn status_name(code: u32) -> &'static str {
    // SAFETY: ibv_wc_status_str returns a static NUL-terminated string for any value.
    let name = unsafe { CStr::from_ptr(sys::ibv_wc_status_str(code)) };
    name.to_str().unwrap_or("unknown status")
}

/// A completion queue, optionally with a completion channel for blocking waits.
#[derive(Debug)]
pub struct CompletionQueue {
    cq: NonNull<sys::ibv_cq>,
    channel: Option<NonNull<sys::ibv_comp_channel>>,
    context: Arc<Context>,
}

// SAFETY: polling a CQ from several threads is allowed by libibverbs; released in Drop.
unsafe impl Send for CompletionQueue {}
// SAFETY: see Send.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// A CQ with room for `entries` completions.
    pub fn new(context: &Arc<Context>, entries: i32) -> Result<Arc<Self>, VerbsError> {
        Self::create(context, entries, None)
    }

    /// A CQ whose completions can also be waited for without spinning
    /// ([`CompletionQueue::wait`]).
    pub fn with_channel(context: &Arc<Context>, entries: i32) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: the context is open; the channel is destroyed after the CQ in Drop.
        let channel = unsafe { sys::ibv_create_comp_channel(context.ctx.as_ptr()) };
        let channel = NonNull::new(channel).ok_or_else(|| VerbsError::CreateCq {
            entries,
            errno: errno(),
        })?;
        Self::create(context, entries, Some(channel))
    }

    fn create(
        context: &Arc<Context>,
        entries: i32,
        channel: Option<NonNull<sys::ibv_comp_channel>>,
    ) -> Result<Arc<Self>, VerbsError> {
        let channel_ptr = channel.map_or(ptr::null_mut(), NonNull::as_ptr);
        // SAFETY: the context is open; the channel (if any) outlives the CQ.
        let cq = unsafe {
            sys::ibv_create_cq(
                context.ctx.as_ptr(),
                entries,
                ptr::null_mut(),
                channel_ptr,
                0,
            )
        };
        match NonNull::new(cq) {
            Some(cq) => Ok(Arc::new(Self {
                cq,
                channel,
                context: context.clone(),
            })),
            None => {
                let errno = errno();
                if let Some(channel) = channel {
                    // SAFETY: created above and used by nothing.
                    unsafe { sys::ibv_destroy_comp_channel(channel.as_ptr()) };
                }
                Err(VerbsError::CreateCq { entries, errno })
            }
        }
    }

    /// Sleeps until a completion arrives or `timeout` passes, then polls into `out`; returns
    /// how many completions were taken (0 on timeout). Needs a CQ made
    /// [`with_channel`](Self::with_channel).
    pub fn wait(
        &self,
        out: &mut [Completion],
        timeout: std::time::Duration,
    ) -> Result<usize, VerbsError> {
        let Some(channel) = self.channel else {
            return Err(VerbsError::InvalidRequest(
                "wait needs a CQ with a completion channel",
            ));
        };
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let got = self.poll(out)?;
            if got > 0 {
                return Ok(got);
            }
            // Arm, then poll again: a completion that landed before arming raises no event.
            // SAFETY: the CQ is alive.
            let rc = unsafe { sys::ibv_req_notify_cq(self.cq.as_ptr(), 0) };
            if rc != 0 {
                return Err(VerbsError::PollCq(-rc.abs()));
            }
            let got = self.poll(out)?;
            if got > 0 {
                return Ok(got);
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(0);
            }
            // SAFETY: the channel lives as long as self; `fd` is its event descriptor.
            let fd = unsafe { channel.as_ref().fd };
            let mut pollfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            let millis = left.as_millis().clamp(1, i32::MAX as u128) as c_int;
            // SAFETY: one valid pollfd for the duration of the call.
            let ready = unsafe { libc::poll(&mut pollfd, 1, millis) };
            if ready > 0 {
                let mut cq: *mut sys::ibv_cq = ptr::null_mut();
                let mut user: *mut std::os::raw::c_void = ptr::null_mut();
                // SAFETY: poll said an event is ready, so this returns at once.
                if unsafe { sys::ibv_get_cq_event(channel.as_ptr(), &mut cq, &mut user) } == 0 {
                    // SAFETY: acknowledges the one event just taken for this CQ.
                    unsafe { sys::ibv_ack_cq_events(self.cq.as_ptr(), 1) };
                }
            }
        }
    }

    /// Takes up to `out.len()` completions without blocking; returns how many.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize, VerbsError> {
        const BATCH: usize = 32;
        // SAFETY: ibv_wc is plain data; zero is a valid bit pattern.
        let mut raw: [sys::ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
        let want = out.len().min(BATCH) as c_int;
        // SAFETY: the CQ is alive and `raw` has room for `want` entries.
        let got = unsafe { sys::ibv_poll_cq(self.cq.as_ptr(), want, raw.as_mut_ptr()) };
        if got < 0 {
            return Err(VerbsError::PollCq(got));
        }
        for (slot, wc) in out.iter_mut().zip(&raw[..got as usize]) {
            *slot = Completion {
                wr_id: wc.wr_id,
                status: if wc.status == sys::ibv_wc_status::IBV_WC_SUCCESS {
                    Ok(())
                } else {
                    Err(CompletionError {
                        code: wc.status,
                        name: status_name(wc.status),
                    })
                },
                byte_len: wc.byte_len,
                qp_num: wc.qp_num,
                imm: (wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0)
                    // SAFETY: with IBV_WC_WITH_IMM set, the union holds the immediate value.
                    .then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })),
            };
        }
        Ok(got as usize)
    }

    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: QPs hold an Arc of their CQ, so none is alive; destroyed once, before the
        // channel it reports to (every event taken was acknowledged in `wait`).
        unsafe { sys::ibv_destroy_cq(self.cq.as_ptr()) };
        if let Some(channel) = self.channel {
            // SAFETY: the CQ using it is gone; destroyed once.
            unsafe { sys::ibv_destroy_comp_channel(channel.as_ptr()) };
        }
    }
}

/// Sizes of a queue pair's queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Outstanding send work requests.
    pub max_send_wr: u32,
    /// Outstanding receive work requests.
    pub max_recv_wr: u32,
    /// SGEs per work request.
    pub max_sge: u32,
    /// Inline data bytes.
    pub max_inline: u32,
}

impl Default for QpCaps {
    /// Mooncake's: 256 WRs, 4 SGEs, 64 bytes inline.
    fn default() -> Self {
        Self {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_sge: 4,
            max_inline: 64,
        }
    }
}

/// What the passive side of a connection needs to know about the other end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    /// Its QP number.
    pub qp_num: u32,
    /// Its first packet sequence number.
    pub psn: u32,
    /// Its GID.
    pub gid: Gid,
    /// Its LID (0 on RoCE).
    pub lid: u16,
}

/// Path settings for RTR and RTS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathConfig {
    /// Local port.
    pub port: u8,
    /// Local GID index.
    pub sgid_index: u8,
    /// Path MTU (verbs enum, 1..=5); the smaller of both ends' active MTUs.
    pub mtu: u32,
    /// ACK timeout exponent (Mooncake: 14 ≈ 67 ms).
    pub timeout: u8,
    /// Retries on timeout (7 means "forever" on some devices).
    pub retry_count: u8,
    /// Retries on receiver-not-ready.
    pub rnr_retry: u8,
    /// Our first packet sequence number.
    pub psn: u32,
}

impl Default for PathConfig {
    fn default() -> Self {
        Self {
            port: 1,
            sgid_index: 0,
            mtu: sys::ibv_mtu::IBV_MTU_4096,
            timeout: 14,
            retry_count: 6,
            rnr_retry: 7,
            psn: 0,
        }
    }
}

/// A reliable-connected queue pair.
#[derive(Debug)]
pub struct QueuePair {
    qp: NonNull<sys::ibv_qp>,
    pd: Arc<ProtectionDomain>,
    cq: Arc<CompletionQueue>,
}

// SAFETY: posting to a QP from several threads is allowed by libibverbs; released in Drop.
unsafe impl Send for QueuePair {}
// SAFETY: see Send.
unsafe impl Sync for QueuePair {}

/// One scatter/gather element: a piece of registered local memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    /// Start address (inside an MR of the QP's PD).
    pub addr: u64,
    /// Bytes.
    pub len: u32,
    /// The MR's lkey.
    pub lkey: u32,
}

fn raw_sges(list: &[Sge]) -> Vec<sys::ibv_sge> {
    list.iter()
        .map(|s| sys::ibv_sge {
            addr: s.addr,
            length: s.len,
            lkey: s.lkey,
        })
        .collect()
}

/// What a send work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOp {
    /// Local SGEs → remote memory.
    Write {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// Local SGEs → remote memory, then an immediate value delivered to a posted receive.
    WriteWithImm {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
        /// The immediate value (host order; sent big-endian).
        imm: u32,
    },
    /// Remote memory → local SGEs.
    Read {
        /// Remote address.
        remote_addr: u64,
        /// Remote key.
        rkey: u32,
    },
    /// Local SGEs → the peer's next posted receive.
    Send,
}

/// A send work request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SendRequest {
    /// Returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp,
    /// The local memory.
    pub sges: Vec<Sge>,
    /// Whether to produce a completion on success.
    pub signaled: bool,
}

impl QueuePair {
    /// Creates an RC QP in RESET whose sends and receives complete on `cq`.
    pub fn new_rc(
        pd: &Arc<ProtectionDomain>,
        cq: &Arc<CompletionQueue>,
        caps: QpCaps,
    ) -> Result<Self, VerbsError> {
        // SAFETY: ibv_qp_init_attr is plain data; zero is a valid bit pattern.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.cq.as_ptr();
        init.recv_cq = cq.cq.as_ptr();
        init.cap = sys::ibv_qp_cap {
            max_send_wr: caps.max_send_wr,
            max_recv_wr: caps.max_recv_wr,
            max_send_sge: caps.max_sge,
            max_recv_sge: caps.max_sge,
            max_inline_data: caps.max_inline,
        };
        init.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        // SAFETY: the PD and CQ are alive (held below for the QP's life); `init` is valid.
        let qp = unsafe { sys::ibv_create_qp(pd.pd.as_ptr(), &mut init) };
        NonNull::new(qp)
            .map(|qp| Self {
                qp,
                pd: pd.clone(),
                cq: cq.clone(),
            })
            .ok_or_else(|| VerbsError::CreateQp(errno()))
    }

    /// The QP number peers address.
    pub fn qp_num(&self) -> u32 {
        // SAFETY: the QP is valid while self lives; qp_num is immutable.
        unsafe { self.qp.as_ref().qp_num }
    }

    /// The completion queue.
    pub fn cq(&self) -> &Arc<CompletionQueue> {
        &self.cq
    }

    /// The protection domain.
    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    fn modify(
        &self,
        attr: &mut sys::ibv_qp_attr,
        mask: u32,
        state: &'static str,
    ) -> Result<(), VerbsError> {
        // SAFETY: the QP is alive and `attr` is a valid, initialised attribute block.
        let rc = unsafe { sys::ibv_modify_qp(self.qp.as_ptr(), attr, mask as c_int) };
        if rc != 0 {
            return Err(VerbsError::ModifyQp { state, errno: rc });
        }
        Ok(())
    }

    fn blank_attr() -> sys::ibv_qp_attr {
        // SAFETY: ibv_qp_attr is plain data; zero is a valid bit pattern.
        unsafe { std::mem::zeroed() }
    }

    /// RESET → INIT on `port`, granting peers remote read and write.
    pub fn to_init(&self, port: u8) -> Result<(), VerbsError> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = Self::blank_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = port;
        attr.qp_access_flags = Access::REMOTE.bits();
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_PKEY_INDEX.0
            | m::IBV_QP_PORT.0
            | m::IBV_QP_ACCESS_FLAGS.0;
        self.modify(&mut attr, mask, "INIT")
    }

    /// INIT → RTR towards `peer`.
    pub fn to_rtr(&self, peer: &Peer, path: &PathConfig) -> Result<(), VerbsError> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = Self::blank_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = path.mtu;
        attr.dest_qp_num = peer.qp_num;
        attr.rq_psn = peer.psn;
        attr.max_dest_rd_atomic = 16;
        attr.min_rnr_timer = 12;
        attr.ah_attr.is_global = 1;
        attr.ah_attr.dlid = peer.lid;
        attr.ah_attr.port_num = path.port;
        attr.ah_attr.grh.dgid = sys::ibv_gid { raw: peer.gid.0 };
        attr.ah_attr.grh.sgid_index = path.sgid_index;
        attr.ah_attr.grh.hop_limit = 16;
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_AV.0
            | m::IBV_QP_PATH_MTU.0
            | m::IBV_QP_DEST_QPN.0
            | m::IBV_QP_RQ_PSN.0
            | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
            | m::IBV_QP_MIN_RNR_TIMER.0;
        self.modify(&mut attr, mask, "RTR")
    }

    /// RTR → RTS.
    pub fn to_rts(&self, path: &PathConfig) -> Result<(), VerbsError> {
        use sys::ibv_qp_attr_mask as m;
        let mut attr = Self::blank_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        attr.timeout = path.timeout;
        attr.retry_cnt = path.retry_count;
        attr.rnr_retry = path.rnr_retry;
        attr.sq_psn = path.psn;
        attr.max_rd_atomic = 16;
        let mask = m::IBV_QP_STATE.0
            | m::IBV_QP_TIMEOUT.0
            | m::IBV_QP_RETRY_CNT.0
            | m::IBV_QP_RNR_RETRY.0
            | m::IBV_QP_SQ_PSN.0
            | m::IBV_QP_MAX_QP_RD_ATOMIC.0;
        self.modify(&mut attr, mask, "RTS")
    }

    /// INIT → RTR → RTS in one call.
    pub fn connect(&self, peer: &Peer, path: &PathConfig) -> Result<(), VerbsError> {
        self.to_init(path.port)?;
        self.to_rtr(peer, path)?;
        self.to_rts(path)
    }

    /// Back to RESET (from any state, the error state included), ready to connect again.
    pub fn reset(&self) -> Result<(), VerbsError> {
        let mut attr = Self::blank_attr();
        attr.qp_state = sys::ibv_qp_state::IBV_QPS_RESET;
        self.modify(&mut attr, sys::ibv_qp_attr_mask::IBV_QP_STATE.0, "RESET")
    }

    /// Posts a chain of send work requests (one `ibv_post_send` call).
    ///
    /// # Safety
    ///
    /// Every SGE must lie inside a live [`MemoryRegion`] of this QP's protection domain whose
    /// `lkey` it names, and that memory must stay valid (and, for reads, not be otherwise
    /// accessed) until the request's completion has been polled or the QP has been reset or
    /// dropped.
    pub unsafe fn post_send(&self, requests: &[SendRequest]) -> Result<(), VerbsError> {
        if requests.is_empty() {
            return Ok(());
        }
        if requests
            .iter()
            .any(|r| r.sges.is_empty() && r.op != SendOp::Send)
        {
            return Err(VerbsError::InvalidRequest(
                "an RDMA request needs at least one SGE",
            ));
        }
        let mut sges: Vec<Vec<sys::ibv_sge>> = requests.iter().map(|r| raw_sges(&r.sges)).collect();
        // SAFETY: ibv_send_wr is plain data (pointers and integers); zero is valid.
        let mut wrs: Vec<sys::ibv_send_wr> = (0..requests.len())
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        for (i, request) in requests.iter().enumerate() {
            let wr = &mut wrs[i];
            wr.wr_id = request.wr_id;
            wr.sg_list = sges[i].as_mut_ptr();
            wr.num_sge = sges[i].len() as c_int;
            wr.send_flags = if request.signaled {
                sys::ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            let (opcode, remote) = match request.op {
                SendOp::Write { remote_addr, rkey } => (
                    sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                    Some((remote_addr, rkey)),
                ),
                SendOp::WriteWithImm {
                    remote_addr,
                    rkey,
                    imm,
                } => {
                    wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
                    (
                        sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
                        Some((remote_addr, rkey)),
                    )
                }
                SendOp::Read { remote_addr, rkey } => (
                    sys::ibv_wr_opcode::IBV_WR_RDMA_READ,
                    Some((remote_addr, rkey)),
                ),
                SendOp::Send => (sys::ibv_wr_opcode::IBV_WR_SEND, None),
            };
            wr.opcode = opcode;
            if let Some((remote_addr, rkey)) = remote {
                wr.wr.rdma = sys::rdma_t { remote_addr, rkey };
            }
        }
        for i in 1..wrs.len() {
            let next: *mut sys::ibv_send_wr = &mut wrs[i];
            wrs[i - 1].next = next;
        }
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: the chain and SGE arrays live until the call returns (the device copies
        // them); the caller guarantees the memory they point at, per this fn's contract.
        let rc = unsafe { sys::ibv_post_send(self.qp.as_ptr(), wrs.as_mut_ptr(), &mut bad) };
        if rc != 0 {
            return Err(VerbsError::PostSend(rc));
        }
        Ok(())
    }
}

impl QueuePair {
    /// Posts receive work requests (for SEND and WRITE_WITH_IMM from the peer).
    ///
    /// # Safety
    ///
    /// As [`QueuePair::post_send`]: every SGE inside a live MR of this QP's domain, the memory
    /// valid and otherwise untouched until the receive completes or the QP is reset or
    /// dropped.
    pub unsafe fn post_recv(&self, requests: &[(u64, Vec<Sge>)]) -> Result<(), VerbsError> {
        if requests.is_empty() {
            return Ok(());
        }
        let mut sges: Vec<Vec<sys::ibv_sge>> =
            requests.iter().map(|(_, list)| raw_sges(list)).collect();
        // SAFETY: ibv_recv_wr is plain data; zero is valid.
        let mut wrs: Vec<sys::ibv_recv_wr> = (0..requests.len())
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        for (i, (wr_id, _)) in requests.iter().enumerate() {
            wrs[i].wr_id = *wr_id;
            wrs[i].sg_list = sges[i].as_mut_ptr();
            wrs[i].num_sge = sges[i].len() as c_int;
        }
        for i in 1..wrs.len() {
            let next: *mut sys::ibv_recv_wr = &mut wrs[i];
            wrs[i - 1].next = next;
        }
        let mut bad: *mut sys::ibv_recv_wr = ptr::null_mut();
        // SAFETY: the chain lives until the call returns; memory per this fn's contract.
        let rc = unsafe { sys::ibv_post_recv(self.qp.as_ptr(), wrs.as_mut_ptr(), &mut bad) };
        if rc != 0 {
            return Err(VerbsError::PostRecv(rc));
        }
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: created once, destroyed once; outstanding WRs are flushed by the device.
        unsafe { sys::ibv_destroy_qp(self.qp.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enosys_means_no_devices() {
        assert!(null_device_list_means_no_devices(38));
        assert!(!null_device_list_means_no_devices(13));
    }

    /// The C structs rdma-sys writes by hand must match libibverbs' layout.
    #[test]
    fn hand_written_structs_have_the_c_sizes() {
        assert_eq!(std::mem::size_of::<sys::ibv_sge>(), 16);
        assert_eq!(std::mem::size_of::<sys::ibv_send_wr>(), 128);
        assert_eq!(std::mem::size_of::<sys::ibv_recv_wr>(), 32);
        assert_eq!(std::mem::size_of::<sys::ibv_wc>(), 48);
        assert_eq!(std::mem::size_of::<sys::ibv_gid>(), 16);
        assert_eq!(std::mem::size_of::<sys::ibv_ah_attr>(), 32);
    }

    #[test]
    fn no_rdma_in_the_kernel_is_an_empty_list_not_an_error() {
        // On hosts without RDMA this is the ENOSYS path; in the guest it lists rxe0.
        let names = device_names().unwrap();
        if std::env::var_os("TERN_IN_GUEST").is_some() {
            assert!(names.iter().any(|n| n == "rxe0"), "{names:?}");
        }
        assert!(matches!(
            Context::open("no-such-device"),
            Err(VerbsError::NoSuchDevice(_))
        ));
    }

    #[test]
    fn mtu_enum_maps_to_bytes() {
        let port = |mtu| PortInfo {
            active: true,
            active_mtu: mtu,
            lid: 0,
            gid_table_len: 1,
            link_layer: 2,
        };
        assert_eq!(port(1).mtu_bytes(), 256);
        assert_eq!(port(5).mtu_bytes(), 4096);
    }
}
