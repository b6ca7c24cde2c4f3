//! The batch's bookkeeping, tested without transports: slices are reported by hand.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::*;
use crate::error::{EngineError, TransferError};
use crate::types::{BatchState, Opcode, TransferStatus};

/// One slice's report, as `Slice` makes it, without a request behind it.
struct SliceCompletion {
    batch: Arc<BatchInner>,
    task: usize,
    reported: bool,
}

impl SliceCompletion {
    fn new(batch: Arc<BatchInner>, task: usize) -> Self {
        Self {
            batch,
            task,
            reported: false,
        }
    }

    fn live(&self) -> bool {
        self.batch.task_live(self.task)
    }

    fn succeed(mut self, bytes: u64) {
        self.reported = true;
        if self.batch.slice_progress(self.task, bytes) {
            self.batch.complete_task(self.task);
        }
    }

    fn fail(mut self, error: TransferError) {
        self.reported = true;
        self.batch.fail_task(self.task, error);
        self.let_go();
    }

    fn abandon(mut self) {
        self.reported = true;
        self.let_go();
    }

    fn let_go(&self) {
        if self.batch.slice_progress(self.task, 0) {
            self.batch.complete_task(self.task);
        }
    }
}

impl Drop for SliceCompletion {
    fn drop(&mut self) {
        if !self.reported {
            self.batch.fail_task(
                self.task,
                TransferError::Dropped("slice released without a result".into()),
            );
            self.let_go();
        }
    }
}

#[test]
fn a_task_completes_when_its_last_slice_does() {
    let batch = Arc::new(BatchInner::new(2));
    let first = batch.reserve(2).unwrap();
    batch.start_task(first, 2, Opcode::Read, 0);
    batch.start_task(first + 1, 1, Opcode::Read, 0);
    batch.publish(2, 15 + 7);
    let a = SliceCompletion::new(batch.clone(), 0);
    let b = SliceCompletion::new(batch.clone(), 0);
    let c = SliceCompletion::new(batch.clone(), 1);
    a.succeed(10);
    assert_eq!(
        batch.task_status(0).unwrap().status,
        TransferStatus::Pending
    );
    b.succeed(5);
    let done = batch.task_status(0).unwrap();
    assert_eq!(
        (done.status, done.transferred_bytes),
        (TransferStatus::Completed, 15)
    );
    assert_eq!(batch.status().state, BatchState::Pending);
    drop(c);
    assert!(matches!(
        batch.task_status(1).unwrap().status,
        TransferStatus::Failed(TransferError::Dropped(_))
    ));
    assert_eq!(batch.status().state, BatchState::Failed);
    assert!(batch.task_status(2).is_none());
}

#[test]
fn capacity_is_enforced_without_partial_reservation() {
    let batch = BatchInner::new(3);
    batch.reserve(2).unwrap();
    assert!(matches!(
        batch.reserve(2),
        Err(EngineError::TooManyRequests {
            capacity: 3,
            room: 1,
            requested: 2
        })
    ));
    assert_eq!(batch.reserve(1).unwrap(), 2);
}

#[test]
fn free_is_refused_while_busy_and_cancel_finishes_tasks() {
    let batch = Arc::new(BatchInner::new(1));
    batch.reserve(1).unwrap();
    batch.start_task(0, 1, Opcode::Read, 0);
    batch.publish(1, 100);
    let late = SliceCompletion::new(batch.clone(), 0);
    assert!(matches!(
        batch.mark_freed(),
        Err(EngineError::BatchBusy { pending: 1 })
    ));
    // The slice stays out past the drain time: cancel gives up waiting, and the task
    // still shows pending (its memory is not free), the batch busy.
    assert_eq!(batch.cancel(), 1);
    assert!(!late.live());
    assert_eq!(
        batch.task_status(0).unwrap().status,
        TransferStatus::Pending
    );
    assert!(batch.mark_freed().is_err());
    late.succeed(100);
    assert_eq!(
        batch.task_status(0).unwrap().status,
        TransferStatus::Canceled
    );
    batch.mark_freed().unwrap();
    assert!(matches!(batch.reserve(1), Err(EngineError::BatchFreed)));
}

