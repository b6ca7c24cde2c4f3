//! Running as a service, for `tern-bench --mode target` and `tern-metadata-server`: wait for
//! SIGINT or SIGTERM (or a deadline, or stdin closing when a parent asks for that), whatever
//! stdin is; after the first, a second signal exits at once.
//!
//! It must not stop anything itself: the caller shuts down cleanly once [`Stop::wait`] returns.

use std::fmt;
use std::io::Read;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::Duration;

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::flag;
use signal_hook::iterator::Signals;

/// Why a service stops.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Reason {
    /// SIGINT or SIGTERM arrived.
    Signal(i32),
    /// The run time given on the command line passed.
    Deadline(Duration),
    /// Stdin reached end of file (only when [`Stop::on_stdin_eof`] asked for it).
    StdinClosed,
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Signal(SIGINT) => f.write_str("SIGINT received"),
            Reason::Signal(SIGTERM) => f.write_str("SIGTERM received"),
            Reason::Signal(other) => write!(f, "signal {other} received"),
            Reason::Deadline(limit) => {
                write!(f, "its run time of {} s passed", limit.as_secs_f64())
            }
            Reason::StdinClosed => f.write_str("stdin closed"),
        }
    }
}

/// The stop conditions of one service process. Create it first, before slow start-up work, so
/// that a signal sent during start-up is not lost.
pub struct Stop {
    reasons: Receiver<Reason>,
    sender: Sender<Reason>,
    /// Set by the first signal (in the handler) or when [`Stop::wait`] returns: from then on
    /// SIGINT or SIGTERM ends the process at once with 128 + the signal's number.
    shutting_down: Arc<AtomicBool>,
}

impl Stop {
    /// Installs the SIGINT and SIGTERM handlers.
    pub fn install() -> Result<Self, String> {
        let shutting_down = Arc::new(AtomicBool::new(false));
        let mut signals = Signals::new([SIGINT, SIGTERM])
            .map_err(|e| format!("installing signal handlers: {e}"))?;
        for signal in [SIGINT, SIGTERM] {
            // Handlers run in the order they were registered: exit if already shutting down,
            // then mark that we are (the `Signals` iterator above registered first, which
            // only records the signal).
            flag::register_conditional_shutdown(signal, 128 + signal, shutting_down.clone())
                .and_then(|_| flag::register(signal, shutting_down.clone()))
                .map_err(|e| format!("installing signal handlers: {e}"))?;
        }
        let (sender, reasons) = mpsc::channel();
        let to_main = sender.clone();
        std::thread::Builder::new()
            .name("tern-signals".into())
            .spawn(move || {
                for signal in signals.forever() {
                    if to_main.send(Reason::Signal(signal)).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| format!("starting the signal thread: {e}"))?;
        Ok(Self {
            reasons,
            sender,
            shutting_down,
        })
    }

    /// Also stops when stdin reaches end of file: for a parent process that owns this one and
    /// holds its stdin open (the parent's exit closes it, whatever way the parent ends).
    pub fn on_stdin_eof(&self) -> Result<(), String> {
        let sender = self.sender.clone();
        std::thread::Builder::new()
            .name("tern-stdin".into())
            .spawn(move || {
                let mut sink = [0u8; 64];
                let mut stdin = std::io::stdin();
                while stdin.read(&mut sink).is_ok_and(|n| n > 0) {}
                let _ = sender.send(Reason::StdinClosed);
            })
            .map(drop)
            .map_err(|e| format!("starting the stdin thread: {e}"))
    }

    /// Sleeps until a stop condition holds (or `limit` passes) and says which. From then on a
    /// signal ends the process at once.
    pub fn wait(&self, limit: Option<Duration>) -> Reason {
        let reason = match limit {
            Some(limit) => match self.reasons.recv_timeout(limit) {
                Ok(reason) => reason,
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                    Reason::Deadline(limit)
                }
            },
            // `self.sender` keeps the channel open, so this only returns with a reason.
            None => self.reasons.recv().unwrap_or(Reason::StdinClosed),
        };
        self.shutting_down.store(true, Ordering::SeqCst);
        reason
    }
}
