//! The frames of the shared-memory socket. Tern-native (no Mooncake format binds it):
//! little-endian, each frame `u32 body length | u8 kind | body`, bodies of fixed fields and
//! `u16`-length-prefixed UTF-8 strings. The client (the initiator) speaks first, after the
//! cluster-secret exchange when there is a secret:
//!
//! ```text
//!  client                                                server (owner of the memory)
//!   Hello   { magic, version, nonce, client segment, wanted segment } ──▶
//!                                              ◀── Welcome { version, probe address, segment }
//!   (reads 16 bytes at the probe address by cross-memory attach: the nonce, if permitted)
//!   Open    { id, addr, len }                   ──▶
//!                                              ◀── Opened  { id, memfd region + 1 fd | plain region | rejected, reason
//!                                                            | declined, reason
//!                                                            | device region, bus ID, chunks (IPC handle or 1 fd each) }
//!   Lease   { id, [addr, len]… }                ──▶   pins each range (registered, remote-accessible)
//!                                              ◀── Leased  { id, [granted?]… }
//!   (cross-memory attach into the granted ranges)
//!   Release { id }                              ──▶   unpins
//!                                              ◀── Revoke  { id, addr }   (a mapped buffer is being unregistered)
//!   Revoked { id }                              ──▶   (no copy into it runs, none will)
//!                                              ◀── Refused { reason }     (bad input; the server closes)
//! ```
//!
//! [`decode`] reads one frame's body and never panics, whatever the bytes (fuzzed through
//! its tests); [`FrameReader`] cuts frames out of a stream and keeps the descriptors that
//! came along.

use std::collections::VecDeque;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

/// First bytes of a Hello: a node that reads anything else closes.
pub const MAGIC: [u8; 8] = *b"TERNSHM\x01";
/// Bytes before a frame's body.
pub const HEADER_LEN: usize = 5;
/// Longest body accepted.
pub const MAX_BODY: usize = 64 << 10;
/// Longest string field.
pub const MAX_TEXT: usize = 1024;
/// Most ranges one Lease asks for.
pub const MAX_LEASE_RANGES: usize = 1024;
/// Bytes of the probe nonce.
pub const NONCE_LEN: usize = 16;
/// Most chunks of device memory one Opened hands out (each may carry a descriptor); a range
/// over more is asked for again from where the answer ended.
pub const MAX_DEVICE_CHUNKS: usize = 32;
/// Bytes of a CUDA IPC handle.
pub const IPC_HANDLE_LEN: usize = 64;

/// One piece of a device buffer as the owner hands it out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceChunk {
    /// Its start in the owner's address space.
    pub base: u64,
    /// Its length.
    pub len: u64,
    /// A CUDA IPC handle of the whole allocation (`cuMemAlloc` memory), or `None`: the
    /// chunk's physical memory comes as the next descriptor (VMM memory).
    pub ipc: Option<[u8; IPC_HANDLE_LEN]>,
}

/// What one Open found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opened {
    /// The buffer `[addr, addr + len)` lives in a memfd of `map_len` bytes, attached.
    Memfd {
        /// Start of the registered buffer in the owner's address space.
        addr: u64,
        /// Its length.
        len: u64,
        /// The memfd's size (at least `len`).
        map_len: u64,
    },
    /// The buffer `[addr, addr + len)` is other memory: reach it by cross-memory attach
    /// under a lease.
    Plain {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// The range is not inside a registered, remote-accessible buffer.
    Rejected(String),
    /// The buffer is memory this transport does not carry (device memory): the slice goes
    /// to the next transport.
    Declined {
        /// Start of the buffer.
        addr: u64,
        /// Its length.
        len: u64,
        /// Why.
        reason: String,
    },
    /// The buffer `[addr, addr + len)` is device memory of the GPU with PCI bus ID `bus_id`:
    /// map these chunks of it (those from the one holding the asked-for start) and copy with
    /// the GPU. One descriptor comes along for each chunk without an IPC handle, in order.
    Device {
        /// Start of the registered buffer.
        addr: u64,
        /// Its length.
        len: u64,
        /// The GPU's PCI bus ID (device ordinals differ between processes).
        bus_id: String,
        /// The chunks, in address order.
        chunks: Vec<DeviceChunk>,
    },
}

