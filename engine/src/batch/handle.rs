//! [`Batch`], the handle users hold.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::lifecycle::BatchInner;
use crate::types::{BatchStatus, TaskStatus};

/// A batch of transfers: allocate with [`crate::TransferEngine::allocate_batch`], submit into
/// it, then poll or wait. Cloning gives another handle to the same batch.
#[derive(Debug, Clone)]
pub struct Batch {
    pub(crate) inner: Arc<BatchInner>,
}

impl Batch {
    /// How many requests the batch takes in all.
    pub fn capacity(&self) -> usize {
        self.inner.capacity()
    }

    /// The status of task `task` (in submission order), or `None` if not submitted.
    pub fn task_status(&self, task: usize) -> Option<TaskStatus> {
        self.inner.task_status(task)
    }

    /// The aggregate status; reading it takes no lock.
    pub fn status(&self) -> BatchStatus {
        self.inner.status()
    }

    /// Sleeps (no busy polling) until every submitted task has finished or `timeout`
    /// elapses, whichever comes first: it returns within `timeout` (and the moment it takes
    /// to read the status), whatever the tasks do; `wait(Duration::ZERO)` only looks. A
    /// deadline passing meanwhile times the unfinished tasks out. A task that ends other
    /// than Completed is shown so only once no slice of it touches local memory and its pins
    /// are released: its slices still on the wire are cut off, and until they let go it
    /// shows `Pending` (wait again, or [`cancel`](Self::cancel), which waits up to
    /// [`DRAIN`](super::DRAIN) for them).
    pub fn wait(&self, timeout: Duration) -> BatchStatus {
        self.inner.wait(timeout)
    }

    /// Cancels every unfinished task; returns how many were canceled. Slices not started
    /// are skipped; the transports cut off those on the wire (a TCP lane drops its
    /// connection, a copy stops before its next piece), and this returns once every slice of
    /// the canceled tasks has let go, or after [`DRAIN`](super::DRAIN) at most: a canceled
    /// task shows `Canceled` only from then on (`Pending` before), its memory no longer
    /// touched and unpinned. [`TaskStatus::remote_may_change`](crate::TaskStatus) says
    /// whether a write's bytes may still land at the peer.
    pub fn cancel(&self) -> usize {
        self.inner.cancel()
    }

    /// Sets (or clears) the deadline after which unfinished tasks end as `Timeout`.
    pub fn set_deadline(&self, at: Option<Instant>) {
        self.inner.set_deadline(at);
    }

    /// Calls `hook` once, when no submitted task is unfinished: at once if none is, else on
    /// the thread that finishes the last one (a transport's worker, or a thread whose status
    /// read or wait times the batch out at its deadline). For completion notices to an event
    /// loop: the hook must be quick and must not block (write a byte to a pipe, say). A
    /// deadline only fires when someone reads the status or waits, so a caller that relies
    /// on the hook alone reads the status once the deadline has passed.
    pub fn on_complete(&self, hook: impl FnOnce() + Send + 'static) {
        self.inner.on_complete(Box::new(hook));
    }
}
