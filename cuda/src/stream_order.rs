//! Host work ordered on a caller's CUDA stream without blocking any host thread.
//!
//! A transfer "on a stream" must start after the work enqueued on the stream before it and
//! finish before the work enqueued after it. Two driver facilities give that without a host
//! callback that waits: an event recorded on the stream marks the work before
//! ([`CallerStream::mark`], polled with `cuEventQuery` from Tern's own thread), and a
//! `cuStreamWaitValue32` on a word of mapped pinned host memory holds the work after
//! ([`CallerStream::hold_until`]) until Tern writes the word ([`Gate::open`]) — from any
//! thread, when the transfer is over, failed or not. The stream's own host thread is never
//! blocked, and a failure never kills the process.
//!
//! Gate words live in pinned pages that are never freed: the GPU may read a word until the
//! stream passes its wait, which Tern does not observe. A word is reused once opened, with a
//! larger target each time; `CU_STREAM_WAIT_VALUE_GEQ` compares cyclically, so a stream
//! waiting for an older target is released by any newer value.

use parking_lot::Mutex;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::driver::{
    CuContext, CuDevice, CuDevicePtr, CuEvent, CuStream, Driver, ERROR_NOT_READY,
    EVENT_DISABLE_TIMING, MEMHOSTALLOC_DEVICEMAP, MEMHOSTALLOC_PORTABLE, STREAM_WAIT_VALUE_GEQ,
    driver,
};
use crate::error::CudaError;

/// Gate words per pinned page.
const WORDS_PER_PAGE: usize = 1024;

/// A context made current on this thread until dropped.
struct Pushed {
    driver: &'static Driver,
}

impl Pushed {
    fn new(driver: &'static Driver, context: CuContext) -> Result<Self, CudaError> {
        // SAFETY: the context is one the driver handed out (the stream's, or the thread's
        // current one) and stays alive while its stream does, which the caller of
        // `CallerStream::from_raw` guarantees.
        driver.check("cuCtxPushCurrent", unsafe {
            (driver.api.ctx_push_current)(context)
        })?;
        Ok(Self { driver })
    }
}

impl Drop for Pushed {
    fn drop(&mut self) {
        let mut popped: CuContext = std::ptr::null_mut();
        // SAFETY: `new` pushed a context on this thread (this guard never leaves it), and
        // guards drop in reverse order, so the top of the stack is that one.
        let code = unsafe { (self.driver.api.ctx_pop_current)(&mut popped) };
        if let Err(e) = self.driver.check("cuCtxPopCurrent", code) {
            tracing::warn!("{e}");
        }
    }
}

/// A stream the caller owns (PyTorch's `torch.cuda.current_stream().cuda_stream`, or 0 for
/// the legacy default stream of the calling thread's context).
#[derive(Debug)]
pub struct CallerStream<'s> {
    driver: &'static Driver,
    raw: CuStream,
    context: CuContext,
    ordinal: usize,
    _stream: std::marker::PhantomData<&'s ()>,
}

// SAFETY: a CUstream and its CUcontext are handles usable from any thread once the context
// is pushed there, which every method does (the Driver API is thread-safe).
unsafe impl Send for CallerStream<'_> {}

impl crate::Stream {
    /// This stream, as a caller's stream to order work on.
    pub fn caller(&self) -> Result<CallerStream<'_>, CudaError> {
        // SAFETY: the stream lives as long as the borrow the result carries.
        unsafe { CallerStream::from_raw(self.raw as usize) }
    }
}

impl CallerStream<'_> {
    /// The caller's stream `raw` (0: the legacy default stream of the context current on
    /// this thread).
    ///
    /// # Safety
    ///
    /// `raw` must be 0 or a stream the driver made that is not destroyed while this value
    /// lives (marks and waits enqueued through it may outlive it: the driver keeps what they
    /// need).
    pub unsafe fn from_raw(raw: usize) -> Result<Self, CudaError> {
        let driver = driver()?;
        let raw = raw as CuStream;
        let mut context: CuContext = std::ptr::null_mut();
        let code = if raw.is_null() {
            // SAFETY: writes one CUcontext (null when the thread has none).
            unsafe { (driver.api.ctx_get_current)(&mut context) }
        } else {
            // SAFETY: writes one CUcontext for a live stream (the caller's guarantee).
            unsafe { (driver.api.stream_get_ctx)(raw, &mut context) }
        };
        driver.check("cuStreamGetCtx", code)?;
        if context.is_null() {
            return Err(CudaError::Call {
                call: "cuCtxGetCurrent",
                code: 0,
                name: "stream 0 means the calling thread's current context, and it has none: \
                       pass the stream (torch.cuda.current_stream().cuda_stream)"
                    .into(),
            });
        }
        let _current = Pushed::new(driver, context)?;
        let mut device: CuDevice = -1;
        // SAFETY: writes one CUdevice, the device of the context just made current.
        driver.check("cuCtxGetDevice", unsafe {
            (driver.api.ctx_get_device)(&mut device)
        })?;
        Ok(Self {
            driver,
            raw,
            context,
            ordinal: usize::try_from(device).unwrap_or(usize::MAX),
            _stream: std::marker::PhantomData,
        })
    }

    /// The ordinal of the stream's device.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// An event after the work enqueued on the stream so far.
    pub fn mark(&self) -> Result<Mark, CudaError> {
        let _current = Pushed::new(self.driver, self.context)?;
        let mut event: CuEvent = std::ptr::null_mut();
        // SAFETY: writes one CUevent in the current context (the stream's).
        self.driver.check("cuEventCreate", unsafe {
            (self.driver.api.event_create)(&mut event, EVENT_DISABLE_TIMING)
        })?;
        let mark = Mark {
            driver: self.driver,
            context: self.context,
            event,
        };
        // SAFETY: the event and the stream belong to the current context.
        self.driver.check("cuEventRecord", unsafe {
            (self.driver.api.event_record)(event, self.raw)
        })?;
        Ok(mark)
    }

    /// A gate whose word this stream can wait on.
    pub fn gate(&self) -> Result<Gate, CudaError> {
        let _current = Pushed::new(self.driver, self.context)?;
        Gate::take(self.driver)
    }

    /// Holds the work enqueued on the stream after this call until `gate` opens.
    pub fn hold_until(&self, gate: &Gate) -> Result<(), CudaError> {
        let _current = Pushed::new(self.driver, self.context)?;
        // SAFETY: the word is mapped pinned memory that is never freed (see the module), and
        // the stream is live (the caller's guarantee).
        let code = unsafe {
            (self.driver.api.stream_wait_value32)(
                self.raw,
                gate.device_addr,
                gate.target,
                STREAM_WAIT_VALUE_GEQ,
            )
        };
        self.driver.check("cuStreamWaitValue32", code)
    }
}

