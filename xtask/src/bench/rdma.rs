//! The RDMA profile in one Soft-RoCE guest boot, beside perftest.

use std::path::Path;
use std::time::Duration;

use super::table::{kib, ratio_mark};
use super::tcp::SIZES;
use super::tern::row;
use crate::{Group, ROUNDS, deps, json_number, median, median_by, root, softroce};

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
pub(super) fn rdma_in_guest(exe: &Path, duration: f64) {
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
