//! CUDA IPC handles: one names its owner's process and memfd, which another process of the
//! same user opens through `/proc/<pid>/fd`.

use std::ffi::{c_int, c_uint};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::alloc::{map_twice, release};
use crate::codes::{ERROR_INVALID_CONTEXT, ERROR_INVALID_VALUE, ERROR_OUT_OF_MEMORY, SUCCESS};
use crate::context::current_device;
use crate::state::{Allocation, Origin, with_state};

/// First bytes of the stand-in's IPC handles.
pub(crate) const IPC_MAGIC: &[u8; 8] = b"TSTANDIN";

#[repr(C)]
pub struct IpcHandle {
    reserved: [u8; 64],
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcGetMemHandle(handle: *mut IpcHandle, dptr: u64) -> c_int {
    let made = with_state(|s| {
        let allocation = s.device.get(&(dptr as usize))?;
        let Origin::Alloc(fd) = &allocation.origin else {
            return None;
        };
        let mut bytes = [0u8; 64];
        bytes[..8].copy_from_slice(IPC_MAGIC);
        // SAFETY: getpid has no preconditions.
        bytes[8..12].copy_from_slice(&unsafe { libc::getpid() }.to_le_bytes());
        bytes[12..16].copy_from_slice(&fd.as_raw_fd().to_le_bytes());
        bytes[16..24].copy_from_slice(&(allocation.len as u64).to_le_bytes());
        bytes[24..32].copy_from_slice(&(allocation.ordinal as u64).to_le_bytes());
        Some(bytes)
    });
    let Some(bytes) = made else {
        return ERROR_INVALID_VALUE;
    };
    // SAFETY: the caller passes a valid handle pointer.
    unsafe { (*handle).reserved = bytes };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcOpenMemHandle_v2(
    dptr: *mut u64,
    handle: IpcHandle,
    _flags: c_uint,
) -> c_int {
    if current_device().is_none() {
        return ERROR_INVALID_CONTEXT;
    }
    let bytes = handle.reserved;
    if &bytes[..8] != IPC_MAGIC {
        return ERROR_INVALID_VALUE;
    }
    let field = |range: std::ops::Range<usize>| {
        let mut raw = [0u8; 8];
        raw[..range.len()].copy_from_slice(&bytes[range]);
        u64::from_le_bytes(raw)
    };
    let (pid, fd, len, ordinal) = (
        field(8..12) as i32,
        field(12..16) as i32,
        field(16..24),
        field(24..32),
    );
    // SAFETY: getpid has no preconditions.
    if pid == unsafe { libc::getpid() } {
        // CUDA IPC handles open only in another process.
        return ERROR_INVALID_CONTEXT;
    }
    let path = std::ffi::CString::new(format!("/proc/{pid}/fd/{fd}")).unwrap_or_default();
    // SAFETY: opens a path given as a NUL-terminated string.
    let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if raw < 0 {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: the fd was just opened and is owned here.
    let file = unsafe { OwnedFd::from_raw_fd(raw) };
    let Some((visible, alias)) = map_twice(&file, len as usize, 0, None) else {
        return ERROR_OUT_OF_MEMORY;
    };
    with_state(|s| {
        s.device.insert(
            visible,
            Allocation {
                len: len as usize,
                ordinal: ordinal as usize,
                alias,
                origin: Origin::Ipc,
            },
        )
    });
    // SAFETY: the caller passes a valid CUdeviceptr pointer.
    unsafe { dptr.write(visible as u64) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuIpcCloseMemHandle(dptr: u64) -> c_int {
    release(dptr, |origin| matches!(origin, Origin::Ipc))
}
