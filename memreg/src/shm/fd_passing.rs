//! File descriptors passed over Unix sockets (`SCM_RIGHTS`).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// Most descriptors one message carries.
pub const MAX_FDS: usize = 4;

/// Room for [`MAX_FDS`] descriptors of control data, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct ControlBuffer([u8; 64]);

/// Sends `bytes` with `fds` attached (`SCM_RIGHTS`, at most [`MAX_FDS`]) in one
/// `sendmsg(2)`, without SIGPIPE; returns how many bytes went (the descriptors travel with
/// the first).
pub fn send_with_fds(
    stream: &UnixStream,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<usize> {
    if fds.len() > MAX_FDS || bytes.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "at most 4 descriptors, with at least one byte",
        ));
    }
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr().cast_mut().cast(),
        iov_len: bytes.len(),
    };
    let mut control = ControlBuffer([0; 64]);
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let payload = (fds.len() * size_of::<libc::c_int>()) as libc::c_uint;
        // SAFETY: CMSG_SPACE and CMSG_LEN are arithmetic on their argument.
        let (space, len) = unsafe { (libc::CMSG_SPACE(payload), libc::CMSG_LEN(payload)) };
        msg.msg_control = control.0.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `msg_control` points at `control`, at least CMSG_SPACE(4 fds) = 40 bytes
        // long and 8-aligned, so CMSG_FIRSTHDR returns a header inside it.
        let header = unsafe { libc::CMSG_FIRSTHDR(&msg) };
        if header.is_null() {
            return Err(io::Error::other("no room for control data"));
        }
        // SAFETY: `header` points at the start of `control` (checked non-null), which has
        // room for the header and `payload` bytes after CMSG_DATA; the descriptors are
        // copied in as ints, unaligned writes being allowed by `write_unaligned`.
        unsafe {
            (*header).cmsg_level = libc::SOL_SOCKET;
            (*header).cmsg_type = libc::SCM_RIGHTS;
            (*header).cmsg_len = len as _;
            let data = libc::CMSG_DATA(header).cast::<libc::c_int>();
            for (i, fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    // SAFETY: the header describes `bytes` (borrowed, read by the kernel) and `control`
    // (filled above); the kernel duplicates the descriptors, which stay ours.
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sent as usize)
}

/// One `recvmsg(2)` into `buf`; descriptors that came along (at most [`MAX_FDS`], close-on-exec)
/// are pushed onto `fds`. Returns the bytes received (0: the peer closed). More descriptors
/// than fit are refused by the kernel (closed) and reported as an error.
pub fn recv_with_fds(
    stream: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = ControlBuffer([0; 64]);
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    // SAFETY: arithmetic on its argument.
    msg.msg_controllen =
        unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<libc::c_int>()) as libc::c_uint) } as _;
    // SAFETY: the header describes `buf` (exclusively borrowed; the kernel writes at most its
    // length) and `control` (64 bytes, at least the space given in msg_controllen).
    let got = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: after recvmsg(2) the control data is `msg_controllen` bytes of cmsghdrs in
    // `control`; CMSG_FIRSTHDR/CMSG_NXTHDR walk only within it and return null at its end.
    let mut header = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !header.is_null() {
        // SAFETY: `header` is a valid cmsghdr inside `control` (see above).
        let (level, kind, len) = unsafe {
            (
                (*header).cmsg_level,
                (*header).cmsg_type,
                (*header).cmsg_len as usize,
            )
        };
        if level == libc::SOL_SOCKET && kind == libc::SCM_RIGHTS {
            // SAFETY: arithmetic on its argument.
            let base = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = len.saturating_sub(base) / size_of::<libc::c_int>();
            // SAFETY: the kernel wrote `count` ints after CMSG_DATA, inside `control`.
            let data = unsafe { libc::CMSG_DATA(header).cast::<libc::c_int>() };
            for i in 0..count {
                // SAFETY: index below `count` (see above); each int is a descriptor the
                // kernel installed in this process for us, owned by nothing else yet.
                let fd = unsafe { data.add(i).read_unaligned() };
                if fd >= 0 {
                    // SAFETY: as above: a fresh descriptor, ours to close.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        // SAFETY: as for CMSG_FIRSTHDR.
        header = unsafe { libc::CMSG_NXTHDR(&msg, header) };
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the peer sent more than {MAX_FDS} descriptors with one message"),
        ));
    }
    Ok(got as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::{MemFd, SharedMapping};

    #[test]
    fn descriptors_cross_a_unix_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        let memfd = MemFd::create("passed", 4096).unwrap();
        assert_eq!(send_with_fds(&a, b"M", &[memfd.as_fd()]).unwrap(), 1);
        let mut buf = [0u8; 16];
        let mut fds = Vec::new();
        assert_eq!(recv_with_fds(&b, &mut buf, &mut fds).unwrap(), 1);
        assert_eq!(fds.len(), 1);
        let adopted = MemFd::adopt(fds.pop().unwrap(), 4096).unwrap();
        let mine = SharedMapping::map(&memfd).unwrap();
        let theirs = SharedMapping::map(&adopted).unwrap();
        mine.write_bytes(0, b"via SCM_RIGHTS").unwrap();
        let mut out = [0u8; 14];
        theirs.read_bytes(0, &mut out).unwrap();
        assert_eq!(&out, b"via SCM_RIGHTS");
        // Plain bytes carry no descriptors.
        send_with_fds(&a, b"plain", &[]).unwrap();
        assert_eq!(recv_with_fds(&b, &mut buf, &mut fds).unwrap(), 5);
        assert!(fds.is_empty());
        drop(a);
        assert_eq!(recv_with_fds(&b, &mut buf, &mut fds).unwrap(), 0);
    }
}
