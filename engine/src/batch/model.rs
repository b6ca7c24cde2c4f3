//! A loom model of the batch's bookkeeping: the real [`BatchInner`] code, its atomics loom's
//! (`--features loom`), with threads that reserve, free, start, end, settle and read status
//! in every order loom can interleave their steps (up to a bound on preemptions). Each
//! model asserts what a caller relies on, in every one of those orders:
//!
//! - a reserve that succeeds never runs in a batch a free has already freed, and a reserve
//!   refused for room never makes a concurrent free of an idle batch fail;
//! - the count of ending tasks never goes below zero (which waiters would read as a huge
//!   count and wait on), whichever of a task's end and its settling comes first;
//! - a batch shows Completed only with every task completed, and every count back at rest
//!   once the tasks are done.
//!
//! Run by `cargo xtask test` as `cargo test -p tern-engine --features loom --lib
//! batch::model` (only these tests work in such a build).

use std::sync::Arc;

use loom::sync::atomic::AtomicBool;

use super::lifecycle::BatchInner;
use super::sync::Ordering;
use super::task::CANCELED;
use crate::error::EngineError;
use crate::types::{BatchState, Opcode, TransferStatus};

/// Every interleaving with up to this many preemptions: the orders that break counts like
/// these take one or two.
const PREEMPTIONS: usize = 3;

fn check(model: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(PREEMPTIONS);
    builder.check(model);
}

/// Reserves, starts and completes one single-slice read task, as a submit and its
/// transport do; returns whether the reserve succeeded.
fn submit_one_and_complete(batch: &BatchInner) -> bool {
    let Ok(first) = batch.reserve(1) else {
        return false;
    };
    batch.start_task(first, 1, Opcode::Read, 0);
    batch.publish(first + 1, 8);
    if batch.slice_progress(first, 8) {
        batch.complete_task(first);
    }
    true
}

#[test]
fn no_reserve_succeeds_in_a_batch_already_freed() {
    check(|| {
        let batch = Arc::new(BatchInner::new(2));
        let freed = Arc::new(AtomicBool::new(false));
        let submitter = {
            let (batch, freed) = (batch.clone(), freed.clone());
            loom::thread::spawn(move || {
                let Ok(first) = batch.reserve(1) else {
                    return false;
                };
                // Reserved and not finished: no free can have succeeded, before or since.
                assert!(
                    !freed.load(Ordering::SeqCst),
                    "a reserve succeeded in a freed batch"
                );
                batch.start_task(first, 1, Opcode::Read, 0);
                batch.publish(first + 1, 8);
                if batch.slice_progress(first, 8) {
                    batch.complete_task(first);
                }
                true
            })
        };
        let outcome = batch.mark_freed();
        if outcome.is_ok() {
            freed.store(true, Ordering::SeqCst);
        }
        let reserved = submitter.join().unwrap();
        match outcome {
            Ok(()) => {
                assert!(matches!(batch.reserve(1), Err(EngineError::BatchFreed)));
            }
            Err(EngineError::BatchBusy { pending }) => {
                assert!(reserved && pending == 1, "busy for nothing: {pending}");
            }
            Err(other) => panic!("{other:?}"),
        }
        assert_eq!(batch.counts.unfinished(), 0);
    });
}

#[test]
fn a_reserve_refused_for_room_never_makes_a_free_of_an_idle_batch_fail() {
    check(|| {
        let batch = Arc::new(BatchInner::new(1));
        let submitter = {
            let batch = batch.clone();
            loom::thread::spawn(move || batch.reserve(2).is_err())
        };
        let freed = batch.mark_freed();
        assert!(submitter.join().unwrap(), "two slots do not fit in one");
        assert!(freed.is_ok(), "{freed:?}");
    });
}

#[test]
fn the_ending_count_never_goes_below_zero_whichever_of_end_and_settling_comes_first() {
    check(|| {
        // One task of a merged run: its run's end settles it, on another thread than the
        // cancel that ends it.
        let batch = Arc::new(BatchInner::new(1));
        batch.reserve(1).unwrap();
        batch.start_run_task(0, Opcode::Write, 0);
        batch.publish(1, 8);
        let canceler = {
            let batch = batch.clone();
            loom::thread::spawn(move || batch.end(0, CANCELED))
        };
        let run_end = {
            let batch = batch.clone();
            loom::thread::spawn(move || {
                let finished = batch.release_run_tasks([(0, 8, 8)].into_iter(), 0, |_| {});
                batch.finished_many(finished);
            })
        };
        // A waiter's look at the count, at any point between their steps.
        let ending = batch.ending.load(Ordering::SeqCst);
        assert!(ending <= 1, "ending count {ending:#x}");
        let canceled = canceler.join().unwrap();
        run_end.join().unwrap();
        assert_eq!(batch.ending.load(Ordering::SeqCst), 0);
        assert_eq!(batch.counts.unfinished(), 0);
        let status = batch.task_status(0).unwrap().status;
        if canceled {
            assert_eq!(status, TransferStatus::Canceled);
        } else {
            assert_eq!(status, TransferStatus::Completed);
        }
    });
}

#[test]
fn a_batch_shows_completed_only_with_every_task_completed() {
    check(|| {
        let batch = Arc::new(BatchInner::new(2));
        let submitters: Vec<_> = (0..2)
            .map(|_| {
                let batch = batch.clone();
                loom::thread::spawn(move || submit_one_and_complete(&batch))
            })
            .collect();
        let status = batch.status();
        if status.state == BatchState::Completed {
            assert_eq!(status.completed, status.submitted, "{status:?}");
            assert_eq!(status.transferred_bytes, 8 * status.submitted as u64);
            for task in 0..status.submitted {
                assert_eq!(
                    batch.task_status(task).map(|t| t.status),
                    Some(TransferStatus::Completed)
                );
            }
        }
        for submitter in submitters {
            assert!(submitter.join().unwrap());
        }
        let status = batch.status();
        assert_eq!(
            (status.state, status.completed, status.transferred_bytes),
            (BatchState::Completed, 2, 16)
        );
        batch.mark_freed().unwrap();
    });
}