impl Opened {
    /// Descriptors that come with this answer.
    pub fn descriptors(&self) -> usize {
        match self {
            Self::Memfd { .. } => 1,
            Self::Device { chunks, .. } => chunks.iter().filter(|c| c.ipc.is_none()).count(),
            _ => 0,
        }
    }
}

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Client → server, first.
    Hello {
        /// [`MAGIC`].
        magic: [u8; 8],
        /// Protocol version.
        version: u16,
        /// What the server is to write at its probe address.
        nonce: [u8; NONCE_LEN],
        /// The client's segment.
        client_segment: String,
        /// The segment the client wants.
        server_segment: String,
    },
    /// Server → client, the answer to Hello.
    Welcome {
        /// Protocol version.
        version: u16,
        /// Where in the server the nonce now is.
        probe_addr: u64,
        /// The server's segment.
        segment: String,
    },
    /// Client → server: which buffer holds `[addr, addr + len)`, and how to reach it.
    Open {
        /// Request ID.
        id: u64,
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// Server → client.
    Opened {
        /// The Open's ID.
        id: u64,
        /// What it found.
        outcome: Opened,
    },
    /// Client → server: pin these ranges while they are moved by cross-memory attach.
    Lease {
        /// Lease ID.
        id: u64,
        /// `(addr, len)` each.
        ranges: Vec<(u64, u64)>,
    },
    /// Server → client: which ranges are pinned (in order).
    Leased {
        /// The Lease's ID.
        id: u64,
        /// One per range.
        granted: Vec<bool>,
    },
    /// Client → server: the lease's ranges are no longer touched.
    Release {
        /// Lease ID.
        id: u64,
    },
    /// Server → client: the memfd buffer at `addr` is being unregistered; stop using it.
    Revoke {
        /// Revocation ID.
        id: u64,
        /// Start of the buffer.
        addr: u64,
    },
    /// Client → server: nothing touches the revoked buffer any more.
    Revoked {
        /// Revocation ID.
        id: u64,
    },
    /// Server → client: bad input; the connection closes.
    Refused {
        /// Why.
        reason: String,
    },
}

/// What was wrong with bytes read from the socket.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// A kind byte no frame has.
    #[error("unknown frame kind {0:#04x}")]
    UnknownKind(u8),
    /// A body longer than [`MAX_BODY`] (a cluster-secret exchange sent to a node without a
    /// secret reads this way too).
    #[error("frame body of {0} bytes is longer than {MAX_BODY}")]
    TooLong(usize),
    /// A body cut short, or with bytes after its end.
    #[error("malformed {kind} frame: {why}")]
    Malformed {
        /// The frame's kind.
        kind: &'static str,
        /// What was wrong.
        why: String,
    },
    /// The stream ended inside a frame.
    #[error("the peer closed the connection inside a frame")]
    Truncated,
    /// The socket failed (or its read timed out: [`WireError::is_timeout`]).
    #[error("socket: {message}")]
    Io {
        /// What kind of failure.
        kind: io::ErrorKind,
        /// The operating system's words.
        message: String,
    },
}

impl WireError {
    /// Whether this is a read that woke at the stream's read timeout with nothing.
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            Self::Io {
                kind: io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut,
                ..
            }
        )
    }
}

const HELLO: u8 = 1;
const OPEN: u8 = 2;
const LEASE: u8 = 3;
const RELEASE: u8 = 4;
const REVOKED: u8 = 5;
const WELCOME: u8 = 0x81;
const OPENED: u8 = 0x82;
const LEASED: u8 = 0x83;
const REVOKE: u8 = 0x84;
const REFUSED: u8 = 0x85;

fn put_text(out: &mut Vec<u8>, text: &str) {
    let mut end = text.len().min(MAX_TEXT);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&(end as u16).to_le_bytes());
    out.extend_from_slice(&text.as_bytes()[..end]);
}

