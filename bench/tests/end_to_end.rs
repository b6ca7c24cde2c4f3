//! The `tern-bench` binary as a user runs it, and a target process that dies mid-transfer.

#[path = "support/target.rs"]
mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use support::Target;
use tern_engine::{BatchState, TransferEngine, TransferError, TransferRequest, TransferStatus};
use tern_transport_tcp::TcpTransport;

const BENCH: &str = env!("CARGO_BIN_EXE_tern-bench");

#[test]
fn loopback_mode_moves_verified_bytes_and_prints_one_json_object() {
    for operation in ["read", "write"] {
        let output = Command::new(BENCH)
            .args([
                "--mode=loopback",
                &format!("--operation={operation}"),
                "--block_size=65536",
                "--batch_size=16",
                "--threads=2",
                "--duration=1",
                "--buffer_size=16777216",
                "--verify",
                "--json",
            ])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{operation}: {stderr}");
        let stdout = String::from_utf8(output.stdout).unwrap();
        assert_eq!(stdout.lines().count(), 1, "one JSON object: {stdout}");
        let json: serde_json::Value = serde_json::from_str(&stdout).unwrap();
        for key in [
            "protocol",
            "operation",
            "block_size",
            "batch_size",
            "threads",
            "duration_s",
            "bytes",
            "gbps",
            "avg_latency_us",
            "p50_latency_us",
            "p99_latency_us",
        ] {
            assert!(json.get(key).is_some(), "{key} missing from {stdout}");
        }
        assert_eq!(json["operation"], operation);
        assert_eq!(json["block_size"], 65536);
        let bytes = json["bytes"].as_u64().unwrap();
        assert!(
            bytes > 0 && bytes.is_multiple_of(65536 * 16),
            "bytes {bytes}"
        );
        let gbps = json["gbps"].as_f64().unwrap();
        let expected = bytes as f64 / json["duration_s"].as_f64().unwrap() / 1e9;
        assert!((gbps - expected).abs() < 1e-6 * expected.max(1.0));
    }
}

#[test]
fn bad_flags_and_unreachable_targets_fail_with_a_message() {
    for args in [
        vec!["--mode=loopback", "--block_size=0"],
        vec!["--mode=loopback", "--protocol=carrier-pigeon"],
        vec!["--mode=initiator"],
        vec![
            "--mode=initiator",
            "--segment_id=127.0.0.1:1",
            "--duration=1",
        ],
        vec![
            "--mode=loopback",
            "--report_unit=furlongs",
            "--duration=0.2",
            "--buffer_size=1048576",
        ],
    ] {
        let output = Command::new(BENCH).args(&args).output().unwrap();
        assert!(!output.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("tern-bench:"), "{args:?}: {stderr}");
    }
}

#[test]
fn a_target_killed_mid_transfer_fails_tasks_loudly_and_nothing_hangs() {
    let mut target = Target::start(
        &["--local_server_name=127.0.0.1", "--buffer_size=67108864"],
        &[],
    );
    let segment = target.segment.clone();

    let engine = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(TcpTransport::default())
        .build()
        .unwrap();
    let peer = engine.open_segment(&segment).unwrap();
    let remote = engine.segment(peer).unwrap().desc.buffers[0].clone();
    let local = engine.allocate(64 << 20, "cpu:0").unwrap();
    // 1 GiB of reads: far more than can finish before the kill lands.
    let requests: Vec<_> = (0..256)
        .map(|i| {
            let offset = (i % 16) * (4 << 20);
            TransferRequest::read(
                local.addr() + offset,
                peer,
                remote.addr + offset as u64,
                4 << 20,
            )
        })
        .collect();
    let batch = engine.allocate_batch(requests.len()).unwrap();
    engine.submit(&batch, &requests).unwrap();
    target.child.kill().unwrap();
    target.child.wait().unwrap();

    let started = Instant::now();
    let status = batch.wait(Duration::from_secs(60));
    assert!(
        started.elapsed() < Duration::from_secs(40),
        "waited {:?}",
        started.elapsed()
    );
    assert_eq!(status.pending, 0, "tasks still pending: {status:?}");
    assert_eq!(status.state, BatchState::Failed, "{status:?}");
    for task in 0..status.submitted {
        match batch.task_status(task).unwrap().status {
            TransferStatus::Completed => {}
            TransferStatus::Failed(TransferError::Connection { .. }) => {}
            other => panic!("task {task} ended {other}"),
        }
    }
    // The engine stays usable: new transfers to the dead peer fail fast and loudly.
    let started = Instant::now();
    let error = engine
        .transfer_sync(TransferRequest::read(local.addr(), peer, remote.addr, 4096))
        .unwrap_err();
    assert!(error.to_string().contains("connection"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(10));
    assert!(engine.probe(peer).is_err());
}
