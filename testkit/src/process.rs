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

/// This test binary run again as a child process, to serve one test (named `test`, run with
/// `env_var` set, which that test checks so a run of the whole suite passes it by): its
/// stdout comes line by line through a channel (a child that hangs fails the test, it does
/// not hang it), its stdin takes commands, and it is killed and reaped when dropped.
pub struct SelfChild {
    child: std::process::Child,
    to_child: Option<std::process::ChildStdin>,
    lines: std::sync::mpsc::Receiver<String>,
}

impl SelfChild {
    /// Starts the child.
    pub fn start(test: &str, env_var: &str) -> Self {
        Self::start_with(test, env_var, &[])
    }

    /// Starts the child with `env` set in its environment besides `env_var`.
    pub fn start_with(test: &str, env_var: &str, env: &[(&str, &str)]) -> Self {
        use std::io::BufRead;
        let mut child = Command::new(std::env::current_exe().expect("the test binary"))
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(env_var, "1")
            .envs(env.iter().copied())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("the test binary starts as a child");
        let from_child = std::io::BufReader::new(child.stdout.take().expect("piped stdout"));
        let to_child = child.stdin.take();
        let (line_tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in from_child.lines().map_while(Result::ok) {
                if line_tx.send(line.trim().to_owned()).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            to_child,
            lines,
        }
    }

    /// Its process ID.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The next line it prints that starts with `prefix`, without the prefix (panics after
    /// 120 s of silence, or when it exited).
    pub fn next(&self, prefix: &str) -> String {
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(120))
                .expect("the child said nothing in 120 s, or exited");
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.to_owned();
            }
        }
    }

    /// Sends `command` as a line.
    pub fn send(&mut self, command: &str) {
        use std::io::Write;
        let to_child = self.to_child.as_mut().expect("the child's stdin is open");
        writeln!(to_child, "{command}").expect("the child reads its stdin");
    }

    /// Sends `command` and returns the next line starting with `answer`, without it.
    pub fn ask(&mut self, command: &str, answer: &str) -> String {
        self.send(command);
        self.next(answer)
    }

    /// Closes its stdin (a child serving until then ends).
    pub fn close_stdin(&mut self) {
        self.to_child.take();
    }
}

impl Drop for SelfChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
