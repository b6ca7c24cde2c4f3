//! `tern-bench --protocol rdma` as a user runs it, on Soft-RoCE: loopback mode, and a target
//! and an initiator as two processes with `--device_name`. Ignored on hosts without RDMA
//! (where `--protocol rdma` must fail with a clear error instead); `cargo xtask test` runs
//! them in the Soft-RoCE guest.

#[path = "support/target.rs"]
mod support;

use std::process::Command;

use support::Target;

const BENCH: &str = env!("CARGO_BIN_EXE_tern-bench");

fn device() -> String {
    std::env::var("TERN_RXE").unwrap_or_else(|_| "rxe0".into())
}

fn json_of(output: &std::process::Output) -> serde_json::Value {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"))
}

/// `tern-bench --mode=<mode> --protocol=rdma` on the test device with `args`, one thread for
/// 2 s over an 8 MiB buffer, verifying every block: its JSON report, once it succeeded.
fn verified_rdma_run(mode: &str, args: &[&str]) -> serde_json::Value {
    let output = Command::new(BENCH)
        .args([
            &format!("--mode={mode}"),
            "--protocol=rdma",
            &format!("--device_name={}", device()),
        ])
        .args(args)
        .args([
            "--threads=1",
            "--duration=2",
            "--buffer_size=8388608",
            "--verify",
            "--json",
        ])
        .output()
        .unwrap();
    json_of(&output)
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-bench --test rdma"]
fn rdma_loopback_moves_verified_bytes() {
    for operation in ["read", "write"] {
        let json = verified_rdma_run(
            "loopback",
            &[
                &format!("--operation={operation}"),
                "--block_size=65536",
                "--batch_size=16",
            ],
        );
        assert_eq!(json["protocol"], "rdma");
        assert!(json["bytes"].as_u64().unwrap() > 0, "{operation}: {json}");
    }
}

/// The guest has 2 GiB: the default 1 GiB buffers, one per side, do not fit, and loopback
/// says which flag to lower instead of being killed by the kernel.
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-bench --test rdma"]
fn loopback_with_buffers_larger_than_memory_names_the_flag_to_lower() {
    let output = Command::new(BENCH)
        .args([
            "--mode=loopback",
            "--protocol=rdma",
            &format!("--device_name={}", device()),
            "--duration=1",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("lower --buffer_size"), "{stderr}");
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-bench --test rdma"]
fn rdma_target_and_initiator_as_two_processes() {
    let device = format!("--device_name={}", device());
    let mut target = Target::start(
        &[
            "--protocol=rdma",
            &device,
            "--local_server_name=127.0.0.1",
            "--buffer_size=8388608",
        ],
        &[],
    );
    let json = verified_rdma_run(
        "initiator",
        &[
            "--local_server_name=127.0.0.1",
            &format!("--segment_id={}", target.segment),
            "--operation=write",
            "--block_size=1048576",
            "--batch_size=4",
        ],
    );
    assert!(json["bytes"].as_u64().unwrap() > 0, "{json}");
    let (status, said) = target.stop("TERM");
    assert!(status.success(), "{status}: {said}");
}

#[test]
fn rdma_without_devices_says_what_it_looked_for() {
    if std::env::var_os("TERN_IN_GUEST").is_some() {
        return;
    }
    let output = Command::new(BENCH)
        .args(["--mode=loopback", "--protocol=rdma", "--duration=1"])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("no usable RDMA device") && stderr.contains("looked for"),
        "{stderr}"
    );
}
