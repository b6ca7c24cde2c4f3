//! Copies between host and device, streams and events to order them, pinned host memory to
//! stage through, and owned device allocations.

use std::ffi::c_void;

use crate::device::Device;
use crate::driver::{
    CuDevicePtr, CuEvent, CuStream, EVENT_DISABLE_TIMING, MEMHOSTALLOC_PORTABLE,
    STREAM_NON_BLOCKING,
};
use crate::error::CudaError;

/// A stream of Tern's for synchronous copies, and the event that orders it after the device's
/// prior work.
#[derive(Debug)]
pub(crate) struct Copier {
    pub(crate) stream: Stream,
    pub(crate) fence: Event,
}

/// What a copy of device memory must come after.
///
/// Tern copies device memory only on streams of its own, which are non-blocking: they do no
/// implicit synchronization with the legacy default stream (CUDA Driver API, "Stream
/// synchronization behavior": a stream created with `CU_STREAM_NON_BLOCKING` "may run
/// concurrently with work in stream 0 (the NULL stream), and ... should perform no implicit
/// synchronization with stream 0"), and Tern's threads never enqueue work there themselves,
/// so none of them can wait behind a caller's work on it (a gate on stream 0, say). Where the
/// caller gave no stream, its earlier work must still come first: a copy then waits, on the
/// GPU, for an event recorded on the legacy stream, which comes after everything the legacy
/// stream holds and, by its implicit synchronization, after the work of every blocking stream
/// enqueued before ("any CUDA operation on the legacy stream ... waits on all blocking
/// streams"). Work of the caller's own non-blocking streams is the caller's to order: it
/// synchronizes them, or asks for a transfer on its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceOrder {
    /// After the device's prior work on the legacy stream and every blocking stream: what
    /// a call that names no stream gets.
    AfterPriorWork,
    /// Ordered by the caller already: the transfer of a call on the caller's stream, which
    /// started only once the work before it on that stream was done. No fence: one on the
    /// legacy stream could wait behind that very call's gate.
    CallerOrdered,
}

impl Device {
    /// Copies `len` bytes of device memory at `src` to host memory at `dst`, after the
    /// device's prior work ([`DeviceOrder::AfterPriorWork`]), and returns once the bytes have
    /// landed.
    ///
    /// # Safety
    ///
    /// `[src, src + len)` must be memory of this device that stays allocated during the call,
    /// and `[dst, dst + len)` host memory valid for writes that nothing else reads or writes
    /// meanwhile.
    pub unsafe fn copy_to_host(
        &'static self,
        dst: *mut u8,
        src: u64,
        len: usize,
    ) -> Result<(), CudaError> {
        self.with_copier(DeviceOrder::AfterPriorWork, |stream| {
            // SAFETY: the caller guarantees both ranges until this returns, and `with_copier`
            // waits for the stream before it does.
            unsafe { stream.copy_to_host(dst, src, len) }
        })
    }

    /// Copies `len` bytes of host memory at `src` to device memory at `dst`, after the
    /// device's prior work, and returns once the bytes have landed in device memory: the
    /// copy runs on a stream of Tern's, which is waited for (a synchronous `cuMemcpyHtoD`
    /// from pageable memory returns "once the pageable buffer has been copied to the staging
    /// memory for DMA transfer to device memory, but the DMA to final destination may not
    /// have completed", Driver API, "API synchronization behavior").
    ///
    /// # Safety
    ///
    /// `[dst, dst + len)` must be memory of this device that stays allocated during the call
    /// and that the caller may write, and `[src, src + len)` host memory valid for reads.
    pub unsafe fn copy_from_host(
        &'static self,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), CudaError> {
        self.with_copier(DeviceOrder::AfterPriorWork, |stream| {
            // SAFETY: as `copy_to_host`.
            unsafe { stream.copy_from_host(dst, src, len) }
        })
    }

    /// Runs `enqueue` on one of the device's copy streams, after what `order` asks, and
    /// waits for the stream: Tern's synchronous copies, none of which touches the legacy
    /// stream (see [`DeviceOrder`]).
    pub(crate) fn with_copier(
        &'static self,
        order: DeviceOrder,
        enqueue: impl FnOnce(&Stream) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let copier = self.take_copier()?;
        let outcome = (|| {
            if order == DeviceOrder::AfterPriorWork {
                copier.stream.order_after_prior_work(&copier.fence)?;
            }
            enqueue(&copier.stream)?;
            copier.stream.synchronize()
        })();
        if outcome.is_ok() {
            self.give_back_copier(copier);
        }
        outcome
    }

    /// The whole allocation holding `addr`: its base and length (`cuMemGetAddressRange`).
    pub fn allocation_of(&self, addr: u64) -> Result<(u64, usize), CudaError> {
        let (mut base, mut len): (CuDevicePtr, usize) = (0, 0);
        // SAFETY: writes one CUdeviceptr and one size_t; reads no memory at `addr`.
        self.call("cuMemGetAddressRange", || unsafe {
            (self.driver.api.mem_get_address_range)(&mut base, &mut len, addr)
        })?;
        Ok((base, len))
    }

