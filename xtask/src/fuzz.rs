//! `cargo xtask fuzz`: runs the fuzz targets of `fuzz/` (a cargo-fuzz project outside the
//! workspace) and prints executions and crashes per target.
//!
//! With the nightly toolchain and cargo-fuzz (installed here when missing) the targets run
//! under libFuzzer with AddressSanitizer; where either cannot be had, the same targets are
//! built with the default toolchain as programs that feed themselves random and mutated seed
//! inputs (`fuzz/src/stable.rs`), and the output says so. A target is one file,
//! `fuzz/fuzz_targets/<name>.rs`; its `[[bin]]` entry in `fuzz/Cargo.toml` is added here when
//! missing.
//!
//! It must not hold target logic (that is in `fuzz/`) or hide a crash: any new artifact makes
//! the command fail and names the file.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Instant;

use crate::root;

/// Seconds per target when `--seconds` is not given.
const DEFAULT_SECONDS: u64 = 60;
/// Seconds per target in `cargo xtask test`'s smoke run (`TERN_FUZZ_SMOKE_SECONDS`).
const SMOKE_SECONDS: u64 = 3;
/// libFuzzer's bound on one input: a hang is reported as a timeout artifact, not waited out.
const INPUT_TIMEOUT_SECS: u64 = 20;

/// Which harness runs the targets.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Harness {
    /// `cargo +nightly fuzz`: libFuzzer, coverage feedback, AddressSanitizer.
    LibFuzzer,
    /// The targets built by the default toolchain; the string says why.
    Stable(String),
}

/// What one target's run gave.
#[derive(Debug)]
struct Outcome {
    target: String,
    executions: Option<u64>,
    per_second: Option<u64>,
    artifacts: Vec<PathBuf>,
    /// Failed without leaving an artifact (the log says why).
    failure: Option<String>,
}

/// `cargo xtask fuzz [--seconds N] [--target NAME]... [--stable]`.
pub(crate) fn command(args: &[String]) -> Result<(), String> {
    let mut seconds = DEFAULT_SECONDS;
    let mut only = Vec::new();
    let mut force_stable = false;
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seconds" => {
                seconds = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--seconds takes a whole number of seconds")?;
            }
            "--target" => only.push(args.next().ok_or("--target takes a target name")?.clone()),
            "--stable" => force_stable = true,
            other => {
                return Err(format!(
                    "unknown fuzz argument {other:?} (usage: cargo xtask fuzz [--seconds N] [--target NAME]... [--stable])"
                ));
            }
        }
    }
    run(seconds, &only, force_stable)
}

/// The short run `cargo xtask test` makes: every target for a few seconds.
pub(crate) fn smoke() -> Result<(), String> {
    let seconds = std::env::var("TERN_FUZZ_SMOKE_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(SMOKE_SECONDS);
    let started = Instant::now();
    // The fuzz crate is outside the workspace, so the workspace's fmt check misses it.
    let mut fmt = crate::cargo();
    fmt.args(["fmt", "-p", "tern-fuzz", "--check", "--manifest-path"])
        .arg(fuzz_dir().join("Cargo.toml"));
    crate::run(fmt, "cargo fmt --check (fuzz)")?;
    let outcome = run(seconds, &[], false);
    eprintln!(
        "xtask: fuzz smoke took {:.0} s",
        started.elapsed().as_secs_f64()
    );
    outcome
}

fn fuzz_dir() -> PathBuf {
    root().join("fuzz")
}

fn run(seconds: u64, only: &[String], force_stable: bool) -> Result<(), String> {
    let started = Instant::now();
    let all = targets()?;
    for name in only {
        if !all.contains(name) {
            return Err(format!(
                "no fuzz target {name:?}; the targets are {}",
                all.join(", ")
            ));
        }
    }
    let selected: Vec<String> = if only.is_empty() {
        all.clone()
    } else {
        all.into_iter().filter(|t| only.contains(t)).collect()
    };
    ensure_bin_entries(&selected)?;

    let mut harness = if force_stable {
        Harness::Stable("--stable was given".into())
    } else {
        match libfuzzer_available() {
            Ok(()) => Harness::LibFuzzer,
            Err(reason) => Harness::Stable(reason),
        }
    };
    if harness == Harness::LibFuzzer
        && let Err(reason) = build_libfuzzer(&selected)
    {
        harness = Harness::Stable(reason);
    }
    if let Harness::Stable(reason) = &harness {
        eprintln!("xtask: fuzzing with the stable harness: {reason}");
        build_stable()?;
    }
    let built = started.elapsed();

    let logs = fuzz_dir().join("target/xtask-logs");
    std::fs::create_dir_all(&logs).map_err(|e| format!("{}: {e}", logs.display()))?;
    let mut outcomes = Vec::new();
    for target in &selected {
        eprintln!("xtask: fuzzing {target} for {seconds} s");
        let outcome = run_target(&harness, target, seconds, &logs)?;
        outcomes.push(outcome);
    }

    print_table(&harness, seconds, &outcomes);
    println!(
        "build {:.0} s, fuzzing {:.0} s, total {:.0} s; logs in {}",
        built.as_secs_f64(),
        (started.elapsed() - built).as_secs_f64(),
        started.elapsed().as_secs_f64(),
        logs.display()
    );
    let mut problems = Vec::new();
    for outcome in &outcomes {
        for artifact in &outcome.artifacts {
            problems.push(format!(
                "{} crashed: {} (reproduce: cargo +nightly fuzz run {} {})",
                outcome.target,
                artifact.display(),
                outcome.target,
                artifact.display()
            ));
        }
        if let Some(failure) = &outcome.failure {
            problems.push(format!("{} failed: {failure}", outcome.target));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("\n"))
    }
}

/// The targets: `fuzz/fuzz_targets/*.rs`, sorted.
fn targets() -> Result<Vec<String>, String> {
    let dir = fuzz_dir().join("fuzz_targets");
    let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_suffix(".rs")
                .map(str::to_owned)
        })
        .collect();
    names.sort();
    if names.is_empty() {
        return Err(format!("no fuzz targets in {}", dir.display()));
    }
    Ok(names)
}

