//! `tern-soak`: a long run of random, verified transfers among 2 to 4 processes on one host,
//! which reports per process the transfers, bytes and errors, and the RSS, open file
//! descriptors, threads and live queue pairs after a warm-up and at the end, so that leaks and
//! stale state show up as growth.
//!
//! Run as `tern-soak --processes K --seconds S [--protocol rdma --device_name rxe0]`: this
//! process (the coordinator) starts K peer processes of itself on 127.0.0.1 (P2P metadata).
//! Every peer serves one buffer and is an initiator towards every other peer. Each of its
//! worker threads owns one slot of every other peer's buffer — nobody else writes there — and
//! keeps a shadow copy of what that slot must hold, so every byte is checked: a read must
//! return the shadow, a write is read back and must return what was written. The coordinator
//! prints one `SOAK {json}` line per peer on stdout, judges them against the limits below and
//! exits non-zero when a peer saw an error or grew.
//!
//! It must not contain transfer logic of its own (everything goes through `tern-engine`'s
//! public API), and it sends traffic only to 127.0.0.1 (and, over RDMA, to the local NIC).
#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::process::{Child, ChildStdin, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use serde_json::json;
use tern_engine::{OwnedBuffer, SegmentId, TransferEngine, TransferRequest, TransferStatus};
use tern_transport_rdma::topology::parse_device_list;
use tern_transport_rdma::{RdmaConfig, RdmaTransport};
use tern_transport_tcp::TcpTransport;

/// The limits a peer's resources must keep between the sample after the warm-up and the one
/// at the end, while every worker is still moving bytes.
///
/// - File descriptors, threads and queue pairs: equal. After the warm-up every peer has
///   reached every other over every connection (or endpoint) it will ever use, and a steady
///   workload has no reason to open, spawn or create one more; any difference is a leak or a
///   reconnection, both worth a look.
/// - RSS: at most [`RSS_SLACK_KIB`] more. Every buffer (served, local, shadow, scratch) is
///   allocated and touched before the warm-up ends, but malloc keeps freed blocks in its
///   per-thread arenas and trims them when it likes, and transparent huge pages back heaps
///   2 MiB at a time, so a steady process moves by a step or two of 2 MiB (seen: +0.1 MiB
///   over 5 minutes of TCP; one step of +4.2 MiB in 2 minutes in the Soft-RoCE guest). A
///   leak of 1 KiB per batch (~10 000 batches a minute per process over TCP in a debug
///   build) passes the limit within a minute of measurement.
const RSS_SLACK_KIB: u64 = 8 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Role {
    /// Starts the peers, hands them each other's names, collects and judges their reports.
    Coordinator,
    /// One process of the soak (started by the coordinator; talks to it over stdin/stdout).
    Peer,
}

/// Random reads and writes of random sizes at random offsets among 2 to 4 processes, every
/// byte verified; reports transfers, errors and resources at start and end.
#[derive(Debug, Clone, Parser)]
#[command(name = "tern-soak", version)]
struct Args {
    /// Peer processes to run (2 to 4).
    #[arg(long, default_value_t = 3)]
    processes: usize,
    /// Seconds each peer moves bytes, warm-up included.
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// Seconds of warm-up before the start sample [default: a sixth of the run, 5 to 30 s].
    #[arg(long)]
    warmup: Option<f64>,
    /// Transport: tcp, or rdma (over the NICs `--device_name` allows).
    #[arg(long, default_value = "tcp")]
    protocol: String,
    /// RDMA devices, comma separated (e.g. `rxe0`); default: `MC_TE_FILTERS`, else every
    /// device with an active port.
    #[arg(long = "device_name")]
    device_name: Option<String>,
    /// Initiator threads per peer; each owns one slot of every other peer's buffer.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Bytes per slot (a multiple of 4096); the largest transfer is half of it.
    #[arg(long = "slot_size", default_value_t = 8 << 20)]
    slot_size: usize,
    /// Most requests in one batch.
    #[arg(long = "max_batch", default_value_t = 8)]
    max_batch: usize,
    /// Seed of the random choices (default: from the clock); printed at start.
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long, value_enum, default_value = "coordinator", hide = true)]
    role: Role,
    #[arg(long, default_value_t = 0, hide = true)]
    index: usize,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let args = Args::parse();
    let result = match args.role {
        Role::Coordinator => coordinate(&args),
        Role::Peer => peer(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("tern-soak: {message}");
            ExitCode::FAILURE
        }
    }
}

