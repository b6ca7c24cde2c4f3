//! Transfers ordered on a caller's CUDA stream (`transfer_write_on_cuda` and kin).
//!
//! The call returns at once. The transfer starts once the work the caller enqueued on the
//! stream before it is done (an event, polled), and the work enqueued after it waits until
//! the transfer is over (a `cuStreamWaitValue32` on a gate word Tern opens): ordering on the
//! device, with no host thread blocked, the stream's own least of all. A failed transfer
//! opens the gate as well — later kernels run, on bytes that did not move — and is reported
//! by the [`StreamTransfer`] the call returned and in the log; it never ends the process.
//!
//! One thread per engine ("tern-on-stream") watches the marks and batches of every transfer
//! in flight; it starts on the first such transfer and ends with the engine.

use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tern_cuda::{CallerStream, Gate, Mark};

use crate::batch::Batch;
use crate::engine::{EngineInner, TransferEngine};
use crate::error::EngineError;
use crate::types::{BatchState, TransferRequest, TransferStatus};

/// How often the watcher looks at what it waits for, when anything is in flight.
const POLL: Duration = Duration::from_micros(50);

/// A transfer ordered on a stream: whether it is over, and how it ended.
#[derive(Debug, Clone)]
pub struct StreamTransfer {
    outcome: Arc<Outcome>,
}

#[derive(Debug, Default)]
struct Outcome {
    result: Mutex<Option<Result<u64, Arc<EngineError>>>>,
    ended: Condvar,
}

impl Outcome {
    fn end(&self, result: Result<u64, EngineError>) {
        if let Err(e) = &result {
            tracing::warn!("a transfer ordered on a CUDA stream failed: {e}");
        }
        *self.result.lock() = Some(result.map_err(Arc::new));
        self.ended.notify_all();
    }
}

impl StreamTransfer {
    /// Whether it is over (moved, failed or given up).
    pub fn is_done(&self) -> bool {
        self.outcome.result.lock().is_some()
    }

