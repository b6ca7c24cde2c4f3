//! The same-host rows of `cargo xtask bench`, all in one run: single-thread `memcpy` (over a
//! span as large as Tern's buffer, and over one block reused), UCX's shared memory
//! (`ucx_perftest -t ucp_put_bw` and `-t ucp_get` with `UCX_TLS=posix,cma,self`, from
//! Debian's `ucx-utils`), and `tern-bench --mode loopback --protocol shm` on both paths
//! (memfd and cross-memory attach), READ and WRITE, at 64 KiB and 1 MiB, over the whole
//! buffer and over one block reused (as `ucx_perftest` reuses its one block, which stays in
//! cache). Prints the table and the ratios the goals are stated in; reported, never fatal.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::json_number;

/// Tern's buffer (each side) over the whole-buffer rows, and the span `memcpy` sweeps.
const SPAN: usize = 256 << 20;
const BLOCKS: [usize; 2] = [64 << 10, 1 << 20];

/// GB/s of one thread copying `block`-byte pieces from one buffer into another of `span`
/// bytes, piece `i` to piece `i` as Tern's benchmark moves them, for `seconds`.
fn memcpy_rate(block: usize, span: usize, seconds: f64) -> f64 {
    let src: Vec<u8> = (0..span).map(|i| i as u8).collect();
    let mut dst = vec![1u8; span];
    let pieces = span / block;
    let until = Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut moved = 0u64;
    let mut piece = 0usize;
    while started.elapsed() < until {
        // 64 pieces between clock reads.
        for _ in 0..64 {
            let at = piece * block;
            dst[at..at + block].copy_from_slice(&src[at..at + block]);
            piece = (piece + 1) % pieces;
        }
        moved += 64 * block as u64;
    }
    std::hint::black_box(&dst);
    moved as f64 / started.elapsed().as_secs_f64() / 1e9
}

/// `ucx_perftest` over UCX's shared memory on loopback: a server, then a client; GB/s
/// (its MB are 2^20 bytes).
fn ucx_rate(test: &str, block: usize, seconds: f64, port: u16) -> Result<f64, String> {
    // About `seconds` of work at ~20 GB/s; ucx_perftest counts iterations, not time.
    let iterations = ((20e9 * seconds) / block as f64).clamp(1000.0, 2e6) as u64;
    let args = |server: bool| {
        let mut args: Vec<String> = Vec::new();
        if !server {
            args.push("127.0.0.1".into());
        }
        args.extend(
            [
                "-t",
                test,
                "-s",
                &block.to_string(),
                "-n",
                &iterations.to_string(),
                "-p",
                &port.to_string(),
                "-f",
            ]
            .map(str::to_owned),
        );
        args
    };
    let mut server = Command::new("ucx_perftest")
        .args(args(true))
        .env("UCX_TLS", "posix,cma,self")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("ucx_perftest: {e}"))?;
    std::thread::sleep(Duration::from_millis(500));
    let client = Command::new("ucx_perftest")
        .args(args(false))
        .env("UCX_TLS", "posix,cma,self")
        .output();
    let _ = server.kill();
    let _ = server.wait();
    let output = client.map_err(|e| format!("ucx_perftest: {e}"))?;
    let text = String::from_utf8_lossy(&output.stdout);
    // The final line: iterations, 3 latency columns, bandwidth average and overall (MB/s), …
    text.lines()
        .rev()
        .find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.len() >= 7 && fields[0].parse::<u64>().is_ok())
                .then(|| fields[5].parse::<f64>().ok())
                .flatten()
        })
        .map(|mibps| mibps * 1_048_576.0 / 1e9)
        .ok_or_else(|| {
            format!(
                "ucx_perftest {test} {block}: no result ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            )
        })
}

