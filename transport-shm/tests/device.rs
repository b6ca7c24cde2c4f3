//! Device memory between two processes of one host, against the stand-in CUDA driver
//! (`tern-cuda-standin`), whose device memory faults on any CPU access: these tests pass only
//! if the same-host transport moved every byte of device memory with the driver's copies.
//! The owner is this test binary run again as a child (CUDA IPC handles open only in another
//! process). `cudaMalloc` memory is reached by an IPC handle, VMM memory (PyTorch's
//! `expandable_segments:True`) by descriptors of each chunk; a range over several chunks
//! maps every one; unregistering unmaps them in the peer. What this proves is the logic
//! above the driver, not that GPUs work.

use std::io::BufRead;

use tern_cuda::Device;
use tern_engine::{RegisterRaw, SegmentId, TransferEngine, TransferRequest};
use tern_testkit::maps::mappings_of;
use tern_testkit::process::SelfChild;
use tern_transport_shm::ShmTransport;
use tern_transport_tcp::TcpTransport;
#[path = "../../testkit/include/transfers.rs"]
mod transfers;
use transfers::{run_to_completion, transport_stats};

/// Set in the environment of the owner child.
const OWNER_ENV: &str = "TERN_SHM_TEST_DEVICE_OWNER";
/// The `cuMemAlloc` buffer: several slices and a ragged tail.
const LEGACY_LEN: usize = (3 << 20) + 4321;
/// The VMM buffer: three chunks of the stand-in's 2 MiB granularity.
const CHUNK: usize = 2 << 20;
const CHUNKS: usize = 3;
const HOST_LEN: usize = 1 << 20;

fn gpu() -> &'static Device {
    if let Some(path) = tern_testkit::cuda::test_driver() {
        tern_cuda::use_driver(path.to_str().unwrap()).expect("the stand-in driver");
    }
    Device::get(0).expect("a stand-in device")
}

fn engine() -> TransferEngine {
    TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(ShmTransport::default())
        .transport(TcpTransport::default())
        .build()
        .unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 13) as u8)
        .collect()
}

/// FNV-1a, to compare bytes across the processes without printing them.
fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// The inode of the stand-in's memfd mapped at a device address (0 on a real GPU, whose
/// device memory is not a file the CPU maps).
fn inode_at(addr: u64) -> u64 {
    if tern_testkit::cuda::real_gpu() {
        return 0;
    }
    tern_testkit::maps::inode_at(addr).expect("a mapping starts at the device address")
}

/// Mappings of the stand-in memfd `inode` here (on a real GPU: `expected`, unchecked).
fn mapped(inode: u64, expected: usize) -> usize {
    if tern_testkit::cuda::real_gpu() {
        return expected;
    }
    mappings_of(inode)
}

/// Registers device memory that outlives the engine.
fn register(engine: &TransferEngine, addr: u64, len: usize) {
    // SAFETY: every device buffer outlives the engine (declared before it); peers writing
    // it is what registration is for.
    unsafe {
        engine
            .register_memory(addr as *mut u8, len, "*", true)
            .unwrap();
    }
}

