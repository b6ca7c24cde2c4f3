//! The command line: Mooncake's `transfer_engine_bench` flags and Tern's own, and the checks
//! of what does not go together (or does not fit in this machine's memory) before anything
//! starts.

use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::report::unit_scale;
use crate::workload::{PageLayout, PageOrder};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Mode {
    Initiator,
    Target,
    Loopback,
    /// Two nodes in this process on a watching metadata store (etcd): how long a descriptor
    /// change takes to reach the other node's cache.
    WatchLatency,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ShmMemory {
    Memfd,
    Plain,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum ShmPtrace {
    Keep,
    #[value(name = "allow_same_user")]
    AllowSameUser,
    Refuse,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Operation {
    Read,
    Write,
}

/// Moves blocks between two Tern nodes as fast as it can and reports throughput and latency.
#[derive(Debug, Clone, Parser)]
#[command(name = "tern-bench", version)]
pub(crate) struct Args {
    /// initiator, target, or loopback (both, on 127.0.0.1).
    #[arg(long, value_enum, default_value = "initiator")]
    pub(crate) mode: Mode,
    /// read (remote → local) or write (local → remote).
    #[arg(long, value_enum, default_value = "read")]
    pub(crate) operation: Operation,
    /// Transport protocol: tcp, rdma (RDMA READ/WRITE over the NICs `--device_name`
    /// allows), or shm (same-host shared memory, with TCP installed beside it for peers it
    /// cannot reach and slices it hands back).
    #[arg(long, default_value = "tcp")]
    pub(crate) protocol: String,
    /// shm: the memory `allocate` hands out: memfd (peers map it) or plain (peers reach it
    /// by cross-memory attach).
    #[arg(long = "shm_memory", value_enum, default_value = "memfd")]
    pub(crate) shm_memory: ShmMemory,
    /// shm: what this process allows peers' cross-memory attach: keep (as the kernel
    /// says), allow_same_user (Yama's PR_SET_PTRACER_ANY), refuse (not dumpable).
    #[arg(long = "shm_ptrace", value_enum, default_value = "keep")]
    pub(crate) shm_ptrace: ShmPtrace,
    /// A cluster secret: peers must prove they know it (HMAC challenge–response) before the
    /// handshake RPC or a TCP data connection serves them. Default: `TERN_CLUSTER_SECRET`,
    /// or the file `TERN_CLUSTER_SECRET_FILE` names; none means plain Mooncake.
    #[arg(long = "cluster_secret")]
    pub(crate) cluster_secret: Option<String>,
    /// RDMA devices to use, comma separated (e.g. `rxe0,rxe1`); default: `MC_TE_FILTERS`,
    /// else every device with an active port.
    #[arg(long = "device_name")]
    pub(crate) device_name: Option<String>,
    /// RDMA: a NIC priority matrix file in Mooncake's JSON form (default:
    /// `MC_CUSTOM_TOPO_JSON`, else one built from the NICs' NUMA nodes).
    #[arg(long = "nic_priority_matrix")]
    pub(crate) nic_priority_matrix: Option<std::path::PathBuf>,
    /// Metadata connection string.
    #[arg(long = "metadata_server", default_value = "P2PHANDSHAKE")]
    pub(crate) metadata_server: String,
    /// This node's server name (P2P: its address).
    #[arg(long = "local_server_name")]
    pub(crate) local_server_name: Option<String>,
    /// The target's segment name (P2P: the `ip:port` the target printed).
    #[arg(long = "segment_id")]
    pub(crate) segment_id: Option<String>,
    /// Bytes per buffer on each side.
    #[arg(long = "buffer_size", default_value_t = 1 << 30)]
    pub(crate) buffer_size: usize,
    /// Requests per batch.
    #[arg(long = "batch_size", default_value_t = 128)]
    pub(crate) batch_size: usize,
    /// Bytes per request.
    #[arg(long = "block_size", default_value_t = 65536)]
    pub(crate) block_size: usize,
    /// Submitting threads.
    #[arg(long, default_value_t = 12)]
    pub(crate) threads: usize,
    /// Seconds to run [initiator: default 10; target: until SIGINT or SIGTERM when not given].
    #[arg(long)]
    pub(crate) duration: Option<f64>,
    /// Unit of the reported throughput: GB, GiB, Gb, MB, MiB, Mb, KB, KiB, Kb.
    #[arg(long = "report_unit", default_value = "GB")]
    pub(crate) report_unit: String,
    /// Digits after the decimal point in the report.
    #[arg(long = "report_precision", default_value_t = 2)]
    pub(crate) report_precision: usize,
    /// Check every block's content after it moves.
    #[arg(long)]
    pub(crate) verify: bool,
    /// Print one JSON object with the results on stdout.
    #[arg(long)]
    pub(crate) json: bool,
    /// TCP connections per peer.
    #[arg(long = "tcp_connections")]
    pub(crate) tcp_connections: Option<usize>,
    /// Largest TCP slice in bytes.
    #[arg(long = "tcp_slice_size")]
    pub(crate) tcp_slice_size: Option<usize>,
    /// After the run, stay idle this many seconds with the endpoints open and report the CPU
    /// the initiator (and, in loopback, the target) used meanwhile.
    #[arg(long = "idle_seconds")]
    pub(crate) idle_seconds: Option<f64>,
    /// Target: also stop when stdin reaches end of file (for a parent process that holds it
    /// open, as `--mode loopback` does).
    #[arg(long = "stop_on_stdin_eof")]
    pub(crate) stop_on_stdin_eof: bool,
    /// Target: serve this engine's metrics (Prometheus text) at `http://ADDR/metrics`; port 0
    /// picks one. The address is printed as `metrics: <url>`, after the segment line.
    #[arg(long = "metrics_addr")]
    pub(crate) metrics_addr: Option<std::net::SocketAddr>,
    /// Pages workload (the shape of a KV cache as serving stacks move it): each (layer,
    /// page) one request of `--page_size` bytes, submitted `--batch_size` at a time, instead
    /// of `--block_size` blocks. Pages per layer; giving it selects the workload.
    #[arg(long)]
    pub(crate) pages: Option<usize>,
    /// Pages workload: layers, each a range of its pages followed by a one-page gap, so that
    /// no two layers' pages are ever neighbours.
    #[arg(long, default_value_t = 32)]
    pub(crate) layers: usize,
    /// Pages workload: bytes per page (per request).
    #[arg(long = "page_size", default_value_t = 16 << 10)]
    pub(crate) page_size: usize,
    /// Pages workload: the order of the requests: contiguous (layer by layer, page by page),
    /// runs:N (runs of N consecutive pages of a layer, the runs in a random order), or
    /// shuffled (every page in a random order).
    #[arg(long = "page_order", default_value = "contiguous", value_parser = PageOrder::parse)]
    pub(crate) page_order: PageOrder,
    /// Turns off the engine's merging of neighbouring requests into runs, to measure what
    /// it gains.
    #[arg(long = "no_merge")]
    pub(crate) no_merge: bool,
}

/// The flags that do not go together, as a clear error before anything starts.
pub(crate) fn check_flags(args: &Args) -> Result<(), String> {
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

/// The bytes the kernel says it can give without swapping (`MemAvailable`), if it says.
pub(crate) fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses to start when the buffers this run pre-touches (both sides' in loopback) do not
/// fit in `available` memory, naming the flag to lower, rather than be killed by the kernel
/// half way.
pub(crate) fn enough_memory(args: &Args, available: Option<u64>) -> Result<(), String> {
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

/// `--duration`, checked.
pub(crate) fn run_time(args: &Args) -> Result<Option<Duration>, String> {
    args.duration
        .map(|secs| {
            Duration::try_from_secs_f64(secs)
                .map_err(|_| format!("--duration {secs} is not a number of seconds"))
        })
        .transpose()
}

/// The flag spelling of a value.
pub(crate) fn value_name(value: impl ValueEnum) -> String {
    value
        .to_possible_value()
        .map_or_else(String::new, |v| v.get_name().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &[&str]) -> Args {
        Args::parse_from(std::iter::once("tern-bench").chain(line.iter().copied()))
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
