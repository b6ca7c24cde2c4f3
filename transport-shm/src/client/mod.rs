//! The initiator's side: one link per same-host peer, made on first use and confirmed there.
//! Connecting to the abstract socket the peer's descriptor names succeeds only inside the
//! peer's network namespace; the kernel's credentials of the socket must show this node's
//! user; with a cluster secret the peer proves it; the peer must answer as the segment asked
//! for; and reading back by cross-memory attach the nonce it was given proves which process
//! answered and whether the kernel permits attaching to it. A peer that fails any of this is
//! not treated as same-host: its slices are handed back to the engine for the next
//! transport. One that is not there at all, and whose handshake RPC does not answer either,
//! is gone: its slices fail with `Connection`.
//!
//! Memfd buffers are mapped once and copied with one `memcpy` per slice. Device buffers are
//! mapped chunk by chunk (CUDA IPC handles, or VMM descriptors) and copied by the GPU, never
//! the CPU; a slice that spans chunks maps and copies each. Any other buffer is reached by
//! cross-memory attach under a lease: the owner pins the ranges first. A peer
//! that revokes a buffer (it unregisters it) has it unmapped before it is told that no copy
//! runs into it; a peer that leaves has everything of it unmapped, and its later slices fail.
//!
//! One idea per module: the table of links (`links`), making and confirming one
//! (`connect`), requests and their answers (`request`), the reader that settles them and
//! handles revocations (`reader`), the memfd mappings' lifecycle (`mapping`), device
//! memory (`device`), sorting a submit's slices by how they move (`carry`), the copies
//! (`copy`), cross-memory attach under a lease (`attach`), and, apart from all the checks,
//! moving several slices at once (`coalesce`).

mod attach;
mod carry;
mod coalesce;
mod connect;
mod copy;
mod device;
mod links;
mod mapping;
mod reader;
mod request;

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use tern_engine::{SharedMovedCounter, Slice, TransferError};

use crate::declines::DeviceDeclines;
use attach::Attach;
use device::DeviceMapped;
use mapping::Mapped;
use request::Pending;

pub(crate) use copy::copy_in_registry;
pub(crate) use links::{Links, Reach};

/// One confirmed same-host peer.
#[derive(Debug)]
pub(crate) struct Link {
    peer: String,
    stream: UnixStream,
    /// Writers take it so frames do not interleave.
    send: Mutex<()>,
    pending: Mutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    alive: AtomicBool,
    maps: RwLock<Vec<Arc<Mapped>>>,
    /// Chunks of the peer's device buffers mapped here, in no order.
    device_maps: RwLock<Vec<Arc<DeviceMapped>>>,
    /// Buffers of the peer known not to be memfds: `(addr, len)`.
    plain: Mutex<Vec<(u64, u64)>>,
    /// How plain buffers of the peer are reached.
    attach: Attach,
    /// Why the link ended, once it has.
    ended: Mutex<Option<String>>,
    /// The last answer of the peer that was refused (for the report).
    refusal: Mutex<Option<String>>,
    io_timeout: Duration,
    /// Bytes and slices moved with the peer (any copy thread may add).
    moved: SharedMovedCounter,
    /// Buffers of the peer this transport does not carry (device memory it cannot map or
    /// the peer cannot share): `(addr, len)`, and why.
    declined: Mutex<Vec<(u64, u64, &'static str)>>,
    /// The transport's tally of device-memory declines.
    device_declines: Arc<DeviceDeclines>,
}

impl Link {
    fn new(
        peer: String,
        stream: UnixStream,
        attach: Attach,
        io_timeout: Duration,
        device_declines: Arc<DeviceDeclines>,
    ) -> Self {
        Self {
            peer,
            stream,
            send: Mutex::new(()),
            pending: Mutex::default(),
            next_id: AtomicU64::new(1),
            alive: AtomicBool::new(true),
            maps: RwLock::default(),
            device_maps: RwLock::default(),
            plain: Mutex::default(),
            attach,
            ended: Mutex::new(None),
            refusal: Mutex::new(None),
            io_timeout,
            moved: Default::default(),
            declined: Mutex::default(),
            device_declines,
        }
    }

    /// The link is over: every mapping goes (after the copies into it finish), every
    /// waiting request fails.
    fn end(&self, why: &str) {
        self.alive.store(false, Ordering::Release);
        self.ended.lock().get_or_insert_with(|| why.to_owned());
        let maps = std::mem::take(&mut *self.maps.write());
        for mapped in maps {
            mapped.unmap();
        }
        let chunks = std::mem::take(&mut *self.device_maps.write());
        for chunk in chunks {
            chunk.unmap();
        }
        self.pending.lock().clear();
    }

    fn gone(&self) -> TransferError {
        TransferError::Connection {
            peer: self.peer.clone(),
            message: self
                .ended
                .lock()
                .clone()
                .unwrap_or_else(|| "the shared-memory link ended".into()),
        }
    }

    fn reject(&self, slice: Slice) {
        let error = TransferError::RemoteRejected {
            peer: self.peer.clone(),
            addr: slice.remote_addr,
            len: slice.len,
        };
        slice.fail(error);
    }

    /// Why the peer's buffer holding the range is declined, if it is.
    fn declined_why(&self, addr: u64, len: u64) -> Option<&'static str> {
        self.declined
            .lock()
            .iter()
            .find(|&&(start, size, _)| inside(addr, len, start, size))
            .map(|&(_, _, why)| why)
    }

    /// Whether the range is inside a buffer of the peer known to be plain memory.
    fn is_plain(&self, addr: u64, len: u64) -> bool {
        self.plain
            .lock()
            .iter()
            .any(|&(start, size)| inside(addr, len, start, size))
    }

    /// Counts `slices` that moved `bytes` for the peer (before they complete, so whoever
    /// sees them done sees them counted).
    fn count(&self, bytes: u64, slices: u64) {
        self.moved.add(bytes, slices);
    }

    /// Completes a slice that moved, counting it for the peer.
    fn completed(&self, slice: Slice) {
        self.count(slice.len as u64, 1);
        slice.complete();
    }
}

/// Whether `[addr, addr + len)` lies inside the buffer `[start, start + size)`.
fn inside(addr: u64, len: u64, start: u64, size: u64) -> bool {
    addr >= start
        && addr
            .checked_add(len)
            .is_some_and(|end| start.checked_add(size).is_some_and(|limit| end <= limit))
}