fn check_args(args: &Args) -> Result<(), String> {
    if !(2..=4).contains(&args.processes) {
        return Err("--processes must be 2, 3 or 4".into());
    }
    if !(args.seconds.is_finite() && args.seconds > 0.0) {
        return Err("--seconds must be positive".into());
    }
    if args.threads == 0 || args.max_batch == 0 {
        return Err("--threads and --max_batch must be positive".into());
    }
    if args.slot_size < 4096 || !args.slot_size.is_multiple_of(4096) {
        return Err("--slot_size must be a positive multiple of 4096".into());
    }
    if !matches!(args.protocol.as_str(), "tcp" | "rdma") {
        return Err(format!("--protocol={} is not tcp or rdma", args.protocol));
    }
    Ok(())
}

fn warmup(args: &Args) -> Duration {
    let secs = args
        .warmup
        .unwrap_or_else(|| (args.seconds / 6.0).clamp(5.0, 30.0))
        .clamp(0.0, args.seconds);
    Duration::from_secs_f64(secs)
}

// ---------------------------------------------------------------------------------------------
// Coordinator

/// A line a peer printed on stdout (`None`: its stdout closed).
type PeerLine = (usize, Option<String>);

fn coordinate(args: &Args) -> Result<(), String> {
    check_args(args)?;
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    eprintln!(
        "tern-soak: {} peers over {}, {} s (warm-up {} s), {} threads each, slots of {} bytes, seed {seed}",
        args.processes,
        args.protocol,
        args.seconds,
        warmup(args).as_secs_f64(),
        args.threads,
        args.slot_size
    );
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let (lines_tx, lines) = mpsc::channel::<PeerLine>();
    let mut children: Vec<Child> = Vec::new();
    let mut stdins: Vec<Option<ChildStdin>> = Vec::new();
    let mut spawn_all = || -> Result<(), String> {
        for index in 0..args.processes {
            let mut command = Command::new(&exe);
            command
                .args(["--role=peer", &format!("--index={index}")])
                .arg(format!("--processes={}", args.processes))
                .arg(format!("--seconds={}", args.seconds))
                .arg(format!("--warmup={}", warmup(args).as_secs_f64()))
                .arg(format!("--protocol={}", args.protocol))
                .arg(format!("--threads={}", args.threads))
                .arg(format!("--slot_size={}", args.slot_size))
                .arg(format!("--max_batch={}", args.max_batch))
                .arg(format!(
                    "--seed={}",
                    seed.wrapping_add(index as u64 * 0x9E37_79B9)
                ))
                .args(
                    args.device_name
                        .iter()
                        .map(|d| format!("--device_name={d}")),
                )
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit());
            let mut child = command
                .spawn()
                .map_err(|e| format!("starting peer {index}: {e}"))?;
            stdins.push(child.stdin.take());
            if let Some(stdout) = child.stdout.take() {
                let tx = lines_tx.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                        if tx.send((index, Some(line))).is_err() {
                            return;
                        }
                    }
                    let _ = tx.send((index, None));
                });
            }
            children.push(child);
        }
        Ok(())
    };
    let started = spawn_all();
    drop(lines_tx);
    let outcome = started.and_then(|()| drive(args, &lines, &mut stdins));
    // Whatever happened: closing their stdin stops the peers (a peer also stops on "exit").
    drop(stdins);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut statuses = Vec::new();
    for (index, child) in children.iter_mut().enumerate() {
        statuses.push(wait_child(index, child, deadline));
    }
    let mut reports = outcome?;
    for (index, status) in statuses.into_iter().enumerate() {
        if let Some(report) = reports.get_mut(index) {
            report.exit = status;
        }
    }
    let mut failures = Vec::new();
    for report in &reports {
        let verdict = report.verdict();
        let mut line = report.json.clone();
        line["process"] = json!(report.index);
        line["exit"] = json!(report.exit.clone());
        line["verdict"] = json!(if verdict.is_empty() {
            "ok".to_owned()
        } else {
            verdict.join("; ")
        });
        println!("SOAK {line}");
        if !verdict.is_empty() {
            failures.push(format!("peer {}: {}", report.index, verdict.join("; ")));
        }
    }
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    if failures.is_empty() {
        eprintln!("tern-soak: passed");
        Ok(())
    } else {
        Err(format!("FAILED: {}", failures.join("; ")))
    }
}

