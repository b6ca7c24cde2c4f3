//! Memory shared with other processes of the same host, behind safe types: sealed memfds
//! ([`MemFd`]) and mappings of them ([`SharedMapping`]), file descriptors passed over Unix
//! sockets (`SCM_RIGHTS`: [`send_with_fds`], [`recv_with_fds`]), the credentials of a
//! socket's peer ([`peer_credentials`]), cross-memory attach into a peer process
//! (`process_vm_readv`/`process_vm_writev`: [`PeerProcess`]), and the process settings that
//! decide whether the kernel permits it ([`set_dumpable`], [`allow_ptrace_by_same_user`]).
//!
//! Region memory is reached only through [`RegionSlice`] (a pointer and a length), never a
//! Rust reference: a peer process writes a shared mapping at any moment, as a NIC would.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;

use crate::region::{MemoryError, RegionSlice};

/// Why shared memory could not be made, adopted or used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// A system call failed; the message names it and the operating system's reason.
    #[error("{call}: {source}")]
    Os {
        /// The call.
        call: &'static str,
        /// Its error.
        source: io::Error,
    },
    /// A memfd of zero bytes, or a name with a NUL byte, was asked for.
    #[error("invalid shared memory request: {0}")]
    Invalid(String),
    /// A file descriptor received from a peer is not a memfd sealed against shrinking (a
    /// pipe, a socket, a regular file, an unsealed memfd): mapping it could fault (SIGBUS)
    /// once the peer truncated it, so it is refused.
    #[error("the file descriptor is not a memfd sealed against shrinking: {0}")]
    NotSealedMemfd(String),
    /// A memfd received from a peer is smaller than the buffer it is said to hold.
    #[error("the memfd holds {size} bytes, fewer than the {needed} claimed")]
    TooSmall {
        /// Its size.
        size: u64,
        /// The bytes it was said to hold.
        needed: u64,
    },
    /// The process named is this process itself, or has no number here (another PID
    /// namespace): cross-memory attach into it is refused.
    #[error("cross-memory attach into process {0} is refused: it is this process or unknown")]
    NotAPeer(i32),
}

fn os(call: &'static str) -> ShmError {
    ShmError::Os {
        call,
        source: io::Error::last_os_error(),
    }
}

/// The seals every [`MemFd`] this crate makes carries: the size is fixed for good.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// An anonymous, sealed shared-memory file (`memfd_create(2)`): its size cannot change, so a
/// mapping of it never faults past its end, whoever else holds it.
#[derive(Debug)]
pub struct MemFd {
    file: File,
    len: usize,
}

