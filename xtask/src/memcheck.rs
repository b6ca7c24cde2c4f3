//! `cargo xtask memcheck`: runs the TCP transfer tests (and the engine's own) under valgrind
//! memcheck, and fails on any memory error or definite leak (exit status 99) as on any test
//! failure.
//!
//! Every test binary of `tern-transport-tcp` and `tern-engine` runs whole, one test at a
//! time: among them the conformance suite, plain and with a secret (1 B … 8 MiB both ways at
//! unaligned offsets, see [`CONFORMANCE_LARGEST`]; 256 tasks in a batch, bad and stale
//! requests, the local segment, notifications, a peer that dies) and the malformed-input
//! tests, over real loopback sockets, and the engine's cheap lifecycle tests. Left out: the
//! etcd cluster tests, which need an etcd server and spend their time in etcd-client's
//! runtime rather than in Tern's memory handling. No
//! suppressions are needed: Rust's runtime leaves only "possibly lost" (a thread handle of
//! the test harness) and "still reachable" blocks at exit, which are not errors here.
//!
//! It must not change what the tests do but for the conformance suite's largest size: it
//! builds them with cargo and runs them as they are.

use std::process::Command;
use std::time::Instant;

use crate::test_executables;

/// The packages whose test binaries run under valgrind: all of them but [`LEFT_OUT`].
const PACKAGES: [&str; 2] = ["tern-transport-tcp", "tern-engine"];

/// Test binaries (by target name) that must be there: the ones that move real bytes.
const REQUIRED: &[&str] = &["conformance", "malformed", "lifecycle"];

/// Test binaries left out, and why.
const LEFT_OUT: &[(&str, &str)] = &[(
    "etcd_cluster",
    "needs an etcd server; its time goes to etcd-client's runtime, not Tern's memory",
)];

/// The conformance suite's largest transfer under valgrind (`tern_engine::conformance::
/// LARGEST_ENV`), for 64 MiB: the suite took 230 s under valgrind with it, 35 s with 8 MiB,
/// which takes the same paths (many slices to a task, several lanes) on fewer bytes.
const CONFORMANCE_LARGEST: (&str, &str) = ("TERN_CONFORMANCE_LARGEST_BYTES", "8388608");

/// Valgrind's verdict on a memory error or a definite leak.
const VALGRIND_ERROR: i32 = 99;

/// `cargo xtask memcheck`.
pub fn command(args: &[String]) -> Result<(), String> {
    if let Some(arg) = args.first() {
        return Err(format!(
            "memcheck: unknown argument {arg:?}; usage: cargo xtask memcheck"
        ));
    }
    let started = Instant::now();
    let mut cargo_args = Vec::new();
    for package in PACKAGES {
        cargo_args.extend(["-p".to_owned(), package.to_owned()]);
    }
    let executables = test_executables(&cargo_args)?;
    let name_of = |exe: &str| -> String {
        let file = exe.rsplit('/').next().unwrap_or(exe);
        file.rsplit_once('-')
            .map_or(file, |(name, _)| name)
            .to_owned()
    };
    for required in REQUIRED {
        if !executables.iter().any(|exe| name_of(exe) == *required) {
            return Err(format!(
                "memcheck: the test binary {required} was not built"
            ));
        }
    }
    let mut runs = Vec::new();
    for exe in &executables {
        let name = name_of(exe);
        match LEFT_OUT.iter().find(|(left, _)| *left == name) {
            Some((_, why)) => eprintln!("xtask: memcheck leaves out {name}: {why}"),
            None => runs.push((name, exe.clone())),
        }
    }
    let mut results = Vec::new();
    let mut failures = Vec::new();
    for (suite, exe) in runs {
        eprintln!("xtask: valgrind memcheck: {suite}");
        let began = Instant::now();
        let status = Command::new("valgrind")
            .args([
                &format!("--error-exitcode={VALGRIND_ERROR}"),
                "--leak-check=full",
                "--errors-for-leak-kinds=definite",
                "--show-leak-kinds=definite",
                "--track-origins=no",
            ])
            .arg(&exe)
            .env(CONFORMANCE_LARGEST.0, CONFORMANCE_LARGEST.1)
            // One test at a time: valgrind runs one thread at a time anyway, and parallel
            // tests would only stretch each other's deadlines.
            .arg("--test-threads=1")
            .status()
            .map_err(|e| format!("valgrind: cannot start ({e}); cargo xtask deps installs it"))?;
        let seconds = began.elapsed().as_secs_f64();
        let outcome = match status.code() {
            Some(0) => "clean".to_owned(),
            Some(VALGRIND_ERROR) => "MEMORY ERROR OR DEFINITE LEAK".to_owned(),
            _ => format!("TEST FAILED ({status})"),
        };
        if !status.success() {
            failures.push(format!("{suite}: {outcome}"));
        }
        results.push((suite, seconds, outcome));
    }
    println!("\nvalgrind memcheck (definite leaks are errors):\n");
    println!("| test binary | seconds | result |");
    println!("|---|---|---|");
    for (suite, seconds, outcome) in &results {
        println!("| {suite} | {seconds:.0} | {outcome} |");
    }
    println!(
        "\nmemcheck took {:.0} s in all",
        started.elapsed().as_secs_f64()
    );
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!("memcheck failed: {}", failures.join(", ")))
    }
}
