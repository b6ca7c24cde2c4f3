//! How other threads reach a worker: a channel of messages, and a doorbell socket rung only
//! while the worker sleeps.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use tern_engine::TransferError;
use tern_verbs::CompletionQueue;

use super::Job;
use crate::endpoint::Endpoint;
use crate::nic::WorkerCounters;

/// What other threads tell a worker.
#[derive(Debug)]
pub(crate) enum Msg {
    Jobs(Vec<Job>),
    /// The handshake this worker started for an endpoint has ended.
    Connected {
        ep: Arc<Endpoint>,
        result: Result<(), String>,
    },
    /// An endpoint of this worker became usable (its peer's ready ACK came) or was
    /// decommissioned.
    Changed(Arc<Endpoint>),
    /// Tasks ended while slices of them were here: let go of those slices now.
    CutOff,
    Stop,
}

/// How other threads reach a worker.
#[derive(Debug)]
pub(crate) struct WorkerHandle {
    tx: Sender<Msg>,
    bell: UnixStream,
    sleeping: Arc<AtomicBool>,
    pub cq: Arc<CompletionQueue>,
    pub counters: Arc<WorkerCounters>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The worker's half of a [`WorkerHandle`], handed to its thread.
#[derive(Debug)]
pub(crate) struct WorkerInbox {
    pub(super) rx: Receiver<Msg>,
    pub(super) bell: UnixStream,
    pub(super) sleeping: Arc<AtomicBool>,
    pub(super) cq: Arc<CompletionQueue>,
    pub(super) counters: Arc<WorkerCounters>,
}

/// A worker's channel, doorbell and CQ, before its thread starts.
pub(crate) fn worker_pair(
    cq: Arc<CompletionQueue>,
) -> std::io::Result<(WorkerHandle, WorkerInbox)> {
    let (tx, rx) = crossbeam_channel::unbounded();
    let (ring, hear) = UnixStream::pair()?;
    ring.set_nonblocking(true)?;
    hear.set_nonblocking(true)?;
    let sleeping = Arc::new(AtomicBool::new(false));
    let counters = Arc::new(WorkerCounters::default());
    Ok((
        WorkerHandle {
            tx,
            bell: ring,
            sleeping: sleeping.clone(),
            cq: cq.clone(),
            counters: counters.clone(),
            thread: Mutex::new(None),
        },
        WorkerInbox {
            rx,
            bell: hear,
            sleeping,
            cq,
            counters,
        },
    ))
}

impl WorkerHandle {
    /// Hands over a message; gives it back if the worker has stopped.
    pub fn send(&self, msg: Msg) -> Result<(), Msg> {
        self.tx.send(msg).map_err(|e| e.0)?;
        // Pairs with the fence in `Worker::sleep`: either the worker sees the message before
        // it sleeps, or this sees it sleeping and rings.
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            // A full socket buffer means a ring is already pending: nothing lost.
            let _ = (&self.bell).write(&[1]);
        }
        Ok(())
    }

    /// Hands over jobs; fails them if the worker has stopped.
    pub fn send_jobs(&self, jobs: Vec<Job>) {
        if let Err(Msg::Jobs(jobs)) = self.send(Msg::Jobs(jobs)) {
            for job in jobs {
                job.slice
                    .fail(TransferError::Dropped("the RDMA transport stopped".into()));
            }
        }
    }

    pub fn set_thread(&self, thread: JoinHandle<()>) {
        *self.thread.lock() = Some(thread);
    }

    /// Stops the worker and waits for it.
    pub fn stop(&self) {
        let _ = self.send(Msg::Stop);
        let thread = self.thread.lock().take();
        if let Some(thread) = thread
            && thread.join().is_err()
        {
            tracing::error!("an RDMA worker panicked");
        }
    }
}
