//! `tern-bench`: Tern's transfer benchmark, with the flags of Mooncake's
//! `transfer_engine_bench`, plus `--verify`, `--json` and `--mode loopback` (which starts a
//! target process itself, runs the initiator against it, and reports). A target serves until
//! SIGINT or SIGTERM (or its `--duration`), whatever its stdin is, and then shuts down cleanly:
//! its keys withdrawn, its connections closed, exit status 0.
//!
//! It must not contain transfer logic of its own: everything goes through `tern-engine`.
#![forbid(unsafe_code)]

mod service;

use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::process::{Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use tern_engine::{
    BatchState, EngineStats, OwnedBuffer, SegmentId, TransferEngine, TransferRequest,
    TransportStats,
};
use tern_metadata::http::{METRICS_PATH, MetricsServer, RenderMetrics};
use tern_transport_rdma::topology::parse_device_list;
use tern_transport_rdma::{RdmaConfig, RdmaTransport};
use tern_transport_shm::{PtracePolicy, ShmConfig, ShmTransport};
use tern_transport_tcp::{TcpConfig, TcpTransport};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    Initiator,
    Target,
    Loopback,
    /// Two nodes in this process on a watching metadata store (etcd): how long a descriptor
    /// change takes to reach the other node's cache.
    WatchLatency,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ShmMemory {
    Memfd,
    Plain,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ShmPtrace {
    Keep,
    #[value(name = "allow_same_user")]
    AllowSameUser,
    Refuse,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Operation {
    Read,
    Write,
}

/// Moves blocks between two Tern nodes as fast as it can and reports throughput and latency.
#[derive(Debug, Clone, Parser)]
#[command(name = "tern-bench", version)]
struct Args {
    /// initiator, target, or loopback (both, on 127.0.0.1).
    #[arg(long, value_enum, default_value = "initiator")]
    mode: Mode,
    /// read (remote → local) or write (local → remote).
    #[arg(long, value_enum, default_value = "read")]
    operation: Operation,
    /// Transport protocol: tcp, rdma (RDMA READ/WRITE over the NICs `--device_name`
    /// allows), or shm (same-host shared memory, with TCP installed beside it for peers it
    /// cannot reach and slices it hands back).
    #[arg(long, default_value = "tcp")]
    protocol: String,
    /// shm: the memory `allocate` hands out: memfd (peers map it) or plain (peers reach it
    /// by cross-memory attach).
    #[arg(long = "shm_memory", value_enum, default_value = "memfd")]
    shm_memory: ShmMemory,
    /// shm: what this process allows peers' cross-memory attach: keep (as the kernel
    /// says), allow_same_user (Yama's PR_SET_PTRACER_ANY), refuse (not dumpable).
    #[arg(long = "shm_ptrace", value_enum, default_value = "keep")]
    shm_ptrace: ShmPtrace,
    /// A cluster secret: peers must prove they know it (HMAC challenge–response) before the
    /// handshake RPC or a TCP data connection serves them. Default: `TERN_CLUSTER_SECRET`,
    /// or the file `TERN_CLUSTER_SECRET_FILE` names; none means plain Mooncake.
    #[arg(long = "cluster_secret")]
    cluster_secret: Option<String>,
    /// RDMA devices to use, comma separated (e.g. `rxe0,rxe1`); default: `MC_TE_FILTERS`,
    /// else every device with an active port.
    #[arg(long = "device_name")]
    device_name: Option<String>,
    /// RDMA: a NIC priority matrix file in Mooncake's JSON form (default:
    /// `MC_CUSTOM_TOPO_JSON`, else one built from the NICs' NUMA nodes).
    #[arg(long = "nic_priority_matrix")]
    nic_priority_matrix: Option<std::path::PathBuf>,
    /// Metadata connection string.
    #[arg(long = "metadata_server", default_value = "P2PHANDSHAKE")]
    metadata_server: String,
    /// This node's server name (P2P: its address).
    #[arg(long = "local_server_name")]
    local_server_name: Option<String>,
    /// The target's segment name (P2P: the `ip:port` the target printed).
    #[arg(long = "segment_id")]
    segment_id: Option<String>,
    /// Bytes per buffer on each side.
    #[arg(long = "buffer_size", default_value_t = 1 << 30)]
    buffer_size: usize,
    /// Requests per batch.
    #[arg(long = "batch_size", default_value_t = 128)]
    batch_size: usize,
    /// Bytes per request.
    #[arg(long = "block_size", default_value_t = 65536)]
    block_size: usize,
    /// Submitting threads.
    #[arg(long, default_value_t = 12)]
    threads: usize,
    /// Seconds to run [initiator: default 10; target: until SIGINT or SIGTERM when not given].
    #[arg(long)]
    duration: Option<f64>,
    /// Unit of the reported throughput: GB, GiB, Gb, MB, MiB, Mb, KB, KiB, Kb.
    #[arg(long = "report_unit", default_value = "GB")]
    report_unit: String,
    /// Digits after the decimal point in the report.
    #[arg(long = "report_precision", default_value_t = 2)]
    report_precision: usize,
    /// Check every block's content after it moves.
    #[arg(long)]
    verify: bool,
    /// Print one JSON object with the results on stdout.
    #[arg(long)]
    json: bool,
    /// TCP connections per peer.
    #[arg(long = "tcp_connections")]
    tcp_connections: Option<usize>,
    /// Largest TCP slice in bytes.
    #[arg(long = "tcp_slice_size")]
    tcp_slice_size: Option<usize>,
    /// After the run, stay idle this many seconds with the endpoints open and report the CPU
    /// the initiator (and, in loopback, the target) used meanwhile.
    #[arg(long = "idle_seconds")]
    idle_seconds: Option<f64>,
    /// Target: also stop when stdin reaches end of file (for a parent process that holds it
    /// open, as `--mode loopback` does).
    #[arg(long = "stop_on_stdin_eof")]
    stop_on_stdin_eof: bool,
    /// Target: serve this engine's metrics (Prometheus text) at `http://ADDR/metrics`; port 0
    /// picks one. The address is printed as `metrics: <url>`, after the segment line.
    #[arg(long = "metrics_addr")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Pages workload (the shape of a KV cache as serving stacks move it): each (layer,
    /// page) one request of `--page_size` bytes, submitted `--batch_size` at a time, instead
    /// of `--block_size` blocks. Pages per layer; giving it selects the workload.
    #[arg(long)]
    pages: Option<usize>,
    /// Pages workload: layers, each a range of its pages followed by a one-page gap, so that
    /// no two layers' pages are ever neighbours.
    #[arg(long, default_value_t = 32)]
    layers: usize,
    /// Pages workload: bytes per page (per request).
    #[arg(long = "page_size", default_value_t = 16 << 10)]
    page_size: usize,
    /// Pages workload: the order of the requests: contiguous (layer by layer, page by page),
    /// runs:N (runs of N consecutive pages of a layer, the runs in a random order), or
    /// shuffled (every page in a random order).
    #[arg(long = "page_order", default_value = "contiguous", value_parser = PageOrder::parse)]
    page_order: PageOrder,
    /// Turns off the engine's merging of neighbouring requests into runs, to measure what
    /// it gains.
    #[arg(long = "no_merge")]
    no_merge: bool,
}

/// The order a pages workload submits its pages in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PageOrder {
    Contiguous,
    /// Runs of this many consecutive pages, the runs shuffled.
    Runs(usize),
    Shuffled,
}

impl PageOrder {
    fn parse(text: &str) -> Result<Self, String> {
        match text {
            "contiguous" => Ok(Self::Contiguous),
            "shuffled" => Ok(Self::Shuffled),
            _ => text
                .strip_prefix("runs:")
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|&n| n > 0)
                .map(Self::Runs)
                .ok_or_else(|| format!("{text:?} is not contiguous, runs:N (N > 0) or shuffled")),
        }
    }

    fn name(&self) -> String {
        match self {
            Self::Contiguous => "contiguous".into(),
            Self::Runs(n) => format!("runs:{n}"),
            Self::Shuffled => "shuffled".into(),
        }
    }
}

/// The pages workload's layout: where each page sits (the same offset on both sides).
#[derive(Debug, Clone, Copy)]
struct PageLayout {
    layers: usize,
    pages: usize,
    page_size: usize,
}

impl PageLayout {
    fn of(args: &Args) -> Option<Self> {
        args.pages.map(|pages| Self {
            layers: args.layers,
            pages,
            page_size: args.page_size,
        })
    }

    /// Bytes from one layer's start to the next: its pages and a one-page gap.
    fn layer_stride(&self) -> Option<usize> {
        self.pages.checked_add(1)?.checked_mul(self.page_size)
    }

    /// Bytes of buffer the layout spans on each side.
    fn span(&self) -> Option<usize> {
        self.layer_stride()?.checked_mul(self.layers)
    }

    /// Every page's offset, in the order `order` submits them; `seed` picks the shuffle.
    fn offsets(&self, order: PageOrder, seed: u64) -> Vec<usize> {
        let stride = self.layer_stride().unwrap_or(0);
        let page = |layer: usize, page: usize| layer * stride + page * self.page_size;
        let mut random = SplitMix(seed);
        match order {
            PageOrder::Contiguous => (0..self.layers)
                .flat_map(|l| (0..self.pages).map(move |p| page(l, p)))
                .collect(),
            PageOrder::Shuffled => {
                let mut all = self.offsets(PageOrder::Contiguous, seed);
                random.shuffle(&mut all);
                all
            }
            PageOrder::Runs(n) => {
                let mut runs: Vec<(usize, usize)> = (0..self.layers)
                    .flat_map(|l| (0..self.pages).step_by(n).map(move |p| (l, p)))
                    .collect();
                random.shuffle(&mut runs);
                runs.into_iter()
                    .flat_map(|(l, first)| {
                        (first..(first + n).min(self.pages)).map(move |p| page(l, p))
                    })
                    .collect()
            }
        }
    }
}

/// A small, seeded generator (SplitMix64): the bench's shuffles repeat from run to run.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let z = (self.0 ^ (self.0 >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Fisher–Yates.
    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            items.swap(i, j);
        }
    }
}

