//! One peer: serves a buffer, opens every other peer's, runs the workers for the run time,
//! and reports its transfers, errors and resource samples to the coordinator on stdout.

use std::io::{BufRead, BufReader, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::json;
use tern_engine::{SegmentId, TransferEngine};
use tern_transport_rdma::topology::parse_device_list;
use tern_transport_rdma::{RdmaConfig, RdmaTransport};
use tern_transport_tcp::TcpTransport;

use crate::args::{Args, check_args, warmup};
use crate::random::{Rng, initial_bytes};
use crate::sample::{Sample, sample};
use crate::worker::Worker;

/// Counters the workers of one peer share.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) transfers: AtomicU64,
    pub(crate) bytes: AtomicU64,
    pub(crate) batches: AtomicU64,
    pub(crate) errors: AtomicU64,
}

impl Counters {
    pub(crate) fn moved(&self, bytes: usize) {
        self.transfers.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// Another peer as this one sees it.
pub(crate) struct Remote {
    /// Its index among the peers (its initial buffer content depends on it).
    pub(crate) index: usize,
    pub(crate) id: SegmentId,
    /// Address of its served buffer.
    pub(crate) base: u64,
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

pub(crate) fn peer(args: &Args) -> Result<(), String> {
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
pub(crate) fn pace(
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
