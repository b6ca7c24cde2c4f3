//! Completion queues: polling, and waiting without spinning.

use std::ffi::CStr;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::raw::c_int;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use rdma_sys as sys;

use crate::device::Context;
use crate::error::{VerbsError, errno};

/// Outcome of one work request, as polled from a CQ.
///
/// Only [`CompletionQueue::poll`] makes these, and a queue pair consumes each one it
/// retires ([`QueuePair::retire`](crate::QueuePair::retire)): a completion cannot be forged
/// or replayed to release a request's memory early.
#[derive(Debug, PartialEq, Eq)]
pub struct Completion {
    wr_id: u64,
    status: Result<(), CompletionError>,
    byte_len: u32,
    qp_num: u32,
    imm: Option<u32>,
    cq: usize,
}

impl Completion {
    /// The request's `wr_id`.
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }

    /// `Ok`, or the verbs status code and its name.
    pub fn status(&self) -> Result<(), CompletionError> {
        self.status
    }

    /// Bytes moved (receives and reads).
    pub fn byte_len(&self) -> u32 {
        self.byte_len
    }

    /// The local QP it belongs to.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The immediate value of a receive completed by WRITE_WITH_IMM or SEND_WITH_IMM.
    pub fn imm(&self) -> Option<u32> {
        self.imm
    }

    /// Which CQ it came from.
    pub(crate) fn cq_id(&self) -> usize {
        self.cq
    }
}

/// A failed completion: the status code (`IBV_WC_*`) with libibverbs' name for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompletionError {
    /// `ibv_wc_status` value.
    pub code: u32,
    /// e.g. "remote access error".
    pub name: &'static str,
}

impl CompletionError {
    /// `IBV_WC_REM_ACCESS_ERR`: the peer refused the key, address or rights.
    pub const REMOTE_ACCESS: u32 = sys::ibv_wc_status::IBV_WC_REM_ACCESS_ERR;
    /// `IBV_WC_WR_FLUSH_ERR`: the QP went to the error state before this ran.
    pub const FLUSHED: u32 = sys::ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
    /// `IBV_WC_RETRY_EXC_ERR`: the peer never acknowledged (it is gone, or the link is
    /// down) after the QP's retries.
    pub const RETRY_EXCEEDED: u32 = sys::ibv_wc_status::IBV_WC_RETRY_EXC_ERR;
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: the peer had no receive posted, after every retry.
    pub const RNR_RETRY_EXCEEDED: u32 = sys::ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR;
    /// `IBV_WC_LOC_PROT_ERR`: a local key did not cover the local buffer.
    pub const LOCAL_PROTECTION: u32 = sys::ibv_wc_status::IBV_WC_LOC_PROT_ERR;
}

impl std::fmt::Display for CompletionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name, self.code)
    }
}

fn status_name(code: u32) -> &'static str {
    // SAFETY: ibv_wc_status_str returns a static NUL-terminated string for any value.
    let name = unsafe { CStr::from_ptr(sys::ibv_wc_status_str(code)) };
    name.to_str().unwrap_or("unknown status")
}

/// A completion queue, optionally with a completion channel for blocking waits.
#[derive(Debug)]
pub struct CompletionQueue {
    pub(crate) cq: NonNull<sys::ibv_cq>,
    channel: Option<NonNull<sys::ibv_comp_channel>>,
    context: Arc<Context>,
}

