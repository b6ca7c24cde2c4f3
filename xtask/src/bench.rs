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

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::{
    Group, ROUNDS, baseline, cargo, deps, json_number, median, median_by, root, run, shm, softroce,
    start_etcd, wheel,
};

/// Block sizes of the profile.
const SIZES: [usize; 4] = [4 << 10, 16 << 10, 64 << 10, 1 << 20];
/// Tern's buffer (and the baselines') in the TCP runs.
const TCP_BUFFER: usize = 256 << 20;
/// TCP lanes per peer in these runs (Tern's default on this machine's core count), and so
/// the baseline's streams.
fn tcp_lanes() -> usize {
    std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .clamp(2, 8)
}

/// One `tern-bench --mode loopback` run; its JSON line.
fn tern(exe: &Path, args: &[String], env: &[(&str, String)]) -> Result<String, String> {
    let mut command = Command::new(exe);
    command.arg("--mode=loopback").arg("--json").args(args);
    for (k, v) in env {
        command.env(k, v);
    }
    let output = command.output().map_err(|e| format!("tern-bench: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    if !output.status.success() {
        return Err(format!(
            "tern-bench {args:?}: {}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(stdout.lines().last().unwrap_or_default().to_owned())
}

fn tcp_args(op: &str, block: usize, batch: usize, duration: f64) -> Vec<String> {
    vec![
        format!("--operation={op}"),
        "--protocol=tcp".into(),
        format!("--block_size={block}"),
        format!("--batch_size={batch}"),
        "--threads=1".into(),
        format!("--duration={duration}"),
        format!("--buffer_size={TCP_BUFFER}"),
    ]
}

fn kib(block: usize) -> String {
    if block >= 1 << 20 {
        format!("{} MiB", block >> 20)
    } else {
        format!("{} KiB", block >> 10)
    }
}

fn ratio_mark(ratio: f64, goal: Option<f64>, higher_is_better: bool) -> String {
    match goal {
        None => format!("{ratio:.2}"),
        Some(goal) => {
            let met = if higher_is_better {
                ratio >= goal
            } else {
                ratio <= goal
            };
            format!(
                "{ratio:.2} ({} {goal} {})",
                if higher_is_better { ">=" } else { "<=" },
                if met { "met" } else { "MISSED" }
            )
        }
    }
}

/// A profile row from a tern-bench JSON line: msgs/s, p50, p99, GB/s, CPU-µs/GB.
fn row(json: &str) -> (f64, f64, f64, f64, f64) {
    let n = |k: &str| json_number(json, k).unwrap_or(f64::NAN);
    (
        n("messages_per_s"),
        n("p50_latency_us"),
        n("p99_latency_us"),
        n("gbps"),
        n("cpu_us_per_gb"),
    )
}

/// The TCP profile; returns the raw JSON lines.
fn tcp_profile(exe: &Path, duration: f64) -> Result<Vec<String>, String> {
    let lanes = tcp_lanes();
    let lanes_env = [("MC_TCP_LANES_PER_PEER", lanes.to_string())];
    println!(
        "\nTCP on loopback, one initiator thread, {lanes} lanes, {} MiB buffers, {duration} s per run. \
         Throughput baseline: {lanes} TCP streams between two processes, the same block size and buffers; \
         latency baseline: one connection's request-reply round trip of the same block, two processes. \
         At batch 128 Tern and the streams take turns, {ROUNDS} rounds each, and each shows its median round.\n",
        TCP_BUFFER >> 20
    );
    println!(
        "| op | block | batch | msgs/s | p50 us | p99 us | GB/s | CPU us/GB | baseline | ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut raw = Vec::new();
    for block in SIZES {
        for op in ["read", "write"] {
            let (p50_base, p99_base) =
                baseline::round_trip(op == "read", TCP_BUFFER, block, duration.min(2.0))?;
            let json = tern(exe, &tcp_args(op, block, 1, duration), &lanes_env)?;
            let (rate, p50, p99, gbps, cpu) = row(&json);
            println!(
                "| {op} | {} | 1 | {rate:.0} | {p50:.1} | {p99:.1} | {gbps:.2} | {cpu:.0} | RTT p50 {p50_base:.1} us, p99 {p99_base:.1} us | {} |",
                kib(block),
                ratio_mark(p50 / p50_base, None, false),
            );
            raw.push(json);
            // Throughput: the streams and Tern take turns, and each shows its median round.
            let round = (duration / ROUNDS as f64).max(1.0);
            let mut streams = Vec::new();
            let mut terns = Vec::new();
            for _ in 0..ROUNDS {
                streams.push(baseline::stream(lanes, TCP_BUFFER, block, round)?);
                let json = tern(exe, &tcp_args(op, block, 128, round), &lanes_env)?;
                terns.push((row(&json), json));
            }
            let (Some(stream), Some(((rate, p50, p99, gbps, cpu), json))) =
                (median_by(streams, |s| s.gbps), median_by(terns, |t| t.0.3))
            else {
                return Err("no throughput rounds".into());
            };
            let goal = match block {
                b if b >= 1 << 20 => Some(1.0),
                b if b >= 64 << 10 => Some(0.9),
                _ => None,
            };
            println!(
                "| {op} | {} | 128 | {rate:.0} | {p50:.1} | {p99:.1} | {gbps:.2} | {cpu:.0} | {lanes} streams {:.2} GB/s, {:.0} CPU us/GB | {} |",
                kib(block),
                stream.gbps,
                stream.cpu_us_per_gb,
                ratio_mark(gbps / stream.gbps, goal, true),
            );
            raw.push(json);
        }
    }
    Ok(raw)
}

/// The 64 KiB TCP rows with and without a cluster secret, alternating, three times each.
fn secret_cost(exe: &Path, duration: f64) -> Result<(), String> {
    let lanes_env = [("MC_TCP_LANES_PER_PEER", tcp_lanes().to_string())];
    println!("\nThe cost of a cluster secret (64 KiB, batch 128, TCP, alternating runs):\n");
    for op in ["read", "write"] {
        let mut plain = Vec::new();
        let mut secured = Vec::new();
        for _ in 0..3 {
            let args = tcp_args(op, 64 << 10, 128, duration.min(3.0));
            plain.push(row(&tern(exe, &args, &lanes_env)?).3);
            let mut with = args.clone();
            with.push("--cluster_secret=bench-secret".into());
            secured.push(row(&tern(exe, &with, &lanes_env)?).3);
        }
        let show = |v: &[f64]| {
            v.iter()
                .map(|g| format!("{g:.2}"))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        println!(
            "{op}: without {} GB/s, with {} GB/s (means {:.2} and {:.2}: ratio {:.2})",
            show(&plain),
            show(&secured),
            mean(&plain),
            mean(&secured),
            mean(&secured) / mean(&plain)
        );
    }
    Ok(())
}

fn watch_latency(exe: &Path) {
    let etcd = match start_etcd(None) {
        Ok(etcd) => etcd,
        Err(e) => return eprintln!("xtask: skipping the etcd watch latency: {e}"),
    };
    let output = Command::new(exe)
        .args([
            "--mode=watch-latency",
            &format!("--metadata_server=etcd://{}", etcd.endpoint),
        ])
        .env("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        .output();
    let Ok(output) = output else {
        return eprintln!("xtask: watch latency could not start");
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    match json_number(&stdout, "median_ms") {
        Some(median) => println!(
            "\nA descriptor change reaches a watching node (etcd on loopback, 20 changes): median {median:.1} ms, p90 {:.1} ms, max {:.1} ms (goal: median < 100 ms)",
            json_number(&stdout, "p90_ms").unwrap_or(f64::NAN),
            json_number(&stdout, "max_ms").unwrap_or(f64::NAN)
        ),
        None => eprintln!(
            "xtask: watch latency failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ),
    }
}

/// The waiter's spin budget in the guest: the engine's native default (200 µs) times the
/// 10–50× the emulation stretches everything by, so that at batch 1 a wait still ends while
/// spinning, as it does on a host, instead of paying a wake-up that a host would not.
const GUEST_WAIT_SPIN_US: u32 = 4000;

/// The guest script of the RDMA profile: one `TERN`, `PERF` or `LAT` line per measurement.
fn rdma_script(exe: &Path, secs: f64) -> String {
    let sizes = SIZES.map(|s| s.to_string()).join(" ");
    format!(
        r#"B='{exe}'
TIMEFORMAT='%U %S'
# $4: QPs per endpoint. The waiter's spin budget is scaled as the emulation stretches time
# (20x the native default), so that it covers a short transfer in the guest as it does on a host.
tern() {{ echo "TERN $1 $2 $3 $4 $(MC_NUM_QP_PER_EP=$4 TERN_WAIT_SPIN_US={GUEST_WAIT_SPIN_US} $B --mode=loopback --protocol=rdma --device_name=rxe0 --operation=$1 --block_size=$2 --batch_size=$3 --threads=1 --duration={secs} --buffer_size=67108864 --json $5 2>/dev/null | tail -1)"; }}
# perftest with the same QPs; CPU of both sides from bash's time.
perf() {{ {{ time $1 -d rxe0 -s $2 -q $3 -D {secs} -F >/dev/null 2>&1 ; }} 2>/tmp/srv.cpu & sleep 2
  out=$({{ time $1 -d rxe0 -s $2 -q $3 -D {secs} -F 10.77.0.1 2>&1 ; }} 2>/tmp/cli.cpu); wait
  echo "PERF $1 $2 $3 $(echo "$out" | awk -v s=$2 '$1 == s {{print $4}}') $(cat /tmp/srv.cpu /tmp/cli.cpu | awk '{{c += $1 + $2}} END {{print c}}')"; }}
lat() {{ $1 -d rxe0 -s $2 -n 1000 -F >/dev/null 2>&1 & sleep 2; echo "LAT $1 $2 $($1 -d rxe0 -s $2 -n 1000 -F 10.77.0.1 2>&1 | awk -v s=$2 '$1 == s {{print $5, $8}}')"; wait; }}
for size in {sizes}; do
  for op in write read; do
    # Latency: Tern and perftest take turns, {ROUNDS} rounds; each shows its median.
    for round in $(seq {ROUNDS}); do tern $op $size 1 2; lat ib_${{op}}_lat $size; done
    # Throughput: the same turns, so a disturbance in the guest lands on both.
    for round in $(seq {ROUNDS}); do tern $op $size 128 2; perf ib_${{op}}_bw $size 2; done
  done
done
for size in 65536 1048576; do
  for op in write read; do
    tern $op $size 128 1
    perf ib_${{op}}_bw $size 1
  done
done
tern write 65536 1 2 --idle_seconds=10
"#,
        exe = exe.display()
    )
}

/// A Tern run in the guest: (operation, block, batch, QPs per endpoint).
type TernKey = (String, usize, usize, usize);
/// A perftest bandwidth run: (tool, block, QPs); its value is (MB/s, CPU seconds).
type PerfKey = (String, usize, usize);

/// The RDMA profile in one guest boot; reported, never fatal.
fn rdma_in_guest(exe: &Path, duration: f64) {
    if deps(&[Group::Guest]).is_err() {
        eprintln!("xtask: no Soft-RoCE guest here; RDMA not measured");
        return;
    }
    let secs = duration.max(2.0);
    println!(
        "\nRDMA on Soft-RoCE (rxe0 in the guest, loopback, one initiator thread, {secs} s per run; perftest in the same boot with the same QPs; perftest's MB is 2^20 bytes, converted to 10^6; at batch 1 and at batch 128 with 2 QPs Tern and perftest take turns, {ROUNDS} rounds, medians; Tern's waiter spins up to {GUEST_WAIT_SPIN_US} us, its native 200 us stretched as the emulation stretches time):\n"
    );
    let outcome = softroce::run(
        &root(),
        &softroce::GuestRun {
            command: &rdma_script(exe, secs),
            forward_env: crate::guest_env(),
            timeout: Duration::from_secs(3600),
            capture: true,
        },
    );
    let output = match outcome {
        Ok((0, output)) => output,
        other => return eprintln!("xtask: the RDMA benchmark in the guest failed: {other:?}"),
    };
    let mut terns: Vec<(TernKey, String)> = Vec::new();
    let mut perfs: Vec<(PerfKey, (f64, f64))> = Vec::new();
    let mut lats: Vec<((String, usize), (f64, f64))> = Vec::new();
    for line in output.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
        match fields.first() {
            Some(&"TERN") if fields.len() >= 6 => {
                if let (Some(size), Some(batch), Some(qps)) = (num(2), num(3), num(4)) {
                    let json = line.splitn(6, ' ').nth(5).unwrap_or_default().to_owned();
                    terns.push((
                        (
                            fields[1].to_owned(),
                            size as usize,
                            batch as usize,
                            qps as usize,
                        ),
                        json,
                    ));
                }
            }
            Some(&"PERF") => {
                if let (Some(size), Some(qps), Some(mib), Some(cpu)) =
                    (num(2), num(3), num(4), num(5))
                {
                    perfs.push((
                        (fields[1].to_owned(), size as usize, qps as usize),
                        (mib * 1_048_576.0 / 1e6, cpu),
                    ));
                }
            }
            Some(&"LAT") => {
                if let (Some(size), Some(typ), Some(p99)) = (num(2), num(3), num(4)) {
                    lats.push(((fields[1].to_owned(), size as usize), (typ, p99)));
                }
            }
            _ => {}
        }
    }
    // The median run where there are rounds: by p50 at batch 1, by throughput otherwise.
    let tern_of = |op: &str, size: usize, batch: usize, qps: usize| {
        let runs: Vec<&String> = terns
            .iter()
            .filter(|(k, _)| k.0 == op && k.1 == size && k.2 == batch && k.3 == qps)
            .map(|(_, j)| j)
            .collect();
        median_by(runs, |j| {
            let (_, p50, _, gbps, _) = row(j);
            if batch == 1 { p50 } else { gbps }
        })
        .cloned()
    };
    // perftest's median round by throughput, with that round's CPU.
    let perf_of = |tool: &str, size: usize, qps: usize| {
        let rounds: Vec<(f64, f64)> = perfs
            .iter()
            .filter(|(k, _)| k.0 == tool && k.1 == size && k.2 == qps)
            .map(|(_, v)| *v)
            .collect();
        median_by(rounds, |r| r.0)
    };
    let lat_of = |tool: &str, size: usize| {
        let rounds: Vec<(f64, f64)> = lats
            .iter()
            .filter(|(k, _)| k.0 == tool && k.1 == size)
            .map(|(_, v)| *v)
            .collect();
        let typical: Vec<f64> = rounds.iter().map(|r| r.0).collect();
        let p99: Vec<f64> = rounds.iter().map(|r| r.1).collect();
        (!rounds.is_empty()).then(|| (median(&typical), median(&p99)))
    };
    println!(
        "| op | block | batch | msgs/s | p50 us | p99 us | MB/s | CPU us/GB | baseline | ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for size in SIZES {
        for op in ["write", "read"] {
            let bw = format!("ib_{op}_bw");
            let lat = format!("ib_{op}_lat");
            for batch in [1usize, 128] {
                let Some(json) = tern_of(op, size, batch, 2) else {
                    println!("| {op} | {} | {batch} | missing | | | | | | |", kib(size));
                    continue;
                };
                let (rate, p50, p99, gbps, cpu) = row(&json);
                let (base, ratio) = if batch == 1 {
                    match lat_of(&lat, size) {
                        // ib_write_lat reports half a ping-pong round trip; a Tern write ends
                        // with the peer's ACK, a whole round trip: compare with twice it.
                        Some((typ, p99_base)) => {
                            let rtt = if op == "write" { 2.0 * typ } else { typ };
                            let goal = (size == 4 << 10).then_some(1.3);
                            (
                                format!(
                                    "{lat} round trip {rtt:.1} us (p99 {:.1})",
                                    if op == "write" {
                                        2.0 * p99_base
                                    } else {
                                        p99_base
                                    }
                                ),
                                ratio_mark(p50 / rtt, goal, false),
                            )
                        }
                        None => ("missing".into(), String::new()),
                    }
                } else {
                    match perf_of(&bw, size, 2) {
                        // perftest moved nothing (at 1 MiB with 2 QPs it does not run in
                        // this guest): there is no baseline, not an infinite ratio.
                        Some((mbps, _)) if mbps <= 0.0 => {
                            (format!("{bw} -q 2 moved nothing"), String::new())
                        }
                        Some((mbps, cpu_s)) => {
                            let goal = match size {
                                s if s == 4 << 10 => Some(0.8),
                                s if s == 64 << 10 => Some(0.95),
                                _ => None,
                            };
                            let base_cpu = cpu_s * 1e6 / (mbps * 1e6 * secs / 1e9);
                            (
                                format!("{bw} -q 2 {mbps:.1} MB/s, {base_cpu:.0} CPU us/GB"),
                                ratio_mark(gbps * 1e3 / mbps, goal, true),
                            )
                        }
                        None => ("missing".into(), String::new()),
                    }
                };
                println!(
                    "| {op} | {} | {batch} | {rate:.0} | {p50:.1} | {p99:.1} | {:.1} | {cpu:.0} | {base} | {ratio} |",
                    kib(size),
                    gbps * 1e3
                );
            }
        }
    }
    println!("\nOne QP per endpoint (MC_NUM_QP_PER_EP=1) beside perftest -q 1, batch 128:\n");
    println!("| op | block | Tern MB/s | perftest MB/s | ratio |");
    println!("|---|---|---|---|---|");
    for size in [64usize << 10, 1 << 20] {
        for op in ["write", "read"] {
            let ours = tern_of(op, size, 128, 1).map(|j| row(&j).3 * 1e3);
            let theirs = perf_of(&format!("ib_{op}_bw"), size, 1).map(|p| p.0);
            match (ours, theirs) {
                (Some(a), Some(b)) if b <= 0.0 => println!(
                    "| {op} | {} | {a:.1} | moved nothing (ib_{op}_bw -q 1) | |",
                    kib(size)
                ),
                (Some(a), Some(b)) => println!(
                    "| {op} | {} | {a:.1} | {b:.1} (ib_{op}_bw -q 1) | {:.2} |",
                    kib(size),
                    a / b
                ),
                _ => println!("| {op} | {} | missing | missing | |", kib(size)),
            }
        }
    }
    if let Some(json) = terns
        .iter()
        .find(|(k, j)| {
            k.0 == "write" && k.1 == 65536 && json_number(j, "idle_cpu_initiator_pct").is_some()
        })
        .map(|(_, j)| j)
    {
        println!(
            "\nidle for 10 s with endpoints open: initiator {:.2}% of a core, target {:.2}% (goal < 1%)",
            json_number(json, "idle_cpu_initiator_pct").unwrap_or(f64::NAN),
            json_number(json, "idle_cpu_target_pct").unwrap_or(f64::NAN)
        );
    }
}

/// Registration cost per MiB on Soft-RoCE, measured in the guest; reported, never fatal.
fn registration_cost_in_guest() {
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

/// Instructions the engine spends per request (callgrind: the difference between two batch
/// counts, over the difference in requests), where valgrind is installed; a figure the
/// machine's load does not move. Batch 1, and batches of 128 contiguous requests (merged
/// into one run) and of 128 with gaps (each its own), with the transport completing slices
/// on another thread and, for the engine's bookkeeping alone, inside `submit`.
fn instructions_per_request() {
    let mut build = cargo();
    build.args([
        "build",
        "--release",
        "-p",
        "tern-bench",
        "--example",
        "slice_cost",
    ]);
    if run(build, "building slice_cost").is_err() {
        return;
    }
    let exe = root().join("target/release/examples/slice_cost");
    let count = |case: &[String], metrics: &str| -> Option<f64> {
        let out = root().join(format!("target/callgrind.slice_cost.{}", case.join(".")));
        let output = Command::new("valgrind")
            .arg("--tool=callgrind")
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(&exe)
            .args(case)
            .env("TERN_WAIT_SPIN_US", "0")
            .env("TERN_METRICS", metrics)
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&output.stderr);
        let line = text.lines().find(|l| l.contains("Collected :"))?;
        line.rsplit(':')
            .next()?
            .trim()
            .replace(',', "")
            .parse()
            .ok()
    };
    // (requests per batch, layout, batches in the short run and in the long one)
    let cases = [
        (1usize, "contiguous", 20usize, 220usize),
        (128, "contiguous", 20, 120),
        (128, "gaps", 20, 120),
    ];
    println!(
        "\nEngine instructions per 64 KiB request (callgrind, with metrics / without):\n\n| batch | layout | transport completing on another thread | transport completing in submit |\n|---|---|---|---|"
    );
    for (per_batch, layout, short, long) in cases {
        let per_request = |transport: &str, metrics: &str| {
            let case = |batches: usize| {
                [batches, per_batch]
                    .map(|n| n.to_string())
                    .into_iter()
                    .chain([layout.to_owned(), transport.to_owned()])
                    .collect::<Vec<_>>()
            };
            Some(
                (count(&case(long), metrics)? - count(&case(short), metrics)?)
                    / ((long - short) * per_batch) as f64,
            )
        };
        let cell =
            |transport: &str| match (per_request(transport, "1"), per_request(transport, "0")) {
                (Some(on), Some(off)) => format!("{on:.0} / {off:.0}"),
                _ => "no valgrind".to_owned(),
            };
        println!(
            "| {per_batch} | {layout} | {} | {} |",
            cell("threaded"),
            cell("instant")
        );
    }
}

/// Pages per layer, layers and the page of the KV-shaped rows: 32 layers of 4 MiB.
const KV_PAGES: usize = 256;
const KV_LAYERS: usize = 32;
const KV_PAGE: usize = 16 << 10;
/// The baseline's request: one layer is four of them.
const KV_BIG: usize = 1 << 20;

/// The KV-shaped rows: 32 layers × 16 KiB pages, one request per page, submitted a layer's
/// bytes (4 MiB) at a time, in runs of 8 pages shuffled and fully shuffled, beside the same
/// layers moved as 1 MiB requests, 4 to a submit; TCP and same-host, {ROUNDS} rounds taken in
/// turn, medians.
fn pages(exe: &Path, duration: f64) -> Result<(), String> {
    let lanes_env = [("MC_TCP_LANES_PER_PEER", tcp_lanes().to_string())];
    let seconds = (duration / ROUNDS as f64).max(1.0);
    // Room for the layers and the page gap after each, in either page size.
    let buffer = KV_LAYERS * (KV_PAGES * KV_PAGE / KV_BIG + 1) * KV_BIG;
    let shape = |page: usize, order: &str, extra: &[&str]| -> Vec<String> {
        let per_layer = KV_PAGES * KV_PAGE / page;
        [
            "--operation=write".to_owned(),
            format!("--pages={per_layer}"),
            format!("--layers={KV_LAYERS}"),
            format!("--page_size={page}"),
            format!("--page_order={order}"),
            format!("--batch_size={per_layer}"),
            "--threads=1".into(),
            format!("--duration={seconds}"),
            format!("--buffer_size={buffer}"),
        ]
        .into_iter()
        .chain(extra.iter().map(|e| (*e).to_owned()))
        .collect()
    };
    let rows = [
        (
            "1 MiB requests",
            KV_BIG,
            "contiguous",
            Some("--no_merge"),
            None,
        ),
        ("16 KiB pages", KV_PAGE, "runs:8", None, Some(0.9)),
        ("16 KiB pages", KV_PAGE, "shuffled", None, Some(0.5)),
    ];
    println!(
        "\nKV-shaped writes on loopback: {KV_LAYERS} layers of {} MiB, one thread, a layer's bytes per submit ({} pages of {} KiB, or 4 requests of 1 MiB without merging), {ROUNDS} rounds in turn of {seconds} s, medians:\n",
        (KV_PAGES * KV_PAGE) >> 20,
        KV_PAGES,
        KV_PAGE >> 10
    );
    println!(
        "| protocol | requests | order | GB/s | requests/s | submit ns/request | vs 1 MiB requests |"
    );
    println!("|---|---|---|---|---|---|---|");
    for protocol in ["tcp", "shm"] {
        let mut runs: Vec<Vec<String>> = vec![Vec::new(); rows.len()];
        for _ in 0..ROUNDS {
            for (i, (_, page, order, extra, _)) in rows.iter().enumerate() {
                let mut args = shape(*page, order, extra.as_slice());
                args.push(format!("--protocol={protocol}"));
                runs[i].push(tern(exe, &args, &lanes_env)?);
            }
        }
        let medians: Vec<String> = runs
            .into_iter()
            .map(|r| median_by(r, |j| json_number(j, "gbps").unwrap_or(f64::NAN)))
            .collect::<Option<_>>()
            .ok_or("no pages rounds")?;
        let base = json_number(&medians[0], "gbps").unwrap_or(f64::NAN);
        for ((what, _, order, _, goal), json) in rows.iter().zip(&medians) {
            let n = |k: &str| json_number(json, k).unwrap_or(f64::NAN);
            let gbps = n("gbps");
            println!(
                "| {protocol} | {what} | {order} | {gbps:.2} | {:.0} | {:.0} | {} |",
                n("requests_per_s"),
                n("submit_ns_per_request"),
                ratio_mark(gbps / base, *goal, true)
            );
        }
    }
    Ok(())
}

/// Prints a line as each section of a run starts: where the run is, and how long it has
/// taken so far.
struct Progress {
    sections: usize,
    done: usize,
    started: std::time::Instant,
}

impl Progress {
    fn new(sections: usize) -> Self {
        Self {
            sections,
            done: 0,
            started: std::time::Instant::now(),
        }
    }

    fn section(&mut self, name: &str) {
        use std::io::Write as _;
        self.done += 1;
        let secs = self.started.elapsed().as_secs();
        println!(
            "\n[{}/{}] {name} … ({}m{:02}s in)",
            self.done,
            self.sections,
            secs / 60,
            secs % 60
        );
        let _ = std::io::stdout().flush();
    }

    fn finish(&self) {
        let secs = self.started.elapsed().as_secs();
        println!(
            "\nbench: {} sections in {}m{:02}s (after the build)",
            self.sections,
            secs / 60,
            secs % 60
        );
    }
}

/// The headline sections, the default run's four (`full`: the same-host table with every
/// memory path); returns the TCP profile's raw JSON lines.
fn headline(
    progress: &mut Progress,
    exe: &Path,
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
    wheel::bench(exe, duration, false);
    Ok(raw)
}

/// Seconds per run of the default bench: the headline tables in minutes.
const HEADLINE_DURATION: f64 = 1.0;

pub(crate) fn command(args: &[String]) -> Result<(), String> {
    let has = |flag: &str| args.iter().any(|a| a == flag);
    let quick = has("--quick");
    let full = has("--full");
    if let Err(e) = deps(&[Group::Bench]) {
        eprintln!("xtask: going on without the optional bench packages: {e}");
    }
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
        wheel::bench(&exe, duration, has("--mooncake"));
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
    if !full {
        let mut progress = Progress::new(4);
        headline(&mut progress, &exe, duration, false)?;
        progress.finish();
        println!(
            "(`cargo xtask bench --full` adds the plain same-host path, the cluster secret's cost, \
             etcd watch latency, RDMA in the Soft-RoCE guest, pre-touch, registration cost, \
             instructions per request and the criterion benches)"
        );
        return Ok(());
    }
    let mut progress = Progress::new(11);
    let raw = headline(&mut progress, &exe, duration, true)?;
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
