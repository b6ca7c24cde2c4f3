//! Starts `tern-bench --mode=target` as its own process and reads the segment name it prints.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// The target process (its stdin held open: closing it stops the target) and its segment.
pub fn start_target(args: &[&str], envs: &[(&str, &str)]) -> (Child, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tern-bench"))
        .arg("--mode=target")
        .args(args)
        .envs(envs.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let segment = line
        .trim()
        .strip_prefix("segment: ")
        .expect("the target printed its segment")
        .to_owned();
    (child, segment)
}
