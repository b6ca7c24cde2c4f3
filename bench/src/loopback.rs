//! `--mode loopback`: a target process of this binary on 127.0.0.1, this process its
//! initiator, and the target's complaints shown when it fails.

use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};

use crate::flags::{Args, value_name};
use crate::initiator::run_initiator;
use crate::report::report;

/// Starts a target process of this binary, runs the initiator against it and reports; a
/// target that failed is reported with what it printed.
pub(crate) fn run_loopback(args: &Args) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // The target stops when its stdin closes: when this process is done with it, or dies.
    let mut child = Command::new(exe)
        .args([
            "--mode=target",
            "--stop_on_stdin_eof",
            "--local_server_name=127.0.0.1",
            &format!("--metadata_server={}", args.metadata_server),
            &format!("--protocol={}", args.protocol),
            &format!("--buffer_size={}", args.buffer_size),
            &format!("--shm_memory={}", value_name(args.shm_memory)),
            &format!("--shm_ptrace={}", value_name(args.shm_ptrace)),
        ])
        .args(
            args.device_name
                .iter()
                .map(|d| format!("--device_name={d}")),
        )
        // Through the environment, not argv, so that `ps` does not show it.
        .envs(
            args.cluster_secret
                .iter()
                .map(|s| ("TERN_CLUSTER_SECRET", s.as_str())),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting the target process: {e}"))?;
    // Drained on a thread so that the target never blocks on a full pipe; shown if it fails.
    let stderr = child.stderr.take().map(|mut pipe| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    });
    let mut first_line = String::new();
    if let Some(stdout) = child.stdout.take() {
        BufReader::new(stdout)
            .read_line(&mut first_line)
            .map_err(|e| e.to_string())?;
    }
    let result = first_line.trim().strip_prefix("segment: ").map(|segment| {
        let mut initiator = args.clone();
        initiator.local_server_name = Some("127.0.0.1".into());
        run_initiator(&initiator, segment, Some(child.id()))
    });
    drop(child.stdin.take());
    let status = child
        .wait()
        .map_err(|e| format!("waiting for the target: {e}"))?;
    let target_said = || {
        let text = stderr
            .and_then(|thread| thread.join().ok())
            .unwrap_or_default();
        let lines: Vec<&str> = text
            .lines()
            .map(|line| line.strip_prefix("tern-bench: ").unwrap_or(line))
            .filter(|line| !line.starts_with("tern-bench target: "))
            .collect();
        if lines.is_empty() {
            String::from("(it printed nothing)")
        } else {
            lines.join("\n")
        }
    };
    match result {
        None => Err(format!(
            "the target process did not start ({status}): {}",
            target_said()
        )),
        Some(result) if !status.success() => Err(format!(
            "{}the target process failed ({status}): {}",
            result.err().map(|e| e + "; ").unwrap_or_default(),
            target_said()
        )),
        Some(result) => report(args, &result?),
    }
}
