//! Cross-memory attach: bytes moved to and from another process of this host
//! (`process_vm_readv(2)`, `process_vm_writev(2)`), and what its failures mean.

use std::io;

use super::ShmError;
use crate::region::RegionSlice;

/// Most elements one cross-memory attach call takes (`IOV_MAX` of `<limits.h>`, which
/// `process_vm_readv(2)` names as its limit).
const MANY_AT_ONCE: usize = 1024;

/// Another process of this host, reached by cross-memory attach (`process_vm_readv(2)`,
/// `process_vm_writev(2)`). The kernel allows it only where this process may ptrace the
/// other (same user and a dumpable target, or `CAP_SYS_PTRACE`; with Yama's
/// `ptrace_scope` 1, also an ancestor or a target that named us with `PR_SET_PTRACER`), and
/// refuses any address the other process has not mapped (`EFAULT`).
///
/// What may be touched there is for the caller to decide: the kernel only checks that the
/// other process lets us. Its own process is refused, so no call can write this process's
/// memory behind Rust's back. (A process that exits and whose number the kernel gives to a
/// new one between two calls is the same hazard as any PID; callers hold a live connection
/// to the peer while they use it.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerProcess {
    pid: i32,
}

impl PeerProcess {
    /// The process numbered `pid`: refused when it is this process (or one of its threads)
    /// or 0 (a peer in a PID namespace invisible here).
    pub fn new(pid: i32) -> Result<Self, ShmError> {
        let me = std::process::id() as i32;
        if pid <= 0 || pid == me || thread_group_of(pid) == Some(me) {
            return Err(ShmError::NotAPeer(pid));
        }
        Ok(Self { pid })
    }

    /// Its process ID.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// One `process_vm_writev(2)` (`write`: from `local` to `remote`) or
    /// `process_vm_readv(2)` call; what it returns.
    ///
    /// # Safety
    /// Every `local` iovec must lie inside memory the caller may let the kernel read (writev)
    /// or write (readv) now, and there must be at most `IOV_MAX` of each. The `remote`
    /// iovecs name memory of the other process (checked in `new`), which the kernel checks
    /// itself and answers EFAULT for when unmapped.
    unsafe fn call(&self, write: bool, local: &[libc::iovec], remote: &[libc::iovec]) -> isize {
        let (l, r) = (local.as_ptr(), remote.as_ptr());
        let (nl, nr) = (local.len() as libc::c_ulong, remote.len() as libc::c_ulong);
        // SAFETY: the pointers and counts are the slices' own; what they point to is the
        // caller's promise (above).
        unsafe {
            if write {
                libc::process_vm_writev(self.pid, l, nl, r, nr, 0)
            } else {
                libc::process_vm_readv(self.pid, l, nl, r, nr, 0)
            }
        }
    }

