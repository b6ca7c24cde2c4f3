//! The same-host rows of `cargo xtask bench`, all in one run: single-thread `memcpy` (over a
//! span as large as Tern's buffer, and over one block reused), UCX's shared memory
//! (`ucx_perftest -t ucp_put_bw` and `-t ucp_get` with `UCX_TLS=posix,cma,self`, from
//! Debian's `ucx-utils`) and UCX's cross-memory-attach transport (`-t put_bw` and `-t get`,
//! `-x cma`, zero-copy), and `tern-bench --mode loopback --protocol shm` on both paths
//! (memfd and cross-memory attach), READ and WRITE, at 64 KiB and 1 MiB, over the whole
//! buffer and over one block reused (as `ucx_perftest` reuses its one block, which stays in
//! cache). Every contender runs in turn, [`ROUNDS`] times per row (Tern's WRITE and READ
//! next to each other), and each figure is the median of its rounds. Prints the table and
//! the ratios the goals are stated in; reported, never fatal.

use std::collections::HashMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{json_number, median};

/// Rounds per row: more than the other benches' ([`crate::ROUNDS`]), each shorter, because
/// the rows in cache swing most with the other load of a shared machine (up to 3× between
/// runs), and the READ/WRITE goal compares two of them within 10 %.
const ROUNDS: usize = 5;

/// Tern's buffer (each side) over the whole-buffer rows, and the span `memcpy` sweeps.
const SPAN: usize = 256 << 20;
const BLOCKS: [usize; 2] = [64 << 10, 1 << 20];

/// The two buffers `memcpy` copies between, [`SPAN`] bytes each, made once for the whole table
/// (this binary is built without optimisation: filling 256 MiB byte by byte took ~3 s a round).
struct MemcpyBuffers {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl MemcpyBuffers {
    fn new() -> Self {
        let pattern: Vec<u8> = (0..=255u8).collect();
        let mut src = vec![0u8; SPAN];
        // Byte i holds i mod 256, written a pattern at a time.
        for chunk in src.chunks_exact_mut(pattern.len()) {
            chunk.copy_from_slice(&pattern);
        }
        Self {
            src,
            dst: vec![1u8; SPAN],
        }
    }
}

/// GB/s of one thread copying `block`-byte pieces from one buffer into another of `span`
/// bytes, piece `i` to piece `i` as Tern's benchmark moves them, for `seconds`.
fn memcpy_rate(buffers: &mut MemcpyBuffers, block: usize, span: usize, seconds: f64) -> f64 {
    let src = &buffers.src[..span];
    let dst = &mut buffers.dst[..span];
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
    std::hint::black_box(&*dst);
    moved as f64 / started.elapsed().as_secs_f64() / 1e9
}

/// The UCX run a row of Tern is set beside, doing the same work: UCP over
/// `UCX_TLS=posix,cma,self`, which maps the memory it allocated into the peer as Tern's memfd
/// path does; and UCX's own cross-memory-attach transport (UCT `-x cma`, zero-copy), which
/// moves memory it cannot map as Tern's CMA path does (UCP would pick the mapping instead).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum UcxPath {
    Mapped,
    CrossMemoryAttach,
}

impl UcxPath {
    fn of(memory: &str) -> Self {
        if memory == "memfd" {
            Self::Mapped
        } else {
            Self::CrossMemoryAttach
        }
    }

    /// The `ucx_perftest` test for a WRITE (put) or a READ (get).
    fn test(self, op: &str) -> &'static str {
        match (self, op == "write") {
            (Self::Mapped, true) => "ucp_put_bw",
            (Self::Mapped, false) => "ucp_get",
            (Self::CrossMemoryAttach, true) => "put_bw",
            (Self::CrossMemoryAttach, false) => "get",
        }
    }

    fn options(self) -> &'static [&'static str] {
        match self {
            Self::Mapped => &[],
            Self::CrossMemoryAttach => &["-x", "cma", "-d", "memory", "-D", "zcopy"],
        }
    }
}

