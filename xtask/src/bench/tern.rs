//! Running `tern-bench --mode loopback` and reading the row its JSON line reports; the TCP
//! settings every section that runs it over TCP shares.

use std::path::Path;
use std::process::Command;

use crate::json_number;

/// Tern's buffer (and the baselines') in the TCP runs.
pub(super) const TCP_BUFFER: usize = 256 << 20;
/// TCP lanes per peer in these runs (Tern's default on this machine's core count), and so
/// the baseline's streams.
pub(super) fn tcp_lanes() -> usize {
    std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 8)
}

/// One `tern-bench --mode loopback` run; its JSON line.
pub(crate) fn tern(exe: &Path, args: &[String], env: &[(&str, String)]) -> Result<String, String> {
    let mut command = Command::new(exe);
    command.arg("--mode=loopback").arg("--json").args(args);
    for (k, v) in env {
        command.env(k, v);
    }
    let output = command.output().map_err(|e| format!("tern-bench: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    if !output.status.success() {
        return Err(format!(
            "tern-bench {args:?}: {}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(stdout.lines().last().unwrap_or_default().to_owned())
}

pub(super) fn tcp_args(op: &str, block: usize, batch: usize, duration: f64) -> Vec<String> {
    vec![
        format!("--operation={op}"),
        "--protocol=tcp".into(),
        format!("--block_size={block}"),
        format!("--batch_size={batch}"),
        "--threads=1".into(),
        format!("--duration={duration}"),
        format!("--buffer_size={TCP_BUFFER}"),
        // One request per block, as the baseline sends one message per block: the engine
        // would otherwise merge a batch's neighbouring blocks into one request.
        "--no_merge".into(),
    ]
}

/// A profile row from a tern-bench JSON line: msgs/s, p50, p99, GB/s, CPU-µs/GB.
pub(super) fn row(json: &str) -> (f64, f64, f64, f64, f64) {
    let n = |k: &str| json_number(json, k).unwrap_or(f64::NAN);
    (
        n("messages_per_s"),
        n("p50_latency_us"),
        n("p99_latency_us"),
        n("gbps"),
        n("cpu_us_per_gb"),
    )
}
