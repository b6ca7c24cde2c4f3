//! Devices, their primary contexts, and what kind of memory an address is.

use std::ffi::{c_int, c_uint, c_void};
use std::marker::PhantomData;

use parking_lot::Mutex;

use crate::driver::{
    CuContext, CuDevice, CuResult, Driver, ERROR_INVALID_VALUE, MEMORYTYPE_HOST,
    POINTER_ATTRIBUTE_DEVICE_ORDINAL, POINTER_ATTRIBUTE_MEMORY_TYPE, driver,
};
use crate::error::CudaError;
use crate::memory::{Copier, Event, Stream};

/// What kind of memory an address is, as the driver reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// Memory the CPU reaches: ordinary memory the driver does not know, or host memory it
    /// pinned or mapped.
    Host,
    /// Memory of a device (or managed memory homed on one): reached only by the driver's
    /// copies.
    Device {
        /// The device's ordinal.
        ordinal: usize,
    },
}

/// One device, with its primary context retained for the rest of the process. Every call
/// Tern makes for memory of this device runs in this context, so no call creates a context,
/// and none runs on a device the memory is not on.
#[derive(Debug)]
pub struct Device {
    pub(crate) driver: &'static Driver,
    ordinal: usize,
    handle: CuDevice,
    context: CuContext,
    /// Streams for synchronous copies not in use, kept for the next (one per thread that
    /// copies at once, at most).
    copiers: Mutex<Vec<Copier>>,
}

// SAFETY: a CUcontext handle may be made current on any thread (cuCtxPushCurrent, Driver API
// reference: "a context may be current to multiple threads"); the handle itself is an
// immutable pointer the driver owns.
unsafe impl Send for Device {}
// SAFETY: see Send; every use goes through driver calls that are thread-safe (the Driver API
// is documented as thread-safe).
unsafe impl Sync for Device {}

impl Device {
    /// The device with `ordinal`, its primary context retained once (the context the runtime
    /// API and PyTorch use, so Tern shares it instead of adding one).
    pub fn get(ordinal: usize) -> Result<&'static Device, CudaError> {
        let driver = driver()?;
        let mut devices = driver.devices.lock();
        let count = devices.len();
        let slot = devices
            .get_mut(ordinal)
            .ok_or(CudaError::NoSuchDevice { ordinal, count })?;
        if let Some(device) = slot {
            return Ok(device);
        }
        let mut handle: CuDevice = 0;
        let index =
            i32::try_from(ordinal).map_err(|_| CudaError::NoSuchDevice { ordinal, count })?;
        // SAFETY: cuDeviceGet writes one CUdevice; the ordinal is below cuDeviceGetCount's.
        driver.check("cuDeviceGet", unsafe {
            (driver.api.device_get)(&mut handle, index)
        })?;
        let mut context: CuContext = std::ptr::null_mut();
        // SAFETY: cuDevicePrimaryCtxRetain writes one CUcontext for a valid device handle.
        // The retain is never released: the device entry lives for the rest of the process.
        driver.check("cuDevicePrimaryCtxRetain", unsafe {
            (driver.api.primary_ctx_retain)(&mut context, handle)
        })?;
        let device: &'static Device = Box::leak(Box::new(Device {
            driver,
            ordinal,
            handle,
            context,
            copiers: Mutex::new(Vec::new()),
        }));
        *slot = Some(device);
        Ok(device)
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// One of the device's attributes (`cuDeviceGetAttribute`, a `CUdevice_attribute`).
    pub fn attribute(&self, attribute: c_int) -> Result<i32, CudaError> {
        let mut value: c_int = 0;
        // SAFETY: writes one int for a valid device handle and attribute number (an unknown
        // number is an error code, not undefined behaviour).
        self.driver.check("cuDeviceGetAttribute", unsafe {
            (self.driver.api.device_get_attribute)(&mut value, attribute, self.handle)
        })?;
        Ok(value)
    }

    /// Makes the device's primary context current on this thread until the guard drops
    /// (then the thread's previous context is current again), so calls from threads with no
    /// context, or another device's, work.
    pub fn enter(&self) -> Result<Current<'_>, CudaError> {
        // SAFETY: the context is retained (valid) for the rest of the process.
        self.driver.check("cuCtxPushCurrent", unsafe {
            (self.driver.api.ctx_push_current)(self.context)
        })?;
        Ok(Current {
            device: self,
            _thread: PhantomData,
        })
    }

    /// Runs one driver call with the device's context current on this thread and turns its
    /// result code into an error naming `call`.
    pub(crate) fn call(
        &self,
        call: &'static str,
        driver_call: impl FnOnce() -> CuResult,
    ) -> Result<(), CudaError> {
        let _current = self.enter()?;
        self.driver.check(call, driver_call())
    }

    /// A stream for one synchronous copy: a kept one, else a new one.
    pub(crate) fn take_copier(&'static self) -> Result<Copier, CudaError> {
        if let Some(copier) = self.copiers.lock().pop() {
            return Ok(copier);
        }
        Ok(Copier {
            stream: Stream::new(self)?,
            fence: Event::new(self)?,
        })
    }

    /// Keeps a copy stream whose copies are done, for the next.
    pub(crate) fn give_back_copier(&self, copier: Copier) {
        self.copiers.lock().push(copier);
    }

    /// Gives a driver resource back from a `Drop`, which cannot return an error: a failure
    /// (including not entering the context, which leaves the resource to the driver's
    /// teardown) is logged.
    pub(crate) fn release(&self, call: &'static str, driver_call: impl FnOnce() -> CuResult) {
        if let Err(e) = self.call(call, driver_call) {
            tracing::warn!("{e}");
        }
    }
}

