//! A served connection under one request's deadline, reading first what was staged.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::time::Instant;

use tern_memreg::{RegionIo, RegionSlice};
use tern_metadata::net::is_tick;

use super::held::Held;
use super::staging::Staging;
use crate::wire::FRAME_ALIGN;

/// A served connection under one request's deadline: reads and writes that wake at the
/// socket's tick go on until the deadline, then fail with `TimedOut`. Reads take what was
/// staged first. Status frames written to it are held (`held`), and go out before anything
/// else is sent.
pub(super) struct Deadlined<'a> {
    pub(super) stream: &'a mut TcpStream,
    pub(super) deadline: Instant,
    /// Taken before the stream.
    pub(super) staged: &'a mut Staging,
    pub(super) held: &'a mut Held,
}

impl Deadlined<'_> {
    /// Writes all of `bytes` within the deadline.
    pub(super) fn write_through(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            match self.retry(|s| s.write(bytes)) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Runs `op` until it does not merely wake at a tick, or the deadline passes.
    pub(super) fn retry<T>(
        &mut self,
        op: impl FnMut(&mut TcpStream) -> io::Result<T>,
    ) -> io::Result<T> {
        until_deadline(self.stream, self.deadline, op)
    }
}

/// Runs `op` on `stream` until it does not merely wake at a tick, or `deadline` passes.
fn until_deadline<T>(
    stream: &mut TcpStream,
    deadline: Instant,
    mut op: impl FnMut(&mut TcpStream) -> io::Result<T>,
) -> io::Result<T> {
    loop {
        match op(stream) {
            Err(e) if is_tick(&e) && Instant::now() < deadline => {}
            Err(e) if is_tick(&e) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the request did not move by its deadline",
                ));
            }
            other => return other,
        }
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !self.staged.is_empty() {
            let n = buf.len().min(self.staged.len());
            buf[..n].copy_from_slice(&self.staged.bytes()[..n]);
            self.staged.consume(n);
            return Ok(n);
        }
        self.retry(|s| s.read(buf))
    }
}

/// What `serve_request` writes is its status frames (a read's data goes by `write_from`):
/// each is held, and `serve` sends it, or keeps it for the next (see `held`).
impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.held.hold(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl RegionIo for Deadlined<'_> {
    /// Reads into `dst`, and in the same call the next request's header and a byte of what
    /// follows it, if they have arrived (staged): a run of writes then costs one read each,
    /// and `held` sees the next write begun without another call.
    fn read_into(&mut self, dst: RegionSlice<'_>) -> io::Result<usize> {
        if !self.staged.is_empty() {
            let n = dst.copy_from(self.staged.bytes());
            self.staged.consume(n);
            return Ok(n);
        }
        let staged = &mut *self.staged;
        staged.compact();
        until_deadline(self.stream, self.deadline, |stream| {
            let spare = staged.spare();
            let ahead = spare.len().min(FRAME_ALIGN + 1);
            let got = dst.recv_with_ahead(stream.as_fd(), &mut spare[..ahead])?;
            let own = got.min(dst.len());
            staged.filled(got - own);
            Ok(own)
        })
    }

    fn write_from(&mut self, prefix: &[u8], src: RegionSlice<'_>) -> io::Result<usize> {
        self.send_held()?;
        self.retry(|s| s.write_from(prefix, src))
    }
}
