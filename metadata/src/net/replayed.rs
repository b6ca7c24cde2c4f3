//! A stream with the bytes already read from it put back in front.

use std::io::{self, Read, Write};

/// A stream with bytes already read from it put back in front (a frame's first byte, taken
/// while waiting for it).
#[derive(Debug)]
pub struct Replayed<'a, S> {
    first: &'a [u8],
    inner: &'a mut S,
}

impl<'a, S> Replayed<'a, S> {
    /// `first`, then the rest of `inner`.
    pub fn new(first: &'a [u8], inner: &'a mut S) -> Self {
        Self { first, inner }
    }
}

impl<S: Read> Read for Replayed<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.first.is_empty() {
            return self.inner.read(buf);
        }
        self.first.read(buf)
    }
}

impl<S: Write> Write for Replayed<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}