/// Appends the `[[bin]]` entry of every target that lacks one (what `cargo fuzz add` writes),
/// so that a new target is one new file.
fn ensure_bin_entries(targets: &[String]) -> Result<(), String> {
    let path = fuzz_dir().join("Cargo.toml");
    let mut manifest =
        std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut added = Vec::new();
    for target in targets {
        if !manifest.contains(&format!("name = \"{target}\"")) {
            manifest.push_str(&format!(
                "\n[[bin]]\nname = \"{target}\"\npath = \"fuzz_targets/{target}.rs\"\ntest = false\ndoc = false\nbench = false\n"
            ));
            added.push(target.as_str());
        }
    }
    if !added.is_empty() {
        std::fs::write(&path, manifest).map_err(|e| format!("{}: {e}", path.display()))?;
        eprintln!(
            "xtask: added the [[bin]] entries of {} to fuzz/Cargo.toml; commit them",
            added.join(", ")
        );
    }
    Ok(())
}

/// `cargo +nightly ...` through rustup, whatever toolchain runs this xtask.
fn nightly_cargo() -> Command {
    let mut command = Command::new("cargo");
    command
        .arg("+nightly")
        .current_dir(root())
        .env("RUSTUP_TOOLCHAIN", "nightly")
        .env_remove("CARGO")
        .env_remove("RUSTC")
        .env_remove("RUSTDOC");
    command
}

