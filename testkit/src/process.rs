//! Signals for tests that stop and continue a peer process. A signal is delivered after
//! `kill(2)` returns, not by then: a stopped group stops only once one of its threads has
//! run to take the signal and the others have followed (milliseconds on a loaded machine,
//! time enough for a peer to serve a whole transfer). [`stop`] returns once every thread is
//! stopped, so a test that stops a peer knows the peer serves nothing after it.

use std::process::Command;
use std::time::{Duration, Instant};

/// Sends `signal` (`STOP`, `CONT`, `TERM`, …) to process `pid` with kill(1) (the tests, like
/// the libraries below them, hold no `unsafe`).
pub fn signal(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .args(["-s", signal, &pid.to_string()])
        .status()
        .expect("kill(1) runs");
    assert!(status.success(), "kill -s {signal} {pid}: {status}");
}

/// Stops process `pid` (SIGSTOP) and returns once every one of its threads is stopped.
pub fn stop(pid: u32) {
    signal(pid, "STOP");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !all_threads_stopped(pid) {
        assert!(
            Instant::now() < deadline,
            "process {pid} did not stop in 60 s"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Continues process `pid` (SIGCONT).
pub fn resume(pid: u32) {
    signal(pid, "CONT");
}

/// Whether every thread of `pid` is stopped (state `T`, or `t` under a tracer), per
/// proc(5)'s `/proc/PID/task/TID/stat`, whose state follows the parenthesised command name.
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let states: Vec<String> = tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("stat")).ok())
        .collect();
    !states.is_empty()
        && states.iter().all(|stat| {
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
        })
}
