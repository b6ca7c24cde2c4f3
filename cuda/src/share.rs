//! Device memory shared between processes of one host: what the owner hands out for a range
//! of its device memory, and how another process maps it and copies to and from it with the
//! GPU's own copy engines.
//!
//! Two kinds of device memory, two ways:
//!
//! - `cuMemAlloc` memory (PyTorch's default caching allocator) is shared by one CUDA IPC
//!   handle of its whole allocation (`cuIpcGetMemHandle`, opened with `cuIpcOpenMemHandle`).
//! - Virtual-memory-management memory (`cuMemCreate` + `cuMemMap`, PyTorch's
//!   `expandable_segments:True`) has no IPC handle: each physical chunk is exported as a
//!   POSIX file descriptor (`cuMemExportToShareableHandle`), which the owner passes over a
//!   Unix socket, and the peer imports, reserves address space for and maps. A range that
//!   spans several chunks is handed out as every chunk it touches, each mapped on its own.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::device::Device;
use crate::driver::{
    AccessDesc, AllocationProp, CuDevice, CuDevicePtr, CuMemHandle,
    DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, DEVICE_ATTRIBUTE_GDR_WITH_VMM, FABRIC_HANDLE_LEN,
    IPC_HANDLE_LEN, IPC_MEM_LAZY_ENABLE_PEER_ACCESS, IpcMemHandle, MEM_ACCESS_READWRITE,
    MEM_ALLOCATION_PINNED, MEM_GRANULARITY_MINIMUM, MEM_HANDLE_FABRIC, MEM_HANDLE_POSIX_FD,
    MEM_LOCATION_DEVICE, MemLocation, POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
    POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE, POINTER_ATTRIBUTE_IS_LEGACY_IPC_CAPABLE,
    POINTER_ATTRIBUTE_MAPPING_BASE_ADDR, POINTER_ATTRIBUTE_MAPPING_SIZE, driver,
};
use crate::error::CudaError;
use crate::memory::DeviceOrder;

/// One piece of device memory as the owner hands it out: where it starts and ends in the
/// owner's address space, and how another process reaches it.
#[derive(Debug)]
pub struct SharedChunk {
    /// Its first address in the owner.
    pub base: u64,
    /// Its length.
    pub len: u64,
    /// How to reach it.
    pub reach: ChunkReach,
}

/// How a peer reaches a [`SharedChunk`].
#[derive(Debug)]
pub enum ChunkReach {
    /// A CUDA IPC handle of the whole `cuMemAlloc` allocation.
    Ipc([u8; IPC_HANDLE_LEN]),
    /// A POSIX file descriptor of the chunk's physical memory (VMM), to be sent with
    /// `SCM_RIGHTS`.
    Fd(OwnedFd),
    /// A fabric handle of the chunk's physical memory (VMM whose chunks allow no descriptor:
    /// nodes with IMEX channels), 64 bytes sent as they are.
    Fabric([u8; FABRIC_HANDLE_LEN]),
}

