//! Device memory in regions, against the stand-in CUDA driver: its device memory faults on
//! any CPU access, so these tests pass only if every byte moves by a driver copy.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use tern_cuda::{Device, DeviceBuffer};
use tern_memreg::{MemoryError, MemoryKind, MemoryRegistry, Region, STAGE_CHUNK, Stage};

fn device(ordinal: usize) -> &'static Device {
    if let Some(path) = tern_testkit::cuda::test_driver() {
        tern_cuda::use_driver(path.to_str().expect("a UTF-8 path")).expect("the stand-in driver");
    }
    Device::get(ordinal).expect("a stand-in device")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn register(
    registry: &MemoryRegistry,
    buffer: &DeviceBuffer,
    location: &str,
) -> Result<(), MemoryError> {
    // SAFETY: the device buffer stays allocated until the end of the test, after every
    // region over it is unregistered or dropped with the registry.
    let region =
        unsafe { Region::from_raw(buffer.addr() as *mut u8, buffer.len(), location, true) };
    registry.register(region).map(drop)
}

#[test]
fn device_memory_is_detected_named_and_checked_against_its_location() {
    let gpu0 = device(0);
    if tern_cuda::driver().map_or(0, |d| d.device_count()) < 2 {
        eprintln!("skipped: this test needs two devices");
        return;
    }
    let gpu1 = device(1);
    let on0 = gpu0.allocate(1 << 20).expect("device memory");
    let on1 = gpu1.allocate(1 << 16).expect("device memory");
    let registry = MemoryRegistry::new();
    register(&registry, &on0, "*").expect("`*` takes device memory");
    register(&registry, &on1, "cuda:1").expect("its own location");
    let infos = registry.snapshot();
    let of = |addr: u64| {
        infos
            .iter()
            .find(|i| i.addr == addr as usize)
            .cloned()
            .expect("registered")
    };
    assert_eq!(of(on0.addr()).location, "cuda:0");
    assert_eq!(of(on0.addr()).kind, MemoryKind::Device { ordinal: 0 });
    assert_eq!(of(on1.addr()).kind, MemoryKind::Device { ordinal: 1 });

    let wrong = gpu1.allocate(4096).expect("device memory");
    for location in ["cuda:0", "cpu:0"] {
        match register(&registry, &wrong, location) {
            Err(MemoryError::LocationMismatch { found, .. }) => assert_eq!(found, "cuda:1"),
            other => panic!("{location} for memory of cuda:1: {other:?}"),
        }
    }
    let host = vec![0u8; 4096];
    // SAFETY: `host` outlives the registry's use of it (the registration fails).
    let region = unsafe { Region::from_raw(host.as_ptr().cast_mut(), host.len(), "cuda:0", true) };
    assert!(matches!(
        registry.register(region),
        Err(MemoryError::LocationMismatch { .. })
    ));
    // Overlap and zero length are checked as for host memory.
    // SAFETY: as above; the region overlaps one registered and is refused.
    let overlapping = unsafe { Region::from_raw((on0.addr() + 4096) as *mut u8, 4096, "*", true) };
    assert!(matches!(
        registry.register(overlapping),
        Err(MemoryError::Overlap { .. })
    ));
}

#[test]
fn the_cpu_is_refused_and_copies_go_through_the_driver() {
    let gpu = device(0);
    let buffer = gpu.allocate(3 * STAGE_CHUNK + 777).expect("device memory");
    let registry = MemoryRegistry::new();
    register(&registry, &buffer, "cuda:0").expect("registered");
    let addr = buffer.addr() as usize;
    let pin = registry.pin(addr, buffer.len()).expect("pinned");
    assert!(pin.is_device());
    assert!(matches!(
        pin.slice(addr, 16),
        Err(MemoryError::DeviceMemory { .. })
    ));
    let data = pattern(10_000, 7);
    pin.copy_from_slice(addr + 123, &data).expect("copied in");
    let mut back = vec![0u8; data.len()];
    pin.copy_to_slice(addr + 123, &mut back)
        .expect("copied out");
    assert_eq!(back, data);
    let mut beyond = vec![0u8; 16];
    assert!(matches!(
        pin.copy_to_slice(addr + buffer.len() - 8, &mut beyond),
        Err(MemoryError::OutOfRange { .. })
    ));
}

#[test]
fn a_stage_moves_device_memory_to_and_from_a_socket_in_chunks() {
    let gpu = device(0);
    let len = 3 * STAGE_CHUNK + 4321;
    let source = gpu.allocate(len).expect("device memory");
    let target = gpu.allocate(len).expect("device memory");
    let data = pattern(len, 3);
    source.write(0, &data).expect("filled");
    let registry = MemoryRegistry::new();
    register(&registry, &source, "*").expect("registered");
    register(&registry, &target, "*").expect("registered");
    let out_pin = registry.pin(source.addr() as usize, len).expect("pinned");
    let in_pin = registry.pin(target.addr() as usize, len).expect("pinned");

    let (mut near, mut far) = UnixStream::pair().expect("a socket pair");
    let echo = std::thread::spawn(move || {
        let mut prefix = [0u8; 5];
        far.read_exact(&mut prefix).expect("prefix");
        let mut body = vec![0u8; len];
        far.read_exact(&mut body).expect("body");
        far.write_all(&body).expect("echoed");
        (prefix, body)
    });
    let mut stage = Stage::new();
    stage
        .write_prefixed_to(&out_pin, b"hello", source.addr() as usize, len, &mut near)
        .expect("sent");
    stage
        .read_exact_from(&in_pin, target.addr() as usize, len, &mut near)
        .expect("received");
    let (prefix, body) = echo.join().expect("the echo thread");
    assert_eq!(&prefix, b"hello");
    assert!(body == data, "the bytes sent are not the device's");
    let mut back = vec![0u8; len];
    target.read(0, &mut back).expect("read back");
    assert!(back == data, "the bytes received did not reach the device");
}
