//! Frames on the Unix stream: [`FrameReader`] cuts them out of what arrives and keeps the
//! descriptors that came along; [`send`] writes them.

use std::collections::VecDeque;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use super::decode::decode;
use super::error::WireError;
use super::frame::Frame;
use super::{HEADER_LEN, MAX_BODY, MAX_DEVICE_CHUNKS};

/// Cuts frames out of a Unix stream, keeping the descriptors that arrive with them in order.
#[derive(Debug, Default)]
pub struct FrameReader {
    buf: Vec<u8>,
    start: usize,
    fds: VecDeque<OwnedFd>,
}

/// Most descriptors a reader keeps before it refuses more (a peer that sends descriptors
/// nobody asked for): one answer's device chunks and some.
const MAX_QUEUED_FDS: usize = MAX_DEVICE_CHUNKS + 16;

impl FrameReader {
    /// An empty reader.
    pub fn new() -> Self {
        Self::default()
    }

    /// The next whole frame, reading as needed; `Ok(None)` when the peer closed between
    /// frames. Blocks as the stream's read timeout allows.
    pub fn next(&mut self, stream: &UnixStream) -> Result<Option<Frame>, WireError> {
        loop {
            if let Some(frame) = self.cut()? {
                return Ok(Some(frame));
            }
            if self.start > 0 {
                self.buf.drain(..self.start);
                self.start = 0;
            }
            let have = self.buf.len();
            self.buf.resize(have + (64 << 10), 0);
            let mut fds = Vec::new();
            let got = tern_memreg::shm::recv_with_fds(stream, &mut self.buf[have..], &mut fds);
            self.fds.extend(fds);
            let got = match got {
                Ok(n) => n,
                Err(e) => {
                    self.buf.truncate(have);
                    return Err(WireError::Io {
                        kind: e.kind(),
                        message: e.to_string(),
                    });
                }
            };
            self.buf.truncate(have + got);
            if self.fds.len() > MAX_QUEUED_FDS {
                return Err(WireError::Io {
                    kind: io::ErrorKind::InvalidData,
                    message: format!(
                        "the peer sent more than {MAX_QUEUED_FDS} descriptors unasked"
                    ),
                });
            }
            if got == 0 {
                return if self.buf.is_empty() {
                    Ok(None)
                } else {
                    Err(WireError::Truncated)
                };
            }
        }
    }

    fn cut(&mut self) -> Result<Option<Frame>, WireError> {
        let pending = &self.buf[self.start..];
        if pending.len() < HEADER_LEN {
            return Ok(None);
        }
        let len = u32::from_le_bytes([pending[0], pending[1], pending[2], pending[3]]) as usize;
        if len > MAX_BODY {
            return Err(WireError::TooLong(len));
        }
        if pending.len() < HEADER_LEN + len {
            return Ok(None);
        }
        let frame = decode(pending[4], &pending[HEADER_LEN..HEADER_LEN + len]);
        self.start += HEADER_LEN + len;
        frame.map(Some)
    }

    /// The oldest descriptor received and not yet taken.
    pub fn take_fd(&mut self) -> Option<OwnedFd> {
        self.fds.pop_front()
    }
}

/// Writes all of `bytes` (a frame, or frames) to the stream.
pub fn send(stream: &UnixStream, bytes: &[u8]) -> io::Result<()> {
    let mut rest = bytes;
    while !rest.is_empty() {
        match tern_memreg::shm::send_with_fds(stream, rest, &[]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => rest = &rest[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::frame::samples;

    #[test]
    fn a_reader_cuts_frames_across_reads_and_refuses_oversized_ones() {
        let (a, b) = UnixStream::pair().unwrap();
        let frames = samples();
        let bytes: Vec<u8> = frames.iter().flat_map(Frame::encode).collect();
        let (first, second) = bytes.split_at(7);
        send(&a, first).unwrap();
        let writer = std::thread::spawn({
            let second = second.to_vec();
            let a = a.try_clone().unwrap();
            move || send(&a, &second).unwrap()
        });
        let mut reader = FrameReader::new();
        for frame in &frames {
            assert_eq!(reader.next(&b).unwrap().as_ref(), Some(frame));
        }
        writer.join().unwrap();
        drop(a);
        assert_eq!(reader.next(&b).unwrap(), None);

        let (a, b) = UnixStream::pair().unwrap();
        send(&a, b"TERNAUTH\x02\x03").unwrap();
        let error = FrameReader::new().next(&b).unwrap_err();
        assert!(matches!(error, WireError::TooLong(_)), "{error}");
        let (a, b) = UnixStream::pair().unwrap();
        send(&a, &Frame::Release { id: 1 }.encode()[..7]).unwrap();
        drop(a);
        assert_eq!(FrameReader::new().next(&b), Err(WireError::Truncated));
    }
}