/// The initiator's run time when `--duration` is not given.
const DEFAULT_DURATION_SECS: f64 = 10.0;

fn main() -> ExitCode {
    let filter = match std::env::var("RUST_LOG").as_deref() {
        Ok("trace") => tracing::Level::TRACE,
        Ok("debug") => tracing::Level::DEBUG,
        Ok("info") => tracing::Level::INFO,
        Ok("error") => tracing::Level::ERROR,
        _ => tracing::Level::WARN,
    };
    tracing_subscriber::fmt()
        .with_max_level(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("tern-bench: {message}");
            ExitCode::FAILURE
        }
    }
}

/// The flags that do not go together, as a clear error before anything starts.
fn check_flags(args: &Args) -> Result<(), String> {
    if args.block_size == 0 || args.batch_size == 0 || args.threads == 0 {
        return Err("--block_size, --batch_size and --threads must be positive".into());
    }
    unit_scale(&args.report_unit)?;
    run_time(args)?;
    // A target only offers its buffer: the blocks are the initiator's to choose.
    if args.mode != Mode::Target && args.block_size > args.buffer_size {
        return Err("--block_size is larger than --buffer_size".into());
    }
    if args.metrics_addr.is_some() && args.mode != Mode::Target {
        return Err("--metrics_addr is for --mode target".into());
    }
    if let Some(layout) = PageLayout::of(args) {
        if layout.pages == 0 || layout.layers == 0 || layout.page_size == 0 {
            return Err("--pages, --layers and --page_size must be positive".into());
        }
        let span = layout.span().filter(|&span| span <= args.buffer_size);
        if args.mode != Mode::Target && span.is_none() {
            return Err(format!(
                "--layers {} of --pages {} (and a one-page gap) of --page_size {} do not fit \
                 in --buffer_size {}",
                layout.layers, layout.pages, layout.page_size, args.buffer_size
            ));
        }
    }
    Ok(())
}

