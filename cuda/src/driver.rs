//! Loading the driver library and the table of the entry points Tern calls.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use parking_lot::Mutex;

use crate::error::CudaError;

/// The driver's status code (`CUresult`); 0 is `CUDA_SUCCESS`.
pub(crate) type CuResult = c_int;
/// A device handle (`CUdevice`).
pub(crate) type CuDevice = c_int;
/// A context handle (`CUcontext`).
pub(crate) type CuContext = *mut c_void;
/// A stream handle (`CUstream`).
pub(crate) type CuStream = *mut c_void;
/// An event handle (`CUevent`).
pub(crate) type CuEvent = *mut c_void;
/// A device address (`CUdeviceptr`).
pub(crate) type CuDevicePtr = u64;
/// A handle of physical device memory (`CUmemGenericAllocationHandle`).
pub(crate) type CuMemHandle = u64;

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct IpcMemHandle {
    pub(crate) reserved: [u8; IPC_HANDLE_LEN],
}

/// Bytes of a `CUipcMemHandle` (`CU_IPC_HANDLE_SIZE`).
pub const IPC_HANDLE_LEN: usize = 64;

/// `CUmemLocation`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct MemLocation {
    /// `CUmemLocationType`: 1 is `CU_MEM_LOCATION_TYPE_DEVICE`.
    pub(crate) kind: c_int,
    /// The device ordinal.
    pub(crate) id: c_int,
}

/// `CUmemAllocationProp`, as cuda.h lays it out.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct AllocationProp {
    /// `CUmemAllocationType`: 1 is `CU_MEM_ALLOCATION_TYPE_PINNED`.
    pub(crate) kind: c_int,
    /// `CUmemAllocationHandleType` bits the allocation may be exported as.
    pub(crate) requested_handle_types: c_int,
    pub(crate) location: MemLocation,
    pub(crate) win32_handle_meta_data: *mut c_void,
    /// `allocFlags`: compression type, GPUDirect RDMA capable, usage, reserved.
    pub(crate) alloc_flags: [u8; 8],
}

impl Default for AllocationProp {
    fn default() -> Self {
        Self {
            kind: 0,
            requested_handle_types: 0,
            location: MemLocation::default(),
            win32_handle_meta_data: std::ptr::null_mut(),
            alloc_flags: [0; 8],
        }
    }
}

