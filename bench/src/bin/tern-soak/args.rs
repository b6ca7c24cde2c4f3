//! The command line (the coordinator's, and the hidden flags it hands each peer), checked.

use std::time::Duration;

use clap::{Parser, ValueEnum};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Role {
    /// Starts the peers, hands them each other's names, collects and judges their reports.
    Coordinator,
    /// One process of the soak (started by the coordinator; talks to it over stdin/stdout).
    Peer,
}

/// Random reads and writes of random sizes at random offsets among 2 to 4 processes, every
/// byte verified; reports transfers, errors and resources at start and end.
#[derive(Debug, Clone, Parser)]
#[command(name = "tern-soak", version)]
pub(crate) struct Args {
    /// Peer processes to run (2 to 4).
    #[arg(long, default_value_t = 3)]
    pub(crate) processes: usize,
    /// Seconds each peer moves bytes, warm-up included.
    #[arg(long, default_value_t = 60.0)]
    pub(crate) seconds: f64,
    /// Seconds of warm-up before the start sample [default: a sixth of the run, 5 to 30 s].
    #[arg(long)]
    pub(crate) warmup: Option<f64>,
    /// Transport: tcp, or rdma (over the NICs `--device_name` allows).
    #[arg(long, default_value = "tcp")]
    pub(crate) protocol: String,
    /// RDMA devices, comma separated (e.g. `rxe0`); default: `MC_TE_FILTERS`, else every
    /// device with an active port.
    #[arg(long = "device_name")]
    pub(crate) device_name: Option<String>,
    /// Initiator threads per peer; each owns one slot of every other peer's buffer.
    #[arg(long, default_value_t = 2)]
    pub(crate) threads: usize,
    /// Bytes per slot (a multiple of 4096); the largest transfer is half of it.
    #[arg(long = "slot_size", default_value_t = 8 << 20)]
    pub(crate) slot_size: usize,
    /// Most requests in one batch.
    #[arg(long = "max_batch", default_value_t = 8)]
    pub(crate) max_batch: usize,
    /// Seed of the random choices (default: from the clock); printed at start.
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    #[arg(long, value_enum, default_value = "coordinator", hide = true)]
    pub(crate) role: Role,
    #[arg(long, default_value_t = 0, hide = true)]
    pub(crate) index: usize,
}

pub(crate) fn check_args(args: &Args) -> Result<(), String> {
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

pub(crate) fn warmup(args: &Args) -> Duration {
    let secs = args
        .warmup
        .unwrap_or_else(|| (args.seconds / 6.0).clamp(5.0, 30.0))
        .clamp(0.0, args.seconds);
    Duration::from_secs_f64(secs)
}