fn run(args: &Args) -> Result<(), String> {
    check_flags(args)?;
    enough_memory(args, available_memory())?;
    match args.mode {
        Mode::Target => run_target(args),
        Mode::Initiator => {
            let segment = args
                .segment_id
                .clone()
                .ok_or("--segment_id names the target (it prints it at start)")?;
            report(args, &run_initiator(args, &segment, None)?)
        }
        Mode::Loopback => run_loopback(args),
        Mode::WatchLatency => run_watch_latency(args),
    }
}

/// The bytes the kernel says it can give without swapping (`MemAvailable`), if it says.
fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses to start when the buffers this run pre-touches (both sides' in loopback) do not
/// fit in `available` memory, naming the flag to lower, rather than be killed by the kernel
/// half way.
fn enough_memory(args: &Args, available: Option<u64>) -> Result<(), String> {
    let Some(available) = available else {
        return Ok(());
    };
    let (buffers, who) = match args.mode {
        Mode::Loopback => (2, "the target's and the initiator's buffers"),
        Mode::Target | Mode::Initiator => (1, "its buffer"),
        Mode::WatchLatency => return Ok(()),
    };
    let needed = buffers * args.buffer_size as u64;
    // Room for everything else the processes hold.
    let margin = 64 << 20;
    if needed + margin > available {
        let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
        let fits = (available.saturating_sub(margin) / buffers) >> 20 << 20;
        return Err(format!(
            "--mode {} needs {:.2} GiB for {who} (--buffer_size {} each), but only {:.2} GiB \
             of memory is available; lower --buffer_size (at most {fits} here)",
            args.mode
                .to_possible_value()
                .map_or_else(String::new, |v| v.get_name().to_owned()),
            gib(needed),
            args.buffer_size,
            gib(available),
        ));
    }
    Ok(())
}

fn engine(args: &Args, default_name: Option<&str>) -> Result<TransferEngine, String> {
    let mut builder = TransferEngine::builder()
        .metadata(args.metadata_server.clone())
        .merge_requests(!args.no_merge);
    if let Some(secret) = &args.cluster_secret {
        builder = builder.cluster_secret(secret);
    }
    let tcp = || {
        let defaults = TcpConfig::default();
        TcpTransport::new(TcpConfig {
            connections_per_peer: args
                .tcp_connections
                .unwrap_or(defaults.connections_per_peer),
            slice_size: args.tcp_slice_size.unwrap_or(defaults.slice_size),
            ..defaults
        })
    };
    builder = match args.protocol.as_str() {
        "tcp" => builder.transport(tcp()),
        "shm" => builder
            .transport(ShmTransport::new(ShmConfig {
                memfd_buffers: args.shm_memory == ShmMemory::Memfd,
                ptrace: match args.shm_ptrace {
                    ShmPtrace::Keep => PtracePolicy::Keep,
                    ShmPtrace::AllowSameUser => PtracePolicy::AllowSameUser,
                    ShmPtrace::Refuse => PtracePolicy::Refuse,
                },
                ..ShmConfig::default()
            }))
            .transport(tcp()),
        "rdma" => {
            let mut config = RdmaConfig::from_env();
            if let Some(list) = &args.device_name {
                config.devices = parse_device_list(list);
            }
            if let Some(path) = &args.nic_priority_matrix {
                config.topology_file = Some(path.clone());
            }
            builder.transport(RdmaTransport::discover(config).map_err(|e| e.to_string())?)
        }
        other => {
            return Err(format!(
                "--protocol={other} is not available; use --protocol=tcp, rdma or shm"
            ));
        }
    };
    if let Some(name) = args.local_server_name.as_deref().or(default_name) {
        builder = builder.local_server_name(name);
    }
    builder
        .build()
        .map_err(|e| format!("starting the engine: {e}"))
}

/// `--duration`, checked.
fn run_time(args: &Args) -> Result<Option<Duration>, String> {
    args.duration
        .map(|secs| {
            Duration::try_from_secs_f64(secs)
                .map_err(|_| format!("--duration {secs} is not a number of seconds"))
        })
        .transpose()
}

/// The byte every node keeps at offset `i` of its buffer when verifying.
fn expected_byte(offset: usize) -> u8 {
    let x = (offset as u64 / 8).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (offset as u64 % 8);
    (x >> 56) as u8 ^ (offset as u8)
}

fn fill_pattern(buffer: &OwnedBuffer) -> Result<(), String> {
    const CHUNK: usize = 1 << 20;
    let mut chunk = vec![0u8; CHUNK];
    let mut offset = 0;
    while offset < buffer.len() {
        let len = CHUNK.min(buffer.len() - offset);
        for (i, byte) in chunk[..len].iter_mut().enumerate() {
            *byte = expected_byte(offset + i);
        }
        buffer
            .write_at(offset, &chunk[..len])
            .map_err(|e| e.to_string())?;
        offset += len;
    }
    Ok(())
}

fn run_target(args: &Args) -> Result<(), String> {
    let limit = run_time(args)?;
    // Before the engine starts, so that a signal sent during start-up is not lost.
    let stop = service::Stop::install()?;
    if args.stop_on_stdin_eof {
        stop.on_stdin_eof()?;
    }
    let engine = Arc::new(engine(args, None)?);
    let buffer = engine
        .allocate(args.buffer_size, "cpu:0")
        .map_err(|e| format!("allocating the buffer: {e}"))?;
    fill_pattern(&buffer)?;
    let metrics = match args.metrics_addr {
        Some(addr) => {
            let engine = Arc::downgrade(&engine);
            let render: RenderMetrics = Arc::new(move || {
                engine
                    .upgrade()
                    .map(|engine| engine.stats().prometheus())
                    .unwrap_or_default()
            });
            let server = MetricsServer::start(addr, render)
                .map_err(|e| format!("--metrics_addr {addr}: {e}"))?;
            Some(server)
        }
        None => None,
    };
    // One write, so that a reader who takes only the first line still gets both.
    let mut said = format!("segment: {}\n", engine.segment_name());
    if let Some(server) = &metrics {
        said += &format!("metrics: http://{}{METRICS_PATH}\n", server.local_addr());
    }
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(said.as_bytes())
        .and_then(|()| stdout.flush())
        .map_err(|e| e.to_string())?;
    drop(stdout);
    eprintln!(
        "tern-bench target: segment {} ({} bytes at {:#x}); run the initiator with --segment_id={}; stop with Ctrl-C or SIGTERM",
        engine.segment_name(),
        buffer.len(),
        buffer.addr(),
        engine.segment_name()
    );
    let reason = stop.wait(limit);
    eprintln!(
        "tern-bench target: {reason}; withdrawing segment {} and exiting",
        engine.segment_name()
    );
    drop(metrics);
    // Dropping the engine closes its connections and deletes its keys (etcd, HTTP) at once.
    drop(engine);
    drop(buffer);
    Ok(())
}

#[derive(Debug, Default)]
struct Outcome {
    duration: Duration,
    bytes: u64,
    batches: u64,
    /// Requests submitted (tasks).
    requests: u64,
    /// Time spent inside `submit` calls, summed over the workers.
    submit_time: Duration,
    latencies_us: Vec<f64>,
    /// With `--idle_seconds`: percent of one core the initiator (and the target, when this
    /// process started it) used while idle with its endpoints open.
    idle_cpu: Option<(f64, Option<f64>)>,
    /// CPU seconds the initiator (this process) and the target (when this process knows its
    /// pid) used during the timed run.
    run_cpu: (Option<f64>, Option<f64>),
    /// The engine's statistics at the end.
    stats: Option<EngineStats>,
}

/// User plus system CPU time of a process so far, from `/proc/<pid>/stat` (in clock ticks
/// of 1/100 s: USER_HZ is 100 for `/proc` on Linux).
fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces; the fields after it are plain numbers.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<f64>().ok();
    Some((ticks(11)? + ticks(12)?) / 100.0)
}