/// What the owner child runs: a device buffer of each kind and a host buffer, filled with
/// known bytes and registered; it prints `owner <segment> <legacy> <chunked> <host>
/// <plain> <legacy inode> <chunk inodes…>`, then answers `sum <legacy|chunked|host|plain>` with `sum
/// <digest>` and `unregister <chunked>` with `unregistered`, until its stdin closes. Without
/// the variable it does nothing.
#[test]
fn serves_as_the_device_owner_when_run_as_its_child() {
    if std::env::var_os(OWNER_ENV).is_none() {
        return;
    }
    let gpu = gpu();
    let legacy = gpu.allocate(LEGACY_LEN).unwrap();
    let chunked = gpu.allocate_chunked(CHUNK, CHUNKS).unwrap();
    legacy.write(0, &pattern(LEGACY_LEN, 1)).unwrap();
    chunked.write(0, &pattern(chunked.len(), 2)).unwrap();
    let owner = engine();
    let host = owner.allocate(HOST_LEN, "cpu:0").unwrap();
    // Host memory that is not a memfd: peers reach it only by cross-memory attach.
    let plain = vec![0u8; HOST_LEN];
    register(&owner, plain.as_ptr() as u64, HOST_LEN);
    register(&owner, legacy.addr(), legacy.len());
    register(&owner, chunked.addr(), chunked.len());
    let inodes: Vec<String> = (0..CHUNKS)
        .map(|i| inode_at(chunked.addr() + (i * CHUNK) as u64).to_string())
        .collect();
    println!(
        "\nowner {} {} {} {} {} {} {}",
        owner.segment_name(),
        legacy.addr(),
        chunked.addr(),
        host.addr(),
        plain.as_ptr() as u64,
        inode_at(legacy.addr()),
        inodes.join(" ")
    );
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["sum", "legacy"] => {
                let mut bytes = vec![0u8; legacy.len()];
                legacy.read(0, &mut bytes).unwrap();
                println!("sum {}", digest(&bytes));
            }
            ["sum", "chunked"] => {
                let mut bytes = vec![0u8; chunked.len()];
                chunked.read(0, &mut bytes).unwrap();
                println!("sum {}", digest(&bytes));
            }
            ["sum", "host"] => {
                let mut bytes = vec![0u8; HOST_LEN];
                host.read_at(0, &mut bytes).unwrap();
                println!("sum {}", digest(&bytes));
            }
            ["sum", "plain"] => println!("sum {}", digest(&plain)),
            ["unregister", "chunked"] => {
                owner.unregister_memory(chunked.addr() as usize).unwrap();
                println!("unregistered");
            }
            _ => println!("unknown {line}"),
        }
    }
    drop(owner);
    drop((legacy, chunked, plain));
}

/// Requests cutting `[0, len)` at `cuts` (offsets that fall off slice and chunk edges).
fn pieces(
    local: u64,
    peer: SegmentId,
    remote: u64,
    cuts: &[usize],
    write: bool,
) -> Vec<TransferRequest> {
    cuts.windows(2)
        .map(|w| {
            let (from, to) = (w[0], w[1]);
            let (local, remote, len) = (local as usize + from, remote + from as u64, to - from);
            if write {
                TransferRequest::write(local, peer, remote, len)
            } else {
                TransferRequest::read(local, peer, remote, len)
            }
        })
        .collect()
}

