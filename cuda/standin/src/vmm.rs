//! Virtual memory management: physical memory (`cuMemCreate`) mapped into reserved address
//! space (`cuMemAddressReserve`, `cuMemMap`), with access granted to devices.

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::alloc::{map_twice, new_memfd};
use crate::codes::{ERROR_INVALID_DEVICE, ERROR_INVALID_VALUE, ERROR_OUT_OF_MEMORY, SUCCESS};
use crate::state::{Allocation, HANDLES, Origin, Physical, devices, with_state};

/// What the stand-in's VMM granularity is (the real one is 2 MiB on current GPUs).
pub(crate) const GRANULARITY: usize = 2 << 20;
/// `CU_MEM_HANDLE_TYPE_FABRIC`.
pub(crate) const HANDLE_TYPE_FABRIC: c_int = 8;
/// `CUDA_ERROR_NOT_PERMITTED`.
const ERROR_NOT_PERMITTED: c_int = 800;

#[repr(C)]
pub struct MemLocation {
    kind: c_int,
    id: c_int,
}

#[repr(C)]
pub struct AllocationProp {
    kind: c_int,
    requested_handle_types: c_int,
    location: MemLocation,
    win32: *mut c_void,
    flags: [u8; 8],
}

#[repr(C)]
pub struct AccessDesc {
    location: MemLocation,
    flags: c_int,
}