/// What a peer imports a chunk of another process's VMM memory by.
#[derive(Debug, Clone, Copy)]
pub enum PeerHandle<'a> {
    /// A descriptor of its physical memory.
    Fd(&'a OwnedFd),
    /// Its fabric handle.
    Fabric(&'a [u8; FABRIC_HANDLE_LEN]),
}

impl Device {
    /// The device's PCI bus ID (`0000:3b:00.0`): what names it across processes whose
    /// device ordinals differ (`CUDA_VISIBLE_DEVICES`).
    pub fn bus_id(&self) -> Result<String, CudaError> {
        let mut text = [0 as c_char; 32];
        let handle = CuDevice::try_from(self.ordinal()).unwrap_or(CuDevice::MAX);
        // SAFETY: cuDeviceGetPCIBusId writes a NUL-terminated string of at most `len` bytes
        // (Driver API reference), and the buffer holds 32.
        let code = unsafe {
            (self.driver.api.device_get_pci_bus_id)(text.as_mut_ptr(), text.len() as c_int, handle)
        };
        self.driver.check("cuDeviceGetPCIBusId", code)?;
        // SAFETY: the driver wrote a NUL-terminated string into the buffer (it is zeroed, so
        // a NUL is there in any case).
        let id = unsafe { CStr::from_ptr(text.as_ptr()) };
        Ok(id.to_string_lossy().into_owned())
    }

    /// The device with PCI bus ID `id` in this process's numbering.
    pub fn by_bus_id(id: &str) -> Result<&'static Device, CudaError> {
        let driver = driver()?;
        let text = std::ffi::CString::new(id).map_err(|_| CudaError::Call {
            call: "cuDeviceGetByPCIBusId",
            code: crate::driver::ERROR_INVALID_VALUE,
            name: format!("bus ID {id:?} holds a NUL"),
        })?;
        let mut handle: CuDevice = -1;
        // SAFETY: writes one CUdevice; the string is NUL-terminated.
        let code = unsafe { (driver.api.device_get_by_pci_bus_id)(&mut handle, text.as_ptr()) };
        driver.check("cuDeviceGetByPCIBusId", code)?;
        let ordinal = usize::try_from(handle).map_err(|_| CudaError::NoSuchDevice {
            ordinal: usize::MAX,
            count: driver.device_count(),
        })?;
        Device::get(ordinal)
    }

    /// What another process needs to reach `[addr, addr + len)` of this device's memory:
    /// the IPC handle of its allocation, or the chunks (at most `max_chunks`, from the one
    /// holding `addr`) it spans, each with a file descriptor of its physical memory. The
    /// chunks may end before `addr + len` when there are more than `max_chunks`: the peer
    /// asks again for the rest.
    pub fn share(
        &self,
        addr: u64,
        len: u64,
        max_chunks: usize,
    ) -> Result<Vec<SharedChunk>, CudaError> {
        let _current = self.enter()?;
        let mut legacy: c_int = 0;
        // SAFETY: IS_LEGACY_CUDA_IPC_CAPABLE writes one int; the query reads no memory.
        let code = unsafe {
            (self.driver.api.pointer_get_attribute)(
                (&raw mut legacy).cast::<c_void>(),
                POINTER_ATTRIBUTE_IS_LEGACY_IPC_CAPABLE,
                addr,
            )
        };
        self.driver
            .check("cuPointerGetAttribute(IS_LEGACY_CUDA_IPC_CAPABLE)", code)?;
        if legacy != 0 {
            let (base, size) = self.allocation_of(addr)?;
            let mut handle = IpcMemHandle {
                reserved: [0; IPC_HANDLE_LEN],
            };
            // SAFETY: writes one CUipcMemHandle for the base of a cuMemAlloc allocation.
            let code = unsafe { (self.driver.api.ipc_get_mem_handle)(&mut handle, base) };
            self.driver.check("cuIpcGetMemHandle", code)?;
            return Ok(vec![SharedChunk {
                base,
                len: size as u64,
                reach: ChunkReach::Ipc(handle.reserved),
            }]);
        }
        let end = addr.saturating_add(len);
        let mut chunks = Vec::new();
        let mut at = addr;
        while at < end && chunks.len() < max_chunks.max(1) {
            let (base, size) = self.mapping_of(at)?;
            if size == 0 || base > at {
                return Err(CudaError::Call {
                    call: "cuPointerGetAttribute(MAPPING_BASE_ADDR)",
                    code: 0,
                    name: format!("mapping [{base:#x}, +{size}) does not hold {at:#x}"),
                });
            }
            let reach = self.export_chunk(at)?;
            chunks.push(SharedChunk {
                base,
                len: size,
                reach,
            });
            at = base + size;
        }
        Ok(chunks)
    }

    /// The VMM mapping holding `addr`: its start and size. `MAPPING_BASE_ADDR` and
    /// `MAPPING_SIZE` are in cuda.h but not in `cuPointerGetAttribute`'s reference: where the
    /// driver refuses them, the address range `cuMemGetAddressRange` names stands in.
    pub(crate) fn mapping_of(&self, addr: u64) -> Result<(u64, u64), CudaError> {
        match self.mapping_attributes_of(addr) {
            Ok(found) => Ok(found),
            Err(refused) => {
                tracing::debug!("{refused}; taking cuMemGetAddressRange's range instead");
                let (base, len) = self.allocation_of(addr)?;
                Ok((base, len as u64))
            }
        }
    }

    /// [`mapping_of`](Self::mapping_of) as the pointer attributes say it.
    fn mapping_attributes_of(&self, addr: u64) -> Result<(u64, u64), CudaError> {
        let mut base: CuDevicePtr = 0;
        let mut size: usize = 0;
        // SAFETY: MAPPING_BASE_ADDR writes one CUdeviceptr, MAPPING_SIZE one size_t; the
        // queries read no memory.
        let code = unsafe {
            (self.driver.api.pointer_get_attribute)(
                (&raw mut base).cast::<c_void>(),
                POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
                addr,
            )
        };
        self.driver
            .check("cuPointerGetAttribute(MAPPING_BASE_ADDR)", code)?;
        // SAFETY: as above.
        let code = unsafe {
            (self.driver.api.pointer_get_attribute)(
                (&raw mut size).cast::<c_void>(),
                POINTER_ATTRIBUTE_MAPPING_SIZE,
                addr,
            )
        };
        self.driver
            .check("cuPointerGetAttribute(MAPPING_SIZE)", code)?;
        Ok((base, size as u64))
    }

    /// The handle types the allocation mapped at `addr` may be exported as
    /// (`CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES`).
    fn allowed_handle_types(&self, addr: u64) -> Result<u64, CudaError> {
        let mut allowed: u64 = 0;
        // SAFETY: ALLOWED_HANDLE_TYPES writes one uint64_t; the query reads no memory.
        let code = unsafe {
            (self.driver.api.pointer_get_attribute)(
                (&raw mut allowed).cast::<c_void>(),
                POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
                addr,
            )
        };
        self.driver
            .check("cuPointerGetAttribute(ALLOWED_HANDLE_TYPES)", code)?;
        Ok(allowed)
    }

    /// How a peer reaches the physical memory mapped at `addr`: a file descriptor where the
    /// chunk allows one, else its fabric handle (the only kind PyTorch's expandable segments
    /// make where IMEX channels exist); an error naming the handle types otherwise.
    fn export_chunk(&self, addr: u64) -> Result<ChunkReach, CudaError> {
        let allowed = self.allowed_handle_types(addr)?;
        let kind = if allowed & MEM_HANDLE_POSIX_FD as u64 != 0 {
            MEM_HANDLE_POSIX_FD
        } else if allowed & MEM_HANDLE_FABRIC as u64 != 0 {
            MEM_HANDLE_FABRIC
        } else {
            return Err(CudaError::Call {
                call: "cuMemExportToShareableHandle",
                code: 0,
                name: format!(
                    "the chunk at {addr:#x} allows handle types {allowed:#x}: neither \
                     POSIX_FILE_DESCRIPTOR (0x1) nor FABRIC (0x8), so no other process can \
                     map it"
                ),
            });
        };
        let mut handle: CuMemHandle = 0;
        // SAFETY: writes one handle for the allocation mapped at `addr`; reads no memory.
        let code = unsafe {
            (self.driver.api.mem_retain_allocation_handle)(&mut handle, addr as *mut c_void)
        };
        self.driver.check("cuMemRetainAllocationHandle", code)?;
        let mut fd: c_int = -1;
        let mut fabric = [0u8; FABRIC_HANDLE_LEN];
        let out = if kind == MEM_HANDLE_FABRIC {
            fabric.as_mut_ptr().cast::<c_void>()
        } else {
            (&raw mut fd).cast::<c_void>()
        };
        // SAFETY: the shareable handle is one int for POSIX_FILE_DESCRIPTOR and a
        // CUmemFabricHandle (64 bytes) for FABRIC, written through the pointer (Driver API,
        // cuMemExportToShareableHandle); `out` points at one of those, for `kind`.
        let code =
            unsafe { (self.driver.api.mem_export_to_shareable_handle)(out, handle, kind, 0) };
        // SAFETY: the retained handle is released once (cuMemRetainAllocationHandle: "must
        // be released with cuMemRelease"); the mapping keeps the memory.
        let released = unsafe { (self.driver.api.mem_release)(handle) };
        let call = if kind == MEM_HANDLE_FABRIC {
            "cuMemExportToShareableHandle(FABRIC)"
        } else {
            "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)"
        };
        self.driver.check(call, code)?;
        self.driver.check("cuMemRelease", released)?;
        if kind == MEM_HANDLE_FABRIC {
            return Ok(ChunkReach::Fabric(fabric));
        }
        if fd < 0 {
            return Err(CudaError::Call {
                call,
                code: 0,
                name: format!("descriptor {fd}"),
            });
        }
        // SAFETY: the driver made a new descriptor for the caller, which now owns it.
        Ok(ChunkReach::Fd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Opens a CUDA IPC handle another process of this host made for memory of this device.
    pub fn open_ipc(
        &'static self,
        handle: &[u8; IPC_HANDLE_LEN],
        len: u64,
    ) -> Result<PeerMemory, CudaError> {
        let _current = self.enter()?;
        let mut addr: CuDevicePtr = 0;
        // SAFETY: writes one CUdeviceptr; the handle is passed by value as cuda.h declares.
        let code = unsafe {
            (self.driver.api.ipc_open_mem_handle)(
                &mut addr,
                IpcMemHandle { reserved: *handle },
                IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
            )
        };
        self.driver.check("cuIpcOpenMemHandle", code)?;
        Ok(PeerMemory {
            device: self,
            addr,
            len,
            mapped: false,
        })
    }

    /// Maps `len` bytes of the physical memory a peer exported (VMM), by its descriptor or
    /// fabric handle, readable and writable by this device.
    pub fn map_shared(
        &'static self,
        shared: PeerHandle<'_>,
        len: u64,
    ) -> Result<PeerMemory, CudaError> {
        let size = usize::try_from(len).map_err(|_| CudaError::Call {
            call: "cuMemAddressReserve",
            code: crate::driver::ERROR_INVALID_VALUE,
            name: format!("{len} bytes do not fit this address space"),
        })?;
        let _current = self.enter()?;
        let api = &self.driver.api;
        let mut handle: CuMemHandle = 0;
        let (os_handle, kind, call) = match shared {
            PeerHandle::Fd(fd) => (
                fd.as_raw_fd() as usize as *mut c_void,
                MEM_HANDLE_POSIX_FD,
                "cuMemImportFromShareableHandle(POSIX_FILE_DESCRIPTOR)",
            ),
            PeerHandle::Fabric(fabric) => (
                fabric.as_ptr().cast_mut().cast::<c_void>(),
                MEM_HANDLE_FABRIC,
                "cuMemImportFromShareableHandle(FABRIC)",
            ),
        };
        // SAFETY: for POSIX file descriptors the OS handle is the descriptor itself, cast to
        // a pointer, and for FABRIC a pointer to the CUmemFabricHandle (Driver API,
        // cuMemImportFromShareableHandle); the driver does not take ownership of either (the
        // descriptor stays open, the handle borrowed, during the call).
        let code = unsafe { (api.mem_import_from_shareable_handle)(&mut handle, os_handle, kind) };
        self.driver.check(call, code)?;
        let mut addr: CuDevicePtr = 0;
        // SAFETY: writes one CUdeviceptr; alignment 0 is the default, flags must be 0.
        let code = unsafe { (api.mem_address_reserve)(&mut addr, size, 0, 0, 0) };
        if let Err(e) = self.driver.check("cuMemAddressReserve", code) {
            // SAFETY: releases the handle imported above, once.
            unsafe { (api.mem_release)(handle) };
            return Err(e);
        }
        // SAFETY: maps the whole imported allocation from its start into the range just
        // reserved, of the same size; flags must be 0.
        let code = unsafe { (api.mem_map)(addr, size, 0, handle, 0) };
        // SAFETY: the mapping holds the memory from here ("the memory is released when all
        // outstanding mappings are unmapped", cuMemRelease), so the handle goes now.
        unsafe { (api.mem_release)(handle) };
        if let Err(e) = self.driver.check("cuMemMap", code) {
            // SAFETY: frees the reservation made above, which holds no mapping.
            unsafe { (api.mem_address_free)(addr, size) };
            return Err(e);
        }
        // From here a failure unmaps and frees it, on drop.
        let memory = PeerMemory {
            device: self,
            addr,
            len,
            mapped: true,
        };
        let access = AccessDesc {
            location: MemLocation {
                kind: MEM_LOCATION_DEVICE,
                id: c_int::try_from(self.ordinal()).unwrap_or(c_int::MAX),
            },
            flags: MEM_ACCESS_READWRITE,
        };
        // SAFETY: one access descriptor for the whole mapped range.
        let code = unsafe { (api.mem_set_access)(addr, size, &access, 1) };
        self.driver.check("cuMemSetAccess", code)?;
        Ok(memory)
    }

    /// Allocates `len` bytes (rounded up to the granularity) of this device's memory in
    /// `chunks` separately created physical pieces mapped back to back: the layout of
    /// PyTorch's `expandable_segments:True`, made as it makes it (CUDA 12.3 and later) — each
    /// chunk exportable as a fabric handle where the driver allows that (nodes with IMEX
    /// channels), else as a POSIX file descriptor; GPUDirect RDMA capable where the device
    /// supports it with VMM memory. For tests and benchmarks.
    pub fn allocate_chunked(
        &'static self,
        chunk: usize,
        chunks: usize,
    ) -> Result<ChunkedBuffer, CudaError> {
        let _current = self.enter()?;
        let api = &self.driver.api;
        let mut alloc_flags = [0u8; 8];
        // allocFlags.gpuDirectRDMACapable: "must be set only if the device supports
        // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED" (CUmemAllocationProp).
        alloc_flags[1] = u8::from(self.attribute(DEVICE_ATTRIBUTE_GDR_WITH_VMM).unwrap_or(0) != 0);
        let mut prop = AllocationProp {
            kind: MEM_ALLOCATION_PINNED,
            requested_handle_types: MEM_HANDLE_FABRIC,
            location: MemLocation {
                kind: MEM_LOCATION_DEVICE,
                id: c_int::try_from(self.ordinal()).unwrap_or(c_int::MAX),
            },
            alloc_flags,
            ..AllocationProp::default()
        };
        // Fabric handles first, descriptors where the driver refuses them, as PyTorch asks
        // (c10/cuda/CUDACachingAllocator.cpp, ExpandableSegment::map).
        let mut probe: CuMemHandle = 0;
        let mut granularity = 0usize;
        // SAFETY: writes one size_t for a valid property block.
        let code = unsafe {
            (api.mem_get_allocation_granularity)(&mut granularity, &prop, MEM_GRANULARITY_MINIMUM)
        };
        let fabric = code == 0 && {
            let size = granularity.max(1);
            // SAFETY: writes one handle for a valid property block; flags must be 0.
            let made = unsafe { (api.mem_create)(&mut probe, size, &prop, 0) } == 0;
            if made {
                // SAFETY: releases the probe allocation made above, once.
                unsafe { (api.mem_release)(probe) };
            }
            made
        };
        if !fabric {
            prop.requested_handle_types = MEM_HANDLE_POSIX_FD;
        }
        let mut granularity = 0usize;
        // SAFETY: writes one size_t for a valid property block.
        let code = unsafe {
            (api.mem_get_allocation_granularity)(&mut granularity, &prop, MEM_GRANULARITY_MINIMUM)
        };
        self.driver.check("cuMemGetAllocationGranularity", code)?;
        let chunk = chunk.div_ceil(granularity.max(1)) * granularity.max(1);
        let total = chunk * chunks;
        let mut addr: CuDevicePtr = 0;
        // SAFETY: writes one CUdeviceptr; flags must be 0.
        let code = unsafe { (api.mem_address_reserve)(&mut addr, total, 0, 0, 0) };
        self.driver.check("cuMemAddressReserve", code)?;
        let mut buffer = ChunkedBuffer {
            device: self,
            addr,
            chunk,
            mapped: 0,
            chunks,
        };
        for index in 0..chunks {
            let mut handle: CuMemHandle = 0;
            // SAFETY: writes one handle for a valid property block; flags must be 0.
            let code = unsafe { (api.mem_create)(&mut handle, chunk, &prop, 0) };
            self.driver.check("cuMemCreate", code)?;
            let at = addr + (index * chunk) as u64;
            // SAFETY: maps the whole new allocation into its slot of the reservation.
            let code = unsafe { (api.mem_map)(at, chunk, 0, handle, 0) };
            // SAFETY: the mapping holds the memory from here (cuMemRelease).
            unsafe { (api.mem_release)(handle) };
            self.driver.check("cuMemMap", code)?;
            buffer.mapped += 1;
        }
        let access = AccessDesc {
            location: prop.location,
            flags: MEM_ACCESS_READWRITE,
        };
        // SAFETY: one access descriptor for the whole mapped range.
        let code = unsafe { (api.mem_set_access)(addr, total, &access, 1) };
        self.driver.check("cuMemSetAccess", code)?;
        Ok(buffer)
    }

    /// A DMA-BUF of `[addr, addr + len)` widened to the host page size, for NICs to
    /// register (`ibv_reg_dmabuf_mr`): the descriptor, and the offset of `addr` in it.
    /// `cuMemGetHandleForAddressRange` wants a device that says
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` and a range aligned to the host page size
    /// that is wholly mapped; within one reservation of VMM memory the range may span
    /// several chunks.
    pub fn dmabuf(&self, addr: u64, len: u64) -> Result<(OwnedFd, u64), CudaError> {
        let unsupported = |name: String| CudaError::Call {
            call: "cuMemGetHandleForAddressRange",
            code: crate::driver::ERROR_INVALID_VALUE,
            name,
        };
        if self.attribute(DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)? == 0 {
            return Err(unsupported(
                "the device reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0 (no dma-buf \
                 export: the kernel or driver lacks it)"
                    .into(),
            ));
        }
        let page = host_page_size();
        let base = addr & !(page - 1);
        let end = addr
            .checked_add(len)
            .and_then(|end| end.checked_next_multiple_of(page))
            .ok_or_else(|| unsupported(format!("[{addr:#x}, +{len}) overflows")))?;
        let size = usize::try_from(end - base)
            .map_err(|_| unsupported(format!("{} bytes do not fit", end - base)))?;
        self.check_wholly_mapped(base, end).map_err(|gap| {
            unsupported(format!("[{base:#x}, {end:#x}) is not wholly mapped: {gap}"))
        })?;
        let _current = self.enter()?;
        let mut fd: c_int = -1;
        // SAFETY: for CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD the handle is one int, written
        // through the pointer; flags 0 (no PCIe-mapping flag, which some GPUs refuse).
        let code = unsafe {
            (self.driver.api.mem_get_handle_for_address_range)(
                (&raw mut fd).cast::<c_void>(),
                base,
                size,
                crate::driver::MEM_RANGE_HANDLE_DMA_BUF_FD,
                0,
            )
        };
        self.driver.check("cuMemGetHandleForAddressRange", code)?;
        if fd < 0 {
            return Err(CudaError::Call {
                call: "cuMemGetHandleForAddressRange",
                code: 0,
                name: format!("descriptor {fd}"),
            });
        }
        // SAFETY: the driver made a new descriptor for the caller, which now owns it.
        Ok((unsafe { OwnedFd::from_raw_fd(fd) }, addr - base))
    }

    /// Whether NICs may reach the memory at `addr` by GPUDirect RDMA
    /// (`CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE`).
    pub fn is_gpu_direct_rdma_capable(&self, addr: u64) -> Result<bool, CudaError> {
        let _current = self.enter()?;
        let mut capable: c_int = 0;
        // SAFETY: IS_GPU_DIRECT_RDMA_CAPABLE writes one int; the query reads no memory.
        let code = unsafe {
            (self.driver.api.pointer_get_attribute)(
                (&raw mut capable).cast::<c_void>(),
                POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
                addr,
            )
        };
        self.driver
            .check("cuPointerGetAttribute(IS_GPU_DIRECT_RDMA_CAPABLE)", code)?;
        Ok(capable != 0)
    }

    /// Whether `[start, end)` is device memory mapped without a gap: inside one `cuMemAlloc`
    /// allocation, or VMM mappings back to back; else where it stops.
    fn check_wholly_mapped(&self, start: u64, end: u64) -> Result<(), String> {
        let mut at = start;
        while at < end {
            let (base, size) = self
                .mapping_of(at)
                .or_else(|_| self.allocation_of(at).map(|(b, s)| (b, s as u64)))
                .map_err(|e| format!("{at:#x}: {e}"))?;
            if base > at || base + size <= at {
                return Err(format!("nothing is mapped at {at:#x}"));
            }
            at = base + size;
        }
        Ok(())
    }

    /// Copies `len` bytes from `src` to `dst`, each host or device memory (unified
    /// addressing tells which), after what `order` asks, on a stream of Tern's (never the
    /// legacy default stream, so no caller's work there can hold it), and returns when they
    /// have landed.
    ///
    /// # Safety
    ///
    /// Both ranges must stay valid (allocated, mapped) during the call, and the caller may
    /// write `[dst, dst + len)`, which nothing else reads or writes meanwhile.
    pub unsafe fn copy_any(
        &'static self,
        dst: u64,
        src: u64,
        len: usize,
        order: DeviceOrder,
    ) -> Result<(), CudaError> {
        self.with_copier(order, |stream| {
            // SAFETY: the caller guarantees both ranges until this returns, and `with_copier`
            // waits for the stream before it does.
            unsafe { stream.copy(dst, src, len) }
        })
    }
}

/// Device memory of another process, opened or mapped into this one; closed or unmapped
/// when dropped (after which the owner's memory is untouched by this process).
#[derive(Debug)]
pub struct PeerMemory {
    device: &'static Device,
    addr: u64,
    len: u64,
    /// Mapped by VMM (else opened by IPC).
    mapped: bool,
}

impl PeerMemory {
    /// Where it starts in this process.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Its length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device whose context maps it.
    pub fn device(&self) -> &'static Device {
        self.device
    }
}

impl Drop for PeerMemory {
    fn drop(&mut self) {
        let Ok(_current) = self.device.enter() else {
            return;
        };
        let api = &self.device.driver.api;
        let driver = self.device.driver;
        let result = if self.mapped {
            let size = self.len as usize;
            // SAFETY: this range was reserved and mapped whole by `map_shared`, and is
            // unmapped and freed once, here.
            let unmapped = unsafe { (api.mem_unmap)(self.addr, size) };
            // SAFETY: as above.
            let freed = unsafe { (api.mem_address_free)(self.addr, size) };
            driver
                .check("cuMemUnmap", unmapped)
                .and_then(|()| driver.check("cuMemAddressFree", freed))
        } else {
            // SAFETY: this address was returned by cuIpcOpenMemHandle and is closed once.
            driver.check("cuIpcCloseMemHandle", unsafe {
                (api.ipc_close_mem_handle)(self.addr)
            })
        };
        if let Err(e) = result {
            tracing::warn!("releasing a peer's device memory: {e}");
        }
    }
}

/// Device memory in separately created chunks mapped back to back
/// ([`Device::allocate_chunked`]); unmapped and freed when dropped.
#[derive(Debug)]
pub struct ChunkedBuffer {
    device: &'static Device,
    addr: u64,
    chunk: usize,
    mapped: usize,
    chunks: usize,
}

impl ChunkedBuffer {
    /// Its first address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.chunk * self.chunks
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of each chunk.
    pub fn chunk_len(&self) -> usize {
        self.chunk
    }

    /// Its device.
    pub fn device(&self) -> &'static Device {
        self.device
    }

    fn check(&self, offset: usize, len: usize) -> Result<u64, CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(self.addr + offset as u64),
            _ => Err(CudaError::Call {
                call: "ChunkedBuffer range",
                code: crate::driver::ERROR_INVALID_VALUE,
                name: format!("[{offset}, +{len}) outside {} bytes", self.len()),
            }),
        }
    }

    /// Copies `data` into the buffer at `offset` (across chunks as needed).
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), CudaError> {
        let dst = self.check(offset, data.len())?;
        // SAFETY: `[dst, +len)` lies in this live, wholly mapped buffer (checked); `data` is
        // a borrow.
        unsafe {
            self.device.copy_any(
                dst,
                data.as_ptr() as u64,
                data.len(),
                DeviceOrder::AfterPriorWork,
            )
        }
    }

    /// Copies the bytes at `offset` into `out`.
    pub fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), CudaError> {
        let src = self.check(offset, out.len())?;
        // SAFETY: `[src, +len)` lies in this live, wholly mapped buffer (checked); `out` is an
        // exclusive borrow.
        unsafe {
            self.device.copy_any(
                out.as_mut_ptr() as u64,
                src,
                out.len(),
                DeviceOrder::AfterPriorWork,
            )
        }
    }
}

impl Drop for ChunkedBuffer {
    fn drop(&mut self) {
        let Ok(_current) = self.device.enter() else {
            return;
        };
        let api = &self.device.driver.api;
        for index in 0..self.mapped {
            let at = self.addr + (index * self.chunk) as u64;
            // SAFETY: each chunk was mapped once by `allocate_chunked` and is unmapped once.
            unsafe { (api.mem_unmap)(at, self.chunk) };
        }
        // SAFETY: the reservation was made by `allocate_chunked` with this size.
        unsafe { (api.mem_address_free)(self.addr, self.chunk * self.chunks) };
    }
}

/// The host's page size, which dma-buf ranges are aligned to.
fn host_page_size() -> u64 {
    // SAFETY: sysconf has no preconditions; _SC_PAGESIZE is always defined on Linux.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size)
        .ok()
        .filter(|s| s.is_power_of_two())
        .unwrap_or(4096)
}