/// Waits for a peer to exit, killing it at `deadline`; its exit as text ("0" when clean).
fn wait_child(index: usize, child: &mut Child, deadline: Instant) -> String {
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                return status
                    .code()
                    .map_or_else(|| status.to_string(), |c| c.to_string());
            }
            Ok(None) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(None) => {
                eprintln!("tern-soak: peer {index} did not exit; killing it");
                let _ = child.kill();
                let _ = child.wait();
                return "killed".into();
            }
            Err(e) => return format!("unknown ({e})"),
        }
    }
}

/// What one peer reported, and how it ended.
struct Report {
    index: usize,
    /// The peer's `report:` object merged with its `closed:` object.
    json: serde_json::Value,
    exit: String,
}

impl Report {
    fn number(&self, key: &str) -> Option<u64> {
        self.json.get(key).and_then(serde_json::Value::as_u64)
    }

    /// What is wrong with this peer's run; empty when nothing is.
    fn verdict(&self) -> Vec<String> {
        let mut wrong = Vec::new();
        if self.exit != "0" {
            wrong.push(format!("exit status {}", self.exit));
        }
        match self.number("errors") {
            Some(0) => {}
            Some(n) => wrong.push(format!("{n} errors")),
            None => wrong.push("no error count".into()),
        }
        if self.number("transfers").unwrap_or(0) == 0 {
            wrong.push("no transfers".into());
        }
        for key in ["fds", "threads", "qps"] {
            match (
                self.number(&format!("{key}_start")),
                self.number(&format!("{key}_end")),
            ) {
                (Some(start), Some(end)) if start == end => {}
                (Some(start), Some(end)) => wrong.push(format!("{key} {start} -> {end}")),
                _ => wrong.push(format!("no {key} samples")),
            }
        }
        match (self.number("rss_kib_start"), self.number("rss_kib_end")) {
            (Some(start), Some(end)) if end <= start + RSS_SLACK_KIB => {}
            (Some(start), Some(end)) => wrong.push(format!(
                "RSS grew {start} -> {end} KiB (limit +{RSS_SLACK_KIB} KiB)"
            )),
            _ => wrong.push("no RSS samples".into()),
        }
        match self.number("qps_closed") {
            Some(0) => {}
            Some(n) => wrong.push(format!("{n} queue pairs left after the engine closed")),
            None => wrong.push("no count of queue pairs after closing".into()),
        }
        wrong
    }
}

/// Hands the peers each other's names, collects their reports, then tells them to close.
fn drive(
    args: &Args,
    lines: &Receiver<PeerLine>,
    stdins: &mut [Option<ChildStdin>],
) -> Result<Vec<Report>, String> {
    let k = args.processes;
    // Engines start in well under a minute even in an emulated guest; the run itself gets
    // its length plus as much again (and two minutes) for stragglers.
    let start_by = Instant::now() + Duration::from_secs(120);
    let mut names: Vec<Option<String>> = vec![None; k];
    while names.iter().any(Option::is_none) {
        let (index, line) = next_line(lines, start_by, "every peer to print its segment")?;
        match line.as_deref().and_then(|l| l.strip_prefix("segment: ")) {
            Some(name) => names[index] = Some(name.to_owned()),
            None if line.is_none() => return Err(format!("peer {index} exited at start")),
            None => {}
        }
    }
    let names: Vec<String> = names.into_iter().flatten().collect();
    let peers_line = format!("peers: {}\n", names.join(" "));
    for (index, stdin) in stdins.iter_mut().enumerate() {
        let stdin = stdin.as_mut().ok_or("a peer's stdin is missing")?;
        stdin
            .write_all(peers_line.as_bytes())
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("telling peer {index} the names: {e}"))?;
    }
    let report_by =
        Instant::now() + Duration::from_secs_f64(args.seconds * 2.0) + Duration::from_secs(120);
    let mut reports: Vec<Option<serde_json::Value>> = vec![None; k];
    while reports.iter().any(Option::is_none) {
        let (index, line) = next_line(lines, report_by, "every peer's report")?;
        match line.as_deref().and_then(|l| l.strip_prefix("report: ")) {
            Some(text) => {
                let value = serde_json::from_str(text)
                    .map_err(|e| format!("peer {index}'s report {text:?}: {e}"))?;
                reports[index] = Some(value);
            }
            None if line.is_none() => return Err(format!("peer {index} exited before its report")),
            None => {}
        }
    }
    // Everyone is done moving bytes: now they may close their engines.
    for stdin in stdins.iter_mut().flatten() {
        let _ = stdin.write_all(b"exit\n").and_then(|()| stdin.flush());
    }
    let close_by = Instant::now() + Duration::from_secs(60);
    let mut closed: Vec<Option<serde_json::Value>> = vec![None; k];
    while closed.iter().any(Option::is_none) {
        let (index, line) = next_line(lines, close_by, "every peer to close")?;
        match line.as_deref().and_then(|l| l.strip_prefix("closed: ")) {
            Some(text) => {
                let value = serde_json::from_str(text)
                    .map_err(|e| format!("peer {index}'s close report {text:?}: {e}"))?;
                closed[index] = Some(value);
            }
            // Its stdout closed without a word (it failed while closing, and says so).
            None if line.is_none() && closed[index].is_none() => {
                closed[index] = Some(json!({}));
            }
            None => {}
        }
    }
    Ok(reports
        .into_iter()
        .zip(closed)
        .enumerate()
        .map(|(index, (report, closed))| {
            let mut json = report.unwrap_or_else(|| json!({}));
            if let (Some(object), Some(serde_json::Value::Object(extra))) =
                (json.as_object_mut(), closed)
            {
                object.extend(extra);
            }
            Report {
                index,
                json,
                exit: "unknown".into(),
            }
        })
        .collect())
}