// SAFETY: polling a CQ from several threads is allowed by libibverbs; released in Drop.
unsafe impl Send for CompletionQueue {}
// SAFETY: see Send.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    /// A CQ with room for `entries` completions.
    pub fn new(context: &Arc<Context>, entries: i32) -> Result<Arc<Self>, VerbsError> {
        Self::create(context, entries, None)
    }

    /// A CQ whose completions can also be waited for without spinning
    /// ([`CompletionQueue::wait`]).
    pub fn with_channel(context: &Arc<Context>, entries: i32) -> Result<Arc<Self>, VerbsError> {
        // SAFETY: the context is open; the channel is destroyed after the CQ in Drop.
        let channel = unsafe { sys::ibv_create_comp_channel(context.ctx.as_ptr()) };
        let channel = NonNull::new(channel).ok_or_else(|| VerbsError::CreateCq {
            entries,
            errno: errno(),
        })?;
        Self::create(context, entries, Some(channel))
    }

    fn create(
        context: &Arc<Context>,
        entries: i32,
        channel: Option<NonNull<sys::ibv_comp_channel>>,
    ) -> Result<Arc<Self>, VerbsError> {
        let channel_ptr = channel.map_or(ptr::null_mut(), NonNull::as_ptr);
        // SAFETY: the context is open; the channel (if any) outlives the CQ.
        let cq = unsafe {
            sys::ibv_create_cq(
                context.ctx.as_ptr(),
                entries,
                ptr::null_mut(),
                channel_ptr,
                0,
            )
        };
        match NonNull::new(cq) {
            Some(cq) => Ok(Arc::new(Self {
                cq,
                channel,
                context: context.clone(),
            })),
            None => {
                let errno = errno();
                if let Some(channel) = channel {
                    // SAFETY: created above and used by nothing.
                    unsafe { sys::ibv_destroy_comp_channel(channel.as_ptr()) };
                }
                Err(VerbsError::CreateCq { entries, errno })
            }
        }
    }

    /// Sleeps until a completion arrives or `timeout` passes, then polls into `out`; returns
    /// how many completions were taken (0 on timeout). Needs a CQ made
    /// [`with_channel`](Self::with_channel).
    pub fn wait(
        &self,
        out: &mut Vec<Completion>,
        max: usize,
        timeout: std::time::Duration,
    ) -> Result<usize, VerbsError> {
        self.wait_or(out, max, None, timeout)
    }

    /// As [`wait`](Self::wait), but also returns (with 0) as soon as `doorbell` becomes
    /// readable: a worker sleeps on its CQ and on a socket other threads write to when they
    /// hand it work. The caller drains the doorbell.
    pub fn wait_or(
        &self,
        out: &mut Vec<Completion>,
        max: usize,
        doorbell: Option<BorrowedFd<'_>>,
        timeout: std::time::Duration,
    ) -> Result<usize, VerbsError> {
        let Some(channel) = self.channel else {
            return Err(VerbsError::InvalidRequest(
                "wait needs a CQ with a completion channel",
            ));
        };
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let got = self.poll(out, max)?;
            if got > 0 {
                return Ok(got);
            }
            // Arm, then poll again: a completion that landed before arming raises no event.
            // SAFETY: the CQ is alive.
            let rc = unsafe { sys::ibv_req_notify_cq(self.cq.as_ptr(), 0) };
            if rc != 0 {
                return Err(VerbsError::PollCq(-rc.abs()));
            }
            let got = self.poll(out, max)?;
            if got > 0 {
                return Ok(got);
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(0);
            }
            // SAFETY: the channel lives as long as self; `fd` is its event descriptor.
            let fd = unsafe { channel.as_ref().fd };
            let mut fds = [
                libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: doorbell.map_or(-1, |d| d.as_raw_fd()),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            let millis = left.as_millis().clamp(1, i32::MAX as u128) as c_int;
            // SAFETY: two valid pollfds for the duration of the call (a negative fd is
            // ignored by poll); the doorbell is borrowed, so it stays open meanwhile.
            let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, millis) };
            if ready > 0 && fds[0].revents & libc::POLLIN != 0 {
                let mut cq: *mut sys::ibv_cq = ptr::null_mut();
                let mut user: *mut std::os::raw::c_void = ptr::null_mut();
                // SAFETY: poll said an event is ready, so this returns at once.
                if unsafe { sys::ibv_get_cq_event(channel.as_ptr(), &mut cq, &mut user) } == 0 {
                    // SAFETY: acknowledges the one event just taken for this CQ.
                    unsafe { sys::ibv_ack_cq_events(self.cq.as_ptr(), 1) };
                }
            }
            if ready > 0 && fds[1].revents != 0 {
                return self.poll(out, max);
            }
        }
    }

    /// Takes up to `max` completions without blocking and appends them to `out`; returns
    /// how many.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize, VerbsError> {
        const BATCH: usize = 32;
        // SAFETY: ibv_wc is plain data; zero is a valid bit pattern.
        let mut raw: [sys::ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
        let want = max.min(BATCH) as c_int;
        // SAFETY: the CQ is alive and `raw` has room for `want` entries.
        let got = unsafe { sys::ibv_poll_cq(self.cq.as_ptr(), want, raw.as_mut_ptr()) };
        if got < 0 {
            return Err(VerbsError::PollCq(got));
        }
        out.extend(raw[..got as usize].iter().map(|wc| {
            Completion {
                wr_id: wc.wr_id,
                status: if wc.status == sys::ibv_wc_status::IBV_WC_SUCCESS {
                    Ok(())
                } else {
                    Err(CompletionError {
                        code: wc.status,
                        name: status_name(wc.status),
                    })
                },
                byte_len: wc.byte_len,
                qp_num: wc.qp_num,
                imm: (wc.wc_flags & sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0)
                    // SAFETY: with IBV_WC_WITH_IMM set, the union holds the immediate value.
                    .then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })),
                cq: self.id(),
            }
        }));
        Ok(got as usize)
    }

    /// An identity for this CQ while it lives (its verbs handle's address).
    pub(crate) fn id(&self) -> usize {
        self.cq.as_ptr() as usize
    }

    /// The device context.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: QPs hold an Arc of their CQ, so none is alive; destroyed once, before the
        // channel it reports to (every event taken was acknowledged in `wait`).
        unsafe { sys::ibv_destroy_cq(self.cq.as_ptr()) };
        if let Some(channel) = self.channel {
            // SAFETY: the CQ using it is gone; destroyed once.
            unsafe { sys::ibv_destroy_comp_channel(channel.as_ptr()) };
        }
    }
}
