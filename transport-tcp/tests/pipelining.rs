//! A lane keeps many requests on one connection. With large reads and writes mixed in one
//! batch and small socket buffers, read replies fill the buffers while write bodies are still
//! going out: the lane must take the replies as it sends, or both ends stall until the I/O
//! timeout. Over real loopback sockets, one lane, 32 KiB buffers.

use std::time::Duration;

use tern_engine::{TransferEngine, TransferRequest, TransferStatus};
use tern_transport_tcp::{TcpConfig, TcpTransport};

const MIB: usize = 1 << 20;

/// A target and an initiator, each with one lane per peer, 32 KiB socket buffers and a 3 s
/// I/O timeout.
fn small_buffer_engines() -> (TransferEngine, TransferEngine) {
    let config = TcpConfig {
        socket_buffer_bytes: Some(32 << 10),
        io_timeout: Duration::from_secs(3),
        connections_per_peer: 1,
        ..TcpConfig::default()
    };
    let engine = || {
        TransferEngine::builder()
            .local_server_name("127.0.0.1")
            .transport(TcpTransport::new(config.clone()))
            .build()
            .unwrap()
    };
    (engine(), engine())
}

/// Submits `requests` as one batch and waits: every task must complete.
fn run_to_completion(initiator: &TransferEngine, requests: &[TransferRequest]) {
    let batch = initiator.allocate_batch(requests.len()).unwrap();
    initiator.submit(&batch, requests).unwrap();
    batch.wait(Duration::from_secs(120));
    for task in 0..requests.len() {
        assert_eq!(
            batch.task_status(task).unwrap().status,
            TransferStatus::Completed,
            "task {task}"
        );
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
        .collect()
}

#[test]
fn reads_and_writes_mixed_in_one_batch_complete_over_small_socket_buffers() {
    let (target, initiator) = small_buffer_engines();
    let remote = target.allocate(32 * MIB, "cpu:0").unwrap();
    let local = initiator.allocate(32 * MIB, "cpu:0").unwrap();
    remote.write_at(0, &pattern(1, 16 * MIB)).unwrap();
    local.write_at(0, &pattern(2, 16 * MIB)).unwrap();
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    // 16 reads of the target's first half into the initiator's second, interleaved with 16
    // writes of the initiator's first half into the target's second.
    let requests: Vec<TransferRequest> = (0..16)
        .flat_map(|i| {
            let at = i * MIB;
            [
                TransferRequest::read(
                    local.addr() + 16 * MIB + at,
                    peer,
                    (remote.addr() + at) as u64,
                    MIB,
                ),
                TransferRequest::write(
                    local.addr() + at,
                    peer,
                    (remote.addr() + 16 * MIB + at) as u64,
                    MIB,
                ),
            ]
        })
        .collect();
    run_to_completion(&initiator, &requests);
    let mut read_back = vec![0u8; 16 * MIB];
    local.read_at(16 * MIB, &mut read_back).unwrap();
    assert!(
        read_back == pattern(1, 16 * MIB),
        "the reads brought the wrong bytes"
    );
    remote.read_at(16 * MIB, &mut read_back).unwrap();
    assert!(
        read_back == pattern(2, 16 * MIB),
        "the writes landed the wrong bytes"
    );
}

/// Small writes one after another leave a lane gathered into one `sendmsg(2)`; with 32 KiB
/// socket buffers a call takes part of the run and ends inside one of its requests. Every
/// write must land whole, in place, and the bytes between them stay untouched — with reads
/// among the writes, which end a run.
#[test]
fn runs_of_small_writes_sent_together_land_whole_over_small_socket_buffers() {
    let (target, initiator) = small_buffer_engines();
    let remote = target.allocate(8 * MIB, "cpu:0").unwrap();
    let local = initiator.allocate(8 * MIB, "cpu:0").unwrap();
    let source = pattern(7, 4 * MIB);
    local.write_at(0, &source).unwrap();
    remote.write_at(0, &pattern(3, 8 * MIB)).unwrap();
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    // 300 writes of uneven sizes with a gap after each (so that none merge), every tenth
    // request a read of the target's second half into the initiator's.
    let mut requests = Vec::new();
    let mut writes = Vec::new();
    let mut at = 0;
    for i in 0..300usize {
        let len = 700 + (i * 977) % 9000;
        if i % 10 == 9 {
            let offset = 4 * MIB + at;
            requests.push(TransferRequest::read(
                local.addr() + offset,
                peer,
                (remote.addr() + offset) as u64,
                len,
            ));
        } else {
            requests.push(TransferRequest::write(
                local.addr() + at,
                peer,
                (remote.addr() + at) as u64,
                len,
            ));
            writes.push((at, len));
        }
        at += len + 64;
    }
    run_to_completion(&initiator, &requests);
    let mut landed = vec![0u8; 4 * MIB];
    remote.read_at(0, &mut landed).unwrap();
    let mut expected = pattern(3, 4 * MIB);
    for &(at, len) in &writes {
        expected[at..at + len].copy_from_slice(&source[at..at + len]);
    }
    let wrong = landed.iter().zip(&expected).position(|(a, b)| a != b);
    assert_eq!(
        wrong, None,
        "the first wrong byte of the target's first half"
    );
    let mut read_back = vec![0u8; 4 * MIB];
    local.read_at(4 * MIB, &mut read_back).unwrap();
    let mut target_half = vec![0u8; 4 * MIB];
    remote.read_at(4 * MIB, &mut target_half).unwrap();
    for (request, task) in requests.iter().zip(0..) {
        if task % 10 == 9 {
            let offset = request.source - local.addr() - 4 * MIB;
            assert!(
                read_back[offset..offset + request.length]
                    == target_half[offset..offset + request.length],
                "read {task} brought the wrong bytes"
            );
        }
    }
}

/// The headers of a lane's queued reads arrive together, and the server answers the reads of
/// host memory among them in one `sendmsg(2)`; with 32 KiB socket buffers a call takes part of
/// the replies and ends inside one. Every read must bring its own bytes, with writes among the
/// reads, which end a run of replies.
#[test]
fn runs_of_small_reads_answered_together_bring_their_own_bytes_over_small_socket_buffers() {
    let (target, initiator) = small_buffer_engines();
    let remote = target.allocate(8 * MIB, "cpu:0").unwrap();
    let local = initiator.allocate(8 * MIB, "cpu:0").unwrap();
    let served = pattern(11, 8 * MIB);
    remote.write_at(0, &served).unwrap();
    local.write_at(0, &pattern(5, 8 * MIB)).unwrap();
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    // 300 reads of uneven sizes with a gap after each (so that none merge) into the
    // initiator's first half, every tenth request a write of its second half.
    let mut requests = Vec::new();
    let mut at = 0;
    for i in 0..300usize {
        let len = 300 + (i * 1499) % 12_000;
        let opcode_read = i % 10 != 9;
        let (source, target_offset) = if opcode_read {
            (local.addr() + at, (remote.addr() + at) as u64)
        } else {
            (
                local.addr() + 4 * MIB + at,
                (remote.addr() + 4 * MIB + at) as u64,
            )
        };
        requests.push(if opcode_read {
            TransferRequest::read(source, peer, target_offset, len)
        } else {
            TransferRequest::write(source, peer, target_offset, len)
        });
        at += len + 64;
    }
    run_to_completion(&initiator, &requests);
    let mut landed = vec![0u8; 8 * MIB];
    local.read_at(0, &mut landed).unwrap();
    let mut remote_now = vec![0u8; 8 * MIB];
    remote.read_at(0, &mut remote_now).unwrap();
    for (task, request) in requests.iter().enumerate() {
        let len = request.length;
        if task % 10 != 9 {
            let offset = request.source - local.addr();
            assert!(
                landed[offset..offset + len] == served[offset..offset + len],
                "read {task} brought the wrong bytes"
            );
        } else {
            let offset = request.target_offset as usize - remote.addr();
            assert!(
                remote_now[offset..offset + len] == landed[offset..offset + len],
                "write {task} landed the wrong bytes"
            );
        }
    }
    // Nothing else of the initiator's first half changed: the gaps between the reads kept
    // their bytes.
    let mut expected = pattern(5, 8 * MIB);
    for (task, request) in requests.iter().enumerate() {
        if task % 10 != 9 {
            let offset = request.source - local.addr();
            expected[offset..offset + request.length]
                .copy_from_slice(&served[offset..offset + request.length]);
        }
    }
    let wrong = landed[..4 * MIB]
        .iter()
        .zip(&expected[..4 * MIB])
        .position(|(a, b)| a != b);
    assert_eq!(
        wrong, None,
        "the first wrong byte of the initiator's first half"
    );
}
