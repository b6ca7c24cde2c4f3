//! Chains of raw work requests: built from Tern's requests, linked, posted, and what the
//! library says when it refuses one.

use std::os::raw::c_int;
use std::ptr;

use rdma_sys as sys;

use super::{MemoryGuard, QueuePair, SendOp, Sge};
use crate::error::VerbsError;

impl<G: MemoryGuard, U: Send> QueuePair<G, U> {
    /// The error of a refused post. When the library did not say which request it refused,
    /// any of the chain may be on the device: the QP goes to the error state, so that each
    /// of those ends with a completion (a flush at the latest) that retires it.
    /// `known` makes the error of a refusal that names its request.
    pub(super) fn post_error(
        &self,
        verb: &'static str,
        refused: Refused,
        known: fn(i32, usize) -> VerbsError,
    ) -> VerbsError {
        match refused {
            Refused::At { posted, errno } => known(errno, posted),
            Refused::Unknown { chain, errno } => {
                let flushed = match self.to_error() {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!("{verb} failed without naming a request; {e}");
                        false
                    }
                };
                VerbsError::PostUncertain {
                    verb,
                    errno,
                    chain,
                    flushed,
                }
            }
        }
    }
}

pub(super) fn post_send_error(errno: i32, posted: usize) -> VerbsError {
    VerbsError::PostSend { errno, posted }
}

pub(super) fn post_recv_error(errno: i32, posted: usize) -> VerbsError {
    VerbsError::PostRecv { errno, posted }
}

pub(super) fn raw_sge(sge: &Sge) -> sys::ibv_sge {
    sys::ibv_sge {
        addr: sge.addr,
        length: sge.len,
        lkey: sge.lkey,
    }
}

/// A send work request without its SGE list.
pub(super) fn send_wr(wr_id: u64, op: SendOp, signaled: bool) -> sys::ibv_send_wr {
    // SAFETY: ibv_send_wr is plain data (pointers and integers); zero is valid.
    let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.send_flags = if signaled {
        sys::ibv_send_flags::IBV_SEND_SIGNALED.0
    } else {
        0
    };
    let (opcode, remote) = match op {
        SendOp::Write { remote_addr, rkey } => (
            sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            Some((remote_addr, rkey)),
        ),
        SendOp::WriteWithImm {
            remote_addr,
            rkey,
            imm,
        } => {
            wr.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
            (
                sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
                Some((remote_addr, rkey)),
            )
        }
        SendOp::Read { remote_addr, rkey } => (
            sys::ibv_wr_opcode::IBV_WR_RDMA_READ,
            Some((remote_addr, rkey)),
        ),
        SendOp::Send => (sys::ibv_wr_opcode::IBV_WR_SEND, None),
    };
    wr.opcode = opcode;
    if let Some((remote_addr, rkey)) = remote {
        wr.wr.rdma = sys::rdma_t { remote_addr, rkey };
    }
    wr
}

pub(super) fn recv_wr(wr_id: u64) -> sys::ibv_recv_wr {
    // SAFETY: ibv_recv_wr is plain data; zero is valid.
    let mut wr: sys::ibv_recv_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr
}

/// A work request type whose chain link and SGE list can be set.
pub(super) trait ChainLink: Sized {
    fn set_next(&mut self, next: *mut Self);
    fn set_sges(&mut self, sge: *mut sys::ibv_sge, count: c_int);
}

impl ChainLink for sys::ibv_send_wr {
    fn set_next(&mut self, next: *mut Self) {
        self.next = next;
    }
    fn set_sges(&mut self, sge: *mut sys::ibv_sge, count: c_int) {
        self.sg_list = sge;
        self.num_sge = count;
    }
}

impl ChainLink for sys::ibv_recv_wr {
    fn set_next(&mut self, next: *mut Self) {
        self.next = next;
    }
    fn set_sges(&mut self, sge: *mut sys::ibv_sge, count: c_int) {
        self.sg_list = sge;
        self.num_sge = count;
    }
}

