//! Allocations: device memory (a memfd mapped `PROT_NONE` where it is handed out, and
//! readable and writable where only the stand-in knows), pinned host memory, and the memfds
//! and double mappings the other kinds of device memory are made of.

use std::ffi::{c_int, c_uint, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::codes::{ERROR_INVALID_CONTEXT, ERROR_INVALID_VALUE, ERROR_OUT_OF_MEMORY, SUCCESS};
use crate::context::current_device;
use crate::state::{Allocation, Origin, with_state};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, len: usize) -> c_int {
    let Some(ordinal) = current_device() else {
        return ERROR_INVALID_CONTEXT;
    };
    if len == 0 {
        return ERROR_INVALID_VALUE;
    }
    let Some(fd) = new_memfd(c"tern-standin-device", len) else {
        return ERROR_OUT_OF_MEMORY;
    };
    // The memfd is kept with the allocation, for IPC handles.
    let Some((visible, alias)) = map_twice(&fd, len, 0, None) else {
        return ERROR_OUT_OF_MEMORY;
    };
    with_state(|s| {
        s.device.insert(
            visible,
            Allocation {
                len,
                ordinal,
                alias,
                origin: Origin::Alloc(fd),
            },
        )
    });
    // SAFETY: the caller passes a valid CUdeviceptr pointer.
    unsafe { dptr.write(visible as u64) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: u64) -> c_int {
    release(dptr, |origin| matches!(origin, Origin::Alloc(_)))
}

/// Removes the range handed out at `dptr` when its origin is the one `made_by` wants, and
/// unmaps both of its mappings.
pub(crate) fn release(dptr: u64, made_by: impl Fn(&Origin) -> bool) -> c_int {
    let at = dptr as usize;
    let removed = with_state(|s| {
        let known = s.device.get(&at).is_some_and(|a| made_by(&a.origin));
        known.then(|| s.device.remove(&at)).flatten()
    });
    let Some(allocation) = removed else {
        return ERROR_INVALID_VALUE;
    };
    // SAFETY: both mappings were made by this library with this length (cuMemAlloc_v2 or
    // cuIpcOpenMemHandle_v2) and are unmapped once, here: the entry is gone from the table.
    unsafe {
        libc::munmap(at as *mut c_void, allocation.len);
        libc::munmap(allocation.alias as *mut c_void, allocation.len);
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostAlloc(
    ptr: *mut *mut c_void,
    len: usize,
    _flags: c_uint,
) -> c_int {
    // SAFETY: a new private anonymous mapping.
    let memory = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len.max(1),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if memory == libc::MAP_FAILED {
        return ERROR_OUT_OF_MEMORY;
    }
    with_state(|s| s.host.insert(memory as usize, len.max(1)));
    // SAFETY: the caller passes a valid pointer.
    unsafe { ptr.write(memory) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeHost(ptr: *mut c_void) -> c_int {
    let Some(len) = with_state(|s| s.host.remove(&(ptr as usize))) else {
        return ERROR_INVALID_VALUE;
    };
    // SAFETY: the mapping was made by cuMemHostAlloc with this length, unmapped once here.
    unsafe { libc::munmap(ptr, len) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    dptr: *mut u64,
    host: *mut c_void,
    _flags: c_uint,
) -> c_int {
    let known = with_state(|s| {
        let at = host as usize;
        s.host
            .range(..=at)
            .next_back()
            .is_some_and(|(&base, &len)| at < base + len)
    });
    if !known {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller passes a valid CUdeviceptr pointer; under unified addressing the
    // device pointer of mapped host memory is its host pointer.
    unsafe { dptr.write(host as u64) };
    SUCCESS
}

/// A new shared memfd of `len` bytes named `name`.
pub(crate) fn new_memfd(name: &std::ffi::CStr, len: usize) -> Option<OwnedFd> {
    // SAFETY: memfd_create takes a NUL-terminated name and flags.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the fd was just made and is owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on the memfd just made.
    (unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } == 0).then_some(fd)
}

/// Maps `len` bytes of `fd` from `offset` twice: `PROT_NONE` at `at` (fixed, inside a
/// reservation) or anywhere, and readable and writable anywhere (the alias).
pub(crate) fn map_twice(
    fd: &OwnedFd,
    len: usize,
    offset: usize,
    at: Option<usize>,
) -> Option<(usize, usize)> {
    let (hint, fixed) = match at {
        Some(at) => (at as *mut c_void, libc::MAP_FIXED),
        None => (std::ptr::null_mut(), 0),
    };
    // SAFETY: a shared mapping of the memfd; with MAP_FIXED it replaces only pages of a
    // reservation this library made and the caller checked.
    let visible = unsafe {
        libc::mmap(
            hint,
            len,
            libc::PROT_NONE,
            libc::MAP_SHARED | fixed,
            fd.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    if visible == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: a new shared mapping of the memfd.
    let alias = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    if alias == libc::MAP_FAILED {
        if at.is_none() {
            // SAFETY: the mapping just made, unmapped once.
            unsafe { libc::munmap(visible, len) };
        }
        return None;
    }
    Some((visible as usize, alias as usize))
}
