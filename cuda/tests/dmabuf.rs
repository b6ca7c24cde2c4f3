//! dma-bufs of device memory as the driver documents `cuMemGetHandleForAddressRange`: only
//! on a device that says `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`, for a range widened to the
//! host page size that is wholly mapped (over several chunks of one VMM reservation too),
//! not the whole allocation; and Tern's own VMM chunks made GPUDirect RDMA capable where the
//! device supports it with VMM. Against the stand-in driver, whose dma-buf is a memfd named
//! after the range it stands for; the dma-buf checks run in a child with the stand-in's
//! devices saying they support dma-bufs.

use tern_cuda::Device;
use tern_testkit::process::SelfChild;

const CHILD_ENV: &str = "TERN_CUDA_TEST_DMABUF_CHILD";
const PAGE: u64 = 4096;
const CHUNK: usize = 2 << 20;

fn gpu() -> Option<&'static Device> {
    let path = tern_testkit::cuda::test_driver()?;
    tern_cuda::use_driver(path.to_str().unwrap()).expect("the stand-in driver");
    Some(Device::get(0).expect("a stand-in device"))
}

/// The range a stand-in dma-buf stands for, from the name of its memfd.
fn exported_range(fd: &std::os::fd::OwnedFd) -> (u64, u64) {
    use std::os::fd::AsRawFd;
    let target = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
    let name = target.to_string_lossy().into_owned();
    let rest = name
        .strip_prefix("/memfd:tern-standin-dmabuf-")
        .unwrap_or_else(|| panic!("not a stand-in dma-buf: {name}"));
    let (start, len) = rest.split_once('-').unwrap();
    let len = len.split(' ').next().unwrap();
    (
        u64::from_str_radix(start.trim_start_matches("0x"), 16).unwrap(),
        len.parse().unwrap(),
    )
}

/// Run as the child, with `TERN_STANDIN_DMA_BUF=1`.
#[test]
fn exports_the_page_aligned_range_asked_for_when_run_as_its_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let gpu = gpu().expect("the stand-in");
    // cuMemAlloc memory: a range inside it, off page edges, widened to pages, not the
    // allocation.
    let legacy = gpu.allocate(3 << 20).unwrap();
    let (addr, len) = (legacy.addr() + 5000, 10_000);
    let (fd, offset) = gpu.dmabuf(addr, len).unwrap();
    let (start, size) = exported_range(&fd);
    assert_eq!(start, addr & !(PAGE - 1));
    assert_eq!(start + size, (addr + len).next_multiple_of(PAGE));
    assert_eq!(offset, addr - start);
    assert!(
        size < legacy.len() as u64,
        "the whole allocation was exported"
    );
    // VMM memory: a range over three chunks of one reservation.
    let chunked = gpu.allocate_chunked(CHUNK, 3).unwrap();
    let (addr, len) = (chunked.addr() + 100, 2 * CHUNK as u64 + 500);
    let (fd, offset) = gpu.dmabuf(addr, len).unwrap();
    let (start, size) = exported_range(&fd);
    assert_eq!((start, offset), (chunked.addr(), 100));
    assert_eq!(size, (100 + len).next_multiple_of(PAGE));
    // Past the end of what is mapped: refused, naming the call.
    let beyond = gpu.dmabuf(chunked.addr() + 2 * CHUNK as u64, 2 * CHUNK as u64);
    let error = beyond.expect_err("a range past the mapping").to_string();
    assert!(error.contains("cuMemGetHandleForAddressRange"), "{error}");
    // On a line of its own: libtest writes the test's name before it without a newline.
    println!("\ndmabuf checks passed");
}

#[test]
fn dma_bufs_follow_the_drivers_rules_and_vmm_chunks_are_gpudirect_capable() {
    let Some(gpu) = gpu() else { return };
    // Here the stand-in's devices say they have no dma-buf support: the error names it.
    let legacy = gpu.allocate(1 << 20).unwrap();
    let error = gpu.dmabuf(legacy.addr(), 4096).unwrap_err().to_string();
    assert!(
        error.contains("cuMemGetHandleForAddressRange")
            && error.contains("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED"),
        "{error}"
    );
    // Tern's VMM chunks ask for GPUDirect RDMA where the device supports it with VMM (the
    // stand-in's devices do).
    let chunked = gpu.allocate_chunked(CHUNK, 2).unwrap();
    for chunk in 0..2 {
        let at = chunked.addr() + (chunk * CHUNK) as u64;
        assert!(gpu.is_gpu_direct_rdma_capable(at).unwrap(), "chunk {chunk}");
    }
    let child = SelfChild::start_with(
        "exports_the_page_aligned_range_asked_for_when_run_as_its_child",
        CHILD_ENV,
        &[("TERN_STANDIN_DMA_BUF", "1")],
    );
    assert_eq!(child.next("dmabuf "), "checks passed");
}