impl Frame {
    fn kind(&self) -> u8 {
        match self {
            Self::Hello { .. } => HELLO,
            Self::Open { .. } => OPEN,
            Self::Lease { .. } => LEASE,
            Self::Release { .. } => RELEASE,
            Self::Revoked { .. } => REVOKED,
            Self::Welcome { .. } => WELCOME,
            Self::Opened { .. } => OPENED,
            Self::Leased { .. } => LEASED,
            Self::Revoke { .. } => REVOKE,
            Self::Refused { .. } => REFUSED,
        }
    }

    /// The frame's bytes, header included.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; HEADER_LEN];
        out[4] = self.kind();
        let u64s = |out: &mut Vec<u8>, values: &[u64]| {
            for v in values {
                out.extend_from_slice(&v.to_le_bytes());
            }
        };
        match self {
            Self::Hello {
                magic,
                version,
                nonce,
                client_segment,
                server_segment,
            } => {
                out.extend_from_slice(magic);
                out.extend_from_slice(&version.to_le_bytes());
                out.extend_from_slice(nonce);
                put_text(&mut out, client_segment);
                put_text(&mut out, server_segment);
            }
            Self::Welcome {
                version,
                probe_addr,
                segment,
            } => {
                out.extend_from_slice(&version.to_le_bytes());
                u64s(&mut out, &[*probe_addr]);
                put_text(&mut out, segment);
            }
            Self::Open { id, addr, len } => u64s(&mut out, &[*id, *addr, *len]),
            Self::Opened { id, outcome } => {
                u64s(&mut out, &[*id]);
                match outcome {
                    Opened::Memfd { addr, len, map_len } => {
                        out.push(0);
                        u64s(&mut out, &[*addr, *len, *map_len]);
                    }
                    Opened::Plain { addr, len } => {
                        out.push(1);
                        u64s(&mut out, &[*addr, *len]);
                    }
                    Opened::Rejected(reason) => {
                        out.push(2);
                        put_text(&mut out, reason);
                    }
                    Opened::Declined { addr, len, reason } => {
                        out.push(3);
                        u64s(&mut out, &[*addr, *len]);
                        put_text(&mut out, reason);
                    }
                    Opened::Device {
                        addr,
                        len,
                        bus_id,
                        chunks,
                    } => {
                        out.push(4);
                        u64s(&mut out, &[*addr, *len]);
                        put_text(&mut out, bus_id);
                        let chunks = &chunks[..chunks.len().min(MAX_DEVICE_CHUNKS)];
                        out.push(chunks.len() as u8);
                        for chunk in chunks {
                            u64s(&mut out, &[chunk.base, chunk.len]);
                            match &chunk.ipc {
                                Some(handle) => {
                                    out.push(1);
                                    out.extend_from_slice(handle);
                                }
                                None => out.push(0),
                            }
                        }
                    }
                }
            }
            Self::Lease { id, ranges } => {
                u64s(&mut out, &[*id]);
                let ranges = &ranges[..ranges.len().min(MAX_LEASE_RANGES)];
                out.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
                for (addr, len) in ranges {
                    u64s(&mut out, &[*addr, *len]);
                }
            }
            Self::Leased { id, granted } => {
                u64s(&mut out, &[*id]);
                let granted = &granted[..granted.len().min(MAX_LEASE_RANGES)];
                out.extend_from_slice(&(granted.len() as u32).to_le_bytes());
                out.extend(granted.iter().map(|&g| u8::from(g)));
            }
            Self::Release { id } | Self::Revoked { id } => u64s(&mut out, &[*id]),
            Self::Revoke { id, addr } => u64s(&mut out, &[*id, *addr]),
            Self::Refused { reason } => put_text(&mut out, reason),
        }
        let body = (out.len() - HEADER_LEN) as u32;
        out[..4].copy_from_slice(&body.to_le_bytes());
        out
    }
}

/// Reads fields off a body, failing (never panicking) when it runs short.
struct Body<'a> {
    bytes: &'a [u8],
    kind: &'static str,
}

