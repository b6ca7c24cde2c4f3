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
//! copied each way. Each stream (the null stream too) runs its operations in order on a
//! thread of its own, asynchronously to the caller as a device does: copies, event records,
//! and waits on a word of mapped host memory (`cuStreamWaitValue32`), so a caller that reads
//! a buffer before the event after its copy has completed reads stale bytes, here as on a GPU.
//! The number of devices comes from `TERN_STANDIN_DEVICES` (default 2).
//!
//! Sharing between processes works as the driver's does, on the same memfds: an IPC handle
//! names the owner's process and its memfd (opened in the peer through `/proc/<pid>/fd`, so
//! only in another process of the same user), and VMM memory (`cuMemCreate`, `cuMemMap` into
//! `cuMemAddressReserve`d space) exports each physical piece as a descriptor of its memfd.
//! Copies split at the edges of mapped pieces, as the driver's do over address space mapped
//! back to back; a copy into reserved space with nothing mapped fails.
//!
//! It must not be loaded outside tests. Every entry point is `unsafe extern "C"` with the
//! contract the Driver API reference gives it; the `unsafe` blocks inside rely on those
//! contracts and on the kernel's `mmap`/`memfd_create` guarantees.
#![allow(clippy::missing_safety_doc, missing_docs, non_snake_case)]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const SUCCESS: c_int = 0;
const ERROR_INVALID_VALUE: c_int = 1;
const ERROR_OUT_OF_MEMORY: c_int = 2;
const ERROR_NOT_INITIALIZED: c_int = 3;
const ERROR_INVALID_DEVICE: c_int = 101;
const ERROR_INVALID_CONTEXT: c_int = 201;
const ERROR_NOT_SUPPORTED: c_int = 801;

const MEMORYTYPE_HOST: c_uint = 1;
const MEMORYTYPE_DEVICE: c_uint = 2;
const ATTRIBUTE_MEMORY_TYPE: c_int = 2;
const ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
const ATTRIBUTE_IS_LEGACY_IPC_CAPABLE: c_int = 10;
const ATTRIBUTE_RANGE_START_ADDR: c_int = 11;
const ATTRIBUTE_RANGE_SIZE: c_int = 12;
const ATTRIBUTE_MAPPING_SIZE: c_int = 18;
const ATTRIBUTE_MAPPING_BASE_ADDR: c_int = 19;
const HANDLE_TYPE_POSIX_FD: c_int = 1;
/// What the stand-in's VMM granularity is (the real one is 2 MiB on current GPUs).
const GRANULARITY: usize = 2 << 20;
/// First bytes of the stand-in's IPC handles.
const IPC_MAGIC: &[u8; 8] = b"TSTANDIN";

struct Allocation {
    len: usize,
    ordinal: usize,
    /// The readable and writable mapping of the same memfd.
    alias: usize,
    origin: Origin,
}

/// Where a range of device memory came from.
enum Origin {
    /// `cuMemAlloc`: its memfd is kept, for IPC handles.
    Alloc(OwnedFd),
    /// Opened from another process's IPC handle.
    Ipc,
    /// `cuMemMap` of physical memory.
    Mapped(Arc<Physical>),
}

/// Physical memory of `cuMemCreate` (or imported from a descriptor).
struct Physical {
    fd: OwnedFd,
    len: usize,
    ordinal: usize,
    handle_types: c_int,
    /// Imported from another process's descriptor.
    imported: bool,
}

