//! The receiving half of a lane: status frames (a run of writes' in one read), read data
//! straight into the destination memory, and each slice completed once its reply is whole.

use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::AsFd;

use tern_engine::{Opcode, ReportTogether, Slice, TransferError};
use tern_memreg::RegionIo;

use super::pool::PoolShared;
use super::window::{Failure, PIPELINE_SLICES, Step, Window};
use crate::wire::{FRAME_ALIGN, Status};

/// A request on the wire, waiting for (the rest of) its reply.
#[derive(Debug)]
pub(super) struct Awaiting {
    pub(super) slice: Slice,
    /// Bytes of its status frame (0 under v1).
    pub(super) status_len: usize,
    pub(super) status: [u8; FRAME_ALIGN],
    /// Bytes of the status frame received.
    pub(super) status_got: usize,
    /// Bytes of a read's data received.
    pub(super) body_got: usize,
    /// Whether the status frame has been decoded (and was Ok).
    pub(super) checked: bool,
}

impl Awaiting {
    pub(super) fn new(slice: Slice, status_len: usize) -> Self {
        Self {
            slice,
            status_len,
            status: [0; FRAME_ALIGN],
            status_got: 0,
            body_got: 0,
            checked: false,
        }
    }
}

impl Window {
    /// Reads (part of) the front request's status frame, and with it those of the writes
    /// right behind it: a write's reply is its status frame alone, so the frames of the
    /// writes at the front can be taken in one read without taking a byte beyond them.
    fn read_statuses(&mut self, stream: &mut TcpStream) -> io::Result<usize> {
        let mut statuses = [0u8; FRAME_ALIGN * PIPELINE_SLICES];
        let mut wanted = 0;
        for (i, awaiting) in self.awaiting.iter().enumerate() {
            let write = awaiting.status_len > 0 && awaiting.slice.opcode() == Opcode::Write;
            if (i > 0 && !write) || wanted + awaiting.status_len > statuses.len() {
                break;
            }
            wanted += awaiting.status_len - awaiting.status_got;
            if !write {
                break;
            }
        }
        let got = stream.read(&mut statuses[..wanted])?;
        self.marks.received(got, wanted);
        let mut taken = 0;
        for awaiting in self.awaiting.iter_mut() {
            let room = (awaiting.status_len - awaiting.status_got).min(got - taken);
            if room == 0 {
                break;
            }
            awaiting.status[awaiting.status_got..awaiting.status_got + room]
                .copy_from_slice(&statuses[taken..taken + room]);
            awaiting.status_got += room;
            taken += room;
        }
        Ok(got)
    }

    /// Takes as much of the replies as the socket holds now, completing each slice whose
    /// reply is whole.
    pub(super) fn receive(
        &mut self,
        shared: &PoolShared,
        lane: usize,
        stream: &mut TcpStream,
    ) -> Result<Step, Failure> {
        let mut step = Step::Blocked;
        // Writes whose statuses came in one read ended together: one clock reading times them.
        let mut together: Option<ReportTogether> = None;
        while let Some(front) = self.awaiting.front() {
            let status_len = front.status_len;
            let (is_read, len) = (front.slice.opcode() == Opcode::Read, front.slice.len);
            // A write's status comes after its data reached the server, a read's before its
            // data: either way the status is first on the wire for this request.
            if front.status_got < status_len {
                drop(together.take());
                if self.marks.drained() {
                    return Ok(step);
                }
                match self.read_statuses(stream) {
                    Ok(0) => return Err(Failure::Io(io::ErrorKind::UnexpectedEof.into())),
                    Ok(_) => {
                        step = Step::Moved;
                        together = Some(ReportTogether::begin());
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        self.marks.receive_blocked();
                        return Ok(step);
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(Failure::Io(e)),
                }
                continue;
            }
            let Some(front) = self.awaiting.front_mut() else {
                break;
            };
            if status_len > 0 && !front.checked {
                front.checked = true;
                match Status::decode(*front.status.first_chunk().unwrap_or(&[0; 8])) {
                    Ok(Status::Ok) => {}
                    Ok(Status::AddressRejected) => {
                        let Some(done) = self.awaiting.pop_front() else {
                            break;
                        };
                        self.leave(&done.slice);
                        let error = TransferError::RemoteRejected {
                            peer: shared.endpoint.clone(),
                            addr: done.slice.remote_addr,
                            len: done.slice.len,
                        };
                        done.slice.fail(error);
                        continue;
                    }
                    Err(raw) => {
                        return Err(Failure::Protocol(format!(
                            "unknown status frame {raw:#018x}"
                        )));
                    }
                }
            }
            if is_read && front.body_got < len {
                drop(together.take());
                if self.marks.drained() {
                    return Ok(step);
                }
                let (local_addr, got) = (front.slice.local_addr, front.body_got);
                // The status frame of the request behind, read with the end of this body.
                let mut ahead = 0;
                let mut replies = self.awaiting.iter_mut();
                let Some(front) = replies.next() else {
                    break;
                };
                let next_status = replies.next().map(|next| {
                    let room = next.status_got..next.status_len;
                    (&mut next.status[room], &mut next.status_got)
                });
                let received = self
                    .stage
                    .inbound(
                        front.slice.local(),
                        local_addr,
                        len,
                        got,
                        front.slice.device_order(),
                    )
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
                    .and_then(|body| match next_status {
                        // Only where the slice is the whole rest of the body: the bytes
                        // behind it are then the next request's.
                        Some((status, status_got))
                            if body.len() == len - got && !status.is_empty() =>
                        {
                            let all = body.recv_with_ahead(stream.as_fd(), status)?;
                            let own = all.min(body.len());
                            ahead = all - own;
                            *status_got += ahead;
                            Ok(own)
                        }
                        _ => stream.read_into(body),
                    });
                let Some(front) = self.awaiting.front_mut() else {
                    break;
                };
                let received = match received {
                    Ok(n) if n > 0 => self
                        .stage
                        .received(front.slice.local(), local_addr, len, got, n)
                        .map(|()| n)
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e)),
                    other => other,
                };
                match received {
                    Ok(0) => return Err(Failure::Io(io::ErrorKind::UnexpectedEof.into())),
                    Ok(n) => {
                        self.marks.received(n + ahead, len - front.body_got + ahead);
                        front.body_got += n;
                        step = Step::Moved;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        self.marks.receive_blocked();
                        return Ok(step);
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(Failure::Io(e)),
                }
                if front.body_got < len {
                    continue;
                }
            }
            if let Some(done) = self.awaiting.pop_front() {
                self.leave(&done.slice);
                if let Some(moved) = shared.moved.get(lane) {
                    moved.add(done.slice.len as u64, 1);
                }
                done.slice.complete();
            }
        }
        Ok(step)
    }
}