fn next_line(lines: &Receiver<PeerLine>, by: Instant, what: &str) -> Result<PeerLine, String> {
    match lines.recv_timeout(by.saturating_duration_since(Instant::now())) {
        Ok(line) => Ok(line),
        Err(RecvTimeoutError::Timeout) => Err(format!("timed out waiting for {what}")),
        Err(RecvTimeoutError::Disconnected) => Err(format!("every peer exited before {what}")),
    }
}

// ---------------------------------------------------------------------------------------------
// Peer

/// Resource counts of this process at one moment.
#[derive(Debug, Clone, Copy)]
struct Sample {
    rss_kib: u64,
    fds: u64,
    threads: u64,
    qps: u64,
}

fn sample() -> Result<Sample, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse::<u64>().ok())
            .ok_or_else(|| format!("/proc/self/status has no {name}"))
    };
    // The directory listing holds the descriptor that reads it: one less.
    let fds = std::fs::read_dir("/proc/self/fd")
        .map_err(|e| e.to_string())?
        .count()
        .saturating_sub(1) as u64;
    Ok(Sample {
        rss_kib: field("VmRSS:")?,
        fds,
        threads: field("Threads:")?,
        qps: tern_verbs::live_queue_pairs() as u64,
    })
}

/// Counters the workers of one peer share.
#[derive(Default)]
struct Counters {
    transfers: AtomicU64,
    bytes: AtomicU64,
    batches: AtomicU64,
    errors: AtomicU64,
}

