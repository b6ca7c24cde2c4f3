//! Devices: initialisation, the driver's version, how many devices there are and their PCI
//! bus IDs.

use std::ffi::{c_char, c_int, c_uint};

use crate::codes::{ERROR_INVALID_DEVICE, ERROR_INVALID_VALUE, ERROR_NOT_INITIALIZED, SUCCESS};
use crate::state::{devices, with_state};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuInit(flags: c_uint) -> c_int {
    if flags != 0 {
        return ERROR_INVALID_VALUE;
    }
    with_state(|s| {
        s.initialized = true;
        s.retained = vec![0; devices()];
    });
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> c_int {
    if version.is_null() {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller passes a valid int pointer (cuDriverGetVersion's contract).
    unsafe { version.write(12080) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> c_int {
    if !with_state(|s| s.initialized) {
        return ERROR_NOT_INITIALIZED;
    }
    // SAFETY: the caller passes a valid int pointer.
    unsafe { count.write(devices() as c_int) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> c_int {
    if ordinal < 0 || ordinal as usize >= devices() {
        return ERROR_INVALID_DEVICE;
    }
    // SAFETY: the caller passes a valid CUdevice pointer.
    unsafe { device.write(ordinal) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(id: *mut c_char, len: c_int, device: c_int) -> c_int {
    if device < 0 || device as usize >= devices() || id.is_null() {
        return ERROR_INVALID_DEVICE;
    }
    let text = format!("0000:{:02x}:00.0\0", 0x10 + device);
    if (len as usize) < text.len() {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller passes a buffer of `len` bytes, which holds the text.
    unsafe { std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), id, text.len()) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetByPCIBusId(device: *mut c_int, id: *const c_char) -> c_int {
    if id.is_null() {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller passes a NUL-terminated string.
    let text = unsafe { std::ffi::CStr::from_ptr(id) }.to_string_lossy();
    let bus = text
        .strip_prefix("0000:")
        .and_then(|rest| rest.split(':').next())
        .and_then(|bus| u32::from_str_radix(bus, 16).ok());
    match bus.and_then(|b| b.checked_sub(0x10)) {
        Some(ordinal) if (ordinal as usize) < devices() => {
            // SAFETY: the caller passes a valid CUdevice pointer.
            unsafe { device.write(ordinal as c_int) };
            SUCCESS
        }
        _ => ERROR_INVALID_DEVICE,
    }
}

/// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`.
pub(crate) const ATTRIBUTE_GDR_WITH_VMM: c_int = 110;
/// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
pub(crate) const ATTRIBUTE_DMA_BUF_SUPPORTED: c_int = 124;
/// `CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED`.
pub(crate) const ATTRIBUTE_FABRIC_SUPPORTED: c_int = 128;

/// Whether the stand-in's devices say they export dma-bufs (`TERN_STANDIN_DMA_BUF=1`; off by
/// default, as on a GPU without the kernel's support).
pub(crate) fn dma_buf_supported() -> bool {
    std::env::var("TERN_STANDIN_DMA_BUF").is_ok_and(|v| v == "1")
}

/// Whether the stand-in models a node with IMEX channels, where VMM memory is exported as
/// fabric handles (`TERN_STANDIN_IMEX=1`).
pub(crate) fn imex() -> bool {
    std::env::var("TERN_STANDIN_IMEX").is_ok_and(|v| v == "1")
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attribute: c_int,
    device: c_int,
) -> c_int {
    if device < 0 || device as usize >= devices() {
        return ERROR_INVALID_DEVICE;
    }
    if value.is_null() {
        return ERROR_INVALID_VALUE;
    }
    let answer = match attribute {
        ATTRIBUTE_GDR_WITH_VMM => 1,
        ATTRIBUTE_DMA_BUF_SUPPORTED => c_int::from(dma_buf_supported()),
        ATTRIBUTE_FABRIC_SUPPORTED => c_int::from(imex()),
        _ => return ERROR_INVALID_VALUE,
    };
    // SAFETY: the caller passes a valid int pointer.
    unsafe { value.write(answer) };
    SUCCESS
}