#[derive(Default)]
struct State {
    initialized: bool,
    /// Device allocations (and mappings) by the address handed out.
    device: BTreeMap<usize, Allocation>,
    /// Pinned host allocations: address → length.
    host: BTreeMap<usize, usize>,
    retained: Vec<u64>,
    /// Physical memory handles.
    handles: BTreeMap<u64, Arc<Physical>>,
    /// Reserved address ranges: start → length.
    reserved: BTreeMap<usize, usize>,
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
        Device {
            base: usize,
            len: usize,
            ordinal: usize,
            legacy: bool,
        },
        Host,
    }
    let found = with_state(|s| {
        let addr = ptr as usize;
        if let Some((&base, allocation)) = s.device.range(..=addr).next_back()
            && addr < base + allocation.len
        {
            return Some(Found::Device {
                base,
                len: allocation.len,
                ordinal: allocation.ordinal,
                legacy: matches!(allocation.origin, Origin::Alloc(_)),
            });
        }
        let (&base, &len) = s.host.range(..=addr).next_back()?;
        (addr < base + len).then_some(Found::Host)
    });
    let Some(found) = found else {
        return ERROR_INVALID_VALUE;
    };
    enum Value {
        Unsigned(c_uint),
        Int(c_int),
        Wide(u64),
    }
    let value = match (attribute, found) {
        (ATTRIBUTE_MEMORY_TYPE, Found::Device { .. }) => Value::Unsigned(MEMORYTYPE_DEVICE),
        (ATTRIBUTE_MEMORY_TYPE, Found::Host) => Value::Unsigned(MEMORYTYPE_HOST),
        (ATTRIBUTE_DEVICE_ORDINAL, Found::Device { ordinal, .. }) => Value::Int(ordinal as c_int),
        (ATTRIBUTE_DEVICE_ORDINAL, Found::Host) => Value::Int(-1),
        (ATTRIBUTE_IS_LEGACY_IPC_CAPABLE, Found::Device { legacy, .. }) => {
            Value::Int(c_int::from(legacy))
        }
        (ATTRIBUTE_RANGE_START_ADDR | ATTRIBUTE_MAPPING_BASE_ADDR, Found::Device { base, .. }) => {
            Value::Wide(base as u64)
        }
        (ATTRIBUTE_RANGE_SIZE | ATTRIBUTE_MAPPING_SIZE, Found::Device { len, .. }) => {
            Value::Wide(len as u64)
        }
        _ => return ERROR_INVALID_VALUE,
    };
    // SAFETY: each attribute's data has the type the Driver API reference gives it
    // (cuPointerGetAttribute: unsigned int, int, CUdeviceptr or size_t, the last two 64-bit
    // here), and the caller passes a pointer to one.
    unsafe {
        match value {
            Value::Unsigned(v) => data.cast::<c_uint>().write(v),
            Value::Int(v) => data.cast::<c_int>().write(v),
            Value::Wide(v) => data.cast::<u64>().write(v),
        }
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
    // SAFETY: the fd is this call's own; it is kept with the allocation for IPC handles.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
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
                origin: Origin::Alloc(fd),
            },
        )
    });
    // SAFETY: the caller passes a valid CUdeviceptr pointer.
    unsafe { dptr.write(visible as u64) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: u64) -> c_int {
    release(dptr, |origin| matches!(origin, Origin::Alloc(_)))
}