impl MemFd {
    /// A new memfd of `len` bytes (zeroed), named `name` (visible in `/proc/<pid>/maps` as
    /// `/memfd:<name>`), close-on-exec, sealed against shrinking and growing.
    pub fn create(name: &str, len: usize) -> Result<Self, ShmError> {
        if len == 0 {
            return Err(ShmError::Invalid("a memfd of zero bytes".into()));
        }
        let cname = CString::new(name)
            .map_err(|_| ShmError::Invalid(format!("memfd name {name:?} holds a NUL byte")))?;
        // SAFETY: memfd_create(2) reads the NUL-terminated name (alive across the call) and
        // returns a new file descriptor or -1; it touches no other memory.
        let raw = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(os("memfd_create"));
        }
        // SAFETY: `raw` is a descriptor memfd_create(2) just returned, owned by nothing else.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(raw) });
        file.set_len(len as u64).map_err(|source| ShmError::Os {
            call: "ftruncate",
            source,
        })?;
        // SAFETY: fcntl(2) F_ADD_SEALS takes an int argument and changes only the file's seals.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, SEALS) } < 0 {
            return Err(os("fcntl(F_ADD_SEALS)"));
        }
        Ok(Self { file, len })
    }

    /// Takes a descriptor received from a peer that is said to hold at least `needed`
    /// bytes: it must be a memfd (or other shmem file) sealed against shrinking, at least
    /// that large. Anything else is refused and closed.
    pub fn adopt(fd: OwnedFd, needed: usize) -> Result<Self, ShmError> {
        let file = File::from(fd);
        let meta = file.metadata().map_err(|source| ShmError::Os {
            call: "fstat",
            source,
        })?;
        if !meta.file_type().is_file() {
            return Err(ShmError::NotSealedMemfd(format!(
                "not a file but a {:?}",
                meta.file_type()
            )));
        }
        // SAFETY: fcntl(2) F_GET_SEALS takes no argument and only reads the file's seals; it
        // fails with EINVAL on files that are not shmem (memfd) files.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(ShmError::NotSealedMemfd(format!(
                "F_GET_SEALS: {} (a regular file or device, not a memfd)",
                io::Error::last_os_error()
            )));
        }
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err(ShmError::NotSealedMemfd(format!(
                "seals {seals:#x} lack F_SEAL_SHRINK"
            )));
        }
        if meta.len() < needed as u64 {
            return Err(ShmError::TooSmall {
                size: meta.len(),
                needed: needed as u64,
            });
        }
        let len = usize::try_from(meta.len()).map_err(|_| ShmError::TooSmall {
            size: meta.len(),
            needed: needed as u64,
        })?;
        Ok(Self { file, len })
    }

    /// Its size in bytes (fixed by its seals).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a memfd has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The descriptor, to send to a peer.
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// Maps the first `len` bytes shared, readable and writable; an error for `len` 0 or
    /// past the end.
    pub(crate) fn map_raw(&self, len: usize) -> Result<NonNull<u8>, ShmError> {
        if len == 0 || len > self.len {
            return Err(ShmError::Invalid(format!(
                "mapping {len} bytes of a memfd of {}",
                self.len
            )));
        }
        // SAFETY: mmap(2) with no address hint makes a new mapping and touches no existing
        // memory; `len` is within the file, whose seals forbid shrinking, so every page of
        // the mapping stays backed (no SIGBUS). The result is checked against MAP_FAILED.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.file.as_raw_fd(),
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return Err(os("mmap"));
        }
        NonNull::new(raw.cast()).ok_or_else(|| ShmError::Invalid("mmap returned null".into()))
    }
}

