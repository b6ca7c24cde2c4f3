//! Events: recorded on a stream, complete once the stream has run up to them.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::codes::{ERROR_INVALID_CONTEXT, ERROR_INVALID_VALUE, ERROR_NOT_READY, SUCCESS};
use crate::context::current_device;
use crate::state::{HANDLES, handles};
use crate::stream::{Op, push_ordered, queue_of};

#[derive(Default)]
pub(crate) struct EventState {
    pub(crate) recorded: AtomicU64,
    pub(crate) completed: AtomicU64,
}

impl EventState {
    /// Waits until record `generation` of the event has completed.
    pub(crate) fn wait_for(&self, generation: u64) {
        while self.completed.load(Ordering::Acquire) < generation {
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    }
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

pub(crate) fn event_of(event: *mut c_void) -> Option<Arc<EventState>> {
    handles().events.get(&(event as usize)).cloned()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventRecord(event: *mut c_void, stream: *mut c_void) -> c_int {
    let (Some(state), Some(queue)) = (event_of(event), queue_of(stream)) else {
        return ERROR_INVALID_VALUE;
    };
    let generation = state.recorded.fetch_add(1, Ordering::AcqRel) + 1;
    push_ordered(&queue, Op::Record(state, generation));
    SUCCESS
}

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
    state.wait_for(state.recorded.load(Ordering::Acquire));
    SUCCESS
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventDestroy_v2(event: *mut c_void) -> c_int {
    match handles().events.remove(&(event as usize)) {
        Some(_) => SUCCESS,
        None => ERROR_INVALID_VALUE,
    }
}