fn succeeds(mut command: Command) -> bool {
    command
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `Ok` when `cargo +nightly fuzz` works, installing cargo-fuzz if needed; else why not.
fn libfuzzer_available() -> Result<(), String> {
    let mut version = nightly_cargo();
    version.arg("--version");
    if !succeeds(version) {
        return Err("no nightly toolchain (rustup toolchain install nightly)".into());
    }
    let fuzz_version = || {
        let mut command = nightly_cargo();
        command.args(["fuzz", "--version"]);
        succeeds(command)
    };
    if fuzz_version() {
        return Ok(());
    }
    eprintln!("xtask: cargo-fuzz is missing; installing it (cargo install cargo-fuzz --locked)");
    let mut install = crate::cargo();
    install.args(["install", "cargo-fuzz", "--locked"]);
    match install.status() {
        Ok(status) if status.success() && fuzz_version() => Ok(()),
        Ok(status) => Err(format!("cargo install cargo-fuzz failed ({status})")),
        Err(e) => Err(format!("cargo install cargo-fuzz could not start: {e}")),
    }
}

/// Builds the selected targets once with cargo-fuzz's defaults (release, debug assertions,
/// AddressSanitizer); each `cargo fuzz run` then finds them built.
fn build_libfuzzer(targets: &[String]) -> Result<(), String> {
    let mut build = nightly_cargo();
    build.args(["fuzz", "build"]);
    if let [one] = targets {
        build.arg(one);
    }
    eprintln!("xtask: cargo +nightly fuzz build");
    match build.status() {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(format!("cargo +nightly fuzz build failed ({status})")),
        Err(e) => Err(format!("cargo +nightly fuzz build could not start: {e}")),
    }
}

fn build_stable() -> Result<(), String> {
    let mut build = crate::cargo();
    build.args(["build", "--release", "--bins", "--manifest-path"]);
    build.arg(fuzz_dir().join("Cargo.toml"));
    crate::run(
        build,
        "cargo build --release --bins --manifest-path fuzz/Cargo.toml",
    )
}

/// The files of a target's artifacts directory.
fn artifacts(target: &str) -> BTreeSet<PathBuf> {
    let dir = fuzz_dir().join("artifacts").join(target);
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default()
}

fn run_target(
    harness: &Harness,
    target: &str,
    seconds: u64,
    logs: &Path,
) -> Result<Outcome, String> {
    let before = artifacts(target);
    let mut command = match harness {
        Harness::LibFuzzer => {
            let mut command = nightly_cargo();
            command.args(["fuzz", "run", target, "--"]).args([
                format!("-max_total_time={seconds}"),
                "-print_final_stats=1".to_owned(),
                format!("-timeout={INPUT_TIMEOUT_SECS}"),
            ]);
            command
        }
        Harness::Stable(_) => {
            let mut command = Command::new(fuzz_dir().join("target/release").join(target));
            command.args(["--seconds", &seconds.to_string()]);
            command
        }
    };
    let started = Instant::now();
    let output: Output = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{target}: cannot start: {e}"))?;
    let took = started.elapsed();
    let log = logs.join(format!("{target}.log"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    std::fs::write(&log, &text).map_err(|e| format!("{}: {e}", log.display()))?;
    let stat = |key: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(key))
            .and_then(|rest| rest.trim().parse::<u64>().ok())
    };
    let new: Vec<PathBuf> = artifacts(target).difference(&before).cloned().collect();
    let failure = (!output.status.success() && new.is_empty()).then(|| {
        let tail: Vec<&str> = text.lines().rev().take(15).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        format!(
            "{} after {:.0} s without an artifact; see {}:\n{}",
            output.status,
            took.as_secs_f64(),
            log.display(),
            tail.join("\n")
        )
    });
    if !new.is_empty() {
        eprintln!(
            "xtask: {target} crashed; the end of its log ({}):",
            log.display()
        );
        for line in text.lines().rev().take(30).collect::<Vec<_>>().iter().rev() {
            eprintln!("  {line}");
        }
    }
    Ok(Outcome {
        target: target.to_owned(),
        executions: stat("stat::number_of_executed_units:"),
        per_second: stat("stat::average_exec_per_sec:"),
        artifacts: new,
        failure,
    })
}

fn print_table(harness: &Harness, seconds: u64, outcomes: &[Outcome]) {
    let harness = match harness {
        Harness::LibFuzzer => {
            "libFuzzer (cargo +nightly fuzz, AddressSanitizer, coverage feedback)".to_owned()
        }
        Harness::Stable(reason) => format!(
            "stable harness (random and mutated seed inputs, no coverage feedback, no sanitizer): {reason}"
        ),
    };
    let number = |n: Option<u64>| n.map_or_else(|| "?".to_owned(), |n| n.to_string());
    println!("\nFuzzing, {seconds} s per target, harness: {harness}\n");
    println!("| target | executions | executions/s | crashes |");
    println!("|---|---|---|---|");
    for outcome in outcomes {
        let crashes = if outcome.artifacts.is_empty() {
            if outcome.failure.is_some() {
                "failed".to_owned()
            } else {
                "0".to_owned()
            }
        } else {
            let names: Vec<String> = outcome
                .artifacts
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            format!("{} ({})", outcome.artifacts.len(), names.join(", "))
        };
        println!(
            "| {} | {} | {} | {crashes} |",
            outcome.target,
            number(outcome.executions),
            number(outcome.per_second)
        );
    }
    println!();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_target_file_is_a_target() {
        let targets = targets().unwrap();
        for expected in ["tcp_frames", "rpc_frame", "handshake", "segment_desc"] {
            assert!(targets.iter().any(|t| t == expected), "{targets:?}");
        }
        assert!(targets.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn arguments_are_checked() {
        assert!(command(&["--seconds".into(), "x".into()]).is_err());
        assert!(command(&["--bogus".into()]).is_err());
        let err = command(&["--target".into(), "no_such_target".into()]).unwrap_err();
        assert!(err.contains("tcp_frames"), "{err}");
    }
}
