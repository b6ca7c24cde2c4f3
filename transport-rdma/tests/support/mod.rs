//! What the RDMA test suites share: the device under test, engines over it, byte patterns,
//! and a child process of the test binary itself that serves as a target.
#![allow(dead_code)]

pub mod standin;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use tern_engine::{OwnedBuffer, TransferEngine, TransferEngineBuilder};
use tern_transport_rdma::{RdmaConfig, RdmaTransport};

/// Logs to stderr at `RUST_LOG`'s level (warn by default), once per process; and a
/// watchdog that ends the process if the calling test runs longer than `limit`, so a hang
/// costs minutes, not the whole guest run.
pub fn setup(test: &'static str, limit: std::time::Duration) {
    static LOGS: std::sync::Once = std::sync::Once::new();
    LOGS.call_once(|| {
        let level = match std::env::var("RUST_LOG").as_deref() {
            Ok("trace") => tracing::Level::TRACE,
            Ok("debug") => tracing::Level::DEBUG,
            Ok("info") => tracing::Level::INFO,
            _ => tracing::Level::WARN,
        };
        let _ = tracing_subscriber::fmt()
            .with_max_level(level)
            .with_writer(std::io::stderr)
            .try_init();
    });
    std::thread::spawn(move || {
        std::thread::sleep(limit);
        eprintln!("{test}: still running after {limit:?}; ending the process");
        std::process::exit(99);
    });
}

/// The Soft-RoCE device of the guest.
pub fn device() -> String {
    std::env::var("TERN_RXE").unwrap_or_else(|_| "rxe0".into())
}

/// An RDMA transport on the test device, with `tweak` applied to the environment's settings.
pub fn rdma_with(tweak: impl FnOnce(&mut RdmaConfig)) -> RdmaTransport {
    let mut config = RdmaConfig {
        devices: vec![device()],
        ..RdmaConfig::from_env()
    };
    tweak(&mut config);
    RdmaTransport::discover(config).expect("the RDMA device opens")
}

/// An engine builder on loopback with `transport` installed.
pub fn builder(transport: RdmaTransport) -> TransferEngineBuilder {
    TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(transport)
}

/// Deterministic bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| tern_engine::conformance::pattern_byte(seed, i))
        .collect()
}

/// Whether `len` bytes at `offset` of `buffer` hold `pattern(seed, len)`.
pub fn holds(buffer: &OwnedBuffer, offset: usize, seed: u64, len: usize) -> bool {
    let mut bytes = vec![0u8; len];
    buffer.read_at(offset, &mut bytes).unwrap();
    bytes == pattern(seed, len)
}

/// Environment variable that makes a test binary act as a helper process.
pub const HELPER_ENV: &str = "TERN_TEST_HELPER";

/// A helper process; killed (if still running) and reaped when dropped.
pub struct Helper {
    child: Child,
}

impl Helper {
    /// Closes its stdin (helpers stop when it closes) and waits for it.
    pub fn finish(&mut self) -> std::process::ExitStatus {
        drop(self.child.stdin.take());
        self.child.wait().unwrap()
    }

    /// Stops it (SIGSTOP); returns once every thread of it is stopped.
    pub fn stop(&self) {
        tern_testkit::process::stop(self.child.id());
    }

    /// Continues it (SIGCONT).
    pub fn resume(&self) {
        tern_testkit::process::resume(self.child.id());
    }

    /// Kills it at once (SIGKILL).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts this test binary again as a helper running `test` with `role` in
/// [`HELPER_ENV`]; returns it and the value of its first `key: value` line on stdout.
pub fn spawn_helper(test: &str, role: &str, envs: &[(&str, &str)], key: &str) -> (Helper, String) {
    let mut helper = Helper {
        child: Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                test,
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(HELPER_ENV, role)
            .envs(envs.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    };
    let mut reader = BufReader::new(helper.child.stdout.take().unwrap());
    let prefix = format!("{key}: ");
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            reader.read_line(&mut line).unwrap_or(0) > 0,
            "the helper exited before printing {key:?}"
        );
        // libtest writes "test NAME ... " without a newline before the test runs, so the
        // key may start mid-line.
        if let Some((_, value)) = line.trim_end().split_once(&prefix) {
            let value = value.to_owned();
            // Keep draining its output so it never blocks on a full pipe.
            std::thread::spawn(move || {
                let mut sink = String::new();
                while reader.read_line(&mut sink).is_ok_and(|n| n > 0) {
                    sink.clear();
                }
            });
            return (helper, value);
        }
    }
}

/// In a helper: blocks until the parent closes our stdin.
pub fn until_stdin_closes() {
    let mut sink = String::new();
    while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {
        sink.clear();
    }
}
