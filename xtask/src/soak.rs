//! `cargo xtask soak --minutes N [--processes K] [--rdma] [--release]`: runs `tern-soak`
//! (random reads and writes of random sizes among K processes on 127.0.0.1, every byte
//! verified) over TCP on the host, or over RDMA on `rxe0` inside the Soft-RoCE guest, prints
//! a summary table per process (transfers, bytes, errors, and RSS, open file descriptors,
//! threads and queue pairs after the warm-up and at the end) and fails when any process saw
//! an error or grew. The limits are `tern-soak`'s; this file only reads its verdict.
//!
//! It must not hold soak logic itself: it builds and runs the binary and reports.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Group, cargo, deps, guest_env, json_number, root, run, softroce};

struct Options {
    minutes: f64,
    processes: usize,
    rdma: bool,
    release: bool,
}

fn parse(args: &[String]) -> Result<Options, String> {
    let mut options = Options {
        minutes: 1.0,
        processes: 3,
        rdma: false,
        release: false,
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--minutes" => {
                options.minutes = args
                    .next()
                    .and_then(|v| v.parse::<f64>().ok())
                    .filter(|m| m.is_finite() && *m > 0.0)
                    .ok_or("--minutes takes a positive number")?;
            }
            "--processes" => {
                options.processes = args
                    .next()
                    .and_then(|v| v.parse::<usize>().ok())
                    .filter(|k| (2..=4).contains(k))
                    .ok_or("--processes takes 2, 3 or 4")?;
            }
            "--rdma" => options.rdma = true,
            "--release" => options.release = true,
            other => {
                return Err(format!(
                    "soak: unknown argument {other:?}; usage: cargo xtask soak --minutes N [--processes K] [--rdma] [--release]"
                ));
            }
        }
    }
    Ok(options)
}

/// `cargo xtask soak ...`.
pub fn command(args: &[String]) -> Result<(), String> {
    let options = parse(args)?;
    let mut build = cargo();
    build.args(["build", "-p", "tern-bench", "--bin", "tern-soak"]);
    if options.release {
        build.arg("--release");
    }
    run(build, "cargo build -p tern-bench --bin tern-soak")?;
    let exe = root()
        .join("target")
        .join(if options.release { "release" } else { "debug" })
        .join("tern-soak");
    let seconds = options.minutes * 60.0;
    let mut soak_args = vec![
        format!("--processes={}", options.processes),
        format!("--seconds={seconds}"),
    ];
    let started = Instant::now();
    let (success, output) = if options.rdma {
        deps(&[Group::Guest])?;
        soak_args.extend([
            "--protocol=rdma".to_owned(),
            "--device_name=rxe0".to_owned(),
        ]);
        let command = format!("'{}' {}", exe.display(), soak_args.join(" "));
        eprintln!("xtask: tern-soak over RDMA in the Soft-RoCE guest for {seconds} s");
        let (status, output) = softroce::run(
            &root(),
            &softroce::GuestRun {
                command: &command,
                forward_env: guest_env(),
                // Boot, engine start-up and shutdown under emulation, on top of the run.
                timeout: Duration::from_secs_f64(seconds * 2.0 + 900.0),
                capture: true,
            },
        )?;
        (status == 0, output)
    } else {
        eprintln!("xtask: tern-soak over TCP on 127.0.0.1 for {seconds} s");
        let output = Command::new(&exe)
            .args(&soak_args)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| format!("{}: {e}", exe.display()))?;
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
        )
    };
    let lines: Vec<&str> = output
        .lines()
        .filter_map(|l| l.trim_end_matches('\r').strip_prefix("SOAK "))
        .collect();
    summarize(&lines, options.rdma, started.elapsed());
    let report = root().join(format!(
        "target/tern-soak-{}.jsonl",
        if options.rdma { "rdma" } else { "tcp" }
    ));
    if std::fs::write(&report, lines.join("\n") + "\n").is_ok() {
        println!("raw results: {}", report.display());
    }
    let failed: Vec<&str> = lines
        .iter()
        .filter(|l| json_string(l, "verdict").as_deref() != Some("ok"))
        .copied()
        .collect();
    if !success || lines.len() != options.processes || !failed.is_empty() {
        return Err(format!(
            "the soak failed: {} of {} processes reported, {} not ok{}",
            lines.len(),
            options.processes,
            failed.len(),
            if success {
                ""
            } else {
                " (tern-soak exited with an error)"
            }
        ));
    }
    Ok(())
}

/// Prints the table of per-process figures.
fn summarize(lines: &[&str], rdma: bool, took: Duration) {
    let number = |line: &str, key: &str| json_number(line, key).unwrap_or(f64::NAN);
    let mib = |line: &str, key: &str| number(line, key) / 1024.0;
    let seconds = lines.first().map_or(f64::NAN, |l| number(l, "seconds"));
    let warmup = lines
        .first()
        .map_or(f64::NAN, |l| number(l, "warmup_seconds"));
    println!(
        "\nSoak over {} ({} processes, {seconds:.0} s each, samples after {warmup:.0} s of warm-up and at the end; {:.0} s in all):\n",
        if rdma {
            "RDMA (rxe0, Soft-RoCE guest)"
        } else {
            "TCP (127.0.0.1)"
        },
        lines.len(),
        took.as_secs_f64()
    );
    println!(
        "| process | transfers | GB moved | errors | RSS MiB start → end | fds | threads | QPs | QPs after close | verdict |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let pair = |line: &str, key: &str| {
        format!(
            "{} → {}",
            number(line, &format!("{key}_start")),
            number(line, &format!("{key}_end"))
        )
    };
    let (mut transfers, mut bytes, mut errors) = (0.0, 0.0, 0.0);
    for line in lines {
        transfers += number(line, "transfers");
        bytes += number(line, "bytes");
        errors += number(line, "errors");
        println!(
            "| {} | {} | {:.2} | {} | {:.1} → {:.1} | {} | {} | {} | {} | {} |",
            number(line, "process"),
            number(line, "transfers"),
            number(line, "bytes") / 1e9,
            number(line, "errors"),
            mib(line, "rss_kib_start"),
            mib(line, "rss_kib_end"),
            pair(line, "fds"),
            pair(line, "threads"),
            pair(line, "qps"),
            number(line, "qps_closed"),
            json_string(line, "verdict").unwrap_or_else(|| "missing".into()),
        );
    }
    println!(
        "| all | {transfers} | {:.2} | {errors} | | | | | | |",
        bytes / 1e9
    );
    if seconds.is_finite() && seconds > 0.0 {
        println!(
            "\n{:.0} transfers/s, {:.1} MB/s verified over all processes",
            transfers / seconds,
            bytes / seconds / 1e6
        );
    }
}

/// The string value of `key` in a flat JSON object (no escapes inside: tern-soak's verdicts
/// have none).
fn json_string(json: &str, key: &str) -> Option<String> {
    let at = json.find(&format!("\"{key}\":\""))? + key.len() + 4;
    let rest = &json[at..];
    Some(rest[..rest.find('"')?].to_owned())
}
