//! What tests ask of the stand-in driver (`tern-cuda-standin`) beyond the Driver API: its
//! `ternStandin*` entry points, looked up in the loaded library. On any other driver they
//! are missing, and these calls fail: they are for tests, which run them only on the
//! stand-in.

use std::ffi::c_void;

use crate::device::Device;
use crate::driver::CuResult;
use crate::error::CudaError;

/// `ternStandinFill`: a "kernel" filling device memory with one value, on a stream.
type FillFn = unsafe extern "C" fn(*mut c_void, u64, u8, usize) -> CuResult;

/// Enqueues on the device's legacy default stream a "kernel" that fills `len` bytes of
/// device memory at `dst` with `value`: work a caller left on stream 0, which a transfer
/// that names no stream must come after. Fails on a driver other than the stand-in.
pub fn fill_on_legacy_stream(
    device: &Device,
    dst: u64,
    value: u8,
    len: usize,
) -> Result<(), CudaError> {
    let driver = device.driver;
    // SAFETY: the symbol's type is the stand-in's declaration of `ternStandinFill`
    // (cuda/standin/src/stream.rs); the library stays loaded for the rest of the process.
    let fill = unsafe { driver.library.get::<FillFn>(b"ternStandinFill\0") }.map_err(|e| {
        CudaError::SymbolMissing {
            symbol: "ternStandinFill",
            library: driver.path().to_owned(),
            reason: e.to_string(),
        }
    })?;
    // SAFETY: the stand-in checks that `[dst, dst + len)` is its device memory and fails
    // otherwise; the null stream is the legacy stream of the context `call` makes current.
    device.call("ternStandinFill", || unsafe {
        fill(std::ptr::null_mut(), dst, value, len)
    })
}