    /// Allocates `len` bytes of this device's memory (`cuMemAlloc`), freed on drop.
    pub fn allocate(&'static self, len: usize) -> Result<DeviceBuffer, CudaError> {
        let mut addr: CuDevicePtr = 0;
        // SAFETY: writes one CUdeviceptr.
        self.call("cuMemAlloc", || unsafe {
            (self.driver.api.mem_alloc)(&mut addr, len)
        })?;
        Ok(DeviceBuffer {
            device: self,
            addr,
            len,
        })
    }
}

/// Device memory Tern allocated; freed when dropped.
#[derive(Debug)]
pub struct DeviceBuffer {
    device: &'static Device,
    addr: u64,
    len: usize,
}

impl DeviceBuffer {
    /// Its device address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its device.
    pub fn device(&self) -> &'static Device {
        self.device
    }

    fn check(&self, offset: usize, len: usize) -> Result<u64, CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.addr + offset as u64),
            _ => Err(CudaError::Call {
                call: "DeviceBuffer range",
                code: 1,
                name: format!("[{offset}, +{len}) outside {} bytes", self.len),
            }),
        }
    }

    /// Copies `data` into the buffer at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), CudaError> {
        let dst = self.check(offset, data.len())?;
        // SAFETY: `[dst, +len)` lies in this live allocation (checked); `data` is a borrow.
        unsafe { self.device.copy_from_host(dst, data.as_ptr(), data.len()) }
    }

    /// Copies the bytes at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), CudaError> {
        let src = self.check(offset, out.len())?;
        // SAFETY: `[src, +len)` lies in this live allocation (checked); `out` is an
        // exclusive borrow.
        unsafe { self.device.copy_to_host(out.as_mut_ptr(), src, out.len()) }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let api = &self.device.driver.api;
        // SAFETY: the address came from cuMemAlloc and is freed once, here.
        self.device
            .release("cuMemFree", || unsafe { (api.mem_free)(self.addr) });
    }
}

/// A stream of the device: copies enqueued on it run in order, asynchronously to the host.
#[derive(Debug)]
pub struct Stream {
    device: &'static Device,
    pub(crate) raw: CuStream,
}

// SAFETY: a CUstream may be used from any thread whose current context is its own, which
// every method makes sure of (`Device::enter`); the Driver API is thread-safe.
unsafe impl Send for Stream {}

impl Stream {
    /// A new non-blocking stream on `device`.
    pub fn new(device: &'static Device) -> Result<Self, CudaError> {
        let mut raw: CuStream = std::ptr::null_mut();
        // SAFETY: writes one CUstream; the flags are documented values.
        device.call("cuStreamCreate", || unsafe {
            (device.driver.api.stream_create)(&mut raw, STREAM_NON_BLOCKING)
        })?;
        Ok(Self { device, raw })
    }