#[test]
fn deadlines_time_tasks_out_and_wake_waiters() {
    let batch = Arc::new(BatchInner::new(1));
    batch.reserve(1).unwrap();
    batch.start_task(0, 0, Opcode::Read, 0);
    batch.publish(1, 0);
    batch.set_deadline(Some(Instant::now() + Duration::from_millis(30)));
    let status = batch.wait(Duration::from_secs(30));
    assert_eq!(status.state, BatchState::Failed);
    assert_eq!(
        batch.task_status(0).unwrap().status,
        TransferStatus::Timeout
    );
}

#[test]
fn a_timed_out_task_shows_its_end_only_once_its_slices_let_go() {
    let batch = Arc::new(BatchInner::new(1));
    batch.reserve(1).unwrap();
    batch.start_task(0, 2, Opcode::Write, 0);
    batch.publish(1, 0);
    let (done, out) = (
        SliceCompletion::new(batch.clone(), 0),
        SliceCompletion::new(batch.clone(), 0),
    );
    done.succeed(7);
    batch.set_deadline(Some(Instant::now()));
    // Ended, not settled: shown pending, the batch busy.
    let status = batch.task_status(0).unwrap();
    assert_eq!(status.status, TransferStatus::Pending);
    assert!(!out.live());
    assert_eq!(batch.status().state, BatchState::Pending);
    assert!(matches!(
        batch.mark_freed(),
        Err(EngineError::BatchBusy { pending: 1 })
    ));
    // A short wait keeps its timeout, the task still shown pending.
    let started = Instant::now();
    let status = batch.wait(Duration::from_millis(1));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(status.state, BatchState::Pending);
    // A long one returns once the last slice lets go, with the task timed out.
    let slice = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        out.fail(TransferError::Dropped("cut".into()));
    });
    let status = batch.wait(Duration::from_secs(30));
    slice.join().unwrap();
    assert_eq!(status.state, BatchState::Failed);
    let task = batch.task_status(0).unwrap();
    assert_eq!(
        (task.status, task.transferred_bytes, task.remote_may_change),
        (TransferStatus::Timeout, 7, false)
    );
    batch.mark_freed().unwrap();
}

#[test]
fn cancel_returns_once_the_slices_of_the_canceled_tasks_let_go() {
    let batch = Arc::new(BatchInner::new(2));
    batch.reserve(2).unwrap();
    batch.start_task(0, 1, Opcode::Read, 0);
    batch.start_task(1, 1, Opcode::Read, 0);
    batch.publish(2, 0);
    let (a, b) = (
        SliceCompletion::new(batch.clone(), 0),
        SliceCompletion::new(batch.clone(), 1),
    );
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(50));
        a.abandon();
        b.succeed(3);
    });
    assert_eq!(batch.cancel(), 2);
    // Both let go before cancel returned: both show canceled, the batch is idle.
    assert_eq!(
        batch.task_status(0).unwrap().status,
        TransferStatus::Canceled
    );
    assert_eq!(
        batch.task_status(1).unwrap().status,
        TransferStatus::Canceled
    );
    assert_eq!(batch.unfinished(), 0);
    late.join().unwrap();
}

#[test]
fn a_task_canceled_before_it_started_settles_when_its_slices_let_go() {
    let batch = Arc::new(BatchInner::new(2));
    batch.reserve(2).unwrap();
    // Another submit published past this task before it started.
    batch.publish(2, 0);
    let slice = SliceCompletion::new(batch.clone(), 0);
    batch.start_task(1, 0, Opcode::Read, 0);
    assert_eq!(batch.submitted.load(Ordering::Acquire), 2);
    let canceler = {
        let batch = batch.clone();
        std::thread::spawn(move || batch.cancel())
    };
    while batch.ending.load(Ordering::SeqCst) == 0 {
        std::thread::yield_now();
    }
    batch.start_task(0, 1, Opcode::Read, 0);
    assert_eq!(
        batch.task_status(0).unwrap().status,
        TransferStatus::Pending
    );
    assert!(!slice.live());
    slice.abandon();
    canceler.join().unwrap();
    assert_eq!(
        batch.task_status(0).unwrap().status,
        TransferStatus::Canceled
    );
    assert_eq!(batch.unfinished(), 0);
}

