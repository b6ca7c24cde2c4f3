//! Synchronous copies, moved through the device memory's readable mappings piece by piece,
//! and the bytes they moved each way.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::codes::{ERROR_INVALID_CONTEXT, ERROR_INVALID_VALUE, SUCCESS};
use crate::context::current_device;
use crate::state::{State, with_state};

pub(crate) static TO_DEVICE: AtomicU64 = AtomicU64::new(0);
pub(crate) static TO_HOST: AtomicU64 = AtomicU64::new(0);
pub(crate) static DEVICE_TO_DEVICE: AtomicU64 = AtomicU64::new(0);

/// Where the bytes at `addr` are for this library: the alias of device memory (and how many
/// bytes follow in that one range), or host memory itself; `None` for reserved address space
/// with nothing mapped, or device memory when `device` is false.
pub(crate) fn span(
    state: &State,
    addr: u64,
    len: usize,
    device: Option<bool>,
) -> Option<(*mut u8, usize)> {
    let at = usize::try_from(addr).ok()?;
    if let Some((&base, allocation)) = state.device.range(..=at).next_back()
        && at < base + allocation.len
    {
        if device == Some(false) {
            return None;
        }
        return Some((
            (allocation.alias + at - base) as *mut u8,
            base + allocation.len - at,
        ));
    }
    if device == Some(true) {
        return None;
    }
    if let Some((&base, &size)) = state.reserved.range(..=at).next_back()
        && at < base + size
    {
        return None;
    }
    Some((at as *mut u8, len))
}

/// Copies `len` bytes from `src` to `dst` piece by piece, each piece inside one device range
/// (device ranges mapped back to back are one address range to the driver, not to the CPU).
/// `None` for a side means "either kind"; `Some(true)` device memory only, `Some(false)` host
/// memory only.
pub(crate) fn copy_between(
    dst: u64,
    dst_device: Option<bool>,
    src: u64,
    src_device: Option<bool>,
    len: usize,
) -> c_int {
    if current_device().is_none() {
        return ERROR_INVALID_CONTEXT;
    }
    let mut done = 0usize;
    while done < len {
        let pieces = with_state(|s| {
            let to = span(s, dst + done as u64, len - done, dst_device)?;
            let from = span(s, src + done as u64, len - done, src_device)?;
            let to_device = dst_device.unwrap_or_else(|| is_device(s, dst + done as u64));
            let from_device = src_device.unwrap_or_else(|| is_device(s, src + done as u64));
            Some((to, from, to_device, from_device))
        });
        let Some(((to, to_room), (from, from_room), to_device, from_device)) = pieces else {
            return ERROR_INVALID_VALUE;
        };
        let piece = (len - done).min(to_room).min(from_room);
        // SAFETY: the host sides are valid for the copy by the Driver API's contract for the
        // call; device sides were translated to their alias mappings, checked to hold the
        // piece.
        unsafe { std::ptr::copy(from.cast_const(), to, piece) };
        let counter = match (to_device, from_device) {
            (true, true) => Some(&DEVICE_TO_DEVICE),
            (true, false) => Some(&TO_DEVICE),
            (false, true) => Some(&TO_HOST),
            (false, false) => None,
        };
        if let Some(counter) = counter {
            counter.fetch_add(piece as u64, Ordering::Relaxed);
        }
        done += piece;
    }
    SUCCESS
}

pub(crate) fn is_device(state: &State, addr: u64) -> bool {
    let at = addr as usize;
    state
        .device
        .range(..=at)
        .next_back()
        .is_some_and(|(&base, a)| at < base + a.len)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, len: usize) -> c_int {
    copy_between(dst as u64, Some(false), src, Some(true), len)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, len: usize) -> c_int {
    copy_between(dst, Some(true), src as u64, Some(false), len)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, len: usize) -> c_int {
    copy_between(dst, Some(true), src, Some(true), len)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy(dst: u64, src: u64, len: usize) -> c_int {
    copy_between(dst, None, src, None, len)
}
