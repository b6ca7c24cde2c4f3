//! Replies of consecutive reads sent together, a speed trick apart from admission: a client
//! sends the headers of the reads queued on a lane in one write, so they arrive together;
//! each read of host memory among them is admitted as any request is
//! ([`admit`](super::request::admit)), and their status frames and data then leave in one
//! `sendmsg(2)` instead of one each, in as few packets as one large read.

use std::io;
use std::os::fd::AsFd;

use tern_memreg::{
    MAX_FRAMES_PER_SEND, MemoryRegistry, RegionPin, RegionSlice, send_frames, skip_sent_frames,
};

use super::deadlined::Deadlined;
use super::request::admit;
use super::staging::Staging;
use crate::wire::{HEADER_LEN, Header, OP_READ, Status};

/// A read admitted (its range pinned), its reply not sent yet.
pub(super) struct Reply {
    pin: RegionPin,
    addr: usize,
    pub(super) size: usize,
    status_len: usize,
}

/// When `header` is a read of host memory that admission accepts: its reply, and those of
/// the reads of host memory whose whole headers are staged right behind it (their headers
/// taken), [`MAX_FRAMES_PER_SEND`] at most. `None`, with nothing taken, for anything else,
/// which the request path serves (a read it rejects, device memory, a write, v1).
pub(super) fn gather_reads(
    header: &Header,
    staged: &mut Staging,
    registry: &MemoryRegistry,
    proto_version: u8,
) -> Option<Vec<Reply>> {
    let first = admitted_host_read(header, registry)?;
    let mut replies = vec![first];
    while replies.len() < MAX_FRAMES_PER_SEND && staged.len() >= HEADER_LEN {
        let next = Header::decode(staged.peek_header());
        if next.version() > u32::from(proto_version.max(1)) || staged.len() < next.frame_len() {
            break;
        }
        let Some(reply) = admitted_host_read(&next, registry) else {
            break;
        };
        staged.consume(next.frame_len());
        replies.push(reply);
    }
    Some(replies)
}

fn admitted_host_read(header: &Header, registry: &MemoryRegistry) -> Option<Reply> {
    if header.operation() != OP_READ || !header.is_v2() {
        return None;
    }
    let (pin, addr, size) = admit(header, registry).ok()?;
    if pin.is_device() {
        return None;
    }
    Some(Reply {
        pin,
        addr,
        size,
        status_len: header.status_len(),
    })
}

impl Deadlined<'_> {
    /// Sends the held status frames, then each reply's Ok status frame and data, in order,
    /// gathered into as few calls as the socket takes, within the deadline.
    pub(super) fn send_replies(&mut self, replies: &[Reply]) -> io::Result<()> {
        self.send_held()?;
        let ok = Status::Ok.encode_padded();
        let mut frames: Vec<(&[u8], RegionSlice<'_>)> = replies
            .iter()
            .map(|reply| {
                let data = reply
                    .pin
                    .slice(reply.addr, reply.size)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
                Ok((&ok[..reply.status_len], data))
            })
            .collect::<io::Result<_>>()?;
        while !frames.is_empty() {
            let sent = match self.retry(|stream| send_frames(stream.as_fd(), &frames)) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            skip_sent_frames(&mut frames, sent);
        }
        Ok(())
    }
}