/// `ucx_perftest` on loopback: a server, then a client; GB/s (its MB are 2^20 bytes).
fn ucx_rate(path: UcxPath, op: &str, block: usize, seconds: f64, port: u16) -> Result<f64, String> {
    let test = path.test(op);
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
            .iter()
            .chain(path.options())
            .map(|s| (*s).to_owned()),
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
    // The client starts once the server listens (it was a fixed 500 ms before: 6 s a table).
    let listening = Instant::now();
    while !listens(port) && listening.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
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

/// Whether a TCP socket of this host listens on `port` (`/proc/net/tcp`, `tcp6`: the local
/// address is `ADDR:PORT` in hex, state `0A` is LISTEN), without connecting to it.
fn listens(port: u16) -> bool {
    let suffix = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|table| {
        std::fs::read_to_string(table).is_ok_and(|text| {
            text.lines().skip(1).any(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                fields.len() > 3 && fields[1].ends_with(&suffix) && fields[3] == "0A"
            })
        })
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
    let args = [
        "--protocol=shm".to_owned(),
        format!("--shm_memory={memory}"),
        format!("--operation={op}"),
        format!("--block_size={block}"),
        "--batch_size=128".into(),
        "--threads=1".into(),
        format!("--duration={seconds}"),
        format!("--buffer_size={buffer}"),
    ];
    let stdout = crate::bench::tern(exe, &args, &[])?;
    let gbps = json_number(&stdout, "gbps").ok_or("tern-bench printed no gbps")?;
    Ok((gbps, stdout))
}

/// One row of Tern: its path (`memfd` or `plain`), operation, block and buffer size.
type Row = (&'static str, &'static str, usize, usize);

/// Runs every row and prints the table. `headline`: the memfd rows only, without the idle
/// run, for the default bench that answers in minutes.
pub(crate) fn bench(exe: &Path, duration: f64, headline: bool) {
    let memories: &[&'static str] = if headline {
        &["memfd"]
    } else {
        &["memfd", "plain"]
    };
    // The headline run takes the other benches' rounds: it answers in minutes.
    let rounds = if headline { crate::ROUNDS } else { ROUNDS };
    let seconds = (duration.max(1.0) / rounds as f64).max(1.0);
    println!(
        "\nSame host (one initiator thread, batch 128, loopback; memcpy, ucx_perftest and Tern in this run, each the median of {rounds} rounds taken in turn):\n"
    );
    let mut memcpy: HashMap<(&str, usize, usize), Vec<f64>> = HashMap::new();
    let mut ucx: HashMap<Row, Vec<f64>> = HashMap::new();
    let mut tern: HashMap<Row, Vec<f64>> = HashMap::new();
    let mut lines = Vec::new();
    let mut port = 13400u16;
    let mut buffers = MemcpyBuffers::new();
    for &memory in memories {
        for block in BLOCKS {
            for buffer in [SPAN, block] {
                eprintln!(
                    "xtask: shm {memory} {} KiB over {} KiB: {rounds} rounds of memcpy, Tern{}",
                    block / 1024,
                    buffer / 1024,
                    if buffer == block { " and UCX" } else { "" }
                );
                for _ in 0..rounds {
                    memcpy
                        .entry((memory, block, buffer))
                        .or_default()
                        .push(memcpy_rate(&mut buffers, block, buffer, seconds.min(2.0)));
                    for op in ["write", "read"] {
                        let row = (memory, op, block, buffer);
                        match tern_rate(exe, memory, op, block, buffer, seconds) {
                            Ok((gbps, json)) => {
                                tern.entry(row).or_default().push(gbps);
                                lines.push(json);
                            }
                            Err(e) => eprintln!("xtask: {e}"),
                        }
                    }
                    // UCX reuses one block: it runs only beside Tern's one-block rows.
                    for op in ["write", "read"].into_iter().filter(|_| buffer == block) {
                        let row = (memory, op, block, buffer);
                        port += 1;
                        match ucx_rate(UcxPath::of(memory), op, block, seconds, port) {
                            Ok(gbps) => ucx.entry(row).or_default().push(gbps),
                            Err(e) => eprintln!("xtask: {e} (is ucx-utils installed?)"),
                        }
                    }
                }
            }
        }
    }
    let memcpy_of = |memory: &str, block: usize, buffer: usize| {
        memcpy
            .get(&(memory, block, buffer))
            .map_or(f64::NAN, |v| median(v))
    };
    let tern_of = |memory: &'static str, op: &'static str, block: usize, buffer: usize| {
        tern.get(&(memory, op, block, buffer)).map(|v| median(v))
    };
    // UCX runs only over one block.
    let ucx_of = |memory: &'static str, op: &'static str, block: usize| {
        ucx.get(&(memory, op, block, block)).map(|v| median(v))
    };
    println!(
        "| path | op | block | over | Tern GB/s | memcpy GB/s | ratio | UCX GB/s | Tern / UCX |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for &memory in memories {
        for block in BLOCKS {
            for buffer in [SPAN, block] {
                for op in ["write", "read"] {
                    let Some(gbps) = tern_of(memory, op, block, buffer) else {
                        continue;
                    };
                    let base = memcpy_of(memory, block, buffer);
                    let whole = buffer == SPAN;
                    let (ucx_text, vs_ucx) = match (whole, ucx_of(memory, op, block)) {
                        (false, Some(theirs)) => (
                            format!("{theirs:.2} ({})", UcxPath::of(memory).test(op)),
                            format!("{:.2}", gbps / theirs),
                        ),
                        _ => (String::new(), String::new()),
                    };
                    println!(
                        "| {} | {op} | {} KiB | {} | {gbps:.2} | {base:.2} | {:.2} | {ucx_text} | {vs_ucx} |",
                        if memory == "memfd" {
                            "memfd"
                        } else {
                            "cross-memory attach"
                        },
                        block / 1024,
                        if whole { "256 MiB buffer" } else { "one block" },
                        gbps / base,
                    );
                }
            }
        }
    }
    println!("\nGoals (same run):");
    for (memory, goal) in [("memfd", 0.8), ("plain", 0.6)] {
        if let Some(ours) = tern_of(memory, "write", 1 << 20, SPAN)
            .into_iter()
            .chain(tern_of(memory, "read", 1 << 20, SPAN))
            .reduce(f64::min)
        {
            let ratio = ours / memcpy_of(memory, 1 << 20, SPAN);
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
    for &memory in memories {
        for block in BLOCKS {
            for op in ["write", "read"] {
                if let (Some(ours), Some(theirs)) =
                    (tern_of(memory, op, block, block), ucx_of(memory, op, block))
                {
                    println!(
                        "- {memory} {op} {} KiB, one block reused: Tern {ours:.2} vs UCX {} {theirs:.2} GB/s ({})",
                        block / 1024,
                        UcxPath::of(memory).test(op),
                        if ours >= theirs { "met" } else { "MISSED" }
                    );
                }
            }
        }
    }
    let report = crate::root().join("target/tern-bench-shm.jsonl");
    let _ = std::fs::write(&report, lines.join("\n") + "\n");
    println!("\nraw results: {}", report.display());
    if !headline {
        idle(exe);
    }
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
