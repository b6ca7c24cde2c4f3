//! Device memory on RDMA NICs, against the stand-in CUDA driver (which exports no DMA-BUF)
//! in the Soft-RoCE guest (no `nvidia_peermem` there): neither way to register device memory
//! works, and registration fails with the typed error that names both, registering nothing.
//! The dma-buf path itself runs on a GPU host (`cargo xtask gpu`). Ignored on hosts without
//! RDMA; `cargo xtask test` runs it in the Soft-RoCE guest.

mod support;

use std::time::Duration;

use support::{builder, rdma_with};
use tern_engine::RegisterRaw;

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn device_memory_no_nic_can_register_fails_naming_dma_buf_and_peermem() {
    support::setup(
        "device_memory_no_nic_can_register_fails_naming_dma_buf_and_peermem",
        Duration::from_secs(300),
    );
    let path = tern_testkit::cuda::standin_driver();
    tern_cuda::use_driver(path.to_str().unwrap()).expect("the stand-in driver");
    let gpu = tern_cuda::Device::get(0).unwrap();
    let memory = gpu.allocate(1 << 20).unwrap();
    assert!(
        !tern_memreg::nic::peermem_loaded(),
        "this test expects a host without nvidia_peermem"
    );
    let engine = builder(rdma_with(|_| {})).build().unwrap();
    // SAFETY: the device buffer outlives the engine (declared before it).
    let registered =
        unsafe { engine.register_memory(memory.addr() as *mut u8, memory.len(), "*", true) };
    let error = registered.expect_err("device memory registered with no way to the NICs");
    let text = error.to_string();
    assert!(text.contains("dma-buf"), "{text}");
    assert!(text.contains("cuMemGetHandleForAddressRange"), "{text}");
    assert!(
        text.contains("nvidia_peermem: the module is not loaded"),
        "{text}"
    );
    assert!(
        engine
            .registered_regions()
            .iter()
            .all(|r| r.addr != memory.addr() as usize),
        "a region was left registered"
    );
    // Host memory still registers on the same engine.
    let host = engine.allocate(1 << 20, "cpu:0").unwrap();
    assert!(
        engine
            .local_descriptor()
            .buffers
            .iter()
            .any(|b| b.addr == host.addr() as u64 && b.rkey.as_ref().is_some_and(|k| !k.is_empty()))
    );
    drop(engine);
}
