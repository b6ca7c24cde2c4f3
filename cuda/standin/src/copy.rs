//! Synchronous copies, moved through the device memory's readable mappings piece by piece,
//! and the bytes they moved each way.
//!
//! A synchronous copy is an operation of the legacy default stream, as on a GPU (Driver API,
//! "API synchronization behavior"): it runs after the work queued there (and, by the legacy
//! stream's synchronization, on blocking streams) before it. A copy to host memory returns
//! once its bytes have landed; one from pageable host memory to the device returns once the
//! source is taken, and its bytes land a moment later (the DMA the call does not wait for);
//! one from pinned memory to the device returns once done; device to device is asynchronous.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::codes::{ERROR_INVALID_CONTEXT, ERROR_INVALID_VALUE, SUCCESS};
use crate::context::current_device;
use crate::state::{State, with_state};
use crate::stream::{Op, on_legacy_stream};

/// How long after a synchronous copy from pageable host memory returns its bytes land in
/// device memory: long enough that a reader not ordered after it sees the old bytes.
const PAGEABLE_DMA_LAG: std::time::Duration = std::time::Duration::from_millis(30);

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

/// A synchronous copy of `len` bytes, on the legacy stream.
fn legacy_copy(
    (dst, dst_device): (u64, Option<bool>),
    (src, src_device): (u64, Option<bool>),
    len: usize,
) -> c_int {
    let Some(ordinal) = current_device() else {
        return ERROR_INVALID_CONTEXT;
    };
    let kinds = with_state(|s| {
        let valid =
            span(s, dst, len, dst_device).is_some() && span(s, src, len, src_device).is_some();
        valid.then(|| {
            let to_device = dst_device.unwrap_or_else(|| is_device(s, dst));
            let from_device = src_device.unwrap_or_else(|| is_device(s, src));
            let pinned_source = s
                .host
                .range(..=(src as usize))
                .next_back()
                .is_some_and(|(&base, &size)| (src as usize) < base + size);
            (to_device, from_device, pinned_source)
        })
    });
    let Some((to_device, from_device, pinned_source)) = kinds else {
        return ERROR_INVALID_VALUE;
    };
    if to_device && !from_device && !pinned_source {
        // SAFETY: the caller's contract for the call: `src` is valid for `len` reads until
        // the call returns, which is when it is taken here.
        let bytes = unsafe { std::slice::from_raw_parts(src as *const u8, len) }.to_vec();
        return on_legacy_stream(
            Op::CopyOwned {
                dst,
                bytes,
                ordinal,
                after: PAGEABLE_DMA_LAG,
            },
            false,
        );
    }
    let op = Op::Copy {
        dst,
        dst_device: Some(to_device),
        src,
        src_device: Some(from_device),
        len,
        ordinal,
    };
    on_legacy_stream(op, !(to_device && from_device))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, len: usize) -> c_int {
    legacy_copy((dst as u64, Some(false)), (src, Some(true)), len)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, len: usize) -> c_int {
    legacy_copy((dst, Some(true)), (src as u64, Some(false)), len)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, len: usize) -> c_int {
    legacy_copy((dst, Some(true)), (src, Some(true)), len)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpy(dst: u64, src: u64, len: usize) -> c_int {
    legacy_copy((dst, None), (src, None), len)
}
