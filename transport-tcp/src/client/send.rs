//! The sending half of a lane: request headers in the framing both ends speak, the headers
//! of consecutive reads in one write, and write bodies straight from the source memory,
//! those of consecutive writes of host memory gathered into one `sendmsg(2)`.

use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::os::fd::AsFd;

use tern_engine::{Opcode, Slice};
use tern_memreg::{MAX_FRAMES_PER_SEND, RegionIo, send_frames};

use super::pool::PoolShared;
use super::receive::Awaiting;
use super::window::{Failure, Step, Window};
use crate::wire::{FRAME_ALIGN, Header, OP_READ, OP_WRITE, version_bits};

/// A request being sent: its header, and how many of its bytes (header and body) are out.
#[derive(Debug)]
pub(super) struct Sending {
    pub(super) slice: Slice,
    pub(super) header: Framed,
    pub(super) sent: usize,
}

impl Sending {
    fn total(&self) -> usize {
        self.header.len
            + match self.slice.opcode() {
                Opcode::Write => self.slice.len,
                Opcode::Read => 0,
            }
    }
}

/// A request header as its framing sends it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Framed {
    pub(super) bytes: [u8; FRAME_ALIGN],
    /// Bytes of `bytes` sent.
    pub(super) len: usize,
    /// Bytes of each status frame the server sends back (0 under v1).
    pub(super) status_len: usize,
}

/// The wire header of `slice`'s request, in the newest framing both this node and the peer
/// speak (v3 aligned, v2 with status frames, or v1).
fn request_header(shared: &PoolShared, slice: &Slice) -> Framed {
    let version = u32::from(shared.config.proto_version).min(slice.peer().desc.tcp_proto_version);
    let op = match slice.opcode() {
        Opcode::Read => OP_READ,
        Opcode::Write => OP_WRITE,
    };
    let header = Header {
        size: slice.len as u64,
        addr: slice.remote_addr,
        opcode: op | version_bits(version),
    };
    let (bytes, len) = header.encode_framed();
    Framed {
        bytes,
        len,
        status_len: header.status_len(),
    }
}

impl Window {
    /// Sends as much of the pending requests as the socket takes now. The headers of reads
    /// queued one after another go out together, in one write.
    pub(super) fn send(
        &mut self,
        shared: &PoolShared,
        stream: &mut TcpStream,
    ) -> Result<Step, Failure> {
        let mut step = Step::Blocked;
        loop {
            if self.marks.send_full() {
                return Ok(step);
            }
            if self.read_headers_sent < self.read_headers.len() {
                let unsent = self.read_headers.len() - self.read_headers_sent;
                let headers = &self.read_headers[self.read_headers_sent..];
                match Wrote::from(io::Write::write(stream, headers))? {
                    Wrote::Bytes(n) => {
                        self.read_headers_sent += n;
                        self.marks.sent(n, unsent);
                        step = Step::Moved;
                    }
                    Wrote::Blocked => {
                        self.marks.send_blocked();
                        return Ok(step);
                    }
                    Wrote::Interrupted => {}
                }
                continue;
            }
            self.read_headers.clear();
            self.read_headers_sent = 0;
            if self.sending.is_none() {
                // Reads first in the queue: their headers, all at once. They await their
                // replies already: the server answers none before its header arrives.
                while self
                    .queued
                    .front()
                    .is_some_and(|slice| slice.opcode() == Opcode::Read)
                {
                    let Some(read) = self.pop_queued() else {
                        break;
                    };
                    let Some(read) = read else {
                        continue;
                    };
                    let header = request_header(shared, &read);
                    self.read_headers
                        .extend_from_slice(&header.bytes[..header.len]);
                    self.awaiting
                        .push_back(Awaiting::new(read, header.status_len));
                }
                if !self.read_headers.is_empty() {
                    continue;
                }
                let Some(slice) = self.pop_queued() else {
                    return Ok(step);
                };
                let Some(slice) = slice else {
                    continue;
                };
                self.stage.begin_outbound(slice.device_order());
                self.sending = Some(Sending {
                    header: request_header(shared, &slice),
                    slice,
                    sent: 0,
                });
            }
            let Some(sending) = self.sending.as_mut() else {
                return Ok(step);
            };
            let (total, header_len) = (sending.total(), sending.header.len);
            // Bytes sent beyond this request, into the writes gathered behind it.
            let mut beyond = 0;
            while sending.sent < total {
                if self.marks.send_full() {
                    return Ok(step);
                }
                let head = &sending.header.bytes[sending.sent.min(header_len)..header_len];
                let body_from = sending.sent.saturating_sub(header_len);
                let mut gathered_bytes = 0;
                let result = match sending.slice.opcode() {
                    Opcode::Write => self
                        .stage
                        .outbound(
                            sending.slice.local(),
                            sending.slice.local_addr,
                            sending.slice.len,
                            body_from,
                        )
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
                        .and_then(|body| {
                            if sending.slice.local().is_device() {
                                return stream.write_from(head, body);
                            }
                            gather_writes(shared, &self.queued, &mut self.gathered);
                            if self.gathered.is_empty() {
                                return stream.write_from(head, body);
                            }
                            let mut frames = Vec::with_capacity(self.gathered.len() + 1);
                            frames.push((head, body));
                            for (slice, header) in self.queued.iter().zip(&self.gathered) {
                                let Ok(body) = slice.local().slice(slice.local_addr, slice.len)
                                else {
                                    break;
                                };
                                gathered_bytes += header.len + slice.len;
                                frames.push((&header.bytes[..header.len], body));
                            }
                            let kept = frames.len() - 1;
                            let sent = send_frames(stream.as_fd(), &frames);
                            self.gathered.truncate(kept);
                            sent
                        }),
                    Opcode::Read => io::Write::write(stream, head),
                };
                match Wrote::from(result)? {
                    Wrote::Bytes(n) => {
                        let own = n.min(total - sending.sent);
                        self.marks.sent(n, total - sending.sent + gathered_bytes);
                        sending.sent += own;
                        beyond = n - own;
                        step = Step::Moved;
                    }
                    Wrote::Blocked => {
                        self.marks.send_blocked();
                        return Ok(step);
                    }
                    Wrote::Interrupted => {}
                }
            }
            if let Some(done) = self.sending.take() {
                self.awaiting
                    .push_back(Awaiting::new(done.slice, done.header.status_len));
            }
            if beyond > 0 {
                self.sent_gathered(beyond);
            }
        }
    }

