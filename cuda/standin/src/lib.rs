//! A stand-in for the CUDA driver (`libcuda.so.1`), which tests load through
//! `TERN_CUDA_DRIVER` on machines without a GPU.
//!
//! Its "device memory" is address space the CPU cannot touch: each allocation is a memfd
//! mapped twice, once `PROT_NONE` at the address handed out (any CPU access there faults the
//! process) and once readable and writable at an address only this library knows, through
//! which its copy calls move the bytes. A test that passes with it proves Tern reached device
//! memory only through driver copies and never with the CPU. It tests the logic above the
//! driver; it is not the proof that GPUs work.
//!
//! It implements the entry points `tern-cuda` resolves, with the Driver API's signatures and
//! error codes, plus `ternStandin*` counters for tests: contexts retained per device, bytes
//! copied each way. Streams run their copies at once (a valid schedule of an asynchronous
//! stream). The number of devices comes from `TERN_STANDIN_DEVICES` (default 2).
//!
//! It must not be loaded outside tests. Every entry point is `unsafe extern "C"` with the
//! contract the Driver API reference gives it; the `unsafe` blocks inside rely on those
//! contracts and on the kernel's `mmap`/`memfd_create` guarantees.
#![allow(clippy::missing_safety_doc, missing_docs, non_snake_case)]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

const SUCCESS: c_int = 0;
const ERROR_INVALID_VALUE: c_int = 1;
const ERROR_OUT_OF_MEMORY: c_int = 2;
const ERROR_NOT_INITIALIZED: c_int = 3;
const ERROR_INVALID_DEVICE: c_int = 101;
const ERROR_INVALID_CONTEXT: c_int = 201;

const MEMORYTYPE_HOST: c_uint = 1;
const MEMORYTYPE_DEVICE: c_uint = 2;
const ATTRIBUTE_MEMORY_TYPE: c_int = 2;
const ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;

struct Allocation {
    len: usize,
    ordinal: usize,
    /// The readable and writable mapping of the same memfd.
    alias: usize,
}

#[derive(Default)]
struct State {
    initialized: bool,
    /// Device allocations by the address handed out.
    device: BTreeMap<usize, Allocation>,
    /// Pinned host allocations: address → length.
    host: BTreeMap<usize, usize>,
    retained: Vec<u64>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);
static TO_DEVICE: AtomicU64 = AtomicU64::new(0);
static TO_HOST: AtomicU64 = AtomicU64::new(0);
static DEVICE_TO_DEVICE: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's context stack: each entry is a device ordinal.
    static CONTEXTS: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