/// Links `wrs` into a chain (each to the next, the last to null).
pub(super) fn link<W: ChainLink>(wrs: &mut [W]) {
    for i in 1..wrs.len() {
        let next: *mut W = &mut wrs[i];
        wrs[i - 1].set_next(next);
    }
    if let Some(last) = wrs.last_mut() {
        last.set_next(ptr::null_mut());
    }
}

/// Gives request `i` of `wrs` the single SGE `sges[i]`, links the chain and posts it with
/// `post(head, &mut bad)`. `Ok(n)` when all `n` were posted; `Err` says what the library
/// said about the one it refused.
pub(super) fn link_and_post<W: ChainLink>(
    wrs: &mut [W],
    sges: &mut [sys::ibv_sge],
    post: impl FnOnce(*mut W, &mut *mut W) -> c_int,
) -> Result<usize, Refused> {
    for (wr, sge) in wrs.iter_mut().zip(sges.iter_mut()) {
        wr.set_sges(sge, 1);
    }
    link(wrs);
    let head: *mut W = wrs.as_mut_ptr();
    let mut bad: *mut W = ptr::null_mut();
    match post(head, &mut bad) {
        0 => Ok(wrs.len()),
        rc => Err(refused_at(head.cast_const(), bad, wrs.len(), rc)),
    }
}

/// What a failed post said about its chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refused {
    /// `bad_wr` named request `posted` of the chain: the ones before it were posted.
    At {
        /// Requests at the head of the chain that were posted.
        posted: usize,
        /// The post's return value.
        errno: i32,
    },
    /// `bad_wr` was left unset or points outside the chain: any request of the chain may
    /// have been posted.
    Unknown {
        /// Requests in the chain.
        chain: usize,
        /// The post's return value.
        errno: i32,
    },
}

/// Which request of a chain of `len` starting at `head` the library refused with `errno`:
/// the one `bad` points at, if it points at one ([`Refused::Unknown`] when it is null, outside
/// the chain or between two requests).
pub(super) fn refused_at<T>(head: *const T, bad: *const T, len: usize, errno: i32) -> Refused {
    let size = std::mem::size_of::<T>().max(1);
    let bytes = (bad as usize).wrapping_sub(head as usize);
    if bad.is_null() || !bytes.is_multiple_of(size) || bytes / size >= len {
        Refused::Unknown { chain: len, errno }
    } else {
        Refused::At {
            posted: bytes / size,
            errno,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chain of five send requests, as `post_send` builds it.
    fn chain() -> (Vec<sys::ibv_send_wr>, Vec<sys::ibv_sge>) {
        let wrs = (0..5u64).map(|i| send_wr(i, SendOp::Send, false)).collect();
        // SAFETY: ibv_sge is plain data; zero is valid.
        let sges = vec![unsafe { std::mem::zeroed::<sys::ibv_sge>() }; 5];
        (wrs, sges)
    }

    #[test]
    fn a_refusal_that_names_its_request_counts_the_ones_before_it() {
        let (mut wrs, mut sges) = chain();
        let result = link_and_post(&mut wrs, &mut sges, |head, bad| {
            // Index 3 of the chain, as a provider refusing the fourth request sets it.
            *bad = head.wrapping_add(3);
            12
        });
        assert_eq!(
            result,
            Err(Refused::At {
                posted: 3,
                errno: 12
            })
        );
    }

    #[test]
    fn a_refusal_without_bad_wr_leaves_every_request_possibly_posted() {
        for offset in [None, Some(5), Some(100)] {
            let (mut wrs, mut sges) = chain();
            let result = link_and_post(&mut wrs, &mut sges, |head, bad| {
                if let Some(offset) = offset {
                    *bad = head.wrapping_add(offset);
                }
                22
            });
            assert_eq!(
                result,
                Err(Refused::Unknown {
                    chain: 5,
                    errno: 22
                }),
                "bad_wr at {offset:?}"
            );
        }
        // Between two requests: not a request of the chain either.
        let head = 0x1000 as *const sys::ibv_send_wr;
        let between = (0x1000 + std::mem::size_of::<sys::ibv_send_wr>() / 2) as *const _;
        assert!(matches!(
            refused_at(head, between, 5, 1),
            Refused::Unknown { .. }
        ));
    }
}
