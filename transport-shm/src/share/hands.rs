//! The hands that copy: copy threads taking jobs (a submit, or part of one) from one queue,
//! and the thread that waits for a batch, which takes a job itself instead of spinning. A
//! copy thread that runs out of work looks for more for a moment before it sleeps.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError, unbounded};
use parking_lot::Mutex;
use tern_engine::{Slice, TransferError};

use crate::client::Links;
use crate::error::ShmError;
use crate::route;

/// The copy threads, their queue, and room for a waiter that helps.
pub(crate) struct Hands {
    queue: Sender<Vec<Slice>>,
    /// The copy threads' end of `queue`, for a waiter that helps.
    jobs: Receiver<Vec<Slice>>,
    stop: Arc<AtomicBool>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    /// The copy threads and the waiter.
    count: usize,
}

impl Hands {
    /// Starts `workers` copy threads (at least one), moving slices over `links`.
    pub(crate) fn start(workers: usize, links: &Arc<Links>) -> Result<Self, ShmError> {
        let (queue, jobs) = unbounded::<Vec<Slice>>();
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for _ in 0..workers.max(1) {
            let (jobs, links, stop) = (jobs.clone(), links.clone(), stop.clone());
            let worker = std::thread::Builder::new()
                .name("tern-shm-copy".into())
                .spawn(move || work(&jobs, &links, &stop))
                .map_err(ShmError::Thread)?;
            threads.push(worker);
        }
        Ok(Self {
            queue,
            jobs,
            stop,
            count: threads.len() + 1,
            workers: Mutex::new(threads),
        })
    }

    /// The copy threads and the waiter.
    pub(crate) fn count(&self) -> usize {
        self.count
    }

    /// Queues one job for the first free hand.
    pub(crate) fn send(&self, job: Vec<Slice>) {
        if let Err(back) = self.queue.send(job) {
            fail_all(back.0);
        }
    }

    /// A waiter copies one queued job itself: with as many copy threads as cores, a waiter
    /// spinning would take a core from them. Whether it found one.
    pub(crate) fn help(&self, links: &Links) -> bool {
        if self.stop.load(Ordering::Acquire) {
            return false;
        }
        match self.jobs.try_recv() {
            Ok(slices) => {
                route::run(slices, links);
                true
            }
            Err(_) => false,
        }
    }

    /// Stops the copy threads and waits for them; slices queued from now on fail.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        let workers: Vec<_> = self.workers.lock().drain(..).collect();
        // Each worker stops at the first job it takes from now on: one empty job each.
        for _ in &workers {
            let _ = self.queue.send(Vec::new());
        }
        for worker in workers {
            let _ = worker.join();
        }
    }
}

/// A copy thread: takes the slices of one submit (or part of it) and moves them.
fn work(jobs: &Receiver<Vec<Slice>>, links: &Links, stop: &AtomicBool) {
    while let Some(slices) = next_job(jobs) {
        if stop.load(Ordering::Acquire) {
            fail_all(slices);
            return;
        }
        route::run(slices, links);
    }
}

/// How long a copy thread that ran out of work keeps looking for more before it sleeps: a
/// submitter that finds it awake hands it work without a wake-up call (a system call of
/// microseconds, often longer than the copy), and an idle one sleeps after one budget.
const LINGER: Duration = Duration::from_micros(50);

/// The next job: spinning for up to [`LINGER`], then sleeping until one comes; `None` once
/// the queue is closed.
fn next_job(jobs: &Receiver<Vec<Slice>>) -> Option<Vec<Slice>> {
    let since = Instant::now();
    loop {
        match jobs.try_recv() {
            Ok(slices) => return Some(slices),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) => {}
        }
        if since.elapsed() >= LINGER {
            return jobs.recv().ok();
        }
        for _ in 0..64 {
            std::hint::spin_loop();
        }
    }
}

fn fail_all(slices: Vec<Slice>) {
    for slice in slices {
        slice.fail(TransferError::Dropped(
            "the shared-memory transport stopped".into(),
        ));
    }
}