/// Percent of a core each process uses over `seconds` of doing nothing.
fn idle_cpu(seconds: f64, target: Option<u32>) -> (f64, Option<f64>) {
    let target = target.map(|pid| pid.to_string());
    let before = (cpu_seconds("self"), target.as_deref().and_then(cpu_seconds));
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let wall = started.elapsed().as_secs_f64();
    let after = (cpu_seconds("self"), target.as_deref().and_then(cpu_seconds));
    let percent = |a: Option<f64>, b: Option<f64>| Some((b? - a?) / wall * 100.0);
    (
        percent(before.0, after.0).unwrap_or(f64::NAN),
        percent(before.1, after.1),
    )
}

fn run_initiator(args: &Args, segment: &str, target: Option<u32>) -> Result<Outcome, String> {
    let engine = engine(args, None)?;
    let peer = engine
        .open_segment(segment)
        .map_err(|e| format!("opening segment {segment}: {e}"))?;
    let remote = engine
        .segment(peer)
        .ok_or("segment vanished")?
        .desc
        .buffers
        .iter()
        .max_by_key(|b| b.length)
        .cloned()
        .ok_or_else(|| format!("segment {segment} has no buffers"))?;
    let local = engine
        .allocate(args.buffer_size, "cpu:0")
        .map_err(|e| format!("allocating the buffer: {e}"))?;
    if args.verify || args.operation == Operation::Write {
        fill_pattern(&local)?;
    }
    let usable = (local.len().min(remote.length as usize) / args.block_size) * args.block_size;
    if usable == 0 {
        return Err("the remote buffer is smaller than one block".into());
    }
    let pages = match PageLayout::of(args) {
        Some(layout) => {
            if layout
                .span()
                .is_none_or(|span| span > remote.length as usize)
            {
                return Err(format!(
                    "the remote buffer ({} bytes) is smaller than --layers × (--pages + 1) × \
                     --page_size",
                    remote.length
                ));
            }
            Some(layout.offsets(args.page_order, 0x5EED))
        }
        None => None,
    };
    let ctx = Shared {
        pages,
        engine: &engine,
        peer,
        local: &local,
        remote_addr: remote.addr,
        usable,
        args,
        moved: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        start: Barrier::new(args.threads + 1),
    };
    let deadline = run_time(args)?.unwrap_or(Duration::from_secs_f64(DEFAULT_DURATION_SECS));
    let (outcome, started) = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..args.threads)
            .map(|thread| {
                let ctx = &ctx;
                scope.spawn(move || ctx.worker(thread))
            })
            .collect();
        let target_pid = target.map(|pid| pid.to_string());
        let cpu_now = || {
            (
                cpu_seconds("self"),
                target_pid.as_deref().and_then(cpu_seconds),
            )
        };
        ctx.start.wait();
        let cpu_before = cpu_now();
        let started = Instant::now();
        show_progress(&ctx, started, deadline);
        ctx.stop.store(true, Ordering::Release);
        let mut outcome = Outcome::default();
        let mut failure = None;
        for worker in workers {
            match worker.join() {
                Ok(Ok(result)) => {
                    outcome.batches += result.batches;
                    outcome.bytes += result.bytes;
                    outcome.requests += result.requests;
                    outcome.submit_time += result.submit_time;
                    outcome.latencies_us.extend(result.latencies_us);
                }
                Ok(Err(e)) => failure = Some(e),
                Err(_) => failure = Some("a worker thread panicked".into()),
            }
        }
        outcome.duration = started.elapsed();
        let cpu_after = cpu_now();
        let spent = |a: Option<f64>, b: Option<f64>| Some(b? - a?);
        outcome.run_cpu = (
            spent(cpu_before.0, cpu_after.0),
            spent(cpu_before.1, cpu_after.1),
        );
        (failure.map_or(Ok(outcome), Err), started)
    });
    let _ = started;
    let mut outcome = outcome?;
    if let Some(seconds) = args.idle_seconds {
        outcome.idle_cpu = Some(idle_cpu(seconds, target));
    }
    outcome.stats = Some(engine.stats());
    Ok(outcome)
}