impl Counters {
    fn moved(&self, bytes: usize) {
        self.transfers.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// Another peer as this one sees it.
struct Remote {
    /// Its index among the peers (its initial buffer content depends on it).
    index: usize,
    id: SegmentId,
    /// Address of its served buffer.
    base: u64,
}

fn engine(args: &Args) -> Result<TransferEngine, String> {
    let builder = TransferEngine::builder().local_server_name("127.0.0.1");
    let builder = if args.protocol == "rdma" {
        let mut config = RdmaConfig::from_env();
        if let Some(list) = &args.device_name {
            config.devices = parse_device_list(list);
        }
        builder.transport(RdmaTransport::discover(config).map_err(|e| e.to_string())?)
    } else {
        builder.transport(TcpTransport::default())
    };
    builder
        .build()
        .map_err(|e| format!("starting the engine: {e}"))
}

/// The bytes peer `process`'s buffer holds from `offset` on before anyone writes to it:
/// eight at a time, a hash of the process and the offset's word.
fn initial_bytes(process: usize, offset: usize, out: &mut [u8]) {
    let mut i = 0;
    while i < out.len() {
        let at = offset + i;
        let word = splitmix((at as u64 / 8) ^ ((process as u64 + 1) << 48)).to_le_bytes();
        let from = at % 8;
        let n = (8 - from).min(out.len() - i);
        out[i..i + n].copy_from_slice(&word[from..from + n]);
        i += n;
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xorshift64*: fast, and good enough to pick sizes, offsets and payloads.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(splitmix(seed) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (`n` > 0).
    fn below(&mut self, n: usize) -> usize {
        ((self.next() >> 11) % n as u64) as usize
    }

    /// Log-uniform in `1..=max`: as many transfers of 1–10 B as of 100 KiB–1 MiB.
    fn size(&mut self, max: usize) -> usize {
        let unit = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        let size = ((max as f64 + 1.0).ln() * unit).exp() as usize;
        size.clamp(1, max)
    }

    fn fill(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for chunk in &mut chunks {
            chunk.copy_from_slice(&self.next().to_le_bytes());
        }
        let tail = chunks.into_remainder();
        let last = self.next().to_le_bytes();
        tail.copy_from_slice(&last[..tail.len()]);
    }
}

fn peer(args: &Args) -> Result<(), String> {
    check_args(args)?;
    let me = args.index;
    let tag = format!("tern-soak[{me}]");
    let k = args.processes;
    let engine = engine(args)?;
    let served_len = k * args.threads * args.slot_size;
    let served = engine
        .allocate(served_len, "cpu:0")
        .map_err(|e| format!("allocating {served_len} bytes to serve: {e}"))?;
    let mut chunk = vec![0u8; 1 << 20];
    for offset in (0..served_len).step_by(chunk.len()) {
        let len = chunk.len().min(served_len - offset);
        initial_bytes(me, offset, &mut chunk[..len]);
        served
            .write_at(offset, &chunk[..len])
            .map_err(|e| e.to_string())?;
    }
    drop(chunk);
    let mut stdout = std::io::stdout();
    writeln!(stdout, "segment: {}", engine.segment_name())
        .and_then(|()| stdout.flush())
        .map_err(|e| e.to_string())?;

    // The coordinator answers with every peer's name, in index order.
    let mut stdin = BufReader::new(std::io::stdin());
    let mut line = String::new();
    stdin.read_line(&mut line).map_err(|e| e.to_string())?;
    let names: Vec<String> = line
        .trim()
        .strip_prefix("peers:")
        .ok_or_else(|| format!("expected the peers' names, got {line:?}"))?
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    if names.len() != k {
        return Err(format!("expected {k} names, got {names:?}"));
    }
    // From now on stdin says when to close: "exit", or end of file if the coordinator died.
    let quit = std::sync::Arc::new(AtomicBool::new(false));
    let (closing_tx, closing) = mpsc::channel::<()>();
    {
        let quit = quit.clone();
        std::thread::Builder::new()
            .name("soak-stdin".into())
            .spawn(move || {
                let mut line = String::new();
                while stdin.read_line(&mut line).is_ok_and(|n| n > 0) && line.trim() != "exit" {
                    line.clear();
                }
                quit.store(true, Ordering::Release);
                let _ = closing_tx.send(());
            })
            .map_err(|e| e.to_string())?;
    }

    let mut remotes = Vec::new();
    for (index, name) in names.iter().enumerate() {
        if index == me {
            continue;
        }
        let id = engine
            .open_segment(name)
            .map_err(|e| format!("opening peer {index} ({name}): {e}"))?;
        let base = engine
            .segment(id)
            .and_then(|s| {
                s.desc
                    .buffers
                    .iter()
                    .find(|b| b.length as usize == served_len)
                    .map(|b| b.addr)
            })
            .ok_or_else(|| {
                format!("peer {index} ({name}) serves no buffer of {served_len} bytes")
            })?;
        remotes.push(Remote { index, id, base });
    }

    let counters = Counters::default();
    let stop = AtomicBool::new(false);
    let warm = warmup(args);
    let run_for = Duration::from_secs_f64(args.seconds);
    let seed = args.seed.unwrap_or(me as u64);
    let (samples, worker_results) = std::thread::scope(|scope| {
        let mut workers = Vec::new();
        for thread in 0..args.threads {
            let worker = Worker::new(
                &engine,
                &remotes,
                me * args.threads + thread,
                args,
                Rng::new(seed ^ ((thread as u64 + 1) << 32)),
                &counters,
                &tag,
            );
            let stop = &stop;
            workers.push(scope.spawn(move || worker?.run(stop)));
        }
        let started = Instant::now();
        let samples = pace(&tag, started, warm, run_for, &counters, &quit);
        stop.store(true, Ordering::Release);
        let results: Vec<Result<(), String>> = workers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|_| Err("a worker panicked".into())))
            .collect();
        (samples, results)
    });
    let (start, end) = samples?;
    for result in worker_results {
        if let Err(e) = result {
            eprintln!("{tag}: a worker stopped: {e}");
            counters.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
    let report = json!({
        "segment": engine.segment_name(),
        "protocol": args.protocol,
        "seconds": args.seconds,
        "warmup_seconds": warm.as_secs_f64(),
        "seed": seed,
        "transfers": counters.transfers.load(Ordering::Relaxed),
        "bytes": counters.bytes.load(Ordering::Relaxed),
        "batches": counters.batches.load(Ordering::Relaxed),
        "errors": counters.errors.load(Ordering::Relaxed),
        "rss_kib_start": start.rss_kib,
        "rss_kib_end": end.rss_kib,
        "fds_start": start.fds,
        "fds_end": end.fds,
        "threads_start": start.threads,
        "threads_end": end.threads,
        "qps_start": start.qps,
        "qps_end": end.qps,
    });
    writeln!(stdout, "report: {report}")
        .and_then(|()| stdout.flush())
        .map_err(|e| e.to_string())?;

    // Others may still be reading this peer's buffer: close only when told to.
    let _ = closing.recv();
    drop(remotes);
    drop(served);
    drop(engine);
    let after = sample()?;
    let closed = json!({
        "qps_closed": after.qps,
        "threads_closed": after.threads,
        "fds_closed": after.fds,
    });
    writeln!(stdout, "closed: {closed}")
        .and_then(|()| stdout.flush())
        .map_err(|e| e.to_string())
}

/// Sleeps through the run, taking the start sample after the warm-up and the end sample just
/// before the workers stop; prints progress every 30 s. Ends early if told to quit.
fn pace(
    tag: &str,
    started: Instant,
    warm: Duration,
    run_for: Duration,
    counters: &Counters,
    quit: &AtomicBool,
) -> Result<(Sample, Sample), String> {
    let sleep_until = |until: Duration| -> Result<(), String> {
        let mut last_progress = started.elapsed();
        while started.elapsed() < until {
            if quit.load(Ordering::Acquire) {
                return Err("told to stop before the run ended".into());
            }
            std::thread::sleep((until - started.elapsed()).min(Duration::from_millis(100)));
            if started.elapsed() - last_progress >= Duration::from_secs(30) {
                last_progress = started.elapsed();
                let rss = sample().map_or(f64::NAN, |s| s.rss_kib as f64 / 1024.0);
                eprintln!(
                    "{tag}: {:.0} s, {} transfers, {:.2} GB, {} errors, RSS {rss:.1} MiB",
                    last_progress.as_secs_f64(),
                    counters.transfers.load(Ordering::Relaxed),
                    counters.bytes.load(Ordering::Relaxed) as f64 / 1e9,
                    counters.errors.load(Ordering::Relaxed)
                );
            }
        }
        Ok(())
    };
    sleep_until(warm)?;
    let start = sample()?;
    sleep_until(run_for)?;
    let end = sample()?;
    Ok((start, end))
}

/// One planned request of a batch.
#[derive(Debug, Clone, Copy)]
struct Planned {
    write: bool,
    /// Position in the worker's list of remotes.
    remote: usize,
    /// Offset in the local buffer (and in the scratch that mirrors it).
    local: usize,
    /// Offset inside this worker's slot of the remote buffer.
    offset: usize,
    len: usize,
}

/// One initiator thread: owns one slot of every remote buffer and a local buffer as big.
struct Worker<'a> {
    engine: &'a TransferEngine,
    remotes: &'a [Remote],
    /// Where this worker's slot starts in every remote buffer.
    slot_base: usize,
    slot_size: usize,
    max_batch: usize,
    local: OwnedBuffer,
    /// What each remote slot holds, as far as this worker knows (one per remote).
    shadows: Vec<Vec<u8>>,
    /// Mirrors the local buffer: the payload of writes, poison before reads, what arrived.
    scratch: Vec<u8>,
    rng: Rng,
    counters: &'a Counters,
    tag: &'a str,
    /// Error messages printed so far (only the first few are).
    told: usize,
}

/// How long one batch may take before the soak calls it a hang (the engine's own deadline is
/// unset; an emulated guest moves ~60 MB/s, so a batch of 8 MiB takes well under a second).
const BATCH_TIMEOUT: Duration = Duration::from_secs(60);

impl<'a> Worker<'a> {
    fn new(
        engine: &'a TransferEngine,
        remotes: &'a [Remote],
        slot: usize,
        args: &Args,
        rng: Rng,
        counters: &'a Counters,
        tag: &'a str,
    ) -> Result<Self, String> {
        let slot_base = slot * args.slot_size;
        let local = engine
            .allocate(args.slot_size, "cpu:0")
            .map_err(|e| format!("allocating the local buffer: {e}"))?;
        let shadows = remotes
            .iter()
            .map(|remote| {
                let mut shadow = vec![0u8; args.slot_size];
                initial_bytes(remote.index, slot_base, &mut shadow);
                shadow
            })
            .collect();
        Ok(Self {
            engine,
            remotes,
            slot_base,
            slot_size: args.slot_size,
            max_batch: args.max_batch,
            local,
            shadows,
            scratch: vec![0u8; args.slot_size],
            rng,
            counters,
            tag,
            told: 0,
        })
    }

    fn run(mut self, stop: &AtomicBool) -> Result<(), String> {
        while !stop.load(Ordering::Acquire) {
            self.round()?;
        }
        Ok(())
    }

    fn error(&mut self, message: String) {
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        if self.told < 10 {
            eprintln!(
                "{}: slot {}: {message}",
                self.tag,
                self.slot_base / self.slot_size
            );
            self.told += 1;
        }
    }

    /// One batch of random reads and writes in disjoint parts of the local buffer and of the
    /// slot, then one batch that reads back every write.
    fn round(&mut self) -> Result<(), String> {
        let count = 1 + self.rng.below(self.max_batch);
        let part = self.slot_size / count;
        let max_len = part.min(self.slot_size / 2).max(1);
        let mut plan = Vec::with_capacity(count);
        for j in 0..count {
            let len = self.rng.size(max_len);
            plan.push(Planned {
                write: self.rng.below(2) == 0,
                remote: self.rng.below(self.remotes.len()),
                local: j * part + self.rng.below(part - len + 1),
                offset: j * part + self.rng.below(part - len + 1),
                len,
            });
        }
        for p in &plan {
            let local = p.local..p.local + p.len;
            if p.write {
                self.rng.fill(&mut self.scratch[local.clone()]);
            } else {
                self.poison(p);
            }
            self.local
                .write_at(p.local, &self.scratch[local])
                .map_err(|e| format!("staging local bytes: {e}"))?;
        }
        let statuses = self.transfer(&plan)?;
        let mut read_back = Vec::new();
        for (p, status) in plan.iter().zip(statuses) {
            let range = p.offset..p.offset + p.len;
            match (status, p.write) {
                (TransferStatus::Completed, true) => {
                    self.counters.moved(p.len);
                    let local = p.local..p.local + p.len;
                    self.shadows[p.remote][range].copy_from_slice(&self.scratch[local]);
                    read_back.push((*p, true));
                }
                (TransferStatus::Completed, false) => {
                    self.counters.moved(p.len);
                    self.check(p, "read")?;
                }
                (status, write) => {
                    self.error(format!(
                        "{} of {} bytes at slot offset {} of peer {} ended {status}",
                        if write { "write" } else { "read" },
                        p.len,
                        p.offset,
                        self.remotes[p.remote].index
                    ));
                    if write {
                        // Some of it may have landed: read it back and take what is there.
                        read_back.push((*p, false));
                    }
                }
            }
        }
        if read_back.is_empty() {
            return Ok(());
        }
        let reads: Vec<Planned> = read_back
            .iter()
            .map(|(p, _)| Planned { write: false, ..*p })
            .collect();
        for p in &reads {
            self.poison(p);
            self.local
                .write_at(p.local, &self.scratch[p.local..p.local + p.len])
                .map_err(|e| format!("staging local bytes: {e}"))?;
        }
        let statuses = self.transfer(&reads)?;
        for ((p, verify), status) in read_back.iter().zip(statuses) {
            if status != TransferStatus::Completed {
                // The slot's content is unknown from here on: this worker cannot go on.
                self.error(format!("reading back a write ended {status}"));
                return Err("a slot's content is unknown after a failed read-back".into());
            }
            self.counters.moved(p.len);
            if *verify {
                self.check(p, "read-back of a write")?;
            } else {
                let local = p.local..p.local + p.len;
                self.local
                    .read_at(p.local, &mut self.scratch[local.clone()])
                    .map_err(|e| e.to_string())?;
                self.shadows[p.remote][p.offset..p.offset + p.len]
                    .copy_from_slice(&self.scratch[local]);
            }
        }
        Ok(())
    }

    /// Fills the local range of a read with the complement of what must arrive, so that a
    /// read that lands nowhere cannot pass.
    fn poison(&mut self, p: &Planned) {
        let shadow = &self.shadows[p.remote][p.offset..p.offset + p.len];
        for (byte, expected) in self.scratch[p.local..p.local + p.len]
            .iter_mut()
            .zip(shadow)
        {
            *byte = !expected;
        }
    }

    /// Compares the local range of a completed read with the shadow of its remote range.
    fn check(&mut self, p: &Planned, what: &str) -> Result<(), String> {
        let local = p.local..p.local + p.len;
        self.local
            .read_at(p.local, &mut self.scratch[local.clone()])
            .map_err(|e| e.to_string())?;
        let got = &self.scratch[local];
        let expected = &self.shadows[p.remote][p.offset..p.offset + p.len];
        if got != expected {
            let first = got
                .iter()
                .zip(expected)
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            let message = format!(
                "{what} of {} bytes at slot offset {} of peer {}: byte {first} is {:#04x}, expected {:#04x}",
                p.len, p.offset, self.remotes[p.remote].index, got[first], expected[first]
            );
            self.error(message);
        }
        Ok(())
    }

    /// Submits the plan as one batch, waits, and returns each task's status. A batch that
    /// does not finish in [`BATCH_TIMEOUT`] is canceled, and the worker stops (its local
    /// buffer may still be written by slices on the wire).
    fn transfer(&mut self, plan: &[Planned]) -> Result<Vec<TransferStatus>, String> {
        let requests: Vec<TransferRequest> = plan
            .iter()
            .map(|p| {
                let remote = &self.remotes[p.remote];
                let source = self.local.addr() + p.local;
                let target = remote.base + (self.slot_base + p.offset) as u64;
                if p.write {
                    TransferRequest::write(source, remote.id, target, p.len)
                } else {
                    TransferRequest::read(source, remote.id, target, p.len)
                }
            })
            .collect();
        let batch = self
            .engine
            .allocate_batch(requests.len())
            .map_err(|e| format!("allocate_batch: {e}"))?;
        if let Err(e) = self.engine.submit(&batch, &requests) {
            self.error(format!("submit: {e}"));
            return Ok(vec![TransferStatus::Waiting; requests.len()]);
        }
        self.counters.batches.fetch_add(1, Ordering::Relaxed);
        batch.wait(BATCH_TIMEOUT);
        let statuses: Vec<TransferStatus> = (0..requests.len())
            .map(|task| {
                batch
                    .task_status(task)
                    .map_or(TransferStatus::Waiting, |s| s.status)
            })
            .collect();
        if statuses.iter().any(|s| !s.is_finished()) {
            batch.cancel();
            self.error(format!(
                "a batch of {} did not finish in {BATCH_TIMEOUT:?}",
                requests.len()
            ));
            return Err("a batch hung".into());
        }
        if let Err(e) = self.engine.free_batch(&batch) {
            self.error(format!("free_batch: {e}"));
        }
        Ok(statuses)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initial_bytes_agree_at_any_offset() {
        let mut whole = vec![0u8; 100];
        initial_bytes(2, 0, &mut whole);
        for start in 0..20 {
            for len in [0, 1, 7, 8, 9, 33] {
                let mut part = vec![0u8; len];
                initial_bytes(2, start, &mut part);
                assert_eq!(part, whole[start..start + len]);
            }
        }
        let mut other = vec![0u8; 100];
        initial_bytes(3, 0, &mut other);
        assert_ne!(whole, other);
    }

    #[test]
    fn sizes_stay_in_range_and_span_it() {
        let mut rng = Rng::new(7);
        let sizes: Vec<usize> = (0..10_000).map(|_| rng.size(4 << 20)).collect();
        assert!(sizes.iter().all(|&s| (1..=4 << 20).contains(&s)));
        assert!(sizes.iter().any(|&s| s < 16));
        assert!(sizes.iter().any(|&s| s > 1 << 20));
        assert!((0..1000).all(|_| rng.size(1) == 1));
    }
}
