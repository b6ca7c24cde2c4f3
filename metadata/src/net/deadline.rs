//! Reads under a deadline: a stream whose reads wake every [`READ_TICK`] is read until a
//! deadline, however its bytes trickle in.

use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::slots::Opening;

/// How long a blocked read on a served or dialed connection waits before it looks at its
/// deadline again: reads never block longer, so a deadline is kept to within this.
pub const READ_TICK: Duration = Duration::from_millis(250);

/// Reads and writes through a stream whose reads wake every [`READ_TICK`], failing with
/// `TimedOut` once `deadline` has passed: a peer that sends one byte a second is cut off at
/// the deadline, not kept alive by its trickle.
#[derive(Debug)]
pub struct DeadlineRead<'a, S> {
    pub(super) inner: &'a mut S,
    pub(super) deadline: Instant,
    pub(super) stop: Option<&'a AtomicBool>,
    pub(super) opening: Option<&'a Opening>,
}

impl<'a, S> DeadlineRead<'a, S> {
    /// Reads of `inner` until `deadline`.
    pub fn new(inner: &'a mut S, deadline: Instant) -> Self {
        Self {
            inner,
            deadline,
            stop: None,
            opening: None,
        }
    }

    /// For a frame of a served connection ([`Served::frame`](super::Served::frame)):
    /// [`Served::opened`](super::Served::opened). Always `true` for any other stream.
    pub fn opened(&self) -> bool {
        self.opening.is_none_or(Opening::open)
    }

    /// Also gives up (with `ConnectionAborted`) once `stop` is raised.
    pub fn stop_on(self, stop: &'a AtomicBool) -> Self {
        Self {
            stop: Some(stop),
            ..self
        }
    }

    /// The stream underneath.
    pub fn get_mut(&mut self) -> &mut S {
        self.inner
    }

    /// When reads give up.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether the deadline has passed; the error to return if so.
    pub fn check(&self) -> io::Result<()> {
        if self.stop.is_some_and(|s| s.load(Ordering::Acquire)) {
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "stopping"));
        }
        if Instant::now() >= self.deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the frame did not arrive by its deadline",
            ));
        }
        Ok(())
    }
}

/// Whether an I/O error is a read that woke at its tick without data.
pub fn is_tick(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

impl<S: Read> Read for DeadlineRead<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            self.check()?;
            match self.inner.read(buf) {
                Err(e) if is_tick(&e) => {}
                other => return other,
            }
        }
    }
}

impl<S: Write> Write for DeadlineRead<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}
