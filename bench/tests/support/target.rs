//! Starts `tern-bench --mode=target` (and `tern-metadata-server`) as its own process, the way
//! a script does (stdin `/dev/null`), reads the segment name it prints, and stops it with a
//! signal.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;

/// A running target. Dropping it kills the process (SIGKILL) if it still runs.
pub struct Target {
    pub child: Child,
    pub segment: String,
    stdout: BufReader<ChildStdout>,
    stderr: Option<JoinHandle<String>>,
}

impl Target {
    /// Starts a target with `args` and `envs` and waits for its `segment: <name>` line.
    pub fn start(args: &[&str], envs: &[(&str, &str)]) -> Self {
        Self::start_under(&[], args, envs)
    }

    /// As [`Target::start`], run by the command `prefix` (`ip netns exec NS`, `setpriv ..`).
    pub fn start_under(prefix: &[&str], args: &[&str], envs: &[(&str, &str)]) -> Self {
        let mut child = tern_bench(prefix)
            .arg("--mode=target")
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = drain(child.stderr.take().unwrap());
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        match line.trim().strip_prefix("segment: ") {
            Some(segment) => Self {
                child,
                segment: segment.to_owned(),
                stdout,
                stderr: Some(stderr),
            },
            None => {
                let _ = child.kill();
                let status = child.wait().unwrap();
                panic!(
                    "the target did not start ({status}): {}",
                    stderr.join().unwrap()
                );
            }
        }
    }

    /// The next line the target prints on stdout, without its newline.
    pub fn line(&mut self) -> String {
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim_end().to_owned()
    }

    /// Whether the process still runs.
    pub fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Sends `signal` (`TERM`, `INT`, …), waits for the process to exit, and returns its
    /// status and everything it wrote to stderr.
    pub fn stop(&mut self, signal: &str) -> (ExitStatus, String) {
        send_signal(self.child.id(), signal);
        let status = self.child.wait().unwrap();
        let stderr = self
            .stderr
            .take()
            .map(|thread| thread.join().unwrap())
            .unwrap_or_default();
        (status, stderr)
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `tern-bench`, run by the command `prefix` when there is one.
pub fn tern_bench(prefix: &[&str]) -> Command {
    let exe = env!("CARGO_BIN_EXE_tern-bench");
    match prefix.split_first() {
        Some((program, rest)) => {
            let mut command = Command::new(program);
            command.args(rest).arg(exe);
            command
        }
        None => Command::new(exe),
    }
}

/// `tern-bench --mode=initiator`, named `name`, against `segment` through `metadata`:
/// `operation` for `seconds`, verifying every block; its JSON report, once it succeeded.
pub fn initiator_through(
    metadata: &str,
    name: &str,
    segment: &str,
    operation: &str,
    seconds: &str,
) -> serde_json::Value {
    let output = tern_bench(&[])
        .args([
            "--mode=initiator",
            &format!("--metadata_server={metadata}"),
            &format!("--local_server_name={name}"),
            &format!("--segment_id={segment}"),
            &format!("--operation={operation}"),
            "--buffer_size=16777216",
            "--batch_size=8",
            "--threads=1",
            &format!("--duration={seconds}"),
            "--verify",
            "--json",
        ])
        .env("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "initiator: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

/// The byte `tern-bench` keeps at `offset` of its buffer.
pub fn target_byte(offset: usize) -> u8 {
    let x = (offset as u64 / 8).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (offset as u64 % 8);
    (x >> 56) as u8 ^ (offset as u8)
}

pub use tern_testkit::process::signal as send_signal;

/// Reads a pipe to its end on a thread.
pub fn drain(mut pipe: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    })
}

/// A process killed (SIGKILL) when dropped, so that a failing test leaves nothing running.
pub struct Reaped(pub Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `tern-metadata-server` on a free loopback port, stdin `/dev/null`; returns it and its
/// `host:port`.
pub fn metadata_server() -> (Reaped, String) {
    let mut server = Command::new(env!("CARGO_BIN_EXE_tern-metadata-server"))
        .args(["--bind", "127.0.0.1", "--port", "0"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("serving http://")
        .and_then(|rest| rest.strip_suffix("/metadata"))
        .unwrap_or_else(|| panic!("server did not start: {line:?}"))
        .to_owned();
    (Reaped(server), addr)
}