pub(crate) fn insert_handle(physical: Arc<Physical>) -> u64 {
    let handle = HANDLES.fetch_add(1, Ordering::Relaxed);
    with_state(|s| s.handles.insert(handle, physical));
    handle
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    _prop: *const AllocationProp,
    _option: c_int,
) -> c_int {
    // SAFETY: the caller passes a valid size_t pointer.
    unsafe { granularity.write(GRANULARITY) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    len: usize,
    prop: *const AllocationProp,
    _flags: u64,
) -> c_int {
    // SAFETY: the caller passes a valid property block.
    let prop = unsafe { &*prop };
    let ordinal = usize::try_from(prop.location.id).unwrap_or(usize::MAX);
    if prop.location.kind != 1 || ordinal >= devices() {
        return ERROR_INVALID_DEVICE;
    }
    if len == 0 || !len.is_multiple_of(GRANULARITY) {
        return ERROR_INVALID_VALUE;
    }
    let fabric = prop.requested_handle_types & HANDLE_TYPE_FABRIC != 0;
    if fabric && !crate::device::imex() {
        // Fabric handles need IMEX channels (as cuMemCreate refuses without them).
        return ERROR_NOT_PERMITTED;
    }
    let name = std::ffi::CString::new(format!("tern-standin-vmm-{ordinal}")).unwrap_or_default();
    let Some(fd) = new_memfd(&name, len) else {
        return ERROR_OUT_OF_MEMORY;
    };
    // A chunk no other process can map, for tests of what a peer is told then
    // (`TERN_STANDIN_UNSHAREABLE=1`).
    let unshareable = std::env::var("TERN_STANDIN_UNSHAREABLE").is_ok_and(|v| v == "1");
    let made = insert_handle(Arc::new(Physical {
        fd,
        len,
        ordinal,
        handle_types: if unshareable {
            0
        } else {
            prop.requested_handle_types
        },
        imported: false,
        gpu_direct: prop.flags[1] != 0,
    }));
    // SAFETY: the caller passes a valid handle pointer.
    unsafe { handle.write(made) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: u64) -> c_int {
    match with_state(|s| s.handles.remove(&handle)) {
        Some(_) => SUCCESS,
        None => ERROR_INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut u64,
    len: usize,
    _alignment: usize,
    _addr: u64,
    _flags: u64,
) -> c_int {
    if len == 0 || !len.is_multiple_of(GRANULARITY) {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: a new private anonymous mapping that nothing can touch.
    let reserved = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if reserved == libc::MAP_FAILED {
        return ERROR_OUT_OF_MEMORY;
    }
    with_state(|s| s.reserved.insert(reserved as usize, len));
    // SAFETY: the caller passes a valid CUdeviceptr pointer.
    unsafe { ptr.write(reserved as u64) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressFree(ptr: u64, len: usize) -> c_int {
    let freed = with_state(|s| {
        let at = ptr as usize;
        let mapped = s.device.range(at..at + len).next().is_some();
        (s.reserved.get(&at) == Some(&len) && !mapped).then(|| s.reserved.remove(&at))
    });
    if freed.is_none() {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: the reservation made by cuMemAddressReserve with this length, unmapped once.
    unsafe { libc::munmap(ptr as usize as *mut c_void, len) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    ptr: u64,
    len: usize,
    offset: usize,
    handle: u64,
    _flags: u64,
) -> c_int {
    let at = ptr as usize;
    let checked = with_state(|s| {
        let physical = s.handles.get(&handle)?.clone();
        let (&base, &size) = s.reserved.range(..=at).next_back()?;
        let inside = at + len <= base + size && offset + len <= physical.len;
        let free = s.device.range(at..at + len).next().is_none()
            && s.device
                .range(..at)
                .next_back()
                .is_none_or(|(&b, a)| b + a.len <= at);
        (inside && free && len > 0).then_some(physical)
    });
    let Some(physical) = checked else {
        return ERROR_INVALID_VALUE;
    };
    let Some((_, alias)) = map_twice(&physical.fd, len, offset, Some(at)) else {
        return ERROR_OUT_OF_MEMORY;
    };
    with_state(|s| {
        s.device.insert(
            at,
            Allocation {
                len,
                ordinal: physical.ordinal,
                alias,
                origin: Origin::Mapped(physical.clone()),
            },
        )
    });
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(ptr: u64, len: usize) -> c_int {
    let at = ptr as usize;
    let removed: Vec<(usize, Allocation)> = with_state(|s| {
        let keys: Vec<usize> = s.device.range(at..at + len).map(|(&k, _)| k).collect();
        let whole = keys.iter().all(|k| {
            s.device
                .get(k)
                .is_some_and(|a| matches!(a.origin, Origin::Mapped(_)) && k + a.len <= at + len)
        });
        if !whole {
            return Vec::new();
        }
        keys.into_iter()
            .filter_map(|k| s.device.remove(&k).map(|a| (k, a)))
            .collect()
    });
    if removed.is_empty() {
        return ERROR_INVALID_VALUE;
    }
    for (base, allocation) in removed {
        // SAFETY: the alias was made by cuMemMap; the visible range goes back to reserved,
        // untouchable address space (a fixed anonymous mapping over this library's own
        // mapping).
        unsafe {
            libc::munmap(allocation.alias as *mut c_void, allocation.len);
            libc::mmap(
                base as *mut c_void,
                allocation.len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            );
        }
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: u64,
    len: usize,
    desc: *const AccessDesc,
    count: usize,
) -> c_int {
    if desc.is_null() || count == 0 {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller passes `count` descriptors.
    let descs = unsafe { std::slice::from_raw_parts(desc, count) };
    if descs.iter().any(|d| {
        d.location.kind != 1
            || d.location.id < 0
            || d.location.id as usize >= devices()
            || d.flags != 3
    }) {
        return ERROR_INVALID_DEVICE;
    }
    let covered = with_state(|s| {
        let mut at = ptr as usize;
        let end = at + len;
        while at < end {
            match s.device.get(&at) {
                Some(a) if matches!(a.origin, Origin::Mapped(_)) => at += a.len,
                _ => return false,
            }
        }
        true
    });
    if covered {
        SUCCESS
    } else {
        ERROR_INVALID_VALUE
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(handle: *mut u64, addr: *mut c_void) -> c_int {
    let found = with_state(|s| {
        let at = addr as usize;
        let (&base, allocation) = s.device.range(..=at).next_back()?;
        match &allocation.origin {
            Origin::Mapped(physical) if at < base + allocation.len => Some(physical.clone()),
            _ => None,
        }
    });
    let Some(physical) = found else {
        return ERROR_INVALID_VALUE;
    };
    let made = insert_handle(physical);
    // SAFETY: the caller passes a valid handle pointer.
    unsafe { handle.write(made) };
    SUCCESS
}
