//! Device memory between two engines over real loopback sockets, against the stand-in CUDA
//! driver (`tern-cuda-standin`): its device memory faults on any CPU access, so these tests
//! pass only if every byte is staged by driver copies on both sides. What they prove is the
//! logic above the driver, not that GPUs work.
//!
//! TCP carries device memory both ways, in chunks through pinned buffers, with requests
//! admitted exactly as for host memory; two engines of one process with the same-host
//! transport first copy device memory with the GPU (between processes:
//! `transport-shm/tests/device.rs`).

use std::time::Duration;

use tern_engine::{MemoryKind, SegmentId, TransferEngine, TransferRequest, TransferStatus};
#[path = "support/gpu.rs"]
mod gpu_support;
use gpu_support::{device_bytes, engine as tcp_engine, gpu, register};
#[path = "../../testkit/include/transfers.rs"]
mod transfers;
use transfers::run_to_completion;

/// Three staging chunks and a ragged tail.
const LEN: usize = 3 * tern_memreg::STAGE_CHUNK + 12_345;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect()
}

fn remote_addr(engine: &TransferEngine, peer: SegmentId, len: usize) -> u64 {
    let desc = engine.segment(peer).unwrap().desc.clone();
    desc.buffers
        .iter()
        .find(|b| b.length == len as u64)
        .expect("the target's device buffer is published")
        .addr
}

#[test]
fn tcp_writes_and_reads_device_memory_on_both_sides() {
    let gpu = gpu();
    let (source, landing, target) = (
        gpu.allocate(LEN).unwrap(),
        gpu.allocate(LEN).unwrap(),
        gpu.allocate(LEN).unwrap(),
    );
    let data = pattern(LEN, 5);
    source.write(0, &data).unwrap();
    let (initiator, peer_engine) = (tcp_engine(false), tcp_engine(false));
    register(&initiator, &source, "*");
    register(&initiator, &landing, "cuda:0");
    register(&peer_engine, &target, "*");
    for region in peer_engine.registered_regions() {
        assert_eq!(region.kind, MemoryKind::Device { ordinal: 0 });
        assert_eq!(region.location, "cuda:0");
    }
    let peer = initiator.open_segment(peer_engine.segment_name()).unwrap();
    let at = remote_addr(&initiator, peer, LEN);

    // Several requests in one batch, at offsets that do not fall on chunk boundaries.
    let cut = [0, 4096, 700_001, LEN];
    let writes: Vec<TransferRequest> = cut
        .windows(2)
        .map(|w| {
            let (from, to) = (w[0], w[1]);
            TransferRequest::write(
                source.addr() as usize + from,
                peer,
                at + from as u64,
                to - from,
            )
        })
        .collect();
    run_to_completion(&initiator, &writes);
    assert!(
        device_bytes(&target) == data,
        "the target's device memory holds other bytes"
    );

    let reads: Vec<TransferRequest> = cut
        .windows(2)
        .map(|w| {
            let (from, to) = (w[0], w[1]);
            TransferRequest::read(
                landing.addr() as usize + from,
                peer,
                at + from as u64,
                to - from,
            )
        })
        .collect();
    run_to_completion(&initiator, &reads);
    assert!(
        device_bytes(&landing) == data,
        "the bytes read did not reach device memory"
    );

    // Outside the target's device buffer: refused as for host memory.
    let beyond = TransferRequest::write(source.addr() as usize, peer, at + LEN as u64 - 8, 16);
    let batch = initiator.allocate_batch(1).unwrap();
    initiator.submit(&batch, &[beyond]).unwrap_or(());
    batch.wait(Duration::from_secs(30));
    assert_ne!(
        batch.task_status(0).unwrap().status,
        TransferStatus::Completed
    );
    drop((initiator, peer_engine));
}

#[test]
fn host_memory_and_device_memory_meet_over_tcp() {
    let gpu = gpu();
    let target = gpu.allocate(LEN).unwrap();
    let initiator = tcp_engine(false);
    let peer_engine = tcp_engine(false);
    let host = initiator.allocate(LEN, "cpu:0").unwrap();
    let data = pattern(LEN, 9);
    host.write_at(0, &data).unwrap();
    register(&peer_engine, &target, "cuda:0");
    let peer = initiator.open_segment(peer_engine.segment_name()).unwrap();
    let at = remote_addr(&initiator, peer, LEN);
    run_to_completion(
        &initiator,
        &[TransferRequest::write(host.addr(), peer, at, LEN)],
    );
    assert!(device_bytes(&target) == data);
    let echo = pattern(LEN, 77);
    target.write(0, &echo).unwrap();
    run_to_completion(
        &initiator,
        &[TransferRequest::read(host.addr(), peer, at, LEN)],
    );
    let mut back = vec![0u8; LEN];
    host.read_at(0, &mut back).unwrap();
    assert!(back == echo);
    drop((initiator, peer_engine));
}

