//! The Driver API's status codes the stand-in returns, and their names.

use std::ffi::{c_char, c_int};

pub(crate) const SUCCESS: c_int = 0;
pub(crate) const ERROR_INVALID_VALUE: c_int = 1;
pub(crate) const ERROR_OUT_OF_MEMORY: c_int = 2;
pub(crate) const ERROR_NOT_INITIALIZED: c_int = 3;
pub(crate) const ERROR_INVALID_DEVICE: c_int = 101;
pub(crate) const ERROR_INVALID_CONTEXT: c_int = 201;
pub(crate) const ERROR_NOT_SUPPORTED: c_int = 801;
/// `CUDA_ERROR_NOT_READY`: the event's work has not all run.
pub(crate) const ERROR_NOT_READY: c_int = 600;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(code: c_int, name: *mut *const c_char) -> c_int {
    let text: &'static [u8] = match code {
        SUCCESS => b"CUDA_SUCCESS\0",
        ERROR_INVALID_VALUE => b"CUDA_ERROR_INVALID_VALUE\0",
        ERROR_OUT_OF_MEMORY => b"CUDA_ERROR_OUT_OF_MEMORY\0",
        ERROR_NOT_INITIALIZED => b"CUDA_ERROR_NOT_INITIALIZED\0",
        ERROR_INVALID_DEVICE => b"CUDA_ERROR_INVALID_DEVICE\0",
        ERROR_INVALID_CONTEXT => b"CUDA_ERROR_INVALID_CONTEXT\0",
        ERROR_NOT_SUPPORTED => b"CUDA_ERROR_NOT_SUPPORTED\0",
        ERROR_NOT_READY => b"CUDA_ERROR_NOT_READY\0",
        _ => return ERROR_INVALID_VALUE,
    };
    if name.is_null() {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller passes a valid pointer to a pointer (cuGetErrorName's contract).
    unsafe { name.write(text.as_ptr().cast()) };
    SUCCESS
}