/// One Tern loopback run; GB/s and the JSON line.
fn tern_rate(
    exe: &Path,
    memory: &str,
    op: &str,
    block: usize,
    buffer: usize,
    seconds: f64,
) -> Result<(f64, String), String> {
    let output = Command::new(exe)
        .args([
            "--mode=loopback",
            "--protocol=shm",
            &format!("--shm_memory={memory}"),
            &format!("--operation={op}"),
            &format!("--block_size={block}"),
            "--batch_size=128",
            "--threads=1",
            &format!("--duration={seconds}"),
            &format!("--buffer_size={buffer}"),
            "--json",
        ])
        .output()
        .map_err(|e| format!("tern-bench: {e}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    if !output.status.success() {
        return Err(format!(
            "tern-bench shm {memory} {op} {block}: {}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let gbps = json_number(&stdout, "gbps").ok_or("tern-bench printed no gbps")?;
    Ok((gbps, stdout))
}

/// Runs every row and prints the table.
pub(crate) fn bench(exe: &Path, duration: f64) {
    let seconds = duration.max(1.0);
    println!(
        "\nSame host (one initiator thread, batch 128, loopback; memcpy, ucx_perftest and Tern in this run):\n"
    );
    let mut memcpy = Vec::new();
    for block in BLOCKS {
        memcpy.push((block, SPAN, memcpy_rate(block, SPAN, seconds.min(3.0))));
        memcpy.push((block, block, memcpy_rate(block, block, seconds.min(3.0))));
    }
    let memcpy_of = |block: usize, span: usize| {
        memcpy
            .iter()
            .find(|m| m.0 == block && m.1 == span)
            .map(|m| m.2)
            .unwrap_or(f64::NAN)
    };
    let mut ucx = Vec::new();
    let mut port = 13400u16;
    for block in BLOCKS {
        for test in ["ucp_put_bw", "ucp_get"] {
            port += 1;
            match ucx_rate(test, block, seconds, port) {
                Ok(gbps) => ucx.push((test, block, gbps)),
                Err(e) => eprintln!("xtask: {e} (is ucx-utils installed?)"),
            }
        }
    }
    let ucx_of = |test: &str, block: usize| {
        ucx.iter()
            .find(|u| u.0 == test && u.1 == block)
            .map(|u| u.2)
    };
    let mut rows = Vec::new();
    for memory in ["memfd", "plain"] {
        for block in BLOCKS {
            for buffer in [SPAN, block] {
                for op in ["write", "read"] {
                    eprintln!(
                        "xtask: tern-bench shm {memory} {op} {} KiB over {} KiB",
                        block / 1024,
                        buffer / 1024
                    );
                    match tern_rate(exe, memory, op, block, buffer, seconds) {
                        Ok((gbps, json)) => rows.push((memory, op, block, buffer, gbps, json)),
                        Err(e) => eprintln!("xtask: {e}"),
                    }
                }
            }
        }
    }
    let tern_of = |memory: &str, op: &str, block: usize, buffer: usize| {
        rows.iter()
            .find(|r| r.0 == memory && r.1 == op && r.2 == block && r.3 == buffer)
            .map(|r| r.4)
    };
    println!(
        "| path | op | block | over | Tern GB/s | memcpy GB/s | ratio | UCX GB/s | Tern / UCX |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (memory, op, block, buffer, gbps, _) in &rows {
        let base = memcpy_of(*block, *buffer);
        let whole = *buffer == SPAN;
        let (ucx_text, vs_ucx) = match (
            whole,
            ucx_of(
                if *op == "write" {
                    "ucp_put_bw"
                } else {
                    "ucp_get"
                },
                *block,
            ),
        ) {
            (false, Some(theirs)) => (format!("{theirs:.2}"), format!("{:.2}", gbps / theirs)),
            _ => (String::new(), String::new()),
        };
        println!(
            "| {} | {op} | {} KiB | {} | {gbps:.2} | {base:.2} | {:.2} | {ucx_text} | {vs_ucx} |",
            if *memory == "memfd" {
                "memfd"
            } else {
                "cross-memory attach"
            },
            block / 1024,
            if whole {
                "256 MiB buffer".to_owned()
            } else {
                "one block".to_owned()
            },
            gbps / base,
        );
    }
    println!("\nGoals (same run):");
    for (memory, goal) in [("memfd", 0.8), ("plain", 0.6)] {
        if let Some(ours) = tern_of(memory, "write", 1 << 20, SPAN)
            .into_iter()
            .chain(tern_of(memory, "read", 1 << 20, SPAN))
            .reduce(f64::min)
        {
            let ratio = ours / memcpy_of(1 << 20, SPAN);
            println!(
                "- {memory}, 1 MiB over the whole buffer: slower of READ/WRITE {ours:.2} GB/s = {ratio:.2} x memcpy (goal >= {goal}: {})",
                if ratio >= goal { "met" } else { "MISSED" }
            );
        }
        for block in BLOCKS {
            for buffer in [SPAN, block] {
                if let (Some(w), Some(r)) = (
                    tern_of(memory, "write", block, buffer),
                    tern_of(memory, "read", block, buffer),
                ) {
                    let gap = (w - r).abs() / w.max(r);
                    println!(
                        "- {memory}, {} KiB over {}: READ {r:.2} vs WRITE {w:.2} GB/s, {:.0} % apart (goal <= 10 %: {})",
                        block / 1024,
                        if buffer == SPAN {
                            "the buffer"
                        } else {
                            "one block"
                        },
                        gap * 100.0,
                        if gap <= 0.10 { "met" } else { "MISSED" }
                    );
                }
            }
        }
    }
    for block in BLOCKS {
        for (op, test) in [("write", "ucp_put_bw"), ("read", "ucp_get")] {
            let best = ["memfd", "plain"]
                .iter()
                .filter_map(|m| tern_of(m, op, block, block).map(|g| (*m, g)))
                .collect::<Vec<_>>();
            if let Some(theirs) = ucx_of(test, block) {
                for (memory, ours) in best {
                    println!(
                        "- {memory} {op} {} KiB, one block reused: Tern {ours:.2} vs UCX {test} {theirs:.2} GB/s ({})",
                        block / 1024,
                        if ours >= theirs { "met" } else { "MISSED" }
                    );
                }
            }
        }
    }
    let report = crate::root().join("target/tern-bench-shm.jsonl");
    let lines: Vec<String> = rows.iter().map(|r| r.5.clone()).collect();
    let _ = std::fs::write(&report, lines.join("\n") + "\n");
    println!("\nraw results: {}", report.display());
    idle(exe);
}

/// CPU of an idle initiator and target with a peer mapped, 5 s.
fn idle(exe: &Path) {
    let output = Command::new(exe)
        .args([
            "--mode=loopback",
            "--protocol=shm",
            "--operation=write",
            "--block_size=65536",
            "--batch_size=16",
            "--threads=1",
            "--duration=1",
            "--buffer_size=16777216",
            "--idle_seconds=5",
            "--json",
        ])
        .output();
    match output {
        Ok(output) if output.status.success() => {
            let json = String::from_utf8_lossy(&output.stdout);
            println!(
                "idle for 5 s with the peer mapped: initiator {:.2} % of a core, target {:.2} %",
                json_number(&json, "idle_cpu_initiator_pct").unwrap_or(f64::NAN),
                json_number(&json, "idle_cpu_target_pct").unwrap_or(f64::NAN)
            );
        }
        other => eprintln!("xtask: the idle run failed: {other:?}"),
    }
}