/// Removes the range handed out at `dptr` when its origin is the one `made_by` wants, and
/// unmaps both of its mappings.
fn release(dptr: u64, made_by: impl Fn(&Origin) -> bool) -> c_int {
    let at = dptr as usize;
    let removed = with_state(|s| {
        let known = s.device.get(&at).is_some_and(|a| made_by(&a.origin));
        known.then(|| s.device.remove(&at)).flatten()
    });
    let Some(allocation) = removed else {
        return ERROR_INVALID_VALUE;
    };
    // SAFETY: both mappings were made by this library with this length (cuMemAlloc_v2 or
    // cuIpcOpenMemHandle_v2) and are unmapped once, here: the entry is gone from the table.
    unsafe {
        libc::munmap(at as *mut c_void, allocation.len);
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

/// Where the bytes at `addr` are for this library: the alias of device memory (and how many
/// bytes follow in that one range), or host memory itself; `None` for reserved address space
/// with nothing mapped, or device memory when `device` is false.
fn span(state: &State, addr: u64, len: usize, device: Option<bool>) -> Option<(*mut u8, usize)> {
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
fn copy_between(
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

fn is_device(state: &State, addr: u64) -> bool {
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

/// One operation queued on a stream.
enum Op {
    Copy {
        dst: u64,
        dst_device: Option<bool>,
        src: u64,
        src_device: Option<bool>,
        len: usize,
        ordinal: usize,
    },
    /// `cuStreamWaitValue32` with `CU_STREAM_WAIT_VALUE_GEQ`: until `(int32)(*addr - value)
    /// >= 0`.
    WaitValue {
        addr: usize,
        value: u32,
    },
    Record(Arc<EventState>, u64),
}

/// A stream: operations run in order on a thread of its own, asynchronously to the caller,
/// as a device's stream runs them.
#[derive(Default)]
struct StreamQueue {
    state: Mutex<QueueState>,
    changed: std::sync::Condvar,
}

#[derive(Default)]
struct QueueState {
    ops: std::collections::VecDeque<Op>,
    /// An operation is running.
    busy: bool,
    destroyed: bool,
    /// The first failure of an operation (reported by the next synchronize).
    failed: Option<c_int>,
}

#[derive(Default)]
struct EventState {
    recorded: AtomicU64,
    completed: AtomicU64,
}

struct Handles {
    streams: BTreeMap<usize, (Arc<StreamQueue>, usize)>,
    events: BTreeMap<usize, Arc<EventState>>,
}

static HANDLE_TABLE: Mutex<Handles> = Mutex::new(Handles {
    streams: BTreeMap::new(),
    events: BTreeMap::new(),
});
/// The legacy default stream (the null stream): one queue, run like the others.
static NULL_STREAM: std::sync::OnceLock<Arc<StreamQueue>> = std::sync::OnceLock::new();

fn handles() -> std::sync::MutexGuard<'static, Handles> {
    HANDLE_TABLE.lock().unwrap_or_else(|p| p.into_inner())
}

fn queue_of(stream: *mut c_void) -> Option<Arc<StreamQueue>> {
    if stream.is_null() {
        return Some(
            NULL_STREAM
                .get_or_init(|| StreamQueue::start(usize::MAX))
                .clone(),
        );
    }
    handles()
        .streams
        .get(&(stream as usize))
        .map(|(q, _)| q.clone())
}

impl StreamQueue {
    fn start(ordinal: usize) -> Arc<Self> {
        let queue = Arc::new(Self::default());
        let running = queue.clone();
        std::thread::spawn(move || running.run(ordinal));
        queue
    }

    fn push(&self, op: Op) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.ops.push_back(op);
        self.changed.notify_all();
    }

    fn run(&self, _ordinal: usize) {
        loop {
            let op = {
                let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if let Some(op) = state.ops.pop_front() {
                        state.busy = true;
                        break op;
                    }
                    if state.destroyed {
                        return;
                    }
                    state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
                }
            };
            let outcome = match op {
                Op::Copy {
                    dst,
                    dst_device,
                    src,
                    src_device,
                    len,
                    ordinal,
                } => {
                    CONTEXTS.with(|c| c.borrow_mut().push(ordinal));
                    let code = copy_between(dst, dst_device, src, src_device, len);
                    CONTEXTS.with(|c| c.borrow_mut().pop());
                    code
                }
                Op::WaitValue { addr, value } => {
                    // SAFETY: the caller's contract for cuStreamWaitValue32: `addr` is
                    // mapped host memory (here: cuMemHostAlloc memory) holding a u32 that
                    // stays allocated until the wait is done.
                    let word = unsafe { std::sync::atomic::AtomicU32::from_ptr(addr as *mut u32) };
                    while (word.load(Ordering::Acquire).wrapping_sub(value) as i32) < 0 {
                        std::thread::sleep(std::time::Duration::from_micros(50));
                    }
                    SUCCESS
                }
                Op::Record(event, generation) => {
                    event.completed.fetch_max(generation, Ordering::AcqRel);
                    SUCCESS
                }
            };
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            state.busy = false;
            if outcome != SUCCESS {
                state.failed.get_or_insert(outcome);
            }
            self.changed.notify_all();
        }
    }

    /// Waits until every operation queued so far has run; the first failure since.
    fn drain(&self) -> c_int {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while !state.ops.is_empty() || state.busy {
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        state.failed.take().unwrap_or(SUCCESS)
    }
}

fn enqueue_copy(
    stream: *mut c_void,
    (dst, dst_device): (u64, Option<bool>),
    (src, src_device): (u64, Option<bool>),
    len: usize,
) -> c_int {
    let Some(ordinal) = current_device() else {
        return ERROR_INVALID_CONTEXT;
    };
    // Ranges are checked now, as the driver checks its arguments when a call is made.
    let valid = with_state(|s| {
        span(s, dst, len, dst_device).is_some() && span(s, src, len, src_device).is_some()
    });
    if !valid {
        return ERROR_INVALID_VALUE;
    }
    let Some(queue) = queue_of(stream) else {
        return ERROR_INVALID_VALUE;
    };
    queue.push(Op::Copy {
        dst,
        dst_device,
        src,
        src_device,
        len,
        ordinal,
    });
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    len: usize,
    stream: *mut c_void,
) -> c_int {
    enqueue_copy(stream, (dst as u64, Some(false)), (src, Some(true)), len)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    len: usize,
    stream: *mut c_void,
) -> c_int {
    enqueue_copy(stream, (dst, Some(true)), (src as u64, Some(false)), len)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyAsync(
    dst: u64,
    src: u64,
    len: usize,
    stream: *mut c_void,
) -> c_int {
    enqueue_copy(stream, (dst, None), (src, None), len)
}

static HANDLES: AtomicU64 = AtomicU64::new(1);

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut *mut c_void, _flags: c_uint) -> c_int {
    let Some(ordinal) = current_device() else {
        return ERROR_INVALID_CONTEXT;
    };
    let handle = HANDLES.fetch_add(1, Ordering::Relaxed) as usize;
    handles()
        .streams
        .insert(handle, (StreamQueue::start(ordinal), ordinal));
    // SAFETY: the caller passes a valid handle pointer.
    unsafe { stream.write(handle as *mut c_void) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamSynchronize(stream: *mut c_void) -> c_int {
    if current_device().is_none() {
        return ERROR_INVALID_CONTEXT;
    }
    match queue_of(stream) {
        Some(queue) => queue.drain(),
        None => ERROR_INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> c_int {
    let Some((queue, _)) = handles().streams.remove(&(stream as usize)) else {
        return ERROR_INVALID_VALUE;
    };
    let mut state = queue.state.lock().unwrap_or_else(|p| p.into_inner());
    state.destroyed = true;
    queue.changed.notify_all();
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamGetCtx(stream: *mut c_void, context: *mut *mut c_void) -> c_int {
    let Some(&(_, ordinal)) = handles().streams.get(&(stream as usize)) else {
        return ERROR_INVALID_VALUE;
    };
    // SAFETY: the caller passes a valid CUcontext pointer.
    unsafe { context.write((ordinal + 1) as *mut c_void) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamWaitValue32_v2(
    stream: *mut c_void,
    addr: u64,
    value: u32,
    flags: c_uint,
) -> c_int {
    if flags != 0 {
        // Only CU_STREAM_WAIT_VALUE_GEQ is modelled.
        return ERROR_NOT_SUPPORTED;
    }
    let pinned = with_state(|s| {
        let at = addr as usize;
        s.host
            .range(..=at)
            .next_back()
            .is_some_and(|(&base, &len)| at + 4 <= base + len)
    });
    if !pinned || !addr.is_multiple_of(4) {
        return ERROR_INVALID_VALUE;
    }
    match queue_of(stream) {
        Some(queue) => {
            queue.push(Op::WaitValue {
                addr: addr as usize,
                value,
            });
            SUCCESS
        }
        None => ERROR_INVALID_VALUE,
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

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    dptr: *mut u64,
    host: *mut c_void,
    _flags: c_uint,
) -> c_int {
    let known = with_state(|s| {
        let at = host as usize;
        s.host
            .range(..=at)
            .next_back()
            .is_some_and(|(&base, &len)| at < base + len)
    });
    if !known {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller passes a valid CUdeviceptr pointer; under unified addressing the
    // device pointer of mapped host memory is its host pointer.
    unsafe { dptr.write(host as u64) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(event: *mut *mut c_void, _flags: c_uint) -> c_int {
    if current_device().is_none() {
        return ERROR_INVALID_CONTEXT;
    }
    let handle = HANDLES.fetch_add(1, Ordering::Relaxed) as usize;
    handles().events.insert(handle, Arc::default());
    // SAFETY: the caller passes a valid handle pointer.
    unsafe { event.write(handle as *mut c_void) };
    SUCCESS
}

fn event_of(event: *mut c_void) -> Option<Arc<EventState>> {
    handles().events.get(&(event as usize)).cloned()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(event: *mut c_void, stream: *mut c_void) -> c_int {
    let (Some(state), Some(queue)) = (event_of(event), queue_of(stream)) else {
        return ERROR_INVALID_VALUE;
    };
    let generation = state.recorded.fetch_add(1, Ordering::AcqRel) + 1;
    queue.push(Op::Record(state, generation));
    SUCCESS
}

/// `CUDA_ERROR_NOT_READY`: the event's work has not all run.
const ERROR_NOT_READY: c_int = 600;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventQuery(event: *mut c_void) -> c_int {
    let Some(state) = event_of(event) else {
        return ERROR_INVALID_VALUE;
    };
    if state.completed.load(Ordering::Acquire) >= state.recorded.load(Ordering::Acquire) {
        SUCCESS
    } else {
        ERROR_NOT_READY
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventSynchronize(event: *mut c_void) -> c_int {
    let Some(state) = event_of(event) else {
        return ERROR_INVALID_VALUE;
    };
    let wanted = state.recorded.load(Ordering::Acquire);
    while state.completed.load(Ordering::Acquire) < wanted {
        std::thread::sleep(std::time::Duration::from_micros(20));
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(event: *mut c_void) -> c_int {
    match handles().events.remove(&(event as usize)) {
        Some(_) => SUCCESS,
        None => ERROR_INVALID_VALUE,
    }
}

/// A new shared memfd of `len` bytes named `name`.
fn new_memfd(name: &std::ffi::CStr, len: usize) -> Option<OwnedFd> {
    // SAFETY: memfd_create takes a NUL-terminated name and flags.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: the fd was just made and is owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on the memfd just made.
    (unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } == 0).then_some(fd)
}

/// Maps `len` bytes of `fd` from `offset` twice: `PROT_NONE` at `at` (fixed, inside a
/// reservation) or anywhere, and readable and writable anywhere (the alias).
fn map_twice(fd: &OwnedFd, len: usize, offset: usize, at: Option<usize>) -> Option<(usize, usize)> {
    let (hint, fixed) = match at {
        Some(at) => (at as *mut c_void, libc::MAP_FIXED),
        None => (std::ptr::null_mut(), 0),
    };
    // SAFETY: a shared mapping of the memfd; with MAP_FIXED it replaces only pages of a
    // reservation this library made and the caller checked.
    let visible = unsafe {
        libc::mmap(
            hint,
            len,
            libc::PROT_NONE,
            libc::MAP_SHARED | fixed,
            fd.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    if visible == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: a new shared mapping of the memfd.
    let alias = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            offset as libc::off_t,
        )
    };
    if alias == libc::MAP_FAILED {
        if at.is_none() {
            // SAFETY: the mapping just made, unmapped once.
            unsafe { libc::munmap(visible, len) };
        }
        return None;
    }
    Some((visible as usize, alias as usize))
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

#[repr(C)]
pub struct MemLocation {
    kind: c_int,
    id: c_int,
}

#[repr(C)]
pub struct AllocationProp {
    kind: c_int,
    requested_handle_types: c_int,
    location: MemLocation,
    win32: *mut c_void,
    flags: [u8; 8],
}

#[repr(C)]
pub struct AccessDesc {
    location: MemLocation,
    flags: c_int,
}

fn insert_handle(physical: Arc<Physical>) -> u64 {
    let handle = HANDLES.fetch_add(1, Ordering::Relaxed);
    with_state(|s| s.handles.insert(handle, physical));
    handle
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    _prop: *const AllocationProp,
    _option: c_int,
) -> c_int {
    // SAFETY: the caller passes a valid size_t pointer.
    unsafe { granularity.write(GRANULARITY) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemCreate(
    handle: *mut u64,
    len: usize,
    prop: *const AllocationProp,
    _flags: u64,
) -> c_int {
    // SAFETY: the caller passes a valid property block.
    let prop = unsafe { &*prop };
    let ordinal = usize::try_from(prop.location.id).unwrap_or(usize::MAX);
    if prop.location.kind != 1 || ordinal >= devices() {
        return ERROR_INVALID_DEVICE;
    }
    if len == 0 || !len.is_multiple_of(GRANULARITY) {
        return ERROR_INVALID_VALUE;
    }
    let name = std::ffi::CString::new(format!("tern-standin-vmm-{ordinal}")).unwrap_or_default();
    let Some(fd) = new_memfd(&name, len) else {
        return ERROR_OUT_OF_MEMORY;
    };
    let made = insert_handle(Arc::new(Physical {
        fd,
        len,
        ordinal,
        handle_types: prop.requested_handle_types,
        imported: false,
    }));
    // SAFETY: the caller passes a valid handle pointer.
    unsafe { handle.write(made) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRelease(handle: u64) -> c_int {
    match with_state(|s| s.handles.remove(&handle)) {
        Some(_) => SUCCESS,
        None => ERROR_INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressReserve(
    ptr: *mut u64,
    len: usize,
    _alignment: usize,
    _addr: u64,
    _flags: u64,
) -> c_int {
    if len == 0 || !len.is_multiple_of(GRANULARITY) {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: a new private anonymous mapping that nothing can touch.
    let reserved = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if reserved == libc::MAP_FAILED {
        return ERROR_OUT_OF_MEMORY;
    }
    with_state(|s| s.reserved.insert(reserved as usize, len));
    // SAFETY: the caller passes a valid CUdeviceptr pointer.
    unsafe { ptr.write(reserved as u64) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAddressFree(ptr: u64, len: usize) -> c_int {
    let freed = with_state(|s| {
        let at = ptr as usize;
        let mapped = s.device.range(at..at + len).next().is_some();
        (s.reserved.get(&at) == Some(&len) && !mapped).then(|| s.reserved.remove(&at))
    });
    if freed.is_none() {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: the reservation made by cuMemAddressReserve with this length, unmapped once.
    unsafe { libc::munmap(ptr as usize as *mut c_void, len) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemMap(
    ptr: u64,
    len: usize,
    offset: usize,
    handle: u64,
    _flags: u64,
) -> c_int {
    let at = ptr as usize;
    let checked = with_state(|s| {
        let physical = s.handles.get(&handle)?.clone();
        let (&base, &size) = s.reserved.range(..=at).next_back()?;
        let inside = at + len <= base + size && offset + len <= physical.len;
        let free = s.device.range(at..at + len).next().is_none()
            && s.device
                .range(..at)
                .next_back()
                .is_none_or(|(&b, a)| b + a.len <= at);
        (inside && free && len > 0).then_some(physical)
    });
    let Some(physical) = checked else {
        return ERROR_INVALID_VALUE;
    };
    let Some((_, alias)) = map_twice(&physical.fd, len, offset, Some(at)) else {
        return ERROR_OUT_OF_MEMORY;
    };
    with_state(|s| {
        s.device.insert(
            at,
            Allocation {
                len,
                ordinal: physical.ordinal,
                alias,
                origin: Origin::Mapped(physical.clone()),
            },
        )
    });
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemUnmap(ptr: u64, len: usize) -> c_int {
    let at = ptr as usize;
    let removed: Vec<(usize, Allocation)> = with_state(|s| {
        let keys: Vec<usize> = s.device.range(at..at + len).map(|(&k, _)| k).collect();
        let whole = keys.iter().all(|k| {
            s.device
                .get(k)
                .is_some_and(|a| matches!(a.origin, Origin::Mapped(_)) && k + a.len <= at + len)
        });
        if !whole {
            return Vec::new();
        }
        keys.into_iter()
            .filter_map(|k| s.device.remove(&k).map(|a| (k, a)))
            .collect()
    });
    if removed.is_empty() {
        return ERROR_INVALID_VALUE;
    }
    for (base, allocation) in removed {
        // SAFETY: the alias was made by cuMemMap; the visible range goes back to reserved,
        // untouchable address space (a fixed anonymous mapping over this library's own
        // mapping).
        unsafe {
            libc::munmap(allocation.alias as *mut c_void, allocation.len);
            libc::mmap(
                base as *mut c_void,
                allocation.len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            );
        }
    }
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemSetAccess(
    ptr: u64,
    len: usize,
    desc: *const AccessDesc,
    count: usize,
) -> c_int {
    if desc.is_null() || count == 0 {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller passes `count` descriptors.
    let descs = unsafe { std::slice::from_raw_parts(desc, count) };
    if descs.iter().any(|d| {
        d.location.kind != 1
            || d.location.id < 0
            || d.location.id as usize >= devices()
            || d.flags != 3
    }) {
        return ERROR_INVALID_DEVICE;
    }
    let covered = with_state(|s| {
        let mut at = ptr as usize;
        let end = at + len;
        while at < end {
            match s.device.get(&at) {
                Some(a) if matches!(a.origin, Origin::Mapped(_)) => at += a.len,
                _ => return false,
            }
        }
        true
    });
    if covered {
        SUCCESS
    } else {
        ERROR_INVALID_VALUE
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemRetainAllocationHandle(handle: *mut u64, addr: *mut c_void) -> c_int {
    let found = with_state(|s| {
        let at = addr as usize;
        let (&base, allocation) = s.device.range(..=at).next_back()?;
        match &allocation.origin {
            Origin::Mapped(physical) if at < base + allocation.len => Some(physical.clone()),
            _ => None,
        }
    });
    let Some(physical) = found else {
        return ERROR_INVALID_VALUE;
    };
    let made = insert_handle(physical);
    // SAFETY: the caller passes a valid handle pointer.
    unsafe { handle.write(made) };
    SUCCESS
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
    if kind != HANDLE_TYPE_POSIX_FD || physical.handle_types & HANDLE_TYPE_POSIX_FD == 0 {
        return ERROR_NOT_SUPPORTED;
    }
    // SAFETY: duplicates a descriptor this library owns.
    let fd = unsafe { libc::fcntl(physical.fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
    if fd < 0 {
        return ERROR_OUT_OF_MEMORY;
    }
    // SAFETY: for POSIX descriptors the shareable handle is one int.
    unsafe { shareable.cast::<c_int>().write(fd) };
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut u64,
    os_handle: *mut c_void,
    kind: c_int,
) -> c_int {
    if kind != HANDLE_TYPE_POSIX_FD {
        return ERROR_NOT_SUPPORTED;
    }
    let given = os_handle as usize as c_int;
    // SAFETY: duplicates the caller's descriptor (the caller keeps its own).
    let fd = unsafe { libc::fcntl(given, libc::F_DUPFD_CLOEXEC, 0) };
    if fd < 0 {
        return ERROR_INVALID_VALUE;
    }
    // SAFETY: the duplicate is owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
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
        handle_types: HANDLE_TYPE_POSIX_FD,
        imported: true,
    }));
    // SAFETY: the caller passes a valid handle pointer.
    unsafe { handle.write(made) };
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

/// The stand-in has no DMA-BUF exporter (its memory is a memfd; udmabuf, which could
/// export one, is not in every kernel): NICs cannot register its memory by dma-buf.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetHandleForAddressRange(
    _handle: *mut c_void,
    _dptr: u64,
    _size: usize,
    _kind: c_int,
    _flags: u64,
) -> c_int {
    ERROR_NOT_SUPPORTED
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
