//! `cargo xtask bench`: Tern beside baselines that do the same work, measured in the same run,
//! reported as ratios. By default the headline tables, in minutes (1 s runs), a progress line
//! as each section starts; `--full` runs every section (5 s runs, the emulated RDMA guest
//! included), and `--tcp-only`, `--shm-only`, `--pages-only`, `--python-only`, `--rdma-only`
//! one section each.
//!
//! - TCP on loopback, a small-message profile: 4 KiB, 16 KiB, 64 KiB and 1 MiB, read and
//!   write, batch 1 and batch 128, one initiator thread; each row beside a baseline from
//!   xtask itself ([`crate::baseline`]) — as many streams as Tern has lanes, two processes,
//!   buffers as large as Tern's, for throughput; one connection's request–reply round trip of
//!   the same block for latency. Message rate, p50/p99, GB/s and CPU-µs per GB of both
//!   processes.
//! - Same host beside memcpy and UCX ([`crate::shm`]); by default the memfd path only.
//! - KV-shaped pages (one request per 16 KiB page, in shuffled runs and fully shuffled)
//!   beside the same bytes in 1 MiB requests, on TCP and same-host.
//! - The Python rows; beside Mooncake's own module with `MOONCAKE_PY` set, or with
//!   `--python-only --mooncake` (its wheel fetched from PyPI into `target/python/`).
//! - `--full` only: the cost of a cluster secret on the 64 KiB rows; RDMA in one Soft-RoCE
//!   guest boot: the same profile beside perftest with as many QPs as Tern uses (`-q 2` for
//!   `MC_NUM_QP_PER_EP` 2, and `-q 1` beside Tern with 1), latency beside
//!   `ib_read_lat`/`ib_write_lat`, and the CPU an idle engine uses; the etcd watch latency,
//!   pre-touch, registration cost and the criterion microbenchmarks, with the engine's
//!   instruction count per request (callgrind).

mod instructions;
mod pages;
mod progress;
mod rdma;
mod registration;
mod secret;
mod table;
mod tcp;
mod tern;
mod watch;

use std::path::{Path, PathBuf};

use crate::{cargo, root, run, shm, wheel};
use instructions::instructions_per_request;
use pages::pages;
use progress::Progress;
use rdma::rdma_in_guest;
use registration::registration_cost_in_guest;
use secret::secret_cost;
use tcp::tcp_profile;
pub(crate) use tern::tern;
use watch::watch_latency;

/// The headline sections, the default run's four (`full`: the same-host table with every
/// memory path); returns the TCP profile's raw JSON lines.
fn headline(
    progress: &mut Progress,
    exe: &Path,
    python: &Result<PathBuf, String>,
    duration: f64,
    full: bool,
) -> Result<Vec<String>, String> {
    progress.section("TCP vs TCP streams and round trips");
    let raw = tcp_profile(exe, duration)?;
    progress.section("same-host vs memcpy and UCX");
    shm::bench(exe, duration, !full);
    progress.section("KV-shaped pages vs 1 MiB requests, TCP and same-host");
    pages(exe, duration)?;
    progress.section("Python beside tern-bench");
    wheel::bench(python, exe, duration, false, full);
    Ok(raw)
}

/// Seconds per run of the default bench: the headline tables in minutes.
const HEADLINE_DURATION: f64 = 1.0;

pub(crate) fn command(args: &[String]) -> Result<(), String> {
    let has = |flag: &str| args.iter().any(|a| a == flag);
    let quick = has("--quick");
    let full = has("--full");
    let duration = args
        .windows(2)
        .find(|w| w[0] == "--duration")
        .and_then(|w| w[1].parse::<f64>().ok())
        .unwrap_or(match (full, quick) {
            (false, _) => HEADLINE_DURATION,
            (true, true) => 2.0,
            (true, false) => 5.0,
        });
    let mut build = cargo();
    build.args(["build", "--release", "-p", "tern-bench"]);
    run(build, "cargo build --release -p tern-bench")?;
    let exe = root().join("target/release/tern-bench");
    if has("--rdma-only") {
        rdma_in_guest(&exe, duration);
        return Ok(());
    }
    if has("--python-only") {
        wheel::bench(
            &wheel::bench_python(),
            &exe,
            duration,
            has("--mooncake"),
            true,
        );
        return Ok(());
    }
    if has("--shm-only") {
        shm::bench(&exe, duration, !full);
        return Ok(());
    }
    if has("--pages-only") {
        return pages(&exe, duration);
    }
    if has("--tcp-only") {
        tcp_profile(&exe, duration)?;
        return Ok(());
    }
    // The wheel is built before the clock starts, as `tern-bench` is.
    let python = wheel::bench_python();
    if !full {
        let mut progress = Progress::new(4);
        headline(&mut progress, &exe, &python, duration, false)?;
        progress.finish();
        println!(
            "(`cargo xtask bench --full` adds the plain same-host path, the cluster secret's cost, \
             etcd watch latency, RDMA in the Soft-RoCE guest, pre-touch, registration cost, \
             instructions per request and the criterion benches)"
        );
        return Ok(());
    }
    let mut progress = Progress::new(11);
    let raw = headline(&mut progress, &exe, &python, duration, true)?;
    let report = root().join("target/tern-bench-results.jsonl");
    let _ = std::fs::write(&report, raw.join("\n") + "\n");
    println!("\nraw TCP results: {}", report.display());
    progress.section("the cost of a cluster secret");
    secret_cost(&exe, duration)?;
    progress.section("etcd watch latency");
    watch_latency(&exe);
    progress.section("RDMA in the Soft-RoCE guest");
    rdma_in_guest(&exe, duration);

    progress.section("parallel pre-touch vs memset");
    let mut pretouch = cargo();
    pretouch.args(["bench", "-p", "tern-bench", "--bench", "pretouch"]);
    run(pretouch, "parallel pre-touch vs memset (4 GiB)")?;
    progress.section("memory registration on Soft-RoCE");
    registration_cost_in_guest();
    progress.section("engine instructions per request (callgrind)");
    instructions_per_request();

    progress.section("criterion benches");
    let mut criterion = cargo();
    criterion.args([
        "bench",
        "-p",
        "tern-bench",
        "--bench",
        "engine",
        "--bench",
        "slices",
        "--",
    ]);
    if quick {
        criterion.args(["--warm-up-time", "1", "--measurement-time", "2"]);
    }
    let outcome = run(criterion, "criterion benches");
    progress.finish();
    outcome
}