/// The point of a stream after the work enqueued before it ([`CallerStream::mark`]).
#[derive(Debug)]
pub struct Mark {
    driver: &'static Driver,
    context: CuContext,
    event: CuEvent,
}

// SAFETY: an event handle may be queried and destroyed from any thread with its context
// pushed, which every method does.
unsafe impl Send for Mark {}

impl Mark {
    /// Whether the work before the mark is done (never blocks).
    pub fn reached(&self) -> Result<bool, CudaError> {
        let _current = Pushed::new(self.driver, self.context)?;
        // SAFETY: the event is live (destroyed only on drop).
        let code = unsafe { (self.driver.api.event_query)(self.event) };
        if code == ERROR_NOT_READY {
            return Ok(false);
        }
        self.driver.check("cuEventQuery", code).map(|()| true)
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        let Ok(_current) = Pushed::new(self.driver, self.context) else {
            return;
        };
        // SAFETY: the event is live and destroyed once, here (cuEventDestroy may be called
        // while recorded work is pending).
        let code = unsafe { (self.driver.api.event_destroy)(self.event) };
        if let Err(e) = self.driver.check("cuEventDestroy", code) {
            tracing::warn!("{e}");
        }
    }
}

/// A word of mapped pinned memory that streams wait on until it is opened. Opened when
/// dropped if not before, so no stream is held for ever.
#[derive(Debug)]
pub struct Gate {
    word: &'static AtomicU32,
    device_addr: CuDevicePtr,
    target: u32,
    slot: Slot,
    open: bool,
}

/// Where a gate word lives: its page and index.
#[derive(Debug, Clone, Copy)]
struct Slot {
    host: usize,
    device: CuDevicePtr,
    index: usize,
}

/// Pages of gate words and the words free to take (with the value each holds).
struct Pool {
    free: Vec<(Slot, u32)>,
}

static POOL: Mutex<Pool> = Mutex::new(Pool { free: Vec::new() });

impl Gate {
    fn take(driver: &'static Driver) -> Result<Self, CudaError> {
        let mut pool = POOL.lock();
        if pool.free.is_empty() {
            pool.free.extend(new_page(driver)?);
        }
        let Some((slot, value)) = pool.free.pop() else {
            return Err(CudaError::Call {
                call: "cuMemHostAlloc",
                code: 0,
                name: "no gate words".into(),
            });
        };
        // SAFETY: the page is pinned host memory that is never freed, aligned for u32 (page
        // aligned), and its words are touched only as atomics (here and by the GPU's reads).
        let word = unsafe { AtomicU32::from_ptr((slot.host as *mut u32).add(slot.index)) };
        Ok(Self {
            word,
            device_addr: slot.device + (slot.index * 4) as u64,
            target: value.wrapping_add(1),
            slot,
            open: false,
        })
    }

    /// Lets the streams waiting on this gate go on.
    pub fn open(mut self) {
        self.release();
    }

    fn release(&mut self) {
        if std::mem::replace(&mut self.open, true) {
            return;
        }
        self.word.store(self.target, Ordering::Release);
        let mut pool = POOL.lock();
        pool.free.push((self.slot, self.target));
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.release();
    }
}

/// A new page of gate words, in the current context (mapped for every context).
fn new_page(driver: &'static Driver) -> Result<Vec<(Slot, u32)>, CudaError> {
    let mut host: *mut c_void = std::ptr::null_mut();
    // SAFETY: writes one pointer; the flags are documented values. The page is never freed.
    driver.check("cuMemHostAlloc", unsafe {
        (driver.api.mem_host_alloc)(
            &mut host,
            WORDS_PER_PAGE * 4,
            MEMHOSTALLOC_PORTABLE | MEMHOSTALLOC_DEVICEMAP,
        )
    })?;
    let mut device: CuDevicePtr = 0;
    // SAFETY: writes one CUdeviceptr for host memory allocated with DEVICEMAP; flags must
    // be 0.
    driver.check("cuMemHostGetDevicePointer", unsafe {
        (driver.api.mem_host_get_device_pointer)(&mut device, host, 0)
    })?;
    // SAFETY: the page holds WORDS_PER_PAGE u32s, zeroed here before any gate hands one out.
    unsafe { std::ptr::write_bytes(host.cast::<u32>(), 0, WORDS_PER_PAGE) };
    Ok((0..WORDS_PER_PAGE)
        .map(|index| {
            (
                Slot {
                    host: host as usize,
                    device,
                    index,
                },
                0,
            )
        })
        .collect())
}
