//! Streams: each runs its operations (copies, event records, waits on a word of host
//! memory) in order on a thread of its own, asynchronously to the caller, as a device does.

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
}

/// A stream: operations run in order on a thread of its own, asynchronously to the caller,
/// as a device's stream runs them.
#[derive(Default)]
pub(crate) struct StreamQueue {
    pub(crate) state: Mutex<QueueState>,
    pub(crate) changed: Condvar,
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
            queue.push(Op::WaitValue {
                addr: addr as usize,
                value,
            });
            SUCCESS
        }
        None => ERROR_INVALID_VALUE,
    }
}