#[test]
fn completion_hooks_run_once_when_the_last_task_finishes() {
    use std::sync::atomic::AtomicUsize;
    let batch = Arc::new(BatchInner::new(2));
    batch.reserve(2).unwrap();
    batch.start_task(0, 1, Opcode::Read, 0);
    batch.start_task(1, 1, Opcode::Read, 0);
    batch.publish(2, 0);
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    batch.on_complete(Box::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
    }));
    let first = SliceCompletion::new(batch.clone(), 0);
    let last = SliceCompletion::new(batch.clone(), 1);
    first.succeed(1);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    std::thread::spawn(move || last.fail(TransferError::ZeroLength))
        .join()
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // Registered on an idle batch: runs at once, on the caller's thread.
    let counter = calls.clone();
    batch.on_complete(Box::new(move || {
        counter.fetch_add(1, Ordering::SeqCst);
    }));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[test]
fn completion_hooks_run_when_the_deadline_times_tasks_out() {
    let batch = Arc::new(BatchInner::new(1));
    batch.reserve(1).unwrap();
    batch.start_task(0, 0, Opcode::Read, 0);
    batch.publish(1, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    batch.on_complete(Box::new(move || tx.send(()).unwrap()));
    batch.set_deadline(Some(Instant::now() + Duration::from_millis(10)));
    assert!(rx.try_recv().is_err());
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(batch.status().state, BatchState::Failed);
    rx.recv_timeout(Duration::from_secs(5)).unwrap();
}

#[test]
fn waiters_wake_when_another_thread_completes() {
    let batch = Arc::new(BatchInner::new(1));
    batch.reserve(1).unwrap();
    batch.start_task(0, 1, Opcode::Read, 0);
    batch.publish(1, 1);
    let slice = SliceCompletion::new(batch.clone(), 0);
    let worker = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        slice.succeed(1);
    });
    let status = batch.wait(Duration::from_secs(30));
    worker.join().unwrap();
    assert_eq!(status.state, BatchState::Completed);
    assert_eq!((status.completed, status.transferred_bytes), (1, 1));
}

/// Task `task`'s length in the tests of the counted status: its own, so that a sum shows
/// which tasks it holds.
fn length_of(task: usize) -> u64 {
    1 + (task as u64 % 7) * 1000 + task as u64
}

#[test]
fn a_completed_batch_shows_what_a_look_at_each_task_does() {
    let batch = Arc::new(BatchInner::new(8));
    for (first, n) in [(0, 3), (3, 5)] {
        assert_eq!(batch.reserve(n).unwrap(), first);
        let mut bytes = 0;
        for task in first..first + n {
            batch.start_task(task, 1, Opcode::Write, 0);
            bytes += length_of(task);
        }
        batch.publish(first + n, bytes);
        assert_eq!(batch.status().state, BatchState::Pending);
        for task in first..first + n {
            SliceCompletion::new(batch.clone(), task).succeed(length_of(task));
        }
        let (counted, walked) = (batch.status(), batch.walked_status(first + n));
        assert_eq!(format!("{counted:?}"), format!("{walked:?}"));
        assert_eq!(counted.state, BatchState::Completed);
        assert_eq!(
            counted.transferred_bytes,
            (0..first + n).map(length_of).sum::<u64>()
        );
    }
    // A room refused leaves nothing unfinished behind.
    assert!(batch.reserve(1).is_err());
    assert_eq!(batch.unfinished(), 0);
    assert_eq!(batch.status().state, BatchState::Completed);
    batch.mark_freed().unwrap();
}