    fn transfer(&self, write: bool, local: *mut u8, remote: u64, len: usize) -> io::Result<()> {
        let mut done = 0usize;
        while done < len {
            let local_iov = libc::iovec {
                // SAFETY: `done < len`, so the pointer stays inside the caller's range.
                iov_base: unsafe { local.add(done) }.cast(),
                iov_len: len - done,
            };
            let remote_iov = libc::iovec {
                iov_base: (remote as usize).wrapping_add(done) as *mut libc::c_void,
                iov_len: len - done,
            };
            // SAFETY: the local iovec lies inside memory the caller vouches for (a pinned
            // region's slice or an exclusive borrow).
            let moved = unsafe { self.call(write, &[local_iov], &[remote_iov]) };
            match moved {
                n if n > 0 => done += n as usize,
                0 => return Err(io::Error::from(io::ErrorKind::UnexpectedEof)),
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }

    /// Moves many ranges with as few system calls as it can (many elements per call, at
    /// most `IOV_MAX`): the bytes that moved, counted from the first pair on. It stops at
    /// the first pair the kernel does not move whole (an address the other process has not
    /// mapped, a signal), so a caller moves the pairs from there on one by one to learn each
    /// one's outcome.
    fn transfer_many(&self, write: bool, pairs: &[(u64, RegionSlice<'_>)]) -> usize {
        let mut done = 0usize;
        for chunk in pairs.chunks(MANY_AT_ONCE) {
            let local: Vec<libc::iovec> = chunk
                .iter()
                .map(|(_, slice)| libc::iovec {
                    iov_base: slice.as_ptr().cast(),
                    iov_len: slice.len(),
                })
                .collect();
            let remote: Vec<libc::iovec> = chunk
                .iter()
                .map(|&(addr, ref slice)| libc::iovec {
                    iov_base: addr as usize as *mut libc::c_void,
                    iov_len: slice.len(),
                })
                .collect();
            let asked: usize = chunk.iter().map(|(_, slice)| slice.len()).sum();
            // SAFETY: every local iovec lies inside a region's slice the caller holds; at most
            // IOV_MAX of them (the chunks).
            let moved = unsafe { self.call(write, &local, &remote) };
            let moved = usize::try_from(moved).unwrap_or(0);
            done += moved;
            if moved < asked {
                break;
            }
        }
        done
    }

    /// Copies each pair's local slice to its remote address in the other process, with as
    /// few system calls as it can: the bytes that moved, from the first pair on; the pairs
    /// not wholly inside that count are for [`write_from`](Self::write_from), one by one.
    pub fn write_many(&self, pairs: &[(u64, RegionSlice<'_>)]) -> usize {
        self.transfer_many(true, pairs)
    }

    /// Fills each pair's local slice from its remote address in the other process, as
    /// [`write_many`](Self::write_many) does the other way.
    pub fn read_many(&self, pairs: &[(u64, RegionSlice<'_>)]) -> usize {
        self.transfer_many(false, pairs)
    }

    /// Copies `src` to `remote` in the other process.
    pub fn write_from(&self, remote: u64, src: RegionSlice<'_>) -> io::Result<()> {
        self.transfer(true, src.as_ptr(), remote, src.len())
    }

    /// Copies `dst.len()` bytes at `remote` in the other process into `dst`.
    pub fn read_into(&self, remote: u64, dst: RegionSlice<'_>) -> io::Result<()> {
        self.transfer(false, dst.as_ptr(), remote, dst.len())
    }

    /// Copies `dst.len()` bytes at `remote` in the other process into `dst` (a probe).
    pub fn read_bytes(&self, remote: u64, dst: &mut [u8]) -> io::Result<()> {
        self.transfer(false, dst.as_mut_ptr(), remote, dst.len())
    }
}

/// What a failed cross-memory attach means, from its error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachFailure {
    /// `EPERM`: the kernel does not let this process ptrace the other.
    Refused,
    /// `ESRCH`: the process is gone.
    Gone,
    /// `EFAULT`: the other process has not mapped the address.
    Unmapped,
    /// Anything else.
    Other,
}

impl AttachFailure {
    /// The meaning of `error`, returned by a [`PeerProcess`] call.
    pub fn of(error: &io::Error) -> Self {
        match error.raw_os_error() {
            Some(libc::EPERM) => Self::Refused,
            Some(libc::ESRCH) => Self::Gone,
            Some(libc::EFAULT) => Self::Unmapped,
            _ => Self::Other,
        }
    }
}

/// The thread group (process) a task ID belongs to, from `/proc/<tid>/status`.
fn thread_group_of(tid: i32) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::AlignedBuffer;
    use crate::region::{MemoryRegistry, Region};

    /// A child that sleeps for 30 s, as a peer, and where its stack mapping starts (its
    /// lowest address).
    fn sleeping_child() -> (std::process::Child, PeerProcess, u64) {
        let child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let peer = PeerProcess::new(child.id() as i32).unwrap();
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", child.id())).unwrap();
        let stack = maps.lines().find(|l| l.ends_with("[stack]")).unwrap();
        let start = u64::from_str_radix(stack.split('-').next().unwrap(), 16).unwrap();
        (child, peer, start)
    }

    /// A registry with one region of `len` bytes of this process.
    fn registered(len: usize) -> (MemoryRegistry, std::sync::Arc<Region>) {
        let registry = MemoryRegistry::new();
        let region = registry
            .register(Region::owned(
                AlignedBuffer::new(len).unwrap(),
                "cpu:0",
                true,
            ))
            .unwrap();
        (registry, region)
    }

    #[test]
    fn cross_memory_attach_refuses_this_process_and_moves_bytes_to_a_child() {
        assert!(matches!(
            PeerProcess::new(std::process::id() as i32),
            Err(ShmError::NotAPeer(_))
        ));
        assert!(PeerProcess::new(0).is_err());
        // A child process whose memory holds its own command line: read it back.
        let (mut child, peer, start) = sleeping_child();
        let (registry, region) = registered(4096);
        let pin = registry.pin(region.addr(), 4096).unwrap();
        let outcome = peer.read_into(start, pin.slice(region.addr(), 64).unwrap());
        // Root (CAP_SYS_PTRACE) or an unrestricted same-user peer reads; Yama may refuse.
        match outcome {
            Ok(()) => {
                let mut bytes = [0u8; 8];
                pin.copy_to_slice(region.addr(), &mut bytes).unwrap();
                peer.write_from(start, pin.slice(region.addr(), 8).unwrap())
                    .unwrap();
                assert!(
                    peer.read_into(8, pin.slice(region.addr(), 8).unwrap())
                        .is_err()
                );
            }
            Err(e) => assert_eq!(AttachFailure::of(&e), AttachFailure::Refused, "{e}"),
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn many_ranges_move_in_one_call_and_stop_at_the_first_the_child_has_not_mapped() {
        let (mut child, peer, start) = sleeping_child();
        let (registry, region) = registered(8192);
        let pin = registry.pin(region.addr(), 8192).unwrap();
        let at = |offset: usize, len: usize| pin.slice(region.addr() + offset, len).unwrap();
        // The bottom two pages of the child's stack mapping, into two places here, in one
        // call: far below what `sleep` uses (its top moves while it starts), so they hold
        // still.
        let (page_a, page_b) = (start, start + 4096);
        let moved = peer.read_many(&[(page_a, at(0, 4096)), (page_b, at(4096, 4096))]);
        if moved == 0 {
            // Yama may refuse; then a single call is refused the same way.
            let e = peer.read_into(page_a, at(0, 64)).unwrap_err();
            assert_eq!(AttachFailure::of(&e), AttachFailure::Refused, "{e}");
        } else {
            assert_eq!(moved, 8192);
            let mut whole = vec![0u8; 4096];
            pin.copy_to_slice(region.addr() + 4096, &mut whole).unwrap();
            let mut again = vec![0u8; 4096];
            peer.read_bytes(page_b, &mut again).unwrap();
            assert!(whole == again, "the second range read back differs");
            // The same bytes written back; a pair at an address the child has not mapped
            // stops the call there: only the first pair's bytes count.
            let moved = peer.write_many(&[(page_b, at(4096, 4096)), (8, at(0, 64))]);
            assert_eq!(moved, 4096);
            assert_eq!(peer.write_many(&[]), 0);
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
