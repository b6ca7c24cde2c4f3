//! Physical memory shared between processes: exported as a POSIX descriptor of its memfd or
//! as a fabric handle (which names the exporter's process and a descriptor it keeps open,
//! opened in another process of the same user through `/proc/<pid>/fd`), and imported from
//! either; DMA-BUF export of a page-aligned, wholly mapped range of device memory, as a fresh
//! memfd standing in for the dma-buf, where the devices say they support it.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::codes::{ERROR_INVALID_VALUE, ERROR_NOT_SUPPORTED, ERROR_OUT_OF_MEMORY, SUCCESS};
use crate::state::{Physical, with_state};
use crate::vmm::{HANDLE_TYPE_FABRIC, insert_handle};

pub(crate) const HANDLE_TYPE_POSIX_FD: c_int = 1;

/// First bytes of the stand-in's fabric handles.
const FABRIC_MAGIC: &[u8; 8] = b"TSFABRIC";

/// Descriptors this process exported fabric handles for: kept open for the importers, who
/// open them through `/proc/<pid>/fd` (never closed: the stand-in lives as long as a test).
static EXPORTED: Mutex<Vec<OwnedFd>> = Mutex::new(Vec::new());

fn duplicate(fd: c_int) -> Option<OwnedFd> {
    // SAFETY: duplicates a descriptor that is open for the length of the call.
    let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    // SAFETY: the duplicate is new, owned here.
    (copy >= 0).then(|| unsafe { OwnedFd::from_raw_fd(copy) })
}

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
    if physical.handle_types & kind == 0 {
        return ERROR_NOT_SUPPORTED;
    }
    let Some(fd) = duplicate(physical.fd.as_raw_fd()) else {
        return ERROR_OUT_OF_MEMORY;
    };
    match kind {
        HANDLE_TYPE_POSIX_FD => {
            // SAFETY: for POSIX descriptors the shareable handle is one int; the caller owns
            // the descriptor from here.
            unsafe {
                shareable
                    .cast::<c_int>()
                    .write(std::os::fd::IntoRawFd::into_raw_fd(fd))
            };
        }
        HANDLE_TYPE_FABRIC => {
            let mut bytes = [0u8; 64];
            bytes[..8].copy_from_slice(FABRIC_MAGIC);
            // SAFETY: getpid has no preconditions.
            bytes[8..12].copy_from_slice(&unsafe { libc::getpid() }.to_le_bytes());
            bytes[12..16].copy_from_slice(&fd.as_raw_fd().to_le_bytes());
            bytes[16..24].copy_from_slice(&(physical.len as u64).to_le_bytes());
            bytes[24..32].copy_from_slice(&(physical.ordinal as u64).to_le_bytes());
            EXPORTED.lock().push(fd);
            // SAFETY: for FABRIC the shareable handle is a CUmemFabricHandle, 64 bytes.
            unsafe { shareable.cast::<[u8; 64]>().write(bytes) };
        }
        _ => return ERROR_NOT_SUPPORTED,
    }
    SUCCESS
}

/// The descriptor a fabric handle names, opened here.
fn open_fabric(bytes: &[u8; 64]) -> Option<OwnedFd> {
    if &bytes[..8] != FABRIC_MAGIC {
        return None;
    }
    let pid = i32::from_le_bytes(bytes[8..12].try_into().ok()?);
    let fd = i32::from_le_bytes(bytes[12..16].try_into().ok()?);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/{pid}/fd/{fd}"))
        .ok()?;
    Some(OwnedFd::from(file))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut u64,
    os_handle: *mut c_void,
    kind: c_int,
) -> c_int {
    let fd = match kind {
        HANDLE_TYPE_POSIX_FD => duplicate(os_handle as usize as c_int),
        HANDLE_TYPE_FABRIC => {
            // SAFETY: for FABRIC the OS handle points at a CUmemFabricHandle (64 bytes).
            let bytes = unsafe { os_handle.cast::<[u8; 64]>().read() };
            open_fabric(&bytes)
        }
        _ => return ERROR_NOT_SUPPORTED,
    };
    let Some(fd) = fd else {
        return ERROR_INVALID_VALUE;
    };
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
        handle_types: kind,
        imported: true,
        gpu_direct: false,
    }));
    // SAFETY: the caller passes a valid handle pointer.
    unsafe { handle.write(made) };
    SUCCESS
}

/// The host page size the driver requires a dma-buf's range to be aligned to.
const PAGE: usize = 4096;

/// A dma-buf of `[dptr, dptr + size)`: where the devices say they support dma-bufs
/// (`cuDeviceGetAttribute`, `TERN_STANDIN_DMA_BUF=1`), a range aligned to the page size and
/// wholly mapped (device ranges back to back) gets a fresh memfd named after it
/// (`tern-standin-dmabuf-<start>-<len>`), standing in for the dma-buf; NICs cannot use it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetHandleForAddressRange(
    handle: *mut c_void,
    dptr: u64,
    size: usize,
    kind: c_int,
    _flags: u64,
) -> c_int {
    if !crate::device::dma_buf_supported() || kind != 1 {
        return ERROR_NOT_SUPPORTED;
    }
    let start = dptr as usize;
    if !start.is_multiple_of(PAGE) || !size.is_multiple_of(PAGE) || size == 0 {
        return ERROR_INVALID_VALUE;
    }
    let mapped = with_state(|s| {
        let mut at = start;
        while at < start + size {
            let Some((&base, allocation)) = s.device.range(..=at).next_back() else {
                return false;
            };
            if at >= base + allocation.len {
                return false;
            }
            at = base + allocation.len;
        }
        true
    });
    if !mapped {
        return ERROR_INVALID_VALUE;
    }
    let name = std::ffi::CString::new(format!("tern-standin-dmabuf-{start:#x}-{size}"))
        .unwrap_or_default();
    // SAFETY: memfd_create takes a NUL-terminated name and flags.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return ERROR_OUT_OF_MEMORY;
    }
    // SAFETY: for CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD the handle is one int.
    unsafe { handle.cast::<c_int>().write(fd) };
    SUCCESS
}