#[test]
fn a_batch_with_a_task_ended_otherwise_is_not_counted_completed() {
    for ending in ["failed", "canceled", "timed out"] {
        let batch = Arc::new(BatchInner::new(3));
        batch.reserve(3).unwrap();
        for task in 0..3 {
            batch.start_task(task, 1, Opcode::Read, 0);
        }
        batch.publish(3, 3 * 4096);
        SliceCompletion::new(batch.clone(), 0).succeed(4096);
        SliceCompletion::new(batch.clone(), 1).succeed(4096);
        let last = SliceCompletion::new(batch.clone(), 2);
        match ending {
            "failed" => last.fail(TransferError::ZeroLength),
            "canceled" => {
                let canceler = std::thread::spawn({
                    let batch = batch.clone();
                    move || batch.cancel()
                });
                std::thread::sleep(Duration::from_millis(20));
                last.abandon();
                assert_eq!(canceler.join().unwrap(), 1);
            }
            _ => {
                batch.set_deadline(Some(Instant::now()));
                assert_eq!(batch.status().pending, 1, "its slice is still out");
                last.abandon();
            }
        }
        let status = batch.status();
        assert_eq!(
            (
                status.state,
                status.completed,
                status.failed,
                status.pending
            ),
            (BatchState::Failed, 2, 1, 0),
            "{ending}: {status:?}"
        );
        assert_eq!(status.transferred_bytes, 2 * 4096, "{ending}");
    }
}

#[test]
fn the_counted_status_holds_while_submits_race_and_tasks_complete() {
    // Submits of 1..=3 tasks race on four threads, each completing its tasks as it goes;
    // a reader that sees the batch completed must see exactly the bytes of the tasks it
    // says were submitted.
    const PER_THREAD: usize = 5000;
    const TASKS: usize = 4 * PER_THREAD * 3;
    let batch = Arc::new(BatchInner::new(TASKS));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The bytes of tasks 0..n, at n: a read's check costs no walk of its own.
    let bytes_before: Vec<u64> = std::iter::once(0)
        .chain((0..TASKS).scan(0, |sum, task| {
            *sum += length_of(task);
            Some(*sum)
        }))
        .collect();
    let reader = std::thread::spawn({
        let (batch, stop) = (batch.clone(), stop.clone());
        move || {
            while !stop.load(Ordering::Acquire) {
                let status = batch.status();
                assert_eq!(status.failed, 0);
                if status.state == BatchState::Completed {
                    assert_eq!(status.completed, status.submitted, "{status:?}");
                    let expected = bytes_before.get(status.submitted).copied();
                    assert_eq!(Some(status.transferred_bytes), expected, "{status:?}");
                }
                // A read of a batch still going walks its tasks: under valgrind, which runs
                // one thread at a time, reading back to back starved the submitters.
                std::thread::yield_now();
            }
        }
    });
    let submitters: Vec<_> = (0..4)
        .map(|thread| {
            let batch = batch.clone();
            std::thread::spawn(move || {
                for round in 0..PER_THREAD {
                    let n = 1 + (round + thread) % 3;
                    let first = batch.reserve(n).unwrap();
                    let mut bytes = 0;
                    for task in first..first + n {
                        batch.start_task(task, 1, Opcode::Write, 0);
                        bytes += length_of(task);
                    }
                    batch.publish(first + n, bytes);
                    for task in first..first + n {
                        SliceCompletion::new(batch.clone(), task).succeed(length_of(task));
                    }
                }
            })
        })
        .collect();
    for submitter in submitters {
        submitter.join().unwrap();
    }
    stop.store(true, Ordering::Release);
    reader.join().unwrap();
    let done = batch.status();
    assert_eq!(done.state, BatchState::Completed);
    let submitted = done.submitted;
    assert_eq!(
        done.transferred_bytes,
        (0..submitted).map(length_of).sum::<u64>()
    );
    assert_eq!(
        format!("{done:?}"),
        format!("{:?}", batch.walked_status(submitted))
    );
}
