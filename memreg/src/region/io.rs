//! Streams that region memory is read into and written from without a Rust reference to
//! it: sockets by `recv(2)` and `sendmsg(2)` straight into and out of a slice, anything
//! else through a bounce buffer.

use std::io::{self, Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use super::{RegionPin, RegionSlice};

impl RegionPin {
    fn slice_io(&self, addr: usize, len: usize) -> io::Result<RegionSlice<'_>> {
        self.slice(addr, len)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    }

    /// Fills `[addr, addr + len)` straight from `source` (no staging copy for sockets).
    pub fn read_exact_from(
        &self,
        addr: usize,
        len: usize,
        source: &mut impl RegionIo,
    ) -> io::Result<()> {
        let mut rest = self.slice_io(addr, len)?;
        while !rest.is_empty() {
            match source.read_into(rest) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => rest = rest.skip(n.min(rest.len())),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Sends `prefix` and then `[addr, addr + len)` to `sink`, gathered into as few system
    /// calls as it allows (a request header and its body in one packet).
    pub fn write_prefixed_to(
        &self,
        prefix: &[u8],
        addr: usize,
        len: usize,
        sink: &mut impl RegionIo,
    ) -> io::Result<()> {
        let (mut head, mut body) = (prefix, self.slice_io(addr, len)?);
        while !head.is_empty() || !body.is_empty() {
            let written = write_some(sink, head, body)?;
            let from_head = written.min(head.len());
            head = &head[from_head..];
            body = body.skip((written - from_head).min(body.len()));
        }
        Ok(())
    }
}

impl RegionSlice<'_> {
    /// One `recv(2)` from `fd` into the slice; returns the bytes received (0: end of stream).
    pub fn recv_from(&self, fd: BorrowedFd<'_>) -> io::Result<usize> {
        // SAFETY: the kernel writes at most `len` bytes at `ptr`, all inside the pinned region
        // (valid for writes while pinned); no Rust reference to those bytes exists.
        let got = unsafe { libc::recv(fd.as_raw_fd(), self.ptr.as_ptr().cast(), self.len, 0) };
        if got < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(got as usize)
    }

    /// One `readv(2)` from `fd` into the slice and then `ahead`: what arrived beyond the
    /// slice's bytes (the next request's header, say) is taken in the same call. Returns the
    /// bytes received in all (0: end of stream); the slice holds the first of them.
    pub fn recv_with_ahead(&self, fd: BorrowedFd<'_>, ahead: &mut [u8]) -> io::Result<usize> {
        let iov = [
            libc::iovec {
                iov_base: self.ptr.as_ptr().cast(),
                iov_len: self.len,
            },
            libc::iovec {
                iov_base: ahead.as_mut_ptr().cast(),
                iov_len: ahead.len(),
            },
        ];
        // SAFETY: the kernel writes at most `len` bytes at `ptr`, all inside the pinned region
        // (valid for writes while pinned, no Rust reference to them exists), and at most
        // `ahead.len()` bytes into `ahead`, borrowed mutably for the call (readv(2) fills the
        // buffers in order and writes nothing else).
        let got = unsafe { libc::readv(fd.as_raw_fd(), iov.as_ptr(), 2) };
        if got < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(got as usize)
    }

    /// One `sendmsg(2)` of `prefix` and then the slice to `fd` (without SIGPIPE); returns the
    /// bytes sent, prefix included.
    pub fn send_to(&self, fd: BorrowedFd<'_>, prefix: &[u8]) -> io::Result<usize> {
        let mut iov = [
            libc::iovec {
                iov_base: prefix.as_ptr().cast_mut().cast(),
                iov_len: prefix.len(),
            },
            libc::iovec {
                iov_base: self.ptr.as_ptr().cast(),
                iov_len: self.len,
            },
        ];
        let skip = usize::from(prefix.is_empty());
        // SAFETY: msghdr is plain data; zero is valid (no name, no control data).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov[skip..].as_mut_ptr();
        msg.msg_iovlen = 2 - skip;
        // SAFETY: both iovecs describe readable memory for the call's duration: `prefix` is
        // borrowed, the slice lies in the pinned region; the kernel only reads them.
        let sent = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(sent as usize)
    }
}

/// Most frames [`send_frames`] gathers into one `sendmsg(2)`.
pub const MAX_FRAMES_PER_SEND: usize = 32;

/// One `sendmsg(2)` to `fd` (without SIGPIPE) of each frame's prefix and then its slice, in
/// order, the first [`MAX_FRAMES_PER_SEND`] frames at most; returns the bytes sent. Many
/// small requests leave in one call, and the kernel packs them into as few packets as one
/// large request.
pub fn send_frames(fd: BorrowedFd<'_>, frames: &[(&[u8], RegionSlice<'_>)]) -> io::Result<usize> {
    let empty = libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    };
    let mut iov = [empty; 2 * MAX_FRAMES_PER_SEND];
    let mut used = 0;
    for (prefix, slice) in frames.iter().take(MAX_FRAMES_PER_SEND) {
        for (base, len) in [
            (prefix.as_ptr().cast_mut().cast(), prefix.len()),
            (slice.ptr.as_ptr().cast(), slice.len),
        ] {
            if len > 0 {
                iov[used] = libc::iovec {
                    iov_base: base,
                    iov_len: len,
                };
                used += 1;
            }
        }
    }
    if used == 0 {
        return Ok(0);
    }
    // SAFETY: msghdr is plain data; zero is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = used;
    // SAFETY: each of the first `used` iovecs describes readable memory for the call's
    // duration: the prefixes are borrowed, the slices lie in pinned regions (a
    // `RegionSlice` is valid for its length while its pin lives); the kernel only reads them
    // (sendmsg(2)). `used` ≤ 64, below the kernel's UIO_MAXIOV of 1024.
    let sent = unsafe { libc::sendmsg(fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sent as usize)
}

