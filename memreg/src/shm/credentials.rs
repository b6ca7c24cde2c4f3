//! Who is at the other end of a Unix socket, as the kernel recorded it (`SO_PEERCRED`).

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

/// Who is at the other end of a Unix socket, as the kernel recorded it when the connection
/// was made (`SO_PEERCRED`): its process (as numbered in this process's PID namespace; 0
/// when it has no number here), user and group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCredentials {
    /// Process ID, 0 when the peer is in a PID namespace this process cannot see.
    pub pid: i32,
    /// Effective user ID.
    pub uid: u32,
    /// Effective group ID.
    pub gid: u32,
}

/// The credentials of `stream`'s peer (`SO_PEERCRED`).
pub fn peer_credentials(stream: &UnixStream) -> io::Result<PeerCredentials> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt(2) writes at most `len` bytes into `cred`, a ucred we own, and
    // stores the length written in `len`.
    let got = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(PeerCredentials {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// This process's effective user ID.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid(2) takes nothing and always succeeds.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_the_kernels() {
        let (_a, b) = UnixStream::pair().unwrap();
        let cred = peer_credentials(&b).unwrap();
        assert_eq!(cred.pid, std::process::id() as i32);
        assert_eq!(cred.uid, effective_uid());
    }
}