    /// Its device.
    pub fn device(&self) -> &'static Device {
        self.device
    }

    /// Enqueues a copy of `len` device bytes at `src` into host memory at `dst`.
    ///
    /// # Safety
    ///
    /// As [`Device::copy_to_host`], and `dst` must stay valid and untouched by anyone else
    /// until an event recorded after this copy has completed (or the stream is
    /// synchronized). `dst` should be pinned ([`PinnedBuffer`]) for the copy to be
    /// asynchronous.
    pub unsafe fn copy_to_host(&self, dst: *mut u8, src: u64, len: usize) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees the ranges for the copy's whole duration.
        self.device.call("cuMemcpyDtoHAsync", || unsafe {
            (self.device.driver.api.memcpy_dtoh_async)(dst.cast::<c_void>(), src, len, self.raw)
        })
    }

    /// Enqueues a copy of `len` host bytes at `src` into device memory at `dst`.
    ///
    /// # Safety
    ///
    /// As [`Device::copy_from_host`], and `src` must stay valid and unwritten until an event
    /// recorded after this copy has completed (or the stream is synchronized).
    pub unsafe fn copy_from_host(
        &self,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees the ranges for the copy's whole duration.
        self.device.call("cuMemcpyHtoDAsync", || unsafe {
            (self.device.driver.api.memcpy_htod_async)(dst, src.cast::<c_void>(), len, self.raw)
        })
    }

    /// Enqueues a copy of `len` bytes from `src` to `dst`, each host or device memory
    /// (unified addressing tells which, Driver API, `cuMemcpyAsync`).
    ///
    /// # Safety
    ///
    /// Both ranges must stay valid (allocated, mapped) until an event recorded after this
    /// copy has completed (or the stream is synchronized); the caller may write `[dst, dst +
    /// len)`, which nothing else reads or writes meanwhile.
    pub unsafe fn copy(&self, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
        // SAFETY: the caller guarantees the ranges for the copy's whole duration.
        self.device.call("cuMemcpyAsync", || unsafe {
            (self.device.driver.api.memcpy_async)(dst, src, len, self.raw)
        })
    }

    /// Makes the work enqueued on this stream after this call wait, on the GPU, until
    /// `event`'s last record has completed (`cuStreamWaitEvent`: "the wait applies to the
    /// most recent call to cuEventRecord on the event"; an event never recorded is no wait).
    pub fn wait(&self, event: &Event) -> Result<(), CudaError> {
        // SAFETY: both handles are live and of this device's context; the flags must be 0.
        self.device.call("cuStreamWaitEvent", || unsafe {
            (self.device.driver.api.stream_wait_event)(self.raw, event.raw, 0)
        })
    }

    /// Makes the work enqueued on this stream after this call wait for everything enqueued
    /// on the device's legacy default stream (and so on every blocking stream) before it,
    /// recording `fence` there: [`DeviceOrder::AfterPriorWork`]. Only the GPU waits; no host
    /// thread blocks on the legacy stream.
    pub fn order_after_prior_work(&self, fence: &Event) -> Result<(), CudaError> {
        // SAFETY: the event is live and of this device's context, which the call makes
        // current; the null stream is that context's legacy default stream.
        self.device.call("cuEventRecord", || unsafe {
            (self.device.driver.api.event_record)(fence.raw, std::ptr::null_mut())
        })?;
        self.wait(fence)
    }

    /// Records `event` after everything enqueued so far.
    pub fn record(&self, event: &Event) -> Result<(), CudaError> {
        // SAFETY: both handles are live and of this device's context.
        self.device.call("cuEventRecord", || unsafe {
            (self.device.driver.api.event_record)(event.raw, self.raw)
        })
    }

    /// Waits until everything enqueued so far is done.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: the stream is live.
        self.device.call("cuStreamSynchronize", || unsafe {
            (self.device.driver.api.stream_synchronize)(self.raw)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Err(e) = self.synchronize() {
            tracing::warn!("{e}");
        }
        let api = &self.device.driver.api;
        // SAFETY: the stream is live, idle (synchronized above) and destroyed once, here.
        self.device.release("cuStreamDestroy", || unsafe {
            (api.stream_destroy)(self.raw)
        });
    }
}

/// A point in a stream to wait for.
#[derive(Debug)]
pub struct Event {
    device: &'static Device,
    raw: CuEvent,
}

// SAFETY: events may be recorded and waited for from any thread (Driver API is thread-safe;
// each call makes the event's context current).
unsafe impl Send for Event {}

impl Event {
    /// A new event on `device` (no timing: a fence only).
    pub fn new(device: &'static Device) -> Result<Self, CudaError> {
        let mut raw: CuEvent = std::ptr::null_mut();
        // SAFETY: writes one CUevent; the flag is a documented value.
        device.call("cuEventCreate", || unsafe {
            (device.driver.api.event_create)(&mut raw, EVENT_DISABLE_TIMING)
        })?;
        Ok(Self { device, raw })
    }

    /// Waits until the work before the event's last record is done (at once if never
    /// recorded: cuEventSynchronize on an unrecorded event returns success).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: the event is live.
        self.device.call("cuEventSynchronize", || unsafe {
            (self.device.driver.api.event_synchronize)(self.raw)
        })
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let api = &self.device.driver.api;
        // SAFETY: the event is live and destroyed once, here (cuEventDestroy may be called
        // while recorded work is pending; its resources go once the work is done).
        self.device.release("cuEventDestroy", || unsafe {
            (api.event_destroy)(self.raw)
        });
    }
}

/// Page-locked host memory (`cuMemHostAlloc`), which the device's copy engines reach
/// directly, so copies to and from it run asynchronously and at full speed.
#[derive(Debug)]
pub struct PinnedBuffer {
    device: &'static Device,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value; it moves between threads as
// a Vec does.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    /// `len` bytes of pinned memory, zeroed, usable by every context (portable).
    pub fn new(device: &'static Device, len: usize) -> Result<Self, CudaError> {
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one pointer to `len` bytes of host memory owned by the caller until
        // cuMemFreeHost.
        device.call("cuMemHostAlloc", || unsafe {
            (device.driver.api.mem_host_alloc)(&mut ptr, len.max(1), MEMHOSTALLOC_PORTABLE)
        })?;
        let ptr = ptr.cast::<u8>();
        // SAFETY: the allocation holds `len` writable bytes; nothing else knows it yet.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(Self { device, ptr, len })
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its first byte, for asynchronous copies (whose callers keep the buffer untouched
    /// until the copy is done).
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    /// Its bytes. The exclusive borrow of `self` for an asynchronous copy's pointer ended
    /// before this borrow began; the copy's caller waited for it to finish before reading.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes (zeroed at allocation) owned by this value.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// Its bytes, to fill.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        let api = &self.device.driver.api;
        let ptr = self.ptr.cast::<c_void>();
        // SAFETY: the pointer came from cuMemHostAlloc and is freed once, here.
        self.device
            .release("cuMemFreeHost", || unsafe { (api.mem_free_host)(ptr) });
    }
}