fn show_progress(ctx: &Shared<'_>, started: Instant, run_for: Duration) {
    let verbose = run_for >= Duration::from_secs(5) || std::io::stderr().is_terminal();
    let mut last_bytes = 0;
    let mut last = started;
    while started.elapsed() < run_for {
        let left = run_for.saturating_sub(started.elapsed());
        std::thread::sleep(left.min(Duration::from_secs(1)));
        if verbose && started.elapsed() < run_for {
            let bytes = ctx.moved.load(Ordering::Relaxed);
            let rate = (bytes - last_bytes) as f64 / last.elapsed().as_secs_f64() / 1e9;
            eprintln!(
                "progress: {:>5.1}/{:.0} s  {rate:.2} GB/s",
                started.elapsed().as_secs_f64(),
                run_for.as_secs_f64()
            );
            (last_bytes, last) = (bytes, Instant::now());
        }
    }
}

struct Shared<'a> {
    /// Pages workload: every page's offset, in submission order.
    pages: Option<Vec<usize>>,
    engine: &'a TransferEngine,
    peer: SegmentId,
    local: &'a OwnedBuffer,
    remote_addr: u64,
    usable: usize,
    args: &'a Args,
    moved: AtomicU64,
    stop: AtomicBool,
    start: Barrier,
}