/// Drops from the front of `frames` the `sent` bytes a [`send_frames`] call took: the frames
/// sent whole go, and one sent in part keeps only what is left of it.
pub fn skip_sent_frames(frames: &mut Vec<(&[u8], RegionSlice<'_>)>, mut sent: usize) {
    let mut whole = 0;
    for (prefix, slice) in frames.iter_mut() {
        let len = prefix.len() + slice.len();
        if sent >= len {
            sent -= len;
            whole += 1;
            continue;
        }
        let from_prefix = sent.min(prefix.len());
        *prefix = &prefix[from_prefix..];
        *slice = slice.skip(sent - from_prefix);
        break;
    }
    frames.drain(..whole);
}

/// One `write_from` that took bytes: an interrupted call is retried and a call that took
/// nothing is `WriteZero`, so the loops that write a whole range cannot spin.
pub(crate) fn write_some(
    sink: &mut impl RegionIo,
    prefix: &[u8],
    src: RegionSlice<'_>,
) -> io::Result<usize> {
    loop {
        match sink.write_from(prefix, src) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(written) => return Ok(written),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// A byte stream that registered memory is read into and written from without a Rust
/// reference to it: sockets through [`RegionSlice::recv_from`] and
/// [`RegionSlice::send_to`], anything else through [`Staged`]'s bounce buffer.
pub trait RegionIo {
    /// Reads some bytes into `dst`; returns how many (0 at end of stream).
    fn read_into(&mut self, dst: RegionSlice<'_>) -> io::Result<usize>;

    /// Writes `prefix` and then `src`, as much as one call takes; returns how many bytes.
    fn write_from(&mut self, prefix: &[u8], src: RegionSlice<'_>) -> io::Result<usize>;
}

impl RegionIo for std::net::TcpStream {
    fn read_into(&mut self, dst: RegionSlice<'_>) -> io::Result<usize> {
        dst.recv_from(self.as_fd())
    }

    fn write_from(&mut self, prefix: &[u8], src: RegionSlice<'_>) -> io::Result<usize> {
        src.send_to(self.as_fd(), prefix)
    }
}

impl RegionIo for std::os::unix::net::UnixStream {
    fn read_into(&mut self, dst: RegionSlice<'_>) -> io::Result<usize> {
        dst.recv_from(self.as_fd())
    }

    fn write_from(&mut self, prefix: &[u8], src: RegionSlice<'_>) -> io::Result<usize> {
        src.send_to(self.as_fd(), prefix)
    }
}

/// Any `Read + Write` as a [`RegionIo`], through a bounce buffer: one more copy, for tests,
/// fuzzing and in-memory streams.
#[derive(Debug)]
pub struct Staged<T> {
    /// The stream.
    pub inner: T,
    bounce: Vec<u8>,
}

impl<T> Staged<T> {
    /// Wraps `inner`.
    pub fn new(inner: T) -> Self {
        Self {
            inner,
            bounce: Vec::new(),
        }
    }
}

/// The bounce buffer's size: bytes moved per call.
const BOUNCE: usize = 64 << 10;

impl<T: Read> Read for Staged<T> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read(buf)
    }
}

impl<T: Write> Write for Staged<T> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<T: Read + Write> RegionIo for Staged<T> {
    fn read_into(&mut self, dst: RegionSlice<'_>) -> io::Result<usize> {
        self.bounce.resize(dst.len().min(BOUNCE), 0);
        let got = self.inner.read(&mut self.bounce)?;
        Ok(dst.copy_from(&self.bounce[..got]))
    }

    fn write_from(&mut self, prefix: &[u8], src: RegionSlice<'_>) -> io::Result<usize> {
        if !prefix.is_empty() {
            return self.inner.write(prefix);
        }
        self.bounce.resize(src.len().min(BOUNCE), 0);
        let n = src.copy_to(&mut self.bounce);
        self.inner.write(&self.bounce[..n])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::AlignedBuffer;
    use crate::region::{MemoryError, MemoryRegistry, Region};

    fn owned(len: usize, remote: bool) -> Region {
        Region::owned(AlignedBuffer::new(len).unwrap(), "cpu:0", remote)
    }

    #[test]
    fn gathered_frames_leave_in_order_and_a_partial_send_resumes_where_it_stopped() {
        let registry = MemoryRegistry::new();
        let region = registry.register(owned(4096, true)).unwrap();
        let base = region.addr();
        let pin = registry.pin(base, 4096).unwrap();
        let body: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        pin.copy_from_slice(base, &body).unwrap();
        let parts = [
            (b"ab".as_slice(), 0, 100),
            (b"".as_slice(), 100, 50),
            (b"xyz", 1000, 3000),
        ];
        let expected: Vec<u8> = parts
            .iter()
            .flat_map(|(prefix, at, len)| prefix.iter().chain(&body[*at..at + len]).copied())
            .collect();
        let frames = || -> Vec<(&[u8], RegionSlice<'_>)> {
            parts
                .iter()
                .map(|(prefix, at, len)| (*prefix, pin.slice(base + at, *len).unwrap()))
                .collect()
        };
        let (a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        let sent = send_frames(a.as_fd(), &frames()).unwrap();
        assert_eq!(sent, expected.len());
        let mut got = vec![0u8; sent];
        b.read_exact(&mut got).unwrap();
        assert_eq!(got, expected);
        // Every cut, inside a prefix, a slice or between frames, leaves exactly the rest.
        for cut in 0..=expected.len() {
            let mut rest = frames();
            skip_sent_frames(&mut rest, cut);
            let left: Vec<u8> = rest
                .iter()
                .flat_map(|(prefix, slice)| {
                    let mut bytes = prefix.to_vec();
                    let mut tail = vec![0u8; slice.len()];
                    slice.copy_to(&mut tail);
                    bytes.extend(tail);
                    bytes
                })
                .collect();
            assert_eq!(left, expected[cut..], "cut at {cut}");
            assert!(rest.first().is_none_or(|(p, s)| p.len() + s.len() > 0));
        }
    }

    #[test]
    fn pinned_access_is_range_checked_and_moves_bytes() {
        let registry = MemoryRegistry::new();
        let region = registry.register(owned(4096, true)).unwrap();
        let base = region.addr();
        let pin = registry.pin(base, 4096).unwrap();
        pin.copy_from_slice(base + 100, b"hello").unwrap();
        let mut out = [0u8; 5];
        pin.copy_to_slice(base + 100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        let mut sink = Staged::new(std::io::Cursor::new(Vec::new()));
        pin.write_prefixed_to(b">", base + 100, 5, &mut sink)
            .unwrap();
        assert_eq!(sink.inner.get_ref(), b">hello");
        let mut source = Staged::new(std::io::Cursor::new(b"world!".to_vec()));
        pin.read_exact_from(base + 4090, 6, &mut source).unwrap();
        pin.copy_to_slice(base + 4090, &mut out).unwrap();
        assert_eq!(&out, b"world");
        assert!(matches!(
            pin.copy_from_slice(base + 4095, b"xy"),
            Err(MemoryError::OutOfRange { .. })
        ));
        assert!(
            pin.write_prefixed_to(&[], usize::MAX, 2, &mut sink)
                .is_err()
        );
        assert!(pin.slice(base - 1, 1).is_err());
        assert!(pin.slice(base, usize::MAX).is_err());
    }
}