/// The device's context, current on this thread while it lives. Not `Send`: a context is
/// pushed on one thread's stack and popped from it.
#[derive(Debug)]
pub struct Current<'d> {
    device: &'d Device,
    _thread: PhantomData<*const ()>,
}

impl Current<'_> {
    /// The device.
    pub fn device(&self) -> &Device {
        self.device
    }
}

impl Drop for Current<'_> {
    fn drop(&mut self) {
        let mut popped: CuContext = std::ptr::null_mut();
        let driver = self.device.driver;
        // SAFETY: this guard pushed the context on this thread (it is not Send), and guards
        // drop in reverse order, so the top of the stack is ours.
        let code = unsafe { (driver.api.ctx_pop_current)(&mut popped) };
        if let Err(e) = driver.check("cuCtxPopCurrent", code) {
            tracing::warn!("{e}");
        }
    }
}

/// What kind of memory `addr` is. Without a loaded driver every address is host memory (and
/// the driver is not loaded to find out: use [`memory_kind_loading`] for that).
pub fn memory_kind(addr: usize) -> Result<MemoryKind, CudaError> {
    match crate::driver::loaded() {
        Some(driver) => query_kind(driver, addr),
        None => Ok(MemoryKind::Host),
    }
}

/// What kind of memory `addr` is, loading the driver if there is one. A host without a
/// driver has only host memory.
pub fn memory_kind_loading(addr: usize) -> Result<MemoryKind, CudaError> {
    match driver() {
        Ok(driver) => query_kind(driver, addr),
        Err(CudaError::DriverMissing { .. }) => Ok(MemoryKind::Host),
        Err(e) => Err(e),
    }
}

fn query_kind(driver: &Driver, addr: usize) -> Result<MemoryKind, CudaError> {
    let mut memory_type: c_uint = 0;
    // SAFETY: CU_POINTER_ATTRIBUTE_MEMORY_TYPE writes one unsigned int (CUmemorytype) through
    // `data`; the query reads no memory at the address (Driver API, cuPointerGetAttribute).
    let code = unsafe {
        (driver.api.pointer_get_attribute)(
            (&raw mut memory_type).cast::<c_void>(),
            POINTER_ATTRIBUTE_MEMORY_TYPE,
            addr as u64,
        )
    };
    if code == ERROR_INVALID_VALUE {
        return Ok(MemoryKind::Host);
    }
    driver.check("cuPointerGetAttribute(MEMORY_TYPE)", code)?;
    if memory_type == MEMORYTYPE_HOST {
        return Ok(MemoryKind::Host);
    }
    let mut ordinal: i32 = -1;
    // SAFETY: CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL writes one int through `data`.
    let code = unsafe {
        (driver.api.pointer_get_attribute)(
            (&raw mut ordinal).cast::<c_void>(),
            POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            addr as u64,
        )
    };
    driver.check("cuPointerGetAttribute(DEVICE_ORDINAL)", code)?;
    let ordinal = usize::try_from(ordinal).map_err(|_| CudaError::Call {
        call: "cuPointerGetAttribute(DEVICE_ORDINAL)",
        code: 0,
        name: format!("ordinal {ordinal}"),
    })?;
    Ok(MemoryKind::Device { ordinal })
}
