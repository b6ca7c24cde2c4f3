//! Bytes read off a connection ahead of the request that needs them: one read may bring
//! several headers (a client sends the headers of consecutive reads together) or a header
//! and the start of a write's body, and each request takes its own from the front.

use std::io::{self, Read};
use std::net::TcpStream;

use tern_metadata::net::{DeadlineRead, is_tick};

use crate::wire::HEADER_LEN;

/// How much one read off a connection may take ahead: a page, so that a write's body beyond
/// it goes straight into registered memory.
const STAGING: usize = 4096;

/// Bytes read off a connection ahead of the request that needs them.
// Why not `rpc::read_frame`: pipelined headers sized by opcode, read ahead; bodies go to memory.
pub(super) struct Staging {
    buf: Box<[u8; STAGING]>,
    start: usize,
    end: usize,
}

impl Default for Staging {
    fn default() -> Self {
        Self {
            buf: Box::new([0; STAGING]),
            start: 0,
            end: 0,
        }
    }
}

impl Staging {
    pub(super) fn len(&self) -> usize {
        self.end - self.start
    }

    pub(super) fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Moves what is staged to the front, making room behind it.
    pub(super) fn compact(&mut self) {
        self.buf.copy_within(self.start..self.end, 0);
        self.end -= self.start;
        self.start = 0;
    }

    /// The room behind what is staged.
    pub(super) fn spare(&mut self) -> &mut [u8] {
        &mut self.buf[self.end..]
    }

    /// `n` bytes were read into [`spare`](Self::spare).
    pub(super) fn filled(&mut self, n: usize) {
        self.end += n;
    }

    /// The first `n` bytes staged are taken.
    pub(super) fn consume(&mut self, n: usize) {
        self.start += n;
    }

    /// The first [`HEADER_LEN`] bytes staged (the caller made sure that many are), left
    /// staged.
    pub(super) fn peek_header(&self) -> &[u8; HEADER_LEN] {
        self.buf[self.start..]
            .first_chunk()
            .unwrap_or(&[0; HEADER_LEN])
    }

    /// What is staged.
    pub(super) fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }
}

/// Reads into `staged` within the frame deadline until it holds `need` bytes of header
/// (room for them is behind what it holds).
pub(super) fn read_rest(
    frame: &mut DeadlineRead<'_, TcpStream>,
    staged: &mut Staging,
    need: usize,
) -> Result<(), String> {
    while staged.len() < need {
        match frame.read(staged.spare()) {
            Ok(0) => {
                return Err(format!(
                    "truncated header ({} of {need} bytes)",
                    staged.len()
                ));
            }
            Ok(n) => staged.filled(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_tick(&e) => {
                return Err(format!(
                    "silent mid-header ({} of {need} bytes)",
                    staged.len()
                ));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_hands_out_headers_in_order_and_keeps_the_rest() {
        let mut staged = Staging::default();
        let bytes: Vec<u8> = (0..(2 * HEADER_LEN + 5) as u8).collect();
        staged.spare()[..bytes.len()].copy_from_slice(&bytes);
        staged.filled(bytes.len());
        assert_eq!(&staged.peek_header()[..], &bytes[..HEADER_LEN]);
        staged.consume(HEADER_LEN);
        assert_eq!(
            &staged.peek_header()[..],
            &bytes[HEADER_LEN..2 * HEADER_LEN]
        );
        staged.consume(HEADER_LEN);
        assert_eq!(staged.bytes(), &bytes[2 * HEADER_LEN..]);
        staged.compact();
        assert_eq!(staged.start, 0);
        assert_eq!(staged.bytes(), &bytes[2 * HEADER_LEN..]);
        assert_eq!(staged.spare().len(), STAGING - 5);
    }
}