    /// Waits up to `timeout` for it to be over: the bytes moved, or why it failed; `None`
    /// while it is still in flight.
    pub fn wait(&self, timeout: Duration) -> Option<Result<u64, Arc<EngineError>>> {
        let deadline = Instant::now() + timeout;
        let mut result = self.outcome.result.lock();
        loop {
            if let Some(done) = result.as_ref() {
                return Some(done.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            self.outcome.ended.wait_for(&mut result, left);
        }
    }
}

/// One transfer the watcher holds.
struct Job {
    mark: Mark,
    /// Taken when opened.
    gate: Option<Gate>,
    requests: Vec<TransferRequest>,
    outcome: Arc<Outcome>,
    batch: Option<Batch>,
}

/// The watcher's inbox, made on the first transfer on a stream.
#[derive(Debug, Default)]
pub(crate) struct StreamWatcher {
    inbox: Mutex<Option<Sender<Job>>>,
}

impl TransferEngine {
    /// Submits `requests` ordered on the caller's `stream`: they start after the work
    /// enqueued on it so far, and work enqueued on it after this call waits for them. Returns
    /// at once. A request that cannot be checked now (its segment is not open) fails the
    /// call; everything else is reported by the returned [`StreamTransfer`].
    pub fn submit_on_stream(
        &self,
        stream: &CallerStream<'_>,
        requests: Vec<TransferRequest>,
    ) -> Result<StreamTransfer, EngineError> {
        if requests.is_empty() {
            return Err(EngineError::InvalidArgument(
                "no requests to order on the stream".into(),
            ));
        }
        for request in &requests {
            if request.target != crate::SegmentId::LOCAL
                && self.inner.segment(request.target).is_none()
            {
                return Err(EngineError::UnknownSegment(request.target));
            }
        }
        let device = |source| EngineError::Device { addr: 0, source };
        let mark = stream.mark().map_err(device)?;
        let gate = stream.gate().map_err(device)?;
        stream.hold_until(&gate).map_err(device)?;
        let outcome = Arc::new(Outcome::default());
        let job = Job {
            mark,
            gate: Some(gate),
            requests,
            outcome: outcome.clone(),
            batch: None,
        };
        let mut inbox = self.inner.stream_watcher.inbox.lock();
        let sender = match inbox.as_ref() {
            Some(sender) => sender.clone(),
            None => {
                let (sender, receiver) = channel();
                let engine = self.inner.weak.clone();
                std::thread::Builder::new()
                    .name("tern-on-stream".into())
                    .spawn(move || watch(&engine, &receiver))
                    .map_err(|e| EngineError::Io {
                        context: "starting the stream watcher".into(),
                        source: e,
                    })?;
                inbox.insert(sender).clone()
            }
        };
        drop(inbox);
        // A send fails only once the watcher has ended, with the engine; the job then drops
        // here, which opens its gate.
        sender
            .send(job)
            .map_err(|_| EngineError::InvalidArgument("the engine is shutting down".into()))?;
        Ok(StreamTransfer { outcome })
    }
}

/// The watcher: starts each job's batch once its mark is reached, ends it once the batch is
/// over, and opens its gate either way. Ends when the engine has gone and nothing is left.
fn watch(engine: &Weak<EngineInner>, inbox: &Receiver<Job>) {
    let mut jobs: Vec<Job> = Vec::new();
    loop {
        let received = if jobs.is_empty() {
            inbox.recv().map_err(|_| TryRecvError::Disconnected)
        } else {
            inbox.try_recv()
        };
        match received {
            Ok(job) => {
                jobs.push(job);
                continue;
            }
            Err(TryRecvError::Disconnected) if jobs.is_empty() => return,
            Err(_) => {}
        }
        jobs.retain_mut(|job| !step(engine, job));
        if !jobs.is_empty() {
            std::thread::sleep(POLL);
        }
    }
}

/// Moves one job on; `true` once it is over (its gate opened).
fn step(engine: &Weak<EngineInner>, job: &mut Job) -> bool {
    let Some(inner) = engine.upgrade() else {
        job.outcome.end(Err(EngineError::InvalidArgument(
            "the engine was dropped before the transfer ran".into(),
        )));
        return true;
    };
    let handle = TransferEngine::handle(inner);
    match &job.batch {
        None => match job.mark.reached() {
            Ok(false) => false,
            Ok(true) => {
                let started = handle.allocate_batch(job.requests.len()).and_then(|batch| {
                    // Started after the caller's earlier work on its stream: no fence on the
                    // legacy stream, where this very call's gate may hold everything.
                    batch
                        .inner
                        .stream_ordered
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                    handle.submit(&batch, &job.requests)?;
                    Ok(batch)
                });
                match started {
                    Ok(batch) => {
                        job.batch = Some(batch);
                        false
                    }
                    Err(e) => finish(job, Err(e)),
                }
            }
            Err(source) => finish(job, Err(EngineError::Device { addr: 0, source })),
        },
        Some(batch) => {
            let status = batch.status();
            if status.state == BatchState::Pending {
                return false;
            }
            let result = match status.state {
                BatchState::Completed => Ok(status.transferred_bytes),
                _ => Err(EngineError::TransferFailed {
                    status: (0..job.requests.len())
                        .filter_map(|task| batch.task_status(task))
                        .map(|s| s.status)
                        .find(|s| *s != TransferStatus::Completed)
                        .unwrap_or(TransferStatus::Waiting),
                }),
            };
            let _ = handle.free_batch(batch);
            finish(job, result)
        }
    }
}

fn finish(job: &mut Job, result: Result<u64, EngineError>) -> bool {
    // Opened once the outcome is there: whoever waits on the stream and then asks the
    // transfer finds it over.
    job.outcome.end(result);
    if let Some(gate) = job.gate.take() {
        gate.open();
    }
    true
}