/// A mapping of a whole [`MemFd`] (typically a peer's), shared, readable and writable. Its
/// bytes are written by other processes at any time, so they are reached only by copies to
/// and from [`RegionSlice`]s. Unmapped on drop; while it lives the memory stays valid,
/// whatever the peer does (the memfd cannot shrink, and the mapping holds its pages).
#[derive(Debug)]
pub struct SharedMapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is reached only through raw copies (never references), valid from any
// thread until it is unmapped in `drop`, which `&self` methods cannot race with.
unsafe impl Send for SharedMapping {}
// SAFETY: see Send; concurrent copies into shared memory leave bytes unspecified, never UB
// for this process, as with DMA.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Maps all of `memfd`.
    pub fn map(memfd: &MemFd) -> Result<Self, ShmError> {
        let ptr = memfd.map_raw(memfd.len())?;
        Ok(Self {
            ptr,
            len: memfd.len(),
        })
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Where it is mapped in this process (for messages and `/proc/self/maps`).
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    fn at(&self, offset: usize, len: usize) -> Result<*mut u8, MemoryError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(MemoryError::OutOfRange {
                addr: self.addr().wrapping_add(offset),
                len,
                region_addr: self.addr(),
                region_len: self.len,
            });
        }
        // SAFETY: `offset + len <= self.len` (checked), so the pointer stays in the mapping.
        Ok(unsafe { self.ptr.as_ptr().add(offset) })
    }

    /// Copies `src` into the mapping at `offset` (one `memcpy`).
    pub fn write_from(&self, offset: usize, src: RegionSlice<'_>) -> Result<(), MemoryError> {
        let dst = self.at(offset, src.len())?;
        // SAFETY: `dst` is valid for `src.len()` writes (inside the live mapping, checked by
        // `at`); `src` is valid for reads (a pinned region's bytes). Neither is a Rust
        // reference; they are distinct mappings, so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies `dst.len()` bytes at `offset` of the mapping into `dst` (one `memcpy`).
    pub fn read_into(&self, offset: usize, dst: RegionSlice<'_>) -> Result<(), MemoryError> {
        let src = self.at(offset, dst.len())?;
        // SAFETY: `src` is valid for `dst.len()` reads (inside the live mapping); `dst` is
        // valid for writes (a pinned region). Distinct mappings: no overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `len` bytes between `[offset, offset + len)` of the mapping and `[addr, addr +
    /// len)` of a pinned region of device memory (`to_mapping`: from the device), with the
    /// GPU's copy engine; both ranges are checked first.
    pub fn copy_with_device(
        &self,
        offset: usize,
        pin: &crate::RegionPin,
        addr: usize,
        len: usize,
        to_mapping: bool,
    ) -> Result<(), MemoryError> {
        let mapped = self.at(offset, len)? as u64;
        let range = pin
            .device_range(addr, len)?
            .ok_or(MemoryError::DeviceMemory { addr, len })?;
        let (dst, src) = if to_mapping {
            (mapped, range.addr)
        } else {
            (range.addr, mapped)
        };
        // SAFETY: the mapping's range is inside the live mapping (checked by `at`, and
        // `&self` keeps it mapped); the device range lies in the pinned device region
        // (checked), which stays allocated while pinned. What else writes either meanwhile is
        // the caller's to order, as for every transfer.
        unsafe { range.device.copy_any(dst, src, len) }
            .map_err(|reason| MemoryError::Device { addr, reason })
    }

    /// Copies `src` into the mapping at `offset` (for tests and probes).
    pub fn write_bytes(&self, offset: usize, src: &[u8]) -> Result<(), MemoryError> {
        let dst = self.at(offset, src.len())?;
        // SAFETY: `dst` is valid for `src.len()` writes (checked); `src` is a Rust borrow of
        // this process's own memory, not of the mapping.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` out into `dst` (for tests and probes).
    pub fn read_bytes(&self, offset: usize, dst: &mut [u8]) -> Result<(), MemoryError> {
        let src = self.at(offset, dst.len())?;
        // SAFETY: `src` is valid for `dst.len()` reads (checked); `dst` is the caller's
        // exclusive borrow of other memory.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: `ptr` starts a mapping of `len` bytes made by `map`; unmapped once, and no
        // copy can run (they borrow `self`).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

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

/// Makes this process dumpable or not (`prctl(PR_SET_DUMPABLE)`). A process that is not
/// dumpable cannot be reached by cross-memory attach from processes without
/// `CAP_SYS_PTRACE`, even of its own user (nor dumps core); `execve` resets it.
pub fn set_dumpable(dumpable: bool) -> io::Result<()> {
    // SAFETY: prctl(2) PR_SET_DUMPABLE takes 0 or 1 and changes only this process's flag.
    let got = unsafe {
        libc::prctl(
            libc::PR_SET_DUMPABLE,
            libc::c_ulong::from(dumpable),
            0,
            0,
            0,
        )
    };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether this process is dumpable (`prctl(PR_GET_DUMPABLE)`).
pub fn is_dumpable() -> bool {
    // SAFETY: prctl(2) PR_GET_DUMPABLE takes no argument and returns the flag.
    unsafe { libc::prctl(libc::PR_GET_DUMPABLE, 0, 0, 0, 0) > 0 }
}

/// Lets any process of this user trace this one, and so reach it by cross-memory attach,
/// where Yama restricts ptrace to ancestors (`ptrace_scope` 1):
/// `prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)`. `Ok(false)` when the kernel has no Yama
/// (nothing to lift). A wide grant: callers make it only when asked to.
pub fn allow_ptrace_by_same_user() -> io::Result<bool> {
    if yama_ptrace_scope().is_none() {
        return Ok(false);
    }
    // SAFETY: prctl(2) PR_SET_PTRACER takes a pid or PR_SET_PTRACER_ANY and changes only
    // this process's Yama exception.
    let got = unsafe { libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0) };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(true)
}

/// Yama's `kernel.yama.ptrace_scope` (0 classic, 1 restricted to ancestors, 2 admin only,
/// 3 none); `None` when the kernel has no Yama.
pub fn yama_ptrace_scope() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::AlignedBuffer;
    use crate::region::{MemoryRegistry, Region};
    use std::io::Write;

    #[test]
    fn memfds_are_sealed_mapped_and_shared_between_mappings() {
        let memfd = MemFd::create("tern-test", 8192).unwrap();
        assert_eq!(memfd.len(), 8192);
        let a = SharedMapping::map(&memfd).unwrap();
        let b = SharedMapping::map(&memfd).unwrap();
        assert_ne!(a.addr(), b.addr());
        a.write_bytes(100, b"shared").unwrap();
        let mut out = [0u8; 6];
        b.read_bytes(100, &mut out).unwrap();
        assert_eq!(&out, b"shared");
        assert!(a.write_bytes(8190, b"abc").is_err());
        // Its size is sealed.
        let file = File::from(memfd.as_fd().try_clone_to_owned().unwrap());
        assert!(file.set_len(4096).is_err());
        assert!(MemFd::create("x", 0).is_err());
        assert!(MemFd::create("bad\0name", 10).is_err());
    }

    #[test]
    fn adoption_refuses_pipes_files_unsealed_and_short_memfds() {
        let (reader, _writer) = std::io::pipe().unwrap();
        let err = MemFd::adopt(OwnedFd::from(reader), 1).unwrap_err();
        assert!(matches!(err, ShmError::NotSealedMemfd(_)), "{err}");
        let path = std::env::temp_dir().join(format!("tern-adopt-{}", std::process::id()));
        let mut file = File::create(&path).unwrap();
        file.write_all(&[0u8; 4096]).unwrap();
        let err = MemFd::adopt(OwnedFd::from(file), 1).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(err, ShmError::NotSealedMemfd(_)), "{err}");
        // A memfd without seals.
        let cname = CString::new("unsealed").unwrap();
        // SAFETY: as in `MemFd::create`.
        let raw = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: a fresh descriptor.
        let unsealed = File::from(unsafe { OwnedFd::from_raw_fd(raw) });
        unsealed.set_len(4096).unwrap();
        let err = MemFd::adopt(OwnedFd::from(unsealed), 1).unwrap_err();
        assert!(err.to_string().contains("F_SEAL_SHRINK"), "{err}");
        let sealed = MemFd::create("short", 4096).unwrap();
        let fd = sealed.as_fd().try_clone_to_owned().unwrap();
        assert!(matches!(
            MemFd::adopt(fd, 8192),
            Err(ShmError::TooSmall {
                size: 4096,
                needed: 8192
            })
        ));
        let fd = sealed.as_fd().try_clone_to_owned().unwrap();
        assert_eq!(MemFd::adopt(fd, 4096).unwrap().len(), 4096);
    }

    #[test]
    fn descriptors_cross_a_unix_socket_and_credentials_are_the_kernels() {
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
        let cred = peer_credentials(&b).unwrap();
        assert_eq!(cred.pid, std::process::id() as i32);
        assert_eq!(cred.uid, effective_uid());
        drop(a);
        assert_eq!(recv_with_fds(&b, &mut buf, &mut fds).unwrap(), 0);
    }

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

    #[test]
    fn dumpable_reads_back() {
        assert!(is_dumpable());
        let _ = yama_ptrace_scope();
    }
}