/// `CUmemAccessDesc`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct AccessDesc {
    pub(crate) location: MemLocation,
    /// `CUmemAccess_flags`: 3 is `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
    pub(crate) flags: c_int,
}

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub(crate) const MEM_LOCATION_DEVICE: c_int = 1;
/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
pub(crate) const MEM_ALLOCATION_PINNED: c_int = 1;
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
pub(crate) const MEM_HANDLE_POSIX_FD: c_int = 1;
/// `CU_MEM_HANDLE_TYPE_FABRIC`: a 64-byte handle (`CUmemFabricHandle`) another process
/// imports without a descriptor (nodes with IMEX channels; PyTorch's expandable segments
/// ask for it first with CUDA 12.3 or later).
pub(crate) const MEM_HANDLE_FABRIC: c_int = 8;
/// Bytes of a `CUmemFabricHandle`.
pub const FABRIC_HANDLE_LEN: usize = 64;
/// `CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES`: the `CUmemAllocationHandleType` bits the
/// allocation holding an address may be exported as (a `uint64_t`).
pub(crate) const POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES: c_int = 14;
/// `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE`: 1 where NICs may reach the memory
/// by GPUDirect RDMA.
pub(crate) const POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE: c_int = 15;
/// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`.
pub(crate) const DEVICE_ATTRIBUTE_GDR_WITH_VMM: c_int = 110;
/// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
pub(crate) const DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: c_int = 124;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub(crate) const MEM_ACCESS_READWRITE: c_int = 3;
/// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
pub(crate) const MEM_GRANULARITY_MINIMUM: c_int = 0;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`.
pub(crate) const IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
/// `CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`: 1 for `cuMemAlloc` memory.
pub(crate) const POINTER_ATTRIBUTE_IS_LEGACY_IPC_CAPABLE: c_int = 10;
/// `CU_POINTER_ATTRIBUTE_MAPPING_SIZE`: the size of the mapping (`cuMemMap`) holding the
/// address.
pub(crate) const POINTER_ATTRIBUTE_MAPPING_SIZE: c_int = 18;
/// `CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR`: the start of that mapping.
pub(crate) const POINTER_ATTRIBUTE_MAPPING_BASE_ADDR: c_int = 19;

/// `CUDA_ERROR_INVALID_VALUE`: what `cuPointerGetAttribute` answers for memory CUDA does not
/// know (CUDA Driver API, cuPointerGetAttribute: "If ptr was not allocated by, mapped by, or
/// registered with a CUcontext which uses unified virtual addressing then
/// CUDA_ERROR_INVALID_VALUE is returned").
pub(crate) const ERROR_INVALID_VALUE: CuResult = 1;
/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE`.
pub(crate) const POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
/// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`.
pub(crate) const POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
/// `CU_MEMORYTYPE_HOST`.
pub(crate) const MEMORYTYPE_HOST: c_uint = 1;
/// `CU_STREAM_NON_BLOCKING`: the stream does not wait for work on the legacy default stream.
pub(crate) const STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_EVENT_DISABLE_TIMING`: a fence only, the cheapest kind of event.
pub(crate) const EVENT_DISABLE_TIMING: c_uint = 2;
/// `CU_MEMHOSTALLOC_PORTABLE`: pinned for every context, not only the current one.
pub(crate) const MEMHOSTALLOC_PORTABLE: c_uint = 1;
/// `CU_MEMHOSTALLOC_DEVICEMAP`: mapped into the device's address space as well.
pub(crate) const MEMHOSTALLOC_DEVICEMAP: c_uint = 2;
/// `CU_STREAM_WAIT_VALUE_GEQ`: wait until `(int32_t)(*addr - value) >= 0`, a cyclic
/// comparison that ignores wraparound (Driver API, CUstreamWaitValue_flags).
pub(crate) const STREAM_WAIT_VALUE_GEQ: c_uint = 0;
/// `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`.
pub(crate) const MEM_RANGE_HANDLE_DMA_BUF_FD: c_int = 1;
/// `CUDA_ERROR_NOT_READY`: what `cuEventQuery` answers while the event's work runs.
pub(crate) const ERROR_NOT_READY: CuResult = 600;

/// The library loaded when `TERN_CUDA_DRIVER` does not name another one.
pub const DEFAULT_DRIVER: &str = "libcuda.so.1";
/// The environment variable naming the driver library to load instead of [`DEFAULT_DRIVER`]
/// (the tests' stand-in driver, or a driver outside the loader's path).
pub const DRIVER_ENV: &str = "TERN_CUDA_DRIVER";

macro_rules! entry_points {
    ($( $field:ident = $symbol:literal : fn($($arg:ty),*); )*) => {
        /// The driver's entry points, resolved once when the library is loaded.
        pub(crate) struct Api {
            $( pub(crate) $field: unsafe extern "C" fn($($arg),*) -> CuResult, )*
        }

        impl Api {
            fn resolve(library: &libloading::Library, path: &str) -> Result<Self, CudaError> {
                Ok(Self {
                    $( $field: {
                        // SAFETY: the type is the entry point's C prototype as the CUDA
                        // Driver API reference (cuda.h) declares it for this versioned
                        // symbol name; the pointer is kept with the library, which is never
                        // unloaded (`Driver` lives for the rest of the process).
                        let symbol = unsafe {
                            library.get::<unsafe extern "C" fn($($arg),*) -> CuResult>(
                                concat!($symbol, "\0").as_bytes(),
                            )
                        };
                        *symbol.map_err(|e| CudaError::SymbolMissing {
                            symbol: $symbol,
                            library: path.to_owned(),
                            reason: e.to_string(),
                        })?
                    }, )*
                })
            }
        }
    };
}

entry_points! {
    init = "cuInit": fn(c_uint);
    driver_get_version = "cuDriverGetVersion": fn(*mut c_int);
    get_error_name = "cuGetErrorName": fn(CuResult, *mut *const c_char);
    device_get_count = "cuDeviceGetCount": fn(*mut c_int);
    device_get = "cuDeviceGet": fn(*mut CuDevice, c_int);
    primary_ctx_retain = "cuDevicePrimaryCtxRetain": fn(*mut CuContext, CuDevice);
    ctx_push_current = "cuCtxPushCurrent_v2": fn(CuContext);
    ctx_pop_current = "cuCtxPopCurrent_v2": fn(*mut CuContext);
    pointer_get_attribute = "cuPointerGetAttribute": fn(*mut c_void, c_int, CuDevicePtr);
    mem_get_address_range = "cuMemGetAddressRange_v2":
        fn(*mut CuDevicePtr, *mut usize, CuDevicePtr);
    mem_alloc = "cuMemAlloc_v2": fn(*mut CuDevicePtr, usize);
    mem_free = "cuMemFree_v2": fn(CuDevicePtr);
    mem_host_alloc = "cuMemHostAlloc": fn(*mut *mut c_void, usize, c_uint);
    mem_free_host = "cuMemFreeHost": fn(*mut c_void);
    memcpy_dtoh_async = "cuMemcpyDtoHAsync_v2": fn(*mut c_void, CuDevicePtr, usize, CuStream);
    memcpy_htod_async = "cuMemcpyHtoDAsync_v2": fn(CuDevicePtr, *const c_void, usize, CuStream);
    memcpy_async = "cuMemcpyAsync": fn(CuDevicePtr, CuDevicePtr, usize, CuStream);
    stream_wait_event = "cuStreamWaitEvent": fn(CuStream, CuEvent, c_uint);
    device_get_attribute = "cuDeviceGetAttribute": fn(*mut c_int, c_int, CuDevice);
    stream_create = "cuStreamCreate": fn(*mut CuStream, c_uint);
    stream_synchronize = "cuStreamSynchronize": fn(CuStream);
    stream_destroy = "cuStreamDestroy_v2": fn(CuStream);
    event_create = "cuEventCreate": fn(*mut CuEvent, c_uint);
    event_record = "cuEventRecord": fn(CuEvent, CuStream);
    event_synchronize = "cuEventSynchronize": fn(CuEvent);
    event_destroy = "cuEventDestroy_v2": fn(CuEvent);
    device_get_pci_bus_id = "cuDeviceGetPCIBusId": fn(*mut c_char, c_int, CuDevice);
    device_get_by_pci_bus_id = "cuDeviceGetByPCIBusId": fn(*mut CuDevice, *const c_char);
    ipc_get_mem_handle = "cuIpcGetMemHandle": fn(*mut IpcMemHandle, CuDevicePtr);
    ipc_open_mem_handle = "cuIpcOpenMemHandle_v2": fn(*mut CuDevicePtr, IpcMemHandle, c_uint);
    ipc_close_mem_handle = "cuIpcCloseMemHandle": fn(CuDevicePtr);
    mem_create = "cuMemCreate": fn(*mut CuMemHandle, usize, *const AllocationProp, u64);
    mem_release = "cuMemRelease": fn(CuMemHandle);
    mem_get_allocation_granularity = "cuMemGetAllocationGranularity":
        fn(*mut usize, *const AllocationProp, c_int);
    mem_retain_allocation_handle = "cuMemRetainAllocationHandle":
        fn(*mut CuMemHandle, *mut c_void);
    mem_export_to_shareable_handle = "cuMemExportToShareableHandle":
        fn(*mut c_void, CuMemHandle, c_int, u64);
    mem_import_from_shareable_handle = "cuMemImportFromShareableHandle":
        fn(*mut CuMemHandle, *mut c_void, c_int);
    mem_address_reserve = "cuMemAddressReserve":
        fn(*mut CuDevicePtr, usize, usize, CuDevicePtr, u64);
    mem_address_free = "cuMemAddressFree": fn(CuDevicePtr, usize);
    mem_map = "cuMemMap": fn(CuDevicePtr, usize, usize, CuMemHandle, u64);
    mem_unmap = "cuMemUnmap": fn(CuDevicePtr, usize);
    mem_set_access = "cuMemSetAccess": fn(CuDevicePtr, usize, *const AccessDesc, usize);
    stream_wait_value32 = "cuStreamWaitValue32_v2": fn(CuStream, CuDevicePtr, u32, c_uint);
    stream_get_ctx = "cuStreamGetCtx": fn(CuStream, *mut CuContext);
    ctx_get_current = "cuCtxGetCurrent": fn(*mut CuContext);
    ctx_get_device = "cuCtxGetDevice": fn(*mut CuDevice);
    event_query = "cuEventQuery": fn(CuEvent);
    mem_host_get_device_pointer = "cuMemHostGetDevicePointer_v2":
        fn(*mut CuDevicePtr, *mut c_void, c_uint);
    mem_get_handle_for_address_range = "cuMemGetHandleForAddressRange":
        fn(*mut c_void, CuDevicePtr, usize, c_int, u64);
}

/// A loaded CUDA driver: the library, its entry points and its version. One per process,
/// loaded on first use and kept until the process ends.
pub struct Driver {
    pub(crate) api: Api,
    path: String,
    version: i32,
    pub(crate) devices: Mutex<Vec<Option<&'static crate::Device>>>,
    pub(crate) library: libloading::Library,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

static DRIVER: OnceLock<Result<Driver, CudaError>> = OnceLock::new();
/// The path asked for by [`use_driver`] before the first load.
static CHOSEN: Mutex<Option<String>> = Mutex::new(None);

/// The process's CUDA driver, loaded on the first call: the library named by
/// `TERN_CUDA_DRIVER` (or given to [`use_driver`] before), else `libcuda.so.1`. A host without
/// a driver gets [`CudaError::DriverMissing`] every time, never a panic.
pub fn driver() -> Result<&'static Driver, CudaError> {
    DRIVER
        .get_or_init(|| {
            let chosen = CHOSEN.lock().clone();
            let path = chosen
                .or_else(|| std::env::var(DRIVER_ENV).ok().filter(|p| !p.is_empty()))
                .unwrap_or_else(|| DEFAULT_DRIVER.to_owned());
            Driver::load(&path)
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Whether a driver is loaded already, without loading one.
pub fn loaded() -> Option<&'static Driver> {
    DRIVER.get().and_then(|d| d.as_ref().ok())
}

/// Names the library [`driver`] loads, before it first does (tests load the stand-in driver
/// this way). Fails with [`CudaError::DriverChosen`] once a different library was loaded or
/// tried.
pub fn use_driver(path: &str) -> Result<&'static Driver, CudaError> {
    *CHOSEN.lock() = Some(path.to_owned());
    let driver = driver();
    let loaded_from = match DRIVER.get() {
        Some(Ok(d)) => d.path.clone(),
        Some(Err(CudaError::DriverMissing { library, .. })) => library.clone(),
        _ => String::new(),
    };
    if loaded_from != path {
        return Err(CudaError::DriverChosen {
            wanted: path.to_owned(),
            loaded: loaded_from,
        });
    }
    driver
}

impl Driver {
    fn load(path: &str) -> Result<Self, CudaError> {
        // SAFETY: loading runs the library's initialisers. The CUDA driver library is made to
        // be loaded into any process (the CUDA Driver API is a C library with no documented
        // preconditions on loading; cuInit is the first call its reference requires), and it
        // is never unloaded (this `Driver` is kept for the rest of the process), so no symbol
        // taken from it outlives it.
        let library =
            unsafe { libloading::Library::new(path) }.map_err(|e| CudaError::DriverMissing {
                library: path.to_owned(),
                reason: e.to_string(),
            })?;
        let api = Api::resolve(&library, path)?;
        let mut driver = Self {
            api,
            path: path.to_owned(),
            version: 0,
            devices: Mutex::new(Vec::new()),
            library,
        };
        // SAFETY: cuInit takes flags, which must be 0 (Driver API reference, cuInit).
        driver.check("cuInit", unsafe { (driver.api.init)(0) })?;
        let mut version = 0;
        // SAFETY: cuDriverGetVersion writes one int through the pointer, which is valid.
        driver.check("cuDriverGetVersion", unsafe {
            (driver.api.driver_get_version)(&mut version)
        })?;
        driver.version = version;
        let mut count = 0;
        // SAFETY: cuDeviceGetCount writes one int through the pointer, which is valid.
        driver.check("cuDeviceGetCount", unsafe {
            (driver.api.device_get_count)(&mut count)
        })?;
        driver.devices = Mutex::new(vec![None; usize::try_from(count).unwrap_or(0)]);
        tracing::debug!(path, version, devices = count, "CUDA driver loaded");
        Ok(driver)
    }

    /// The library it was loaded from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The driver's CUDA version, as `cuDriverGetVersion` gives it (12080 for 12.8).
    pub fn version(&self) -> i32 {
        self.version
    }

    /// How many devices the driver sees.
    pub fn device_count(&self) -> usize {
        self.devices.lock().len()
    }

    /// `Ok` for `CUDA_SUCCESS`, else the call's typed error with the driver's name for it.
    pub(crate) fn check(&self, call: &'static str, code: CuResult) -> Result<(), CudaError> {
        if code == 0 {
            return Ok(());
        }
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static NUL-terminated string, or
        // leaves it and returns an error for an unknown code (Driver API reference).
        let named = unsafe { (self.api.get_error_name)(code, &mut name) } == 0 && !name.is_null();
        let name = if named {
            // SAFETY: the driver documents the string as static and NUL-terminated.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        } else {
            format!("CUresult {code}")
        };
        Err(CudaError::Call { call, code, name })
    }
}
