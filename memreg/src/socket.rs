//! Sockets a transport drives itself: waiting until one is ready (`poll(2)`) and taking what
//! has arrived without waiting (`recv(2)` with `MSG_DONTWAIT`).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// What [`wait_ready`] found a file descriptor ready for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ready {
    /// Readable (data, or the peer closed).
    pub read: bool,
    /// Writable.
    pub write: bool,
    /// An error or hang-up is pending (the next read or write reports it).
    pub failed: bool,
}

/// Waits up to `timeout` (`None`: for ever) until `fd` is readable (if `read`) or writable
/// (if `write`): one `poll(2)`. Returns what it is ready for; nothing on timeout.
pub fn wait_ready(
    fd: BorrowedFd<'_>,
    read: bool,
    write: bool,
    timeout: Option<std::time::Duration>,
) -> io::Result<Ready> {
    let mut events = 0;
    if read {
        events |= libc::POLLIN;
    }
    if write {
        events |= libc::POLLOUT;
    }
    let mut pollfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events,
        revents: 0,
    };
    let millis = timeout.map_or(-1, |t| {
        t.as_millis().clamp(0, i32::MAX as u128) as libc::c_int
    });
    // SAFETY: one valid pollfd for the duration of the call; the fd is borrowed, so open.
    let got = unsafe { libc::poll(&mut pollfd, 1, millis) };
    if got < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(Ready::default())
        } else {
            Err(e)
        };
    }
    let revents = pollfd.revents;
    Ok(Ready {
        read: revents & libc::POLLIN != 0,
        write: revents & libc::POLLOUT != 0,
        failed: revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0,
    })
}

/// One `recv(2)` from `fd` into `buf` that does not wait (`MSG_DONTWAIT`): what has arrived,
/// up to `buf.len()`; `WouldBlock` if nothing has, 0 at end of stream.
pub fn recv_now(fd: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: the kernel writes at most `buf.len()` bytes into `buf`, which is borrowed
    // mutably for the call; the fd is borrowed, so open.
    let got = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(got as usize)
}
