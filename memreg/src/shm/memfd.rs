//! Sealed memfds: anonymous shared-memory files whose size cannot change, made here or
//! adopted from a peer after checking their seals.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use super::error::{ShmError, os};

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

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
}
