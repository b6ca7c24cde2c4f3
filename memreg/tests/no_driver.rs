//! A host without a CUDA driver: device locations fail with the missing driver named, and
//! everything else is host memory, with no panic.

use tern_cuda::CudaError;
use tern_memreg::{MemoryError, MemoryKind, MemoryRegistry, Region};

#[test]
fn without_a_driver_device_locations_fail_typed_and_host_memory_registers() {
    let missing = "/nonexistent/libcuda.so.1";
    match tern_cuda::use_driver(missing) {
        Err(CudaError::DriverMissing { library, .. }) => assert_eq!(library, missing),
        other => panic!("a missing library: {other:?}"),
    }
    let memory = vec![0u8; 8192];
    let registry = MemoryRegistry::new();
    // SAFETY: `memory` outlives the registry (declared before it, dropped after).
    let device = unsafe { Region::from_raw(memory.as_ptr().cast_mut(), 4096, "cuda:0", true) };
    match registry.register(device) {
        Err(MemoryError::Device {
            reason: CudaError::DriverMissing { .. },
            ..
        }) => {}
        other => panic!("cuda:0 without a driver: {other:?}"),
    }
    // SAFETY: as above.
    let host = unsafe { Region::from_raw(memory.as_ptr().cast_mut(), 8192, "*", true) };
    let region = registry
        .register(host)
        .expect("host memory needs no driver");
    assert_eq!(region.info().kind, MemoryKind::Host);
    assert!(region.info().location.starts_with("cpu:") || region.info().location == "*");
}