impl<'a> Body<'a> {
    fn bad(&self, why: impl Into<String>) -> WireError {
        WireError::Malformed {
            kind: self.kind,
            why: why.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.bytes.len() < n {
            return Err(self.bad(format!("{} bytes short", n - self.bytes.len())));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, WireError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    /// A count of ranges, at most [`MAX_LEASE_RANGES`].
    fn count(&mut self) -> Result<usize, WireError> {
        let count = self.u32()? as usize;
        if count > MAX_LEASE_RANGES {
            return Err(self.bad(format!("{count} ranges")));
        }
        Ok(count)
    }

    fn text(&mut self) -> Result<String, WireError> {
        let len = usize::from(self.u16()?);
        if len > MAX_TEXT {
            return Err(self.bad(format!("a string of {len} bytes")));
        }
        let bytes = self.take(len)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| self.bad("a string that is not UTF-8"))
    }

    fn end(self) -> Result<(), WireError> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(self.bad(format!("{} bytes after its end", self.bytes.len())))
        }
    }
}

/// Decodes one frame from its kind byte and body. Total: any input gives a frame or an
/// error.
pub fn decode(kind: u8, body: &[u8]) -> Result<Frame, WireError> {
    if body.len() > MAX_BODY {
        return Err(WireError::TooLong(body.len()));
    }
    let name = match kind {
        HELLO => "Hello",
        OPEN => "Open",
        LEASE => "Lease",
        RELEASE => "Release",
        REVOKED => "Revoked",
        WELCOME => "Welcome",
        OPENED => "Opened",
        LEASED => "Leased",
        REVOKE => "Revoke",
        REFUSED => "Refused",
        other => return Err(WireError::UnknownKind(other)),
    };
    let mut b = Body {
        bytes: body,
        kind: name,
    };
    let frame = match kind {
        HELLO => Frame::Hello {
            magic: b.array()?,
            version: b.u16()?,
            nonce: b.array()?,
            client_segment: b.text()?,
            server_segment: b.text()?,
        },
        WELCOME => Frame::Welcome {
            version: b.u16()?,
            probe_addr: b.u64()?,
            segment: b.text()?,
        },
        OPEN => Frame::Open {
            id: b.u64()?,
            addr: b.u64()?,
            len: b.u64()?,
        },
        OPENED => {
            let id = b.u64()?;
            let outcome = match b.u8()? {
                0 => Opened::Memfd {
                    addr: b.u64()?,
                    len: b.u64()?,
                    map_len: b.u64()?,
                },
                1 => Opened::Plain {
                    addr: b.u64()?,
                    len: b.u64()?,
                },
                2 => Opened::Rejected(b.text()?),
                3 => Opened::Declined {
                    addr: b.u64()?,
                    len: b.u64()?,
                    reason: b.text()?,
                },
                4 => {
                    let (addr, len, bus_id) = (b.u64()?, b.u64()?, b.text()?);
                    let count = usize::from(b.u8()?);
                    if count > MAX_DEVICE_CHUNKS {
                        return Err(b.bad(format!("{count} device chunks")));
                    }
                    let mut chunks = Vec::with_capacity(count);
                    for _ in 0..count {
                        let (base, len) = (b.u64()?, b.u64()?);
                        let ipc = match b.u8()? {
                            0 => None,
                            1 => Some(b.array()?),
                            other => return Err(b.bad(format!("device chunk kind {other}"))),
                        };
                        chunks.push(DeviceChunk { base, len, ipc });
                    }
                    Opened::Device {
                        addr,
                        len,
                        bus_id,
                        chunks,
                    }
                }
                other => return Err(b.bad(format!("outcome {other}"))),
            };
            Frame::Opened { id, outcome }
        }
        LEASE => {
            let id = b.u64()?;
            let count = b.count()?;
            let mut ranges = Vec::with_capacity(count);
            for _ in 0..count {
                ranges.push((b.u64()?, b.u64()?));
            }
            Frame::Lease { id, ranges }
        }
        LEASED => {
            let id = b.u64()?;
            let count = b.count()?;
            let mut granted = Vec::with_capacity(count);
            for _ in 0..count {
                granted.push(match b.u8()? {
                    0 => false,
                    1 => true,
                    other => return Err(b.bad(format!("grant {other}"))),
                });
            }
            Frame::Leased { id, granted }
        }
        RELEASE => Frame::Release { id: b.u64()? },
        REVOKED => Frame::Revoked { id: b.u64()? },
        REVOKE => Frame::Revoke {
            id: b.u64()?,
            addr: b.u64()?,
        },
        _ => Frame::Refused { reason: b.text()? },
    };
    b.end()?;
    Ok(frame)
}

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

    fn all_frames() -> Vec<Frame> {
        vec![
            Frame::Hello {
                magic: MAGIC,
                version: 1,
                nonce: [7; NONCE_LEN],
                client_segment: "127.0.0.1:15001".into(),
                server_segment: "node-é".into(),
            },
            Frame::Welcome {
                version: 1,
                probe_addr: 0x7fff_0000,
                segment: "s".into(),
            },
            Frame::Open {
                id: 1,
                addr: 2,
                len: 3,
            },
            Frame::Opened {
                id: 4,
                outcome: Opened::Memfd {
                    addr: 5,
                    len: 6,
                    map_len: 8192,
                },
            },
            Frame::Opened {
                id: 4,
                outcome: Opened::Plain { addr: 5, len: 6 },
            },
            Frame::Opened {
                id: 4,
                outcome: Opened::Rejected("not registered".into()),
            },
            Frame::Opened {
                id: 4,
                outcome: Opened::Declined {
                    addr: 5,
                    len: 6,
                    reason: "device".into(),
                },
            },
            Frame::Opened {
                id: 4,
                outcome: Opened::Device {
                    addr: 5,
                    len: 6,
                    bus_id: "0000:3b:00.0".into(),
                    chunks: vec![
                        DeviceChunk {
                            base: 4,
                            len: 2 << 20,
                            ipc: Some([9; IPC_HANDLE_LEN]),
                        },
                        DeviceChunk {
                            base: 4 + (2 << 20),
                            len: 2 << 20,
                            ipc: None,
                        },
                    ],
                },
            },
            Frame::Lease {
                id: 9,
                ranges: vec![(1, 2), (3, 4)],
            },
            Frame::Leased {
                id: 9,
                granted: vec![true, false],
            },
            Frame::Release { id: 9 },
            Frame::Revoke { id: 10, addr: 11 },
            Frame::Revoked { id: 10 },
            Frame::Refused {
                reason: "no".into(),
            },
        ]
    }

    #[test]
    fn every_frame_round_trips_and_every_cut_is_an_error() {
        for frame in all_frames() {
            let bytes = frame.encode();
            let len = u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize;
            assert_eq!(len + HEADER_LEN, bytes.len());
            assert_eq!(
                decode(bytes[4], &bytes[HEADER_LEN..]).as_ref(),
                Ok(&frame),
                "{frame:?}"
            );
            for cut in HEADER_LEN..bytes.len() {
                assert!(
                    decode(bytes[4], &bytes[HEADER_LEN..cut]).is_err(),
                    "{frame:?} cut at {cut}"
                );
            }
            let mut longer = bytes[HEADER_LEN..].to_vec();
            longer.push(0);
            assert!(decode(bytes[4], &longer).is_err());
        }
        assert_eq!(decode(0x42, &[]), Err(WireError::UnknownKind(0x42)));
    }

    #[test]
    fn pseudo_random_bytes_never_panic_the_decoder() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for round in 0..20_000 {
            let len = round % 80;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            for kind in [
                HELLO, OPEN, LEASE, RELEASE, REVOKED, WELCOME, OPENED, LEASED, REVOKE, REFUSED,
            ] {
                let _ = decode(kind, &bytes);
            }
        }
        // A huge count in a short body is refused, not allocated.
        let mut lease = vec![0u8; 8];
        lease.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(LEASE, &lease).is_err());
    }

    #[test]
    fn a_reader_cuts_frames_across_reads_and_refuses_oversized_ones() {
        let (a, b) = UnixStream::pair().unwrap();
        let frames = all_frames();
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
