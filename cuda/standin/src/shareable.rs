//! Physical memory shared between processes: exported as a POSIX descriptor of its memfd and
//! imported from one; DMA-BUF export, which the stand-in does not have.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use crate::codes::{ERROR_INVALID_VALUE, ERROR_NOT_SUPPORTED, ERROR_OUT_OF_MEMORY, SUCCESS};
use crate::state::{Physical, with_state};
use crate::vmm::insert_handle;

pub(crate) const HANDLE_TYPE_POSIX_FD: c_int = 1;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: u64,
    kind: c_int,
    _flags: u64,
) -> c_int {
    let Some(physical) = with_state(|s| s.handles.get(&handle).cloned()) else {
        return ERROR_INVALID_VALUE;
    };
    if kind != HANDLE_TYPE_POSIX_FD || physical.handle_types & HANDLE_TYPE_POSIX_FD == 0 {
        return ERROR_NOT_SUPPORTED;
    }
    // SAFETY: duplicates a descriptor this library owns.
    let fd = unsafe { libc::fcntl(physical.fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if fd < 0 {
        return ERROR_OUT_OF_MEMORY;
    }
    // SAFETY: for POSIX descriptors the shareable handle is one int.
    unsafe { shareable.cast::<c_int>().write(fd) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut u64,
    os_handle: *mut c_void,
    kind: c_int,
) -> c_int {
    if kind != HANDLE_TYPE_POSIX_FD {
        return ERROR_NOT_SUPPORTED;
    }
    let given = os_handle as usize as c_int;
    // SAFETY: duplicates the caller's descriptor (the caller keeps its own).
    let fd = unsafe { libc::fcntl(given, libc::F_DUPFD_CLOEXEC, 0) };
    if fd < 0 {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: the duplicate is owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let Ok(copy) = fd.try_clone() else {
        return ERROR_OUT_OF_MEMORY;
    };
    let Ok(meta) = std::fs::File::from(copy).metadata() else {
        return ERROR_INVALID_VALUE;
    };
    let Ok(target) = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())) else {
        return ERROR_INVALID_VALUE;
    };
    let ordinal = target
        .to_string_lossy()
        .strip_prefix("/memfd:tern-standin-vmm-")
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse::<usize>().ok());
    let Some(ordinal) = ordinal else {
        return ERROR_INVALID_VALUE;
    };
    let made = insert_handle(Arc::new(Physical {
        fd,
        len: meta.len() as usize,
        ordinal,
        handle_types: HANDLE_TYPE_POSIX_FD,
        imported: true,
    }));
    // SAFETY: the caller passes a valid handle pointer.
    unsafe { handle.write(made) };
    SUCCESS
}

/// The stand-in has no DMA-BUF exporter (its memory is a memfd; udmabuf, which could
/// export one, is not in every kernel): NICs cannot register its memory by dma-buf.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetHandleForAddressRange(
    _handle: *mut c_void,
    _dptr: u64,
    _size: usize,
    _kind: c_int,
    _flags: u64,
) -> c_int {
    ERROR_NOT_SUPPORTED
}
