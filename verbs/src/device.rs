//! Devices: the device list, an open device ([`Context`]), its limits, ports and GIDs.

use std::ffi::CStr;
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys as sys;

use crate::error::{VerbsError, errno, null_device_list_means_no_devices};
use crate::gid::{Gid, GidEntry, GidKind, rank_gids, read_gid_table};

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
    /// The largest message the port carries, in bytes (`ibv_port_attr.max_msg_sz`): the
    /// longest one work request may move.
    pub max_msg_sz: u32,
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
    pub(crate) ctx: NonNull<sys::ibv_context>,
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
            max_msg_sz: attr.max_msg_sz,
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
