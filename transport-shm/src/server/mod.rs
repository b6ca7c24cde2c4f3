//! The owner's side: the abstract Unix socket same-host peers connect to, and what it
//! grants them. A peer is served only if the kernel says it runs as this node's user
//! (`SO_PEERCRED`), it proves the cluster secret when there is one, and it greets with the
//! right magic and this node's segment name. Then every range it asks for is checked
//! against this node's registered, remote-accessible memory: a memfd buffer is handed over
//! as its descriptor (the peer maps it, and is told to unmap it, and confirms, before
//! unregistering returns), any other buffer is pinned for as long as the peer's lease on it
//! lasts, so unregistering it fails as in use meanwhile. The socket is served by the one
//! [`Acceptor`](tern_metadata::net::Acceptor) every Tern listener runs: a connection that has not sent its hello (with a
//! secret: its proof first) within the exchange timeout of being accepted is closed, and only
//! one past it holds one of `max_inbound` slots.
//!
//! One idea per module: what the owner shares and with whom (here), revoking a buffer from
//! the peers that mapped it (`revoke`), the owners of this process (`in_process`), the
//! listener and each connection's life (`listen`), a peer's opening (`admit`), the frames
//! of an admitted peer (`serve`), answering an Open (`open`, with `device` for device
//! memory) and leases (`lease`).

mod admit;
mod device;
mod in_process;
mod lease;
mod listen;
mod open;
mod revoke;
mod serve;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use tern_memreg::MemoryRegistry;
use tern_memreg::shm::MemFd;
use tern_metadata::auth::ClusterSecret;

pub(crate) use in_process::in_process;
pub(crate) use listen::Server;
pub(crate) use revoke::Unconfirmed;

/// What this node shares, and with whom.
pub(crate) struct Owner {
    pub(crate) registry: Arc<MemoryRegistry>,
    /// The memfd of each buffer `allocate` handed out, by start address; gone with the buffer.
    pub(crate) memfds: Mutex<HashMap<usize, Weak<MemFd>>>,
    pub(crate) segment: String,
    pub(crate) socket: String,
    pub(crate) secret: Option<ClusterSecret>,
    pub(crate) uid: u32,
    pub(crate) revoke_timeout: Duration,
    pub(crate) max_inbound: usize,
    /// How long a connection may take from being accepted to its hello.
    pub(crate) exchange_timeout: Duration,
    pub(crate) max_leases: usize,
    conns: Mutex<Vec<Arc<Conn>>>,
    /// Revocations peers did not confirm in time, the latest first to go.
    unconfirmed: Mutex<Vec<Unconfirmed>>,
    next_revoke: AtomicU64,
    stop: AtomicBool,
}

/// One peer's connection.
struct Conn {
    stream: UnixStream,
    state: Mutex<ConnState>,
    changed: Condvar,
}

#[derive(Default)]
struct ConnState {
    /// The client's segment, once it said.
    peer: String,
    /// Start addresses of the memfd buffers whose descriptor this peer was given.
    mapped: BTreeSet<usize>,
    /// Revocations sent and not yet confirmed.
    revoking: HashSet<u64>,
    closed: bool,
}

impl Owner {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        registry: Arc<MemoryRegistry>,
        segment: String,
        socket: String,
        secret: Option<ClusterSecret>,
        revoke_timeout: Duration,
        max_inbound: usize,
        exchange_timeout: Duration,
    ) -> Self {
        Self {
            registry,
            memfds: Mutex::default(),
            segment,
            socket,
            secret,
            uid: tern_memreg::shm::effective_uid(),
            revoke_timeout,
            max_inbound,
            exchange_timeout,
            max_leases: 256,
            conns: Mutex::default(),
            unconfirmed: Mutex::default(),
            next_revoke: AtomicU64::new(1),
            stop: AtomicBool::new(false),
        }
    }

    /// Remembers the memfd of a buffer about to be registered.
    pub(crate) fn remember(&self, addr: usize, memfd: &Arc<MemFd>) {
        let mut memfds = self.memfds.lock();
        memfds.retain(|_, weak| weak.strong_count() > 0);
        memfds.insert(addr, Arc::downgrade(memfd));
    }

    /// Revocations peers did not confirm (the latest `MAX_UNCONFIRMED_KEPT`).
    pub(crate) fn unconfirmed(&self) -> Vec<Unconfirmed> {
        self.unconfirmed.lock().clone()
    }

    /// Peers connected now.
    pub(crate) fn peers(&self) -> usize {
        self.conns.lock().len()
    }
}