#[test]
fn engines_of_one_process_copy_device_memory_with_the_gpu_over_the_same_host_transport() {
    let gpu = gpu();
    let (source, target) = (gpu.allocate(LEN).unwrap(), gpu.allocate(LEN).unwrap());
    let data = pattern(LEN, 1);
    source.write(0, &data).unwrap();
    let initiator = tcp_engine(true);
    let peer_engine = tcp_engine(true);
    register(&initiator, &source, "*");
    register(&peer_engine, &target, "*");
    let host_target = peer_engine.allocate(LEN / 2, "cpu:0").unwrap();
    let peer = initiator.open_segment(peer_engine.segment_name()).unwrap();
    let at = remote_addr(&initiator, peer, LEN);
    run_to_completion(
        &initiator,
        &[TransferRequest::write(
            source.addr() as usize,
            peer,
            at,
            LEN,
        )],
    );
    assert!(device_bytes(&target) == data);
    // Device source, host target: a GPU copy too, within one process.
    run_to_completion(
        &initiator,
        &[TransferRequest::write(
            source.addr() as usize,
            peer,
            host_target.addr() as u64,
            LEN / 2,
        )],
    );
    let mut back = vec![0u8; LEN / 2];
    host_target.read_at(0, &mut back).unwrap();
    assert!(back == data[..LEN / 2]);
    let stats = initiator.stats();
    let by = |protocol: &str| {
        stats
            .transports
            .iter()
            .find(|t| t.protocol == protocol)
            .cloned()
            .unwrap()
    };
    let (shm, tcp) = (by("shm"), by("tcp"));
    assert!(shm.declined.is_empty(), "{:?}", shm.declined);
    assert_eq!(shm.bytes, (LEN + LEN / 2) as u64);
    assert_eq!(tcp.bytes, 0, "TCP carried {}", tcp.bytes);
    drop((initiator, peer_engine, host_target));
}

#[test]
fn a_transfer_on_a_stream_waits_for_the_work_before_it_and_holds_the_work_after_it() {
    let gpu = gpu();
    let (source, target, landing) = (
        gpu.allocate(LEN).unwrap(),
        gpu.allocate(LEN).unwrap(),
        gpu.allocate(LEN).unwrap(),
    );
    let data = pattern(LEN, 33);
    source.write(0, &data).unwrap();
    let (initiator, peer_engine) = (tcp_engine(false), tcp_engine(false));
    register(&initiator, &source, "*");
    register(&initiator, &landing, "*");
    register(&peer_engine, &target, "*");
    let peer = initiator.open_segment(peer_engine.segment_name()).unwrap();
    let at = remote_addr(&initiator, peer, LEN);
    let stream = tern_cuda::Stream::new(gpu).unwrap();
    let caller = stream.caller().unwrap();

    // The stream is held by work of its own (a gate the test opens); a write ordered after it
    // must not start before that work is done, however long it takes.
    let earlier_work = caller.gate().unwrap();
    caller.hold_until(&earlier_work).unwrap();
    let write = initiator
        .submit_on_stream(
            &caller,
            vec![TransferRequest::write(
                source.addr() as usize,
                peer,
                at,
                LEN,
            )],
        )
        .unwrap();
    assert!(write.wait(Duration::from_millis(300)).is_none());
    assert!(
        device_bytes(&target).iter().all(|&b| b == 0),
        "the write started before the work enqueued before it was done"
    );
    earlier_work.open();
    let moved = write
        .wait(Duration::from_secs(60))
        .expect("the write ended")
        .unwrap();
    assert_eq!(moved, LEN as u64);
    assert!(device_bytes(&target) == data);

    // Work enqueued after a read runs only once the read is over: an event recorded after
    // it completes after the transfer has ended.
    let read = initiator
        .submit_on_stream(
            &caller,
            vec![TransferRequest::read(
                landing.addr() as usize,
                peer,
                at,
                LEN,
            )],
        )
        .unwrap();
    let later_work = tern_cuda::Event::new(gpu).unwrap();
    stream.record(&later_work).unwrap();
    later_work.synchronize().unwrap();
    assert!(
        read.is_done(),
        "work after the read ran before the read was over"
    );
    assert_eq!(read.wait(Duration::ZERO).unwrap().unwrap(), LEN as u64);
    assert!(device_bytes(&landing) == data);

    // A failed transfer releases the stream too, and says why; nothing ends the process.
    let failing = initiator
        .submit_on_stream(
            &caller,
            vec![TransferRequest::write(
                source.addr() as usize,
                peer,
                at + LEN as u64 - 8,
                16,
            )],
        )
        .unwrap();
    let after_failure = tern_cuda::Event::new(gpu).unwrap();
    stream.record(&after_failure).unwrap();
    after_failure.synchronize().unwrap();
    let failed = failing
        .wait(Duration::ZERO)
        .expect("over once the stream went on");
    assert!(
        matches!(
            failed.as_ref().map_err(|e| &**e),
            Err(tern_engine::EngineError::TransferFailed { .. })
        ),
        "{failed:?}"
    );
    drop((initiator, peer_engine));
}
