//! What an address is: its attributes (`cuPointerGetAttribute`) and the allocation it lies
//! in.

use std::ffi::{c_int, c_uint, c_void};

use crate::codes::{ERROR_INVALID_VALUE, SUCCESS};
use crate::state::{Origin, with_state};

pub(crate) const MEMORYTYPE_HOST: c_uint = 1;
pub(crate) const MEMORYTYPE_DEVICE: c_uint = 2;
pub(crate) const ATTRIBUTE_MEMORY_TYPE: c_int = 2;
pub(crate) const ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
pub(crate) const ATTRIBUTE_IS_LEGACY_IPC_CAPABLE: c_int = 10;
pub(crate) const ATTRIBUTE_RANGE_START_ADDR: c_int = 11;
pub(crate) const ATTRIBUTE_RANGE_SIZE: c_int = 12;
pub(crate) const ATTRIBUTE_ALLOWED_HANDLE_TYPES: c_int = 14;
pub(crate) const ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE: c_int = 15;
pub(crate) const ATTRIBUTE_MAPPING_SIZE: c_int = 18;
pub(crate) const ATTRIBUTE_MAPPING_BASE_ADDR: c_int = 19;

/// Whether the mapping attributes (which `cuPointerGetAttribute`'s reference does not list)
/// are refused, as a driver may (`TERN_STANDIN_NO_MAPPING_ATTRS=1`).
fn mapping_attributes_refused() -> bool {
    std::env::var("TERN_STANDIN_NO_MAPPING_ATTRS").is_ok_and(|v| v == "1")
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
            handle_types: u64,
            gpu_direct: bool,
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
                handle_types: match &allocation.origin {
                    Origin::Mapped(physical) => physical.handle_types as u64,
                    _ => 0,
                },
                gpu_direct: match &allocation.origin {
                    Origin::Mapped(physical) => physical.gpu_direct,
                    _ => true,
                },
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
        (ATTRIBUTE_MAPPING_BASE_ADDR | ATTRIBUTE_MAPPING_SIZE, _)
            if mapping_attributes_refused() =>
        {
            return ERROR_INVALID_VALUE;
        }
        (ATTRIBUTE_RANGE_START_ADDR | ATTRIBUTE_MAPPING_BASE_ADDR, Found::Device { base, .. }) => {
            Value::Wide(base as u64)
        }
        (ATTRIBUTE_RANGE_SIZE | ATTRIBUTE_MAPPING_SIZE, Found::Device { len, .. }) => {
            Value::Wide(len as u64)
        }
        (ATTRIBUTE_ALLOWED_HANDLE_TYPES, Found::Device { handle_types, .. }) => {
            Value::Wide(handle_types)
        }
        (ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE, Found::Device { gpu_direct, .. }) => {
            Value::Int(c_int::from(gpu_direct))
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
