//! Streams: each runs its operations (copies, event records, waits on a word of host
//! memory or on an event, test "kernels") in order on a thread of its own, asynchronously to
//! the caller, as a device does.
//!
//! The legacy default stream (the null stream) and blocking streams synchronize as the
//! Driver API's "Stream synchronization behavior" says: an operation on the legacy stream
//! waits for the work enqueued before it on every blocking stream, and an operation on a
//! blocking stream waits for the work enqueued before it on the legacy stream; a
//! non-blocking stream (`CU_STREAM_NON_BLOCKING`) runs unordered with both unless an event
//! orders it (`cuStreamWaitEvent`). Synchronous copies are legacy-stream operations: they
//! wait behind its work, and a copy from pageable host memory to the device returns once the
//! source is taken, before the bytes land ([`crate::copy`]).

use std::ffi::{c_int, c_uint, c_void};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use parking_lot::{Condvar, Mutex};

use crate::codes::{ERROR_INVALID_CONTEXT, ERROR_INVALID_VALUE, ERROR_NOT_SUPPORTED, SUCCESS};
use crate::context::{CONTEXTS, current_device};
use crate::copy::{copy_between, span};
use crate::event::EventState;
use crate::state::{HANDLES, handles, with_state};

/// One operation queued on a stream.
pub(crate) enum Op {
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
    /// `cuStreamWaitEvent`: until the event's record `generation` has completed.
    WaitEvent {
        event: Arc<EventState>,
        generation: u64,
    },
    /// Bytes taken when it was enqueued, landing in device memory `after` it runs: a copy
    /// from pageable host memory (the DMA a synchronous copy does not wait for), or a test's
    /// "kernel" that fills memory.
    CopyOwned {
        dst: u64,
        bytes: Vec<u8>,
        ordinal: usize,
        after: std::time::Duration,
    },
}

/// A stream: operations run in order on a thread of its own, asynchronously to the caller,
/// as a device's stream runs them.
#[derive(Default)]
pub(crate) struct StreamQueue {
    pub(crate) state: Mutex<QueueState>,
    pub(crate) changed: Condvar,
    /// Made without `CU_STREAM_NON_BLOCKING`: synchronizes with the legacy stream.
    pub(crate) blocking: bool,
}

#[derive(Default)]
pub(crate) struct QueueState {
    pub(crate) ops: std::collections::VecDeque<Op>,
    /// An operation is running.
    pub(crate) busy: bool,
    pub(crate) destroyed: bool,
    /// The first failure of an operation (reported by the next synchronize).
    pub(crate) failed: Option<c_int>,
}

/// The legacy default stream (the null stream): one queue, run like the others.
pub(crate) static NULL_STREAM: std::sync::OnceLock<Arc<StreamQueue>> = std::sync::OnceLock::new();

pub(crate) fn queue_of(stream: *mut c_void) -> Option<Arc<StreamQueue>> {
    if stream.is_null() {
        return Some(null_queue());
    }
    handles()
        .streams
        .get(&(stream as usize))
        .map(|(q, _)| q.clone())
}

/// The null stream's queue.
fn null_queue() -> Arc<StreamQueue> {
    NULL_STREAM
        .get_or_init(|| StreamQueue::start(usize::MAX, false))
        .clone()
}

/// Whether `queue` is the legacy default stream's.
fn is_null(queue: &Arc<StreamQueue>) -> bool {
    NULL_STREAM
        .get()
        .is_some_and(|null| Arc::ptr_eq(null, queue))
}

/// A fresh event recorded once, and the operation that completes that record.
fn fresh_record() -> (Arc<EventState>, u64, Op) {
    let event = Arc::new(EventState::default());
    let generation = event.recorded.fetch_add(1, Ordering::AcqRel) + 1;
    let record = Op::Record(event.clone(), generation);
    (event, generation, record)
}

/// Records a fresh event on `queue` after what it holds; the event and its generation.
fn record_here(queue: &StreamQueue) -> (Arc<EventState>, u64) {
    let (event, generation, record) = fresh_record();
    queue.push(record);
    (event, generation)
}

/// Enqueues `op` on `queue` with the legacy stream's implicit synchronization: on the legacy
/// stream it waits for every blocking stream's work so far, on a blocking stream for the
/// legacy stream's; a non-blocking stream takes it as it is.
pub(crate) fn push_ordered(queue: &Arc<StreamQueue>, op: Op) {
    if is_null(queue) {
        let blocking: Vec<Arc<StreamQueue>> = handles()
            .streams
            .values()
            .filter(|(q, _)| q.blocking)
            .map(|(q, _)| q.clone())
            .collect();
        for other in blocking {
            let (event, generation) = record_here(&other);
            queue.push(Op::WaitEvent { event, generation });
        }
    } else if queue.blocking {
        let (event, generation) = record_here(&null_queue());
        queue.push(Op::WaitEvent { event, generation });
    }
    queue.push(op);
}

/// Enqueues `op` on the legacy stream (ordered as [`push_ordered`] says) and, with `wait`,
/// returns once it has run: a synchronous call's operation.
pub(crate) fn on_legacy_stream(op: Op, wait: bool) -> c_int {
    push_ordered(&null_queue(), op);
    if wait {
        synchronize_legacy_stream()
    } else {
        SUCCESS
    }
}

