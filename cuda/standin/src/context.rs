//! Contexts: each thread's stack of current contexts (a context is a device's primary one,
//! named by its ordinal plus one), and primary contexts retained.

use std::cell::RefCell;
use std::ffi::{c_int, c_void};

use crate::codes::{ERROR_INVALID_CONTEXT, ERROR_INVALID_DEVICE, SUCCESS};
use crate::state::{devices, with_state};

thread_local! {
    /// This thread's context stack: each entry is a device ordinal.
    pub(crate) static CONTEXTS: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

pub(crate) fn current_device() -> Option<usize> {
    CONTEXTS.with(|c| c.borrow().last().copied())
}

/// Contexts are the device ordinal plus one, as a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(
    context: *mut *mut c_void,
    device: c_int,
) -> c_int {
    let Ok(ordinal) = usize::try_from(device) else {
        return ERROR_INVALID_DEVICE;
    };
    let known = with_state(|s| match s.retained.get_mut(ordinal) {
        Some(count) => {
            *count += 1;
            true
        }
        None => false,
    });
    if !known {
        return ERROR_INVALID_DEVICE;
    }
    // SAFETY: the caller passes a valid CUcontext pointer.
    unsafe { context.write((ordinal + 1) as *mut c_void) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPushCurrent_v2(context: *mut c_void) -> c_int {
    let ordinal = (context as usize).wrapping_sub(1);
    if ordinal >= devices() {
        return ERROR_INVALID_CONTEXT;
    }
    CONTEXTS.with(|c| c.borrow_mut().push(ordinal));
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(context: *mut *mut c_void) -> c_int {
    match CONTEXTS.with(|c| c.borrow_mut().pop()) {
        Some(ordinal) => {
            if !context.is_null() {
                // SAFETY: the caller passes a valid CUcontext pointer or null.
                unsafe { context.write((ordinal + 1) as *mut c_void) };
            }
            SUCCESS
        }
        None => ERROR_INVALID_CONTEXT,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(context: *mut *mut c_void) -> c_int {
    let current = current_device().map_or(std::ptr::null_mut(), |o| (o + 1) as *mut c_void);
    // SAFETY: the caller passes a valid CUcontext pointer.
    unsafe { context.write(current) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut c_int) -> c_int {
    let Some(ordinal) = current_device() else {
        return ERROR_INVALID_CONTEXT;
    };
    // SAFETY: the caller passes a valid CUdevice pointer.
    unsafe { device.write(ordinal as c_int) };
    SUCCESS
}