    /// `beyond` bytes of the writes gathered behind the request just sent went with it: each
    /// sent whole awaits its reply, one sent in part is the request being sent.
    fn sent_gathered(&mut self, mut beyond: usize) {
        let mut gathered = std::mem::take(&mut self.gathered);
        for header in gathered.drain(..) {
            if beyond == 0 {
                break;
            }
            // The slice the header was made for: nothing takes from the queue in between.
            self.resent = self.resent.saturating_sub(1);
            let Some(slice) = self.queued.pop_front() else {
                break;
            };
            let total = header.len + slice.len;
            if beyond >= total {
                beyond -= total;
                self.awaiting
                    .push_back(Awaiting::new(slice, header.status_len));
            } else {
                self.stage.begin_outbound(slice.device_order());
                self.sending = Some(Sending {
                    slice,
                    header,
                    sent: beyond,
                });
                beyond = 0;
            }
        }
        self.gathered = gathered;
    }
}

/// The headers of the writes at the front of `queued` that can go in one `sendmsg(2)`
/// behind the request being sent, into `headers`: live writes of host memory (device memory
/// goes through the lane's staging buffers, one request at a time), up to
/// [`MAX_FRAMES_PER_SEND`] requests in all.
fn gather_writes(shared: &PoolShared, queued: &VecDeque<Slice>, headers: &mut Vec<Framed>) {
    headers.clear();
    for slice in queued.iter().take(MAX_FRAMES_PER_SEND - 1) {
        if slice.opcode() != Opcode::Write || slice.local().is_device() || !slice.is_live() {
            break;
        }
        headers.push(request_header(shared, slice));
    }
}

/// What one write on the non-blocking socket did, its errors sorted out.
enum Wrote {
    /// This many bytes went (never 0: a write of nothing is the peer gone, an error).
    Bytes(usize),
    /// The socket's send buffer is full: wait for it to drain.
    Blocked,
    /// A signal interrupted the call: try it again.
    Interrupted,
}

impl Wrote {
    fn from(result: io::Result<usize>) -> Result<Self, Failure> {
        match result {
            Ok(0) => Err(Failure::Io(io::ErrorKind::WriteZero.into())),
            Ok(n) => Ok(Self::Bytes(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Self::Blocked),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(Self::Interrupted),
            Err(e) => Err(Failure::Io(e)),
        }
    }
}