fn devices() -> usize {
    std::env::var("TERN_STANDIN_DEVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
}

fn with_state<R>(f: impl FnOnce(&mut State) -> R) -> R {
    let mut guard = STATE.lock().unwrap_or_else(|p| p.into_inner());
    f(guard.get_or_insert_with(State::default))
}

/// The alias address of `[addr, addr + len)` when it lies inside one device allocation.
fn alias_of(state: &State, addr: u64, len: usize) -> Option<*mut u8> {
    let addr = usize::try_from(addr).ok()?;
    let (&base, allocation) = state.device.range(..=addr).next_back()?;
    let offset = addr - base;
    (offset.checked_add(len)? <= allocation.len).then_some((allocation.alias + offset) as *mut u8)
}

fn current_device() -> Option<usize> {
    CONTEXTS.with(|c| c.borrow().last().copied())
}

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
pub unsafe extern "C" fn cuGetErrorName(code: c_int, name: *mut *const c_char) -> c_int {
    let text: &'static [u8] = match code {
        SUCCESS => b"CUDA_SUCCESS\0",
        ERROR_INVALID_VALUE => b"CUDA_ERROR_INVALID_VALUE\0",
        ERROR_OUT_OF_MEMORY => b"CUDA_ERROR_OUT_OF_MEMORY\0",
        ERROR_NOT_INITIALIZED => b"CUDA_ERROR_NOT_INITIALIZED\0",
        ERROR_INVALID_DEVICE => b"CUDA_ERROR_INVALID_DEVICE\0",
        ERROR_INVALID_CONTEXT => b"CUDA_ERROR_INVALID_CONTEXT\0",
        _ => return ERROR_INVALID_VALUE,
    };
    if name.is_null() {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller passes a valid pointer to a pointer (cuGetErrorName's contract).
    unsafe { name.write(text.as_ptr().cast()) };
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
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: c_int,
    ptr: u64,
) -> c_int {
    enum Found {
        Device(usize),
        Host,
    }
    let found = with_state(|s| {
        if let Some(alias) = alias_of(s, ptr, 1) {
            let _ = alias;
            let addr = ptr as usize;
            let (_, allocation) = s.device.range(..=addr).next_back()?;
            return Some(Found::Device(allocation.ordinal));
        }
        let addr = ptr as usize;
        let (&base, &len) = s.host.range(..=addr).next_back()?;
        (addr < base + len).then_some(Found::Host)
    });
    let Some(found) = found else {
        return ERROR_INVALID_VALUE;
    };
    match (attribute, found) {
        (ATTRIBUTE_MEMORY_TYPE, Found::Device(_)) => {
            // SAFETY: MEMORY_TYPE's data is an unsigned int.
            unsafe { data.cast::<c_uint>().write(MEMORYTYPE_DEVICE) }
        }
        (ATTRIBUTE_MEMORY_TYPE, Found::Host) => {
            // SAFETY: as above.
            unsafe { data.cast::<c_uint>().write(MEMORYTYPE_HOST) }
        }
        (ATTRIBUTE_DEVICE_ORDINAL, Found::Device(ordinal)) => {
            // SAFETY: DEVICE_ORDINAL's data is an int.
            unsafe { data.cast::<c_int>().write(ordinal as c_int) }
        }
        (ATTRIBUTE_DEVICE_ORDINAL, Found::Host) => {
            // SAFETY: as above.
            unsafe { data.cast::<c_int>().write(-1) }
        }
        _ => return ERROR_INVALID_VALUE,
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    base: *mut u64,
    size: *mut usize,
    ptr: u64,
) -> c_int {
    let found = with_state(|s| {
        let addr = ptr as usize;
        let (&start, allocation) = s.device.range(..=addr).next_back()?;
        (addr < start + allocation.len).then_some((start, allocation.len))
    });
    let Some((start, len)) = found else {
        return ERROR_INVALID_VALUE;
    };
    if !base.is_null() {
        // SAFETY: the caller passes a valid pointer or null.
        unsafe { base.write(start as u64) };
    }
    if !size.is_null() {
        // SAFETY: as above.
        unsafe { size.write(len) };
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, len: usize) -> c_int {
    let Some(ordinal) = current_device() else {
        return ERROR_INVALID_CONTEXT;
    };
    if len == 0 {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: memfd_create takes a NUL-terminated name and flags.
    let fd = unsafe { libc::memfd_create(c"tern-standin-device".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return ERROR_OUT_OF_MEMORY;
    }
    // SAFETY: ftruncate on the memfd just made.
    if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
        // SAFETY: closes the fd made above.
        unsafe { libc::close(fd) };
        return ERROR_OUT_OF_MEMORY;
    }
    // SAFETY: a new shared mapping of the memfd; no existing memory is affected.
    let visible = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    // SAFETY: as above.
    let alias = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    // SAFETY: the mappings keep the memfd's pages; the fd itself is no longer needed.
    unsafe { libc::close(fd) };
    if visible == libc::MAP_FAILED || alias == libc::MAP_FAILED {
        return ERROR_OUT_OF_MEMORY;
    }
    with_state(|s| {
        s.device.insert(
            visible as usize,
            Allocation {
                len,
                ordinal,
                alias: alias as usize,
            },
        )
    });
    // SAFETY: the caller passes a valid CUdeviceptr pointer.
    unsafe { dptr.write(visible as u64) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: u64) -> c_int {
    let Some(allocation) = with_state(|s| s.device.remove(&(dptr as usize))) else {
        return ERROR_INVALID_VALUE;
    };
    // SAFETY: both mappings were made by cuMemAlloc_v2 with this length and are unmapped
    // once, here (the entry is gone from the table).
    unsafe {
        libc::munmap(dptr as usize as *mut c_void, allocation.len);
        libc::munmap(allocation.alias as *mut c_void, allocation.len);
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostAlloc(
    ptr: *mut *mut c_void,
    len: usize,
    _flags: c_uint,
) -> c_int {
    // SAFETY: a new private anonymous mapping.
    let memory = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len.max(1),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if memory == libc::MAP_FAILED {
        return ERROR_OUT_OF_MEMORY;
    }
    with_state(|s| s.host.insert(memory as usize, len.max(1)));
    // SAFETY: the caller passes a valid pointer.
    unsafe { ptr.write(memory) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFreeHost(ptr: *mut c_void) -> c_int {
    let Some(len) = with_state(|s| s.host.remove(&(ptr as usize))) else {
        return ERROR_INVALID_VALUE;
    };
    // SAFETY: the mapping was made by cuMemHostAlloc with this length, unmapped once here.
    unsafe { libc::munmap(ptr, len) };
    SUCCESS
}

fn copy(dst: *mut u8, src: *const u8, len: usize, counter: &AtomicU64) -> c_int {
    if current_device().is_none() {
        return ERROR_INVALID_CONTEXT;
    }
    // SAFETY: the host side is valid for `len` by the Driver API's contract for the call;
    // the device side was translated to its alias mapping, checked to hold `len` bytes.
    unsafe { std::ptr::copy(src, dst, len) };
    counter.fetch_add(len as u64, Ordering::Relaxed);
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, len: usize) -> c_int {
    match with_state(|s| alias_of(s, src, len)) {
        Some(from) => copy(dst.cast(), from, len, &TO_HOST),
        None => ERROR_INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, len: usize) -> c_int {
    match with_state(|s| alias_of(s, dst, len)) {
        Some(to) => copy(to, src.cast(), len, &TO_DEVICE),
        None => ERROR_INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoD_v2(dst: u64, src: u64, len: usize) -> c_int {
    match with_state(|s| (alias_of(s, dst, len), alias_of(s, src, len))) {
        (Some(to), Some(from)) => copy(to, from, len, &DEVICE_TO_DEVICE),
        _ => ERROR_INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    len: usize,
    _stream: *mut c_void,
) -> c_int {
    // SAFETY: same contract as the synchronous copy; the stream runs it at once.
    unsafe { cuMemcpyDtoH_v2(dst, src, len) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    len: usize,
    _stream: *mut c_void,
) -> c_int {
    // SAFETY: same contract as the synchronous copy; the stream runs it at once.
    unsafe { cuMemcpyHtoD_v2(dst, src, len) }
}

static HANDLES: AtomicU64 = AtomicU64::new(1);

fn new_handle(out: *mut *mut c_void) -> c_int {
    if current_device().is_none() {
        return ERROR_INVALID_CONTEXT;
    }
    let handle = HANDLES.fetch_add(1, Ordering::Relaxed) as usize;
    // SAFETY: the caller passes a valid handle pointer.
    unsafe { out.write(handle as *mut c_void) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut *mut c_void, _flags: c_uint) -> c_int {
    new_handle(stream)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(_stream: *mut c_void) -> c_int {
    if current_device().is_none() {
        return ERROR_INVALID_CONTEXT;
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(_stream: *mut c_void) -> c_int {
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(event: *mut *mut c_void, _flags: c_uint) -> c_int {
    new_handle(event)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(_event: *mut c_void, _stream: *mut c_void) -> c_int {
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(_event: *mut c_void) -> c_int {
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(_event: *mut c_void) -> c_int {
    SUCCESS
}

/// For tests: how many times the primary context of `ordinal` was retained (-1: no such
/// device).
#[unsafe(no_mangle)]
pub extern "C" fn ternStandinRetained(ordinal: c_int) -> i64 {
    usize::try_from(ordinal)
        .ok()
        .and_then(|o| with_state(|s| s.retained.get(o).copied()))
        .map_or(-1, |n| n as i64)
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
