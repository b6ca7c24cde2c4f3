//! The initiator: `--threads` workers submit batches of the workload to the target's buffer
//! for the run time, each waiting for its batch before the next, and the outcome is summed.

use std::io::IsTerminal;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tern_engine::{
    BatchState, BatchStatus, EngineStats, OwnedBuffer, SegmentId, TransferEngine, TransferRequest,
};

use crate::cpu::{cpu_seconds, idle_cpu};
use crate::flags::{Args, Operation, run_time};
use crate::transport::engine;
use crate::workload::{Workload, expected_byte, fill_pattern};

/// The initiator's run time when `--duration` is not given.
const DEFAULT_DURATION_SECS: f64 = 10.0;

/// What a run measured, summed over the workers.
#[derive(Debug, Default)]
pub(crate) struct Outcome {
    pub(crate) duration: Duration,
    pub(crate) bytes: u64,
    pub(crate) batches: u64,
    /// Requests submitted (tasks).
    pub(crate) requests: u64,
    /// Time spent inside `submit` calls, summed over the workers.
    pub(crate) submit_time: Duration,
    pub(crate) latencies_us: Vec<f64>,
    /// With `--idle_seconds`: percent of one core the initiator (and the target, when this
    /// process started it) used while idle with its endpoints open.
    pub(crate) idle_cpu: Option<(f64, Option<f64>)>,
    /// CPU seconds the initiator (this process) and the target (when this process knows its
    /// pid) used during the timed run.
    pub(crate) run_cpu: (Option<f64>, Option<f64>),
    /// The engine's statistics at the end.
    pub(crate) stats: Option<EngineStats>,
}

/// Opens the target's segment, runs the workload against its largest buffer for the run time
/// and sums what the workers measured; `target` is the target's pid when this process knows it.
pub(crate) fn run_initiator(
    args: &Args,
    segment: &str,
    target: Option<u32>,
) -> Result<Outcome, String> {
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
    let workload = Workload::of(args, local.len(), remote.length)?;
    let ctx = Shared {
        workload,
        engine: &engine,
        peer,
        local: &local,
        remote_addr: remote.addr,
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

/// Where a batch's time went.
struct Timings {
    /// In `submit`.
    submit: Duration,
    /// From `allocate_batch` until the batch, freed, is gone.
    latency: Duration,
}

/// What the workers share.
struct Shared<'a> {
    workload: Workload,
    engine: &'a TransferEngine,
    peer: SegmentId,
    local: &'a OwnedBuffer,
    remote_addr: u64,
    args: &'a Args,
    moved: AtomicU64,
    stop: AtomicBool,
    start: Barrier,
}

impl Shared<'_> {
    /// One worker: batch after batch of the workload until told to stop.
    fn worker(&self, thread: usize) -> Result<Outcome, String> {
        let args = self.args;
        let len = self.workload.request_len();
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
        // One batch before the clock starts: the first transfer to a peer opens its
        // connections or maps its memory, a cost no later batch pays.
        self.workload.batch_offsets(args, thread, 0, &mut offsets);
        self.requests_at(&offsets, len, &mut requests);
        let warmed = self.one_batch(&requests);
        // Past the barrier even on failure, or the thread that starts the clock waits forever.
        self.start.wait();
        warmed?;
        while !self.stop.load(Ordering::Acquire) {
            self.workload
                .batch_offsets(args, thread, round, &mut offsets);
            self.requests_at(&offsets, len, &mut requests);
            let (status, Timings { submit, latency }) = self.one_batch(&requests)?;
            outcome.submit_time += submit;
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

    /// The workload's requests for one batch, at `offsets` on both sides.
    fn requests_at(&self, offsets: &[usize], len: usize, requests: &mut Vec<TransferRequest>) {
        requests.clear();
        requests.extend(offsets.iter().map(|&offset| {
            let local = self.local.addr() + offset;
            let remote = self.remote_addr + offset as u64;
            match self.args.operation {
                Operation::Read => TransferRequest::read(local, self.peer, remote, len),
                Operation::Write => TransferRequest::write(local, self.peer, remote, len),
            }
        }));
    }

    /// Allocates, submits, waits for and frees one batch; its status and timings, or why it
    /// did not complete.
    fn one_batch(&self, requests: &[TransferRequest]) -> Result<(BatchStatus, Timings), String> {
        let began = Instant::now();
        let batch = self
            .engine
            .allocate_batch(requests.len())
            .map_err(|e| e.to_string())?;
        let submitting = Instant::now();
        self.engine
            .submit(&batch, requests)
            .map_err(|e| format!("submit: {e}"))?;
        let submit = submitting.elapsed();
        let status = batch.wait(Duration::from_secs(600));
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
        // A batch's time ends once it is gone, as a caller's call that frees it does (the
        // drop-in's batch calls, `transfer_sync`): its tasks' tally is taken as it goes.
        drop(batch);
        let latency = began.elapsed();
        Ok((status, Timings { submit, latency }))
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