impl Shared<'_> {
    /// Bytes per request.
    fn request_len(&self) -> usize {
        match &self.pages {
            Some(_) => self.args.page_size,
            None => self.args.block_size,
        }
    }

    /// The offsets (the same on both sides) of the requests of a thread's `round`th batch.
    fn batch_offsets(&self, thread: usize, round: usize, offsets: &mut Vec<usize>) {
        let args = self.args;
        offsets.clear();
        match &self.pages {
            Some(pages) => {
                // The page list cut into batches, the threads taking them in turn.
                let batches = pages.len().div_ceil(args.batch_size);
                let batch = (thread + round * args.threads) % batches;
                let first = batch * args.batch_size;
                offsets
                    .extend_from_slice(&pages[first..(first + args.batch_size).min(pages.len())]);
            }
            None => {
                let blocks = self.usable / args.block_size;
                offsets.extend((0..args.batch_size).map(|i| {
                    let block =
                        (thread * args.batch_size + round * args.threads * args.batch_size + i)
                            % blocks;
                    block * args.block_size
                }));
            }
        }
    }

    fn worker(&self, thread: usize) -> Result<Outcome, String> {
        let args = self.args;
        let len = self.request_len();
        let mut outcome = Outcome::default();
        let mut requests = Vec::with_capacity(args.batch_size);
        let mut offsets = Vec::with_capacity(args.batch_size);
        let mut round = 0usize;
        let mut scratch = vec![0u8; if args.verify { len } else { 0 }];
        let read_back = if args.verify && args.operation == Operation::Write {
            Some(
                self.engine
                    .allocate(len, "cpu:0")
                    .map_err(|e| format!("allocating the --verify buffer: {e}"))?,
            )
        } else {
            None
        };
        self.start.wait();
        while !self.stop.load(Ordering::Acquire) {
            self.batch_offsets(thread, round, &mut offsets);
            requests.clear();
            requests.extend(offsets.iter().map(|&offset| {
                let local = self.local.addr() + offset;
                let remote = self.remote_addr + offset as u64;
                match args.operation {
                    Operation::Read => TransferRequest::read(local, self.peer, remote, len),
                    Operation::Write => TransferRequest::write(local, self.peer, remote, len),
                }
            }));
            let began = Instant::now();
            let batch = self
                .engine
                .allocate_batch(requests.len())
                .map_err(|e| e.to_string())?;
            let submitting = Instant::now();
            self.engine
                .submit(&batch, &requests)
                .map_err(|e| format!("submit: {e}"))?;
            outcome.submit_time += submitting.elapsed();
            let status = batch.wait(Duration::from_secs(600));
            let latency = began.elapsed();
            if status.state != BatchState::Completed {
                let reason = (0..status.submitted)
                    .filter_map(|t| batch.task_status(t))
                    .find(|s| {
                        s.status.is_finished() && s.status != tern_engine::TransferStatus::Completed
                    })
                    .map_or_else(|| format!("{status:?}"), |s| s.status.to_string());
                return Err(format!("batch did not complete: {reason}"));
            }
            self.engine.free_batch(&batch).map_err(|e| e.to_string())?;
            if args.verify {
                self.verify(&offsets, &mut scratch, read_back.as_ref())?;
            }
            outcome.batches += 1;
            outcome.requests += requests.len() as u64;
            outcome.bytes += status.transferred_bytes;
            outcome.latencies_us.push(latency.as_secs_f64() * 1e6);
            self.moved
                .fetch_add(status.transferred_bytes, Ordering::Relaxed);
            round += 1;
        }
        Ok(outcome)
    }

    /// Reads: the local block must hold the target's pattern. Writes: the block is read
    /// back from the target and must hold the pattern that was written.
    fn verify(
        &self,
        offsets: &[usize],
        scratch: &mut [u8],
        read_back: Option<&OwnedBuffer>,
    ) -> Result<(), String> {
        for &offset in offsets {
            match read_back {
                None => self
                    .local
                    .read_at(offset, scratch)
                    .map_err(|e| e.to_string())?,
                Some(verify_buf) => {
                    self.engine
                        .transfer_sync(TransferRequest::read(
                            verify_buf.addr(),
                            self.peer,
                            self.remote_addr + offset as u64,
                            scratch.len(),
                        ))
                        .map_err(|e| format!("reading back for --verify: {e}"))?;
                    verify_buf.read_at(0, scratch).map_err(|e| e.to_string())?;
                }
            }
            if let Some(i) = (0..scratch.len()).find(|&i| scratch[i] != expected_byte(offset + i)) {
                return Err(format!(
                    "--verify: byte {} of the block at offset {offset} is {:#04x}, expected {:#04x}",
                    i,
                    scratch[i],
                    expected_byte(offset + i)
                ));
            }
        }
        Ok(())
    }
}

fn run_loopback(args: &Args) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // The target stops when its stdin closes: when this process is done with it, or dies.
    let mut child = Command::new(exe)
        .args([
            "--mode=target",
            "--stop_on_stdin_eof",
            "--local_server_name=127.0.0.1",
            &format!("--metadata_server={}", args.metadata_server),
            &format!("--protocol={}", args.protocol),
            &format!("--buffer_size={}", args.buffer_size),
            &format!("--shm_memory={}", value_name(args.shm_memory)),
            &format!("--shm_ptrace={}", value_name(args.shm_ptrace)),
        ])
        .args(
            args.device_name
                .iter()
                .map(|d| format!("--device_name={d}")),
        )
        // Through the environment, not argv, so that `ps` does not show it.
        .envs(
            args.cluster_secret
                .iter()
                .map(|s| ("TERN_CLUSTER_SECRET", s.as_str())),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting the target process: {e}"))?;
    // Drained on a thread so that the target never blocks on a full pipe; shown if it fails.
    let stderr = child.stderr.take().map(|mut pipe| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    });
    let mut first_line = String::new();
    if let Some(stdout) = child.stdout.take() {
        BufReader::new(stdout)
            .read_line(&mut first_line)
            .map_err(|e| e.to_string())?;
    }
    let result = first_line.trim().strip_prefix("segment: ").map(|segment| {
        let mut initiator = args.clone();
        initiator.local_server_name = Some("127.0.0.1".into());
        run_initiator(&initiator, segment, Some(child.id()))
    });
    drop(child.stdin.take());
    let status = child
        .wait()
        .map_err(|e| format!("waiting for the target: {e}"))?;
    let target_said = || {
        let text = stderr
            .and_then(|thread| thread.join().ok())
            .unwrap_or_default();
        let lines: Vec<&str> = text
            .lines()
            .map(|line| line.strip_prefix("tern-bench: ").unwrap_or(line))
            .filter(|line| !line.starts_with("tern-bench target: "))
            .collect();
        if lines.is_empty() {
            String::from("(it printed nothing)")
        } else {
            lines.join("\n")
        }
    };
    match result {
        None => Err(format!(
            "the target process did not start ({status}): {}",
            target_said()
        )),
        Some(result) if !status.success() => Err(format!(
            "{}the target process failed ({status}): {}",
            result.err().map(|e| e + "; ").unwrap_or_default(),
            target_said()
        )),
        Some(result) => report(args, &result?),
    }
}

/// The flag spelling of a value.
fn value_name(value: impl ValueEnum) -> String {
    value
        .to_possible_value()
        .map_or_else(String::new, |v| v.get_name().to_owned())
}

