//! What registering memory costs on Soft-RoCE, measured in the guest.

use std::time::Duration;

use crate::{Group, cargo, deps, root, run, softroce};

/// Registration cost per MiB on Soft-RoCE, measured in the guest; reported, never fatal.
pub(super) fn registration_cost_in_guest() {
    let mut build = cargo();
    build.args([
        "build",
        "--release",
        "-p",
        "tern-verbs",
        "--example",
        "registration_cost",
    ]);
    if run(build, "building registration_cost").is_err() {
        return;
    }
    if deps(&[Group::Guest]).is_err() {
        eprintln!("xtask: no Soft-RoCE guest here; registration cost not measured");
        return;
    }
    let exe = root().join("target/release/examples/registration_cost");
    let command = exe.display().to_string();
    println!("\nMemory registration on Soft-RoCE (in the guest):\n");
    let outcome = softroce::run(
        &root(),
        &softroce::GuestRun {
            command: &command,
            forward_env: Vec::new(),
            timeout: Duration::from_secs(900),
            capture: false,
        },
    );
    if !matches!(outcome, Ok((0, _))) {
        eprintln!("xtask: registration cost run failed: {outcome:?}");
    }
}
