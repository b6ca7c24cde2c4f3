//! A listener's table of connections: which are opening and which are open, the limits on
//! each, and the log lines held back when many are closed at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::ServeLimits;

/// How long a connection that has completed its opening waits for a slot when every one
/// is taken: a connection that has sent its last answer holds its slot until its thread
/// ends, a moment after its client (which may already be opening the next connection) has
/// the answer. The connection waits on its own thread, never the accept thread.
pub(super) const FINISHING_GRACE: Duration = Duration::from_millis(50);

/// At most one log line a second about each kind of connection closed for the limits: a
/// flood of them would otherwise flood the log.
const QUIET: Duration = Duration::from_secs(1);

/// The connections of one listener and its limits, shared by its accept thread, its reaper
/// and its connections.
pub(super) struct Table {
    pub(super) slots: Mutex<Slots>,
    /// Raised whenever a connection leaves, opens or is closed, and when a new one arrives.
    pub(super) changed: Condvar,
    pub(super) limits: ServeLimits,
    pub(super) name: String,
    pub(super) stop: Arc<AtomicBool>,
}

#[derive(Default)]
pub(super) struct Slots {
    /// Live connections, oldest first.
    pub(super) conns: Vec<Conn>,
    pub(super) opening: usize,
    pub(super) open: usize,
    /// Log lines held back (see [`QUIET`]).
    pub(super) displaced: Quiet,
    pub(super) expired: Quiet,
    pub(super) refused: Quiet,
}

/// A live connection.
pub(super) struct Conn {
    pub(super) id: u64,
    pub(super) phase: Phase,
    /// When its opening must be complete.
    pub(super) deadline: Instant,
    pub(super) peer: String,
    pub(super) cut: Box<dyn Fn() + Send>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Opening,
    Open,
    /// Cut by the listener; its thread has not ended yet.
    Cut,
}

impl Slots {
    pub(super) fn position(&self, id: u64) -> Option<usize> {
        self.conns.iter().position(|c| c.id == id)
    }

    /// Cuts the connection at `at`; it stops counting against the limits at once (its
    /// thread, whose read the cut ends, removes it).
    pub(super) fn cut(&mut self, at: usize) {
        let conn = &mut self.conns[at];
        match conn.phase {
            Phase::Opening => self.opening -= 1,
            Phase::Open => self.open -= 1,
            Phase::Cut => return,
        }
        conn.phase = Phase::Cut;
        (conn.cut)();
    }

    pub(super) fn remove(&mut self, id: u64) {
        if let Some(at) = self.position(id) {
            match self.conns[at].phase {
                Phase::Opening => self.opening -= 1,
                Phase::Open => self.open -= 1,
                Phase::Cut => {}
            }
            self.conns.remove(at);
        }
    }
}

/// Counts events whose log line is held back.
#[derive(Default)]
pub(super) struct Quiet {
    last: Option<Instant>,
    held: u64,
}

impl Quiet {
    /// One more event: `Some(events since the last line)` when a line is due.
    pub(super) fn note(&mut self, events: u64) -> Option<u64> {
        self.held += events;
        let now = Instant::now();
        if self
            .last
            .is_some_and(|last| now.duration_since(last) < QUIET)
        {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.held))
    }
}

/// A served connection's place in its listener's table, until its handler returns.
pub(super) struct Opening {
    pub(super) table: Arc<Table>,
    pub(super) id: u64,
    pub(super) deadline: Instant,
    pub(super) done: AtomicBool,
}

impl std::fmt::Debug for Opening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opening")
            .field("id", &self.id)
            .field("deadline", &self.deadline)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl Opening {
    pub(super) fn deadline(&self) -> Option<Instant> {
        (!self.done.load(Ordering::Acquire)).then_some(self.deadline)
    }

    pub(super) fn open(&self) -> bool {
        if self.done.load(Ordering::Acquire) {
            return true;
        }
        let table = &*self.table;
        let max = table.limits.max_connections;
        let until = (Instant::now() + FINISHING_GRACE).min(self.deadline);
        let mut slots = table.slots.lock();
        loop {
            let Some(at) = slots
                .position(self.id)
                .filter(|&at| slots.conns[at].phase == Phase::Opening)
            else {
                return false;
            };
            if slots.open < max {
                slots.conns[at].phase = Phase::Open;
                slots.opening -= 1;
                slots.open += 1;
                self.done.store(true, Ordering::Release);
                return true;
            }
            let now = Instant::now();
            if now >= until {
                if let Some(more) = slots.refused.note(1) {
                    tracing::warn!(
                        "{}: {max} connections already; closing the one from {}{}",
                        table.name,
                        slots.conns[at].peer,
                        also(more - 1)
                    );
                }
                slots.cut(at);
                table.changed.notify_all();
                return false;
            }
            table.changed.wait_for(&mut slots, until - now);
        }
    }
}

/// The tail of a log line that stands for others held back.
pub(super) fn also(held: u64) -> String {
    if held == 0 {
        String::new()
    } else {
        format!(" ({held} more like it since the last line)")
    }
}
