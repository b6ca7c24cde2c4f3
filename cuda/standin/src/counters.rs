//! What tests ask the stand-in: contexts retained, other processes' memory mapped here,
//! bytes copied each way.

use std::ffi::c_int;
use std::sync::atomic::Ordering;

use crate::codes::SUCCESS;
use crate::copy::{DEVICE_TO_DEVICE, TO_DEVICE, TO_HOST};
use crate::state::{Origin, with_state};

/// For tests: how many times the primary context of `ordinal` was retained (-1: no such
/// device).
#[unsafe(no_mangle)]
pub extern "C" fn ternStandinRetained(ordinal: c_int) -> i64 {
    usize::try_from(ordinal)
        .ok()
        .and_then(|o| with_state(|s| s.retained.get(o).copied()))
        .map_or(-1, |n| n as i64)
}

/// For tests: how many ranges of other processes' device memory this process has mapped
/// now (IPC handles opened, imported chunks mapped).
#[unsafe(no_mangle)]
pub extern "C" fn ternStandinPeerMappings() -> i64 {
    with_state(|s| {
        s.device
            .values()
            .filter(|a| match &a.origin {
                Origin::Ipc => true,
                Origin::Mapped(physical) => physical.imported,
                Origin::Alloc(_) => false,
            })
            .count() as i64
    })
}

/// For tests: bytes copied host → device, device → host and device → device so far.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ternStandinCopied(
    to_device: *mut u64,
    to_host: *mut u64,
    device_to_device: *mut u64,
) -> c_int {
    for (out, counter) in [
        (to_device, &TO_DEVICE),
        (to_host, &TO_HOST),
        (device_to_device, &DEVICE_TO_DEVICE),
    ] {
        if !out.is_null() {
            // SAFETY: the caller passes valid pointers or null.
            unsafe { out.write(counter.load(Ordering::Relaxed)) };
        }
    }
    SUCCESS
}