#[test]
fn device_memory_moves_between_processes_by_the_gpu_and_every_chunk_is_mapped() {
    let gpu = gpu();
    let local_device = gpu.allocate(CHUNK * CHUNKS).unwrap();
    let local_chunked = gpu.allocate_chunked(CHUNK, CHUNKS).unwrap();
    let mut owner = SelfChild::start(
        "serves_as_the_device_owner_when_run_as_its_child",
        OWNER_ENV,
    );
    let said = owner.next("owner ");
    let words: Vec<&str> = said.split_whitespace().collect();
    let (segment, legacy, chunked, host, plain) = (
        words[0],
        words[1].parse::<u64>().unwrap(),
        words[2].parse::<u64>().unwrap(),
        words[3].parse::<u64>().unwrap(),
        words[4].parse::<u64>().unwrap(),
    );
    let legacy_inode: u64 = words[5].parse().unwrap();
    let chunk_inodes: Vec<u64> = words[6..].iter().map(|w| w.parse().unwrap()).collect();
    assert_eq!(chunk_inodes.len(), CHUNKS);

    let initiator = engine();
    register(&initiator, local_device.addr(), local_device.len());
    register(&initiator, local_chunked.addr(), local_chunked.len());
    let local_host = initiator.allocate(CHUNK * CHUNKS, "cpu:0").unwrap();
    let peer = initiator.open_segment(segment).unwrap();

    // Device → device (an IPC handle): the target holds exactly what was sent.
    let sent = pattern(LEGACY_LEN, 40);
    local_device.write(0, &sent).unwrap();
    let cuts = [0, 4096, 1_000_003, LEGACY_LEN];
    run_to_completion(
        &initiator,
        &pieces(local_device.addr(), peer, legacy, &cuts, true),
    );
    assert_eq!(
        owner.ask("sum legacy", "sum ").parse::<u64>().unwrap(),
        digest(&sent),
        "the owner's cudaMalloc memory holds other bytes"
    );
    // Device → host, read back.
    run_to_completion(
        &initiator,
        &pieces(local_host.addr() as u64, peer, legacy, &cuts, false),
    );
    let mut back = vec![0u8; LEGACY_LEN];
    local_host.read_at(0, &mut back).unwrap();
    assert!(
        back == sent,
        "the bytes read from the peer's device memory differ"
    );
    assert_eq!(
        mapped(legacy_inode, 2),
        2,
        "the peer's allocation is opened once (its two stand-in mappings)"
    );

    // Host → VMM memory over all three chunks, with requests across chunk edges.
    let whole = CHUNK * CHUNKS;
    let sent = pattern(whole, 90);
    local_host.write_at(0, &sent).unwrap();
    let cuts = [0, CHUNK - 1000, CHUNK + 5000, 2 * CHUNK + 1, whole];
    run_to_completion(
        &initiator,
        &pieces(local_host.addr() as u64, peer, chunked, &cuts, true),
    );
    assert_eq!(
        owner.ask("sum chunked", "sum ").parse::<u64>().unwrap(),
        digest(&sent),
        "the owner's VMM memory holds other bytes (a chunk not mapped, or mapped wrong)"
    );
    for inode in &chunk_inodes {
        assert_eq!(mapped(*inode, 2), 2, "every chunk is mapped, once");
    }
    // VMM → VMM of this side, one request over all of it.
    run_to_completion(
        &initiator,
        &[TransferRequest::read(
            local_chunked.addr() as usize,
            peer,
            chunked,
            whole,
        )],
    );
    let mut back = vec![0u8; whole];
    local_chunked.read(0, &mut back).unwrap();
    assert!(back == sent, "the bytes read into local VMM memory differ");

    let shm = transport_stats(&initiator, "shm");
    let moved = (2 * LEGACY_LEN + 2 * whole) as u64;
    assert_eq!(shm.bytes, moved, "the same-host transport carried it all");
    assert_eq!(
        transport_stats(&initiator, "tcp").bytes,
        0,
        "nothing fell to TCP"
    );
    assert!(shm.declined.is_empty(), "{:?}", shm.declined);

    // Local device memory to the peer's memfd host memory: a GPU copy into the mapping.
    let sent = pattern(HOST_LEN, 7);
    local_device.write(0, &sent).unwrap();
    let write_to = |to: u64| {
        run_to_completion(
            &initiator,
            &[TransferRequest::write(
                local_device.addr() as usize,
                peer,
                to,
                HOST_LEN,
            )],
        )
    };
    write_to(host);
    assert_eq!(
        owner.ask("sum host", "sum ").parse::<u64>().unwrap(),
        digest(&sent)
    );
    let shm = transport_stats(&initiator, "shm");
    assert_eq!(shm.bytes, moved + HOST_LEN as u64);
    assert!(shm.declined.is_empty(), "{:?}", shm.declined);
    // To its plain host memory, which only cross-memory attach (the CPU) reaches: declined
    // to TCP, and counted under its reason.
    write_to(plain);
    assert_eq!(
        owner.ask("sum plain", "sum ").parse::<u64>().unwrap(),
        digest(&sent)
    );
    let shm = transport_stats(&initiator, "shm");
    let declined = shm
        .declined
        .iter()
        .find(|d| d.reason.contains("cross-memory attach"))
        .expect("the decline is counted under its reason");
    assert!(declined.bytes >= HOST_LEN as u64, "{declined:?}");
    assert!(transport_stats(&initiator, "tcp").bytes >= HOST_LEN as u64);

    // Unregistering the VMM buffer unmaps every chunk here before it returns.
    assert_eq!(owner.ask("unregister chunked", ""), "unregistered");
    for inode in &chunk_inodes {
        assert_eq!(mapped(*inode, 0), 0, "a revoked chunk is still mapped here");
    }
    assert_eq!(mapped(legacy_inode, 2), 2, "the other buffer stays mapped");
    drop(initiator);
    assert_eq!(
        mapped(legacy_inode, 0),
        0,
        "the engine gone, nothing of the peer is mapped"
    );
    drop(owner);
}

