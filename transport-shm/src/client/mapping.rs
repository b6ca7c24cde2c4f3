//! The memfd mappings of a peer's buffers: one per buffer, made when an Open's answer brings
//! the descriptor, unmapped when the peer revokes the buffer (after the copies into it
//! finish) or the link ends.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use parking_lot::RwLock;
use tern_memreg::shm::{MemFd, SharedMapping};

use super::device::DeviceMapped;
use super::request::Reply;
use super::{Link, inside};

/// A mapped memfd buffer of a peer.
#[derive(Debug)]
pub(super) struct Mapped {
    /// Start of the buffer in the peer.
    pub(super) addr: u64,
    /// Its registered length.
    len: u64,
    /// The memfd's device and inode: which file this maps.
    file: (u64, u64),
    /// The mapping until revoked or the peer left, then `None`: copies hold the read side
    /// while they run, so the revocation (which takes the write side) waits for them and
    /// then unmaps it at once — not whenever the last holder of this record lets it go,
    /// which may be a copy thread that has completed its slices and not yet returned.
    pub(super) live: RwLock<Option<SharedMapping>>,
}

impl Mapped {
    /// Waits for the copies into it to finish, then unmaps it; later copies find it gone.
    pub(super) fn unmap(&self) {
        self.live.write().take();
    }

    /// Whether this is a live mapping of the buffer `addr..addr + len` backed by `file`.
    fn is(&self, addr: u64, len: u64, file: (u64, u64)) -> bool {
        (self.addr, self.len, self.file) == (addr, len, file) && self.live.read().is_some()
    }

    pub(super) fn contains(&self, addr: u64, len: u64) -> bool {
        inside(addr, len, self.addr, self.len)
    }
}

impl Link {
    /// The peer revoked its buffer at `addr`: its mapping and device chunks go, once the
    /// copies into them finish.
    pub(super) fn unmap(&self, addr: u64) {
        let mut maps = self.maps.write();
        if let Some(at) = maps.iter().position(|m| m.addr == addr) {
            let mapped = maps.remove(at);
            drop(maps);
            mapped.unmap();
        }
        let chunks: Vec<Arc<DeviceMapped>> = self
            .device_maps
            .write()
            .extract_if(.., |c| c.buffer == addr)
            .collect();
        chunks.iter().for_each(|c| c.unmap());
    }

    /// Maps the peer's memfd for `addr..addr + len`, or hands out the mapping of it this
    /// link already holds: the hands of one submit (copy threads and the waiter) each open
    /// a buffer they find unmapped, so the answers to several opens of one buffer can come
    /// one after another, and each must not map it again. A mapping of one buffer twice
    /// would keep the first one mapped while a hand held it, and no revocation would ever
    /// find it (the revocation unmaps what the list holds).
    pub(super) fn map(&self, addr: u64, len: u64, fd: OwnedFd) -> Reply {
        let Ok(needed) = usize::try_from(len) else {
            return Reply::Refused(format!("a buffer of {len} bytes does not fit here"));
        };
        let memfd = match MemFd::adopt(fd, needed) {
            Ok(memfd) => memfd,
            Err(e) => return Reply::Refused(format!("the peer's descriptor is refused: {e}")),
        };
        let file = match memfd_file(&memfd) {
            Ok(file) => file,
            Err(e) => return Reply::Refused(format!("the peer's descriptor: fstat: {e}")),
        };
        let mut maps = self.maps.write();
        if let Some(held) = maps.iter().find(|m| m.is(addr, len, file)) {
            return Reply::Mapped(held.clone());
        }
        let mapping = match SharedMapping::map(&memfd) {
            Ok(mapping) => mapping,
            Err(e) => return Reply::Refused(format!("mapping the peer's memfd: {e}")),
        };
        let mapped = Arc::new(Mapped {
            addr,
            len,
            file,
            live: RwLock::new(Some(mapping)),
        });
        // Another buffer at this address (the old one's revocation came before this answer
        // on the socket, so it is revoked already; unmap it all the same, at once, not
        // when its last holder lets go).
        let superseded: Vec<Arc<Mapped>> = maps.extract_if(.., |m| m.addr == addr).collect();
        maps.push(mapped.clone());
        drop(maps);
        superseded.iter().for_each(|m| m.unmap());
        Reply::Mapped(mapped)
    }

    /// The mapping of the peer's buffer holding `addr..addr + len` (it may have been revoked
    /// since it was looked up: copies find out under its read side).
    pub(super) fn mapping(&self, addr: u64, len: u64) -> Option<Arc<Mapped>> {
        let maps = self.maps.read();
        maps.iter().find(|m| m.contains(addr, len)).cloned()
    }
}

/// The device and inode of a memfd.
fn memfd_file(memfd: &MemFd) -> io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::File::from(memfd.as_fd().try_clone_to_owned()?).metadata()?;
    Ok((meta.dev(), meta.ino()))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::net::UnixStream;
    use std::time::Duration;

    use super::*;
    use crate::client::attach::Attach;

    /// A link over one end of a socket pair, reaching no process: enough to settle answers.
    fn link() -> (Link, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let link = Link::new(
            "peer".into(),
            ours,
            Attach::Refused("a test".into()),
            Duration::from_secs(1),
            Default::default(),
        );
        (link, theirs)
    }

    fn inode(memfd: &MemFd) -> u64 {
        std::fs::File::from(memfd.as_fd().try_clone_to_owned().unwrap())
            .metadata()
            .unwrap()
            .ino()
    }

    /// Mappings of this process of the memfd with this inode.
    fn mappings_of(inode: u64) -> usize {
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter(|l| {
                l.contains("/memfd:")
                    && l.split_whitespace().nth(4).and_then(|i| i.parse().ok()) == Some(inode)
            })
            .count()
    }

    fn mapped(reply: Reply) -> Arc<Mapped> {
        match reply {
            Reply::Mapped(mapped) => mapped,
            other => panic!("not mapped: {other:?}"),
        }
    }

    #[test]
    fn answers_to_two_opens_of_one_buffer_map_it_once_and_a_new_buffer_there_unmaps_the_old() {
        let (link, _peer) = link();
        let (addr, len) = (0x7000_0000_0000u64, 1u64 << 16);
        let old = MemFd::create("tern-client-test-old", len as usize).unwrap();
        let fd = |memfd: &MemFd| memfd.as_fd().try_clone_to_owned().unwrap();
        // Two hands opened the buffer at once; their answers come one after the other.
        let first = mapped(link.map(addr, len, fd(&old)));
        let second = mapped(link.map(addr, len, fd(&old)));
        assert!(Arc::ptr_eq(&first, &second), "mapped twice");
        assert_eq!(mappings_of(inode(&old)), 1);
        // Another buffer at that address (a new memfd): the old mapping goes at once, though
        // hands still hold its record.
        let new = MemFd::create("tern-client-test-new", len as usize).unwrap();
        let third = mapped(link.map(addr, len, fd(&new)));
        assert!(!Arc::ptr_eq(&first, &third));
        assert_eq!(mappings_of(inode(&old)), 0, "the superseded mapping stayed");
        assert!(first.live.read().is_none());
        assert_eq!(mappings_of(inode(&new)), 1);
        // A revocation finds the one mapping the link holds.
        link.unmap(addr);
        assert_eq!(mappings_of(inode(&new)), 0);
        drop((first, second, third));
    }
}