/// Waits until the work on the legacy stream so far (and so on the blocking streams before
/// it) has run; the first failure since.
fn synchronize_legacy_stream() -> c_int {
    let queue = null_queue();
    let (event, generation, record) = fresh_record();
    push_ordered(&queue, record);
    event.wait_for(generation);
    queue.state.lock().failed.take().unwrap_or(SUCCESS)
}

/// Runs `copy` with device `ordinal`'s context current, as a stream's thread runs its copies.
fn in_context(ordinal: usize, copy: impl FnOnce() -> c_int) -> c_int {
    CONTEXTS.with(|c| c.borrow_mut().push(ordinal));
    let code = copy();
    CONTEXTS.with(|c| c.borrow_mut().pop());
    code
}

impl StreamQueue {
    fn start(ordinal: usize, blocking: bool) -> Arc<Self> {
        let queue = Arc::new(Self {
            blocking,
            ..Self::default()
        });
        let running = queue.clone();
        std::thread::spawn(move || running.run(ordinal));
        queue
    }

    pub(crate) fn push(&self, op: Op) {
        let mut state = self.state.lock();
        state.ops.push_back(op);
        self.changed.notify_all();
    }

    fn run(&self, _ordinal: usize) {
        loop {
            let op = {
                let mut state = self.state.lock();
                loop {
                    if let Some(op) = state.ops.pop_front() {
                        state.busy = true;
                        break op;
                    }
                    if state.destroyed {
                        return;
                    }
                    self.changed.wait(&mut state);
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
                } => in_context(ordinal, || {
                    copy_between(dst, dst_device, src, src_device, len)
                }),
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
                Op::WaitEvent { event, generation } => {
                    event.wait_for(generation);
                    SUCCESS
                }
                Op::CopyOwned {
                    dst,
                    bytes,
                    ordinal,
                    after,
                } => {
                    std::thread::sleep(after);
                    let src = bytes.as_ptr() as u64;
                    in_context(ordinal, || {
                        copy_between(dst, Some(true), src, Some(false), bytes.len())
                    })
                }
            };
            let mut state = self.state.lock();
            state.busy = false;
            if outcome != SUCCESS {
                state.failed.get_or_insert(outcome);
            }
            self.changed.notify_all();
        }
    }

    /// Waits until every operation queued so far has run; the first failure since.
    fn drain(&self) -> c_int {
        let mut state = self.state.lock();
        while !state.ops.is_empty() || state.busy {
            self.changed.wait(&mut state);
        }
        state.failed.take().unwrap_or(SUCCESS)
    }
}

pub(crate) fn enqueue_copy(
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
    push_ordered(
        &queue,
        Op::Copy {
            dst,
            dst_device,
            src,
            src_device,
            len,
            ordinal,
        },
    );
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

/// `CU_STREAM_NON_BLOCKING`.
const STREAM_NON_BLOCKING: c_uint = 1;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamCreate(stream: *mut *mut c_void, flags: c_uint) -> c_int {
    let Some(ordinal) = current_device() else {
        return ERROR_INVALID_CONTEXT;
    };
    let handle = HANDLES.fetch_add(1, Ordering::Relaxed) as usize;
    let blocking = flags & STREAM_NON_BLOCKING == 0;
    handles()
        .streams
        .insert(handle, (StreamQueue::start(ordinal, blocking), ordinal));
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
        // The legacy stream's synchronize waits for the blocking streams' work before it too.
        Some(queue) if is_null(&queue) => synchronize_legacy_stream(),
        Some(queue) => queue.drain(),
        None => ERROR_INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamWaitEvent(
    stream: *mut c_void,
    event: *mut c_void,
    flags: c_uint,
) -> c_int {
    if flags != 0 {
        return ERROR_INVALID_VALUE;
    }
    let (Some(queue), Some(event)) = (queue_of(stream), crate::event::event_of(event)) else {
        return ERROR_INVALID_VALUE;
    };
    // The wait is for the event's most recent record; an event never recorded is no wait.
    let generation = event.recorded.load(Ordering::Acquire);
    if generation > 0 {
        push_ordered(&queue, Op::WaitEvent { event, generation });
    }
    SUCCESS
}

/// For tests: enqueues a "kernel" on `stream` (0: the legacy stream) that fills `len` bytes
/// of device memory at `dst` with `value`, ordered as any operation on that stream.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ternStandinFill(
    stream: *mut c_void,
    dst: u64,
    value: u8,
    len: usize,
) -> c_int {
    let Some(ordinal) = current_device() else {
        return ERROR_INVALID_CONTEXT;
    };
    if !with_state(|s| span(s, dst, len, Some(true)).is_some()) {
        return ERROR_INVALID_VALUE;
    }
    match queue_of(stream) {
        Some(queue) => {
            push_ordered(
                &queue,
                Op::CopyOwned {
                    dst,
                    bytes: vec![value; len],
                    ordinal,
                    after: std::time::Duration::ZERO,
                },
            );
            SUCCESS
        }
        None => ERROR_INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuStreamDestroy_v2(stream: *mut c_void) -> c_int {
    let Some((queue, _)) = handles().streams.remove(&(stream as usize)) else {
        return ERROR_INVALID_VALUE;
    };
    let mut state = queue.state.lock();
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
            push_ordered(
                &queue,
                Op::WaitValue {
                    addr: addr as usize,
                    value,
                },
            );
            SUCCESS
        }
        None => ERROR_INVALID_VALUE,
    }
}