/// An owner child whose driver behaves as `env` says, its segment, and the address of its
/// chunked (VMM) buffer.
fn owner_with(env: &[(&str, &str)]) -> (SelfChild, String, u64) {
    let owner = SelfChild::start_with(
        "serves_as_the_device_owner_when_run_as_its_child",
        OWNER_ENV,
        env,
    );
    let said = owner.next("owner ");
    let words: Vec<&str> = said.split_whitespace().collect();
    let (segment, chunked) = (words[0].to_owned(), words[2].parse::<u64>().unwrap());
    (owner, segment, chunked)
}

/// Writes a pattern over all of the owner's chunked buffer from host memory and reads it
/// back; returns the initiator's same-host stats.
fn write_and_read_the_chunked_buffer(
    owner: &mut SelfChild,
    segment: &str,
    chunked: u64,
) -> tern_engine::TransportStats {
    let initiator = engine();
    let whole = CHUNK * CHUNKS;
    let local = initiator.allocate(whole, "cpu:0").unwrap();
    let peer = initiator.open_segment(segment).unwrap();
    let sent = pattern(whole, 61);
    local.write_at(0, &sent).unwrap();
    let cuts = [0, CHUNK - 1000, CHUNK + 5000, 2 * CHUNK + 1, whole];
    run_to_completion(
        &initiator,
        &pieces(local.addr() as u64, peer, chunked, &cuts, true),
    );
    assert_eq!(
        owner.ask("sum chunked", "sum ").parse::<u64>().unwrap(),
        digest(&sent),
        "the owner's VMM memory holds other bytes"
    );
    let back = initiator.allocate(whole, "cpu:0").unwrap();
    run_to_completion(
        &initiator,
        &[TransferRequest::read(back.addr(), peer, chunked, whole)],
    );
    let mut got = vec![0u8; whole];
    back.read_at(0, &mut got).unwrap();
    assert!(got == sent, "the bytes read back differ");
    transport_stats(&initiator, "shm")
}

/// VMM memory as PyTorch makes it where IMEX channels exist: each chunk exportable as a
/// fabric handle only, no descriptor; and a driver that refuses the mapping attributes,
/// where each chunk's bounds come from `cuMemGetAddressRange`. The peer maps every chunk by
/// its fabric handle, and the GPU moves the bytes.
#[test]
fn vmm_chunks_that_allow_only_fabric_handles_are_mapped_by_them() {
    if tern_testkit::cuda::real_gpu() {
        return;
    }
    gpu();
    let (mut owner, segment, chunked) = owner_with(&[
        ("TERN_STANDIN_IMEX", "1"),
        ("TERN_STANDIN_NO_MAPPING_ATTRS", "1"),
    ]);
    let shm = write_and_read_the_chunked_buffer(&mut owner, &segment, chunked);
    assert!(shm.declined.is_empty(), "{:?}", shm.declined);
    assert_eq!(
        shm.bytes,
        2 * (CHUNK * CHUNKS) as u64,
        "the GPU carried it all"
    );
}

/// A chunk no other process can map (it allows neither a descriptor nor a fabric handle):
/// its slices are declined to TCP, which moves them, and the decline names the handle types.
#[test]
fn a_vmm_chunk_no_peer_can_map_is_declined_naming_its_handle_types() {
    if tern_testkit::cuda::real_gpu() {
        return;
    }
    gpu();
    tern_testkit::logs::capture();
    let (mut owner, segment, chunked) = owner_with(&[("TERN_STANDIN_UNSHAREABLE", "1")]);
    let shm = write_and_read_the_chunked_buffer(&mut owner, &segment, chunked);
    let declined = shm
        .declined
        .iter()
        .find(|d| d.reason.contains("declined its device memory"))
        .unwrap_or_else(|| panic!("the slices were not declined: {:?}", shm.declined));
    assert!(declined.bytes > 0, "{declined:?}");
    let said = tern_testkit::logs::mentioning("allows handle types");
    assert!(
        said.iter()
            .any(|l| l.contains("POSIX_FILE_DESCRIPTOR") && l.contains("FABRIC")),
        "the decline does not name the handle types: {said:?}"
    );
}
