//! What the device-memory tests over two engines share: the device (the stand-in's, or the
//! real driver's on a GPU), engines on loopback, registration of device memory, and reading
//! it back.
// Each test binary takes what it needs of this file.
#![allow(dead_code)]

use tern_cuda::{Device, DeviceBuffer};
use tern_engine::{RegisterRaw, TransferEngine};
use tern_transport_shm::{ShmConfig, ShmTransport};
use tern_transport_tcp::TcpTransport;

/// Device 0 of the stand-in, or of the real driver on a GPU (`TERN_GPU=1`).
pub fn gpu() -> &'static Device {
    if let Some(path) = tern_testkit::cuda::test_driver() {
        tern_cuda::use_driver(path.to_str().unwrap()).expect("the stand-in driver");
    }
    Device::get(0).expect("a device")
}

/// An engine on loopback over TCP, with the same-host transport first if asked.
pub fn engine(same_host_first: bool) -> TransferEngine {
    let mut builder = TransferEngine::builder().local_server_name("127.0.0.1");
    if same_host_first {
        builder = builder.transport(ShmTransport::new(ShmConfig::default()));
    }
    builder.transport(TcpTransport::default()).build().unwrap()
}

/// Registers device memory the test keeps until after the engine is gone, at `location`.
pub fn register(engine: &TransferEngine, buffer: &DeviceBuffer, location: &str) {
    // SAFETY: every device buffer outlives the engines (declared before them in each test,
    // so dropped after them); peers writing it is what registration is for.
    unsafe {
        engine
            .register_memory(buffer.addr() as *mut u8, buffer.len(), location, true)
            .unwrap();
    }
}

/// What the device buffer holds.
pub fn device_bytes(buffer: &DeviceBuffer) -> Vec<u8> {
    let mut out = vec![0u8; buffer.len()];
    buffer.read(0, &mut out).unwrap();
    out
}