fn run_watch_latency(args: &Args) -> Result<(), String> {
    const CHANGES: usize = 20;
    let tag = std::process::id();
    let mut target_args = args.clone();
    target_args.local_server_name = Some(format!("watch-target-{tag}"));
    let target = engine(&target_args, None)?;
    let mut initiator_args = args.clone();
    initiator_args.local_server_name = Some(format!("watch-initiator-{tag}"));
    let initiator = engine(&initiator_args, None)?;
    let peer = initiator
        .open_segment(target.segment_name())
        .map_err(|e| format!("opening the target: {e}"))?;
    let mut samples = Vec::with_capacity(CHANGES);
    for _ in 0..CHANGES {
        let started = Instant::now();
        let buffer = target.allocate(4096, "cpu:0").map_err(|e| e.to_string())?;
        let addr = buffer.addr() as u64;
        loop {
            let seen = initiator
                .segment(peer)
                .is_some_and(|p| p.desc.buffers.iter().any(|b| b.addr == addr));
            if seen {
                break;
            }
            if started.elapsed() > Duration::from_secs(10) {
                return Err("a descriptor change did not arrive within 10 s".into());
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        samples.push(started.elapsed().as_secs_f64() * 1e3);
        drop(buffer);
        std::thread::sleep(Duration::from_millis(20));
    }
    samples.sort_by(f64::total_cmp);
    let json = serde_json::json!({
        "samples": samples.len(),
        "median_ms": percentile(&samples, 50.0),
        "p90_ms": percentile(&samples, 90.0),
        "max_ms": samples.last().copied().unwrap_or(0.0),
    });
    println!("{json}");
    Ok(())
}

fn unit_scale(unit: &str) -> Result<f64, String> {
    Ok(match unit {
        "GB" => 1e9,
        "GiB" => (1u64 << 30) as f64,
        "Gb" => 1e9 / 8.0,
        "MB" => 1e6,
        "MiB" => (1u64 << 20) as f64,
        "Mb" => 1e6 / 8.0,
        "KB" => 1e3,
        "KiB" => 1024.0,
        "Kb" => 1e3 / 8.0,
        other => {
            return Err(format!(
                "--report_unit {other:?} is not one of GB GiB Gb MB MiB Mb KB KiB Kb"
            ));
        }
    })
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// One line per transport: what it moved, and how each peer stands.
fn describe_transport(stats: &TransportStats) -> String {
    let peers: Vec<String> = stats
        .peers
        .iter()
        .map(|p| {
            let error = p
                .last_error
                .as_ref()
                .map_or_else(String::new, |e| format!(", last error: {e}"));
            format!("{} {:?} ({} open{error})", p.peer, p.state, p.endpoints)
        })
        .collect();
    format!(
        "{}: {} bytes in {} slices, {} retries, {} failures; peers: {}",
        stats.protocol,
        stats.bytes,
        stats.slices,
        stats.retries,
        stats.failures,
        if peers.is_empty() {
            "none".to_owned()
        } else {
            peers.join("; ")
        }
    )
}

fn report(args: &Args, outcome: &Outcome) -> Result<(), String> {
    let secs = outcome.duration.as_secs_f64().max(1e-9);
    let scale = unit_scale(&args.report_unit)?;
    let mut latencies = outcome.latencies_us.clone();
    latencies.sort_by(f64::total_cmp);
    let avg = latencies.iter().sum::<f64>() / latencies.len().max(1) as f64;
    let line = format!(
        "Test completed: duration {secs:.2}, batch count {}, throughput {:.prec$} {}/s",
        outcome.batches,
        outcome.bytes as f64 / secs / scale,
        args.report_unit,
        prec = args.report_precision
    );
    let requests = outcome.requests.max(1) as f64;
    let submit_ns_per_request = outcome.submit_time.as_secs_f64() * 1e9 / requests;
    let batch_ns_per_request = latencies.iter().sum::<f64>() * 1e3 / requests;
    let workload = PageLayout::of(args).map_or_else(
        || "blocks".to_owned(),
        |l| {
            format!(
                "{} layers × {} pages of {} bytes, {}",
                l.layers,
                l.pages,
                l.page_size,
                args.page_order.name()
            )
        },
    );
    if !args.json {
        println!("{line}");
        println!(
            "{workload}: {:.0} requests/s; per request: {submit_ns_per_request:.0} ns in \
             submit, {batch_ns_per_request:.0} ns from submit to done (merging {})",
            outcome.requests as f64 / secs,
            if args.no_merge { "off" } else { "on" }
        );
        println!(
            "latency per batch of {}: avg {avg:.1} us, p50 {:.1} us, p99 {:.1} us",
            args.batch_size,
            percentile(&latencies, 50.0),
            percentile(&latencies, 99.0)
        );
        for transport in outcome.stats.iter().flat_map(|s| &s.transports) {
            println!("{}", describe_transport(transport));
        }
        if let Some((initiator, target)) = outcome.idle_cpu {
            let target = target.map_or_else(|| "not measured".to_owned(), |t| format!("{t:.2}%"));
            println!(
                "idle with endpoints open: initiator {initiator:.2}% of a core, target {target}"
            );
        }
        return Ok(());
    }
    eprintln!("{line}");
    let json = serde_json::json!({
        "protocol": args.protocol,
        "operation": match args.operation { Operation::Read => "read", Operation::Write => "write" },
        "block_size": args.block_size,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "duration_s": secs,
        "bytes": outcome.bytes,
        "gbps": outcome.bytes as f64 / secs / 1e9,
        "avg_latency_us": avg,
        "p50_latency_us": percentile(&latencies, 50.0),
        "p99_latency_us": percentile(&latencies, 99.0),
        "messages_per_s": outcome.batches as f64 * args.batch_size as f64 / secs,
        "workload": workload,
        "pages": PageLayout::of(args).map(|l| serde_json::json!({
            "layers": l.layers,
            "pages": l.pages,
            "page_size": l.page_size,
            "page_order": args.page_order.name(),
        })),
        "merge_requests": !args.no_merge,
        "requests": outcome.requests,
        "requests_per_s": outcome.requests as f64 / secs,
        "submit_ns_per_request": submit_ns_per_request,
        "batch_ns_per_request": batch_ns_per_request,
        "cpu_initiator_s": outcome.run_cpu.0,
        "cpu_target_s": outcome.run_cpu.1,
        "cpu_us_per_gb": match outcome.run_cpu {
            (Some(i), Some(t)) if outcome.bytes > 0 => Some((i + t) * 1e6 / (outcome.bytes as f64 / 1e9)),
            _ => None,
        },
        "idle_cpu_initiator_pct": outcome.idle_cpu.map(|c| c.0),
        "idle_cpu_target_pct": outcome.idle_cpu.and_then(|c| c.1),
        "stats": outcome.stats,
    });
    println!("{json}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &[&str]) -> Args {
        Args::parse_from(std::iter::once("tern-bench").chain(line.iter().copied()))
    }

    #[test]
    fn page_orders_visit_every_page_once_and_runs_keep_their_pages_together() {
        let layout = PageLayout {
            layers: 3,
            pages: 10,
            page_size: 4096,
        };
        let stride = 11 * 4096;
        let mut every: Vec<usize> = (0..3)
            .flat_map(|l| (0..10).map(move |p| l * stride + p * 4096))
            .collect();
        assert_eq!(layout.offsets(PageOrder::Contiguous, 1), every);
        for order in [PageOrder::Shuffled, PageOrder::Runs(4)] {
            let mut offsets = layout.offsets(order, 1);
            assert_ne!(offsets, every, "{order:?} is not the contiguous order");
            offsets.sort_unstable();
            every.sort_unstable();
            assert_eq!(offsets, every, "{order:?}");
        }
        // Runs of 4 (the last of a layer shorter): within a run, consecutive pages.
        let runs = layout.offsets(PageOrder::Runs(4), 1);
        let mut at = 0;
        while at < runs.len() {
            let (layer, page) = (runs[at] / stride, runs[at] % stride / 4096);
            assert_eq!(page % 4, 0, "a run starts on a multiple of 4");
            let len = 4.min(10 - page);
            for k in 0..len {
                assert_eq!(runs[at + k], layer * stride + (page + k) * 4096);
            }
            at += len;
        }
    }

    #[test]
    fn page_flags_are_checked_before_anything_starts() {
        assert_eq!(PageOrder::parse("runs:8"), Ok(PageOrder::Runs(8)));
        assert!(PageOrder::parse("runs:0").is_err());
        assert!(PageOrder::parse("sorted").is_err());
        let fits = [
            "--mode=loopback",
            "--pages=63",
            "--layers=4",
            "--buffer_size=1048576",
        ];
        check_flags(&args(&[&fits[..], &["--page_size=4096"]].concat())).unwrap();
        let error = check_flags(&args(&[&fits[..], &["--page_size=8192"]].concat())).unwrap_err();
        assert!(error.contains("do not fit"), "{error}");
        let error = check_flags(&args(&["--pages=0"])).unwrap_err();
        assert!(error.contains("must be positive"), "{error}");
    }

    #[test]
    fn short_memory_is_a_clear_error_naming_the_flag() {
        let loopback = args(&["--mode=loopback"]);
        // The default 1 GiB buffers, twice, on a machine with 1.5 GiB to give.
        let error = enough_memory(&loopback, Some(3 << 29)).unwrap_err();
        assert!(error.contains("lower --buffer_size"), "{error}");
        assert!(error.contains("2.00 GiB"), "{error}");
        // What it suggests fits.
        let fits: usize = error
            .rsplit("at most ")
            .next()
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap();
        let smaller = args(&["--mode=loopback", &format!("--buffer_size={fits}")]);
        enough_memory(&smaller, Some(3 << 29)).unwrap();
        // One buffer for a target; unknown memory is not refused.
        enough_memory(&args(&["--mode=target"]), Some(3 << 29)).unwrap();
        enough_memory(&loopback, None).unwrap();
    }

    #[test]
    fn a_buffer_of_one_block_is_fine_and_a_smaller_one_is_refused_only_where_blocks_are_chosen() {
        // One 4 KiB block moved again and again, as perftest's latency tests do: the target
        // offers the 4 KiB whatever --block_size it was given.
        let one_block = ["--block_size=4096", "--buffer_size=4096"];
        check_flags(&args(&[&["--mode=loopback"][..], &one_block].concat())).unwrap();
        check_flags(&args(&["--mode=target", "--buffer_size=4096"])).unwrap();
        let error = check_flags(&args(&[
            "--mode=loopback",
            "--block_size=8192",
            "--buffer_size=4096",
        ]))
        .unwrap_err();
        assert!(error.contains("larger than --buffer_size"), "{error}");
        let error = check_flags(&args(&["--mode=loopback", "--block_size=0"])).unwrap_err();
        assert!(error.contains("must be positive"), "{error}");
    }
}
