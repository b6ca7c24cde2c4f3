//! The owner's side: the abstract Unix socket same-host peers connect to, and what it
//! grants them. A peer is served only if the kernel says it runs as this node's user
//! (`SO_PEERCRED`), it proves the cluster secret when there is one, and it greets with the
//! right magic and this node's segment name. Then every range it asks for is checked
//! against this node's registered, remote-accessible memory: a memfd buffer is handed over
//! as its descriptor (the peer maps it, and is told to unmap it, and confirms, before
//! unregistering returns), any other buffer is pinned for as long as the peer's lease on it
//! lasts, so unregistering it fails as in use meanwhile. The socket is served by the one
//! [`Acceptor`] every Tern listener runs: a connection that has not sent its hello (with a
//! secret: its proof first) within the exchange timeout of being accepted is closed, and only
//! one past it holds one of `max_inbound` slots.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tern_memreg::shm::{MemFd, peer_credentials, send_with_fds};
use tern_memreg::{MemoryRegistry, RegionPin};
use tern_metadata::auth::{self, Channel, ClusterSecret, Identity};
use tern_metadata::net::{Acceptor, ServeLimits, Served};

use crate::identity::VERSION;
use tern_cuda::ChunkReach;

use crate::wire::{
    self, DeviceChunk, Frame, FrameReader, MAGIC, MAX_DEVICE_CHUNKS, NONCE_LEN, Opened,
};

pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

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

/// How many unconfirmed revocations an owner keeps for its report.
const MAX_UNCONFIRMED_KEPT: usize = 16;

/// A revocation a peer did not confirm in time.
#[derive(Debug, Clone)]
pub(crate) struct Unconfirmed {
    /// The peer's segment, as it said in its hello.
    pub(crate) peer: String,
    /// What happened.
    pub(crate) message: String,
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
        let mut memfds = lock(&self.memfds);
        memfds.retain(|_, weak| weak.strong_count() > 0);
        memfds.insert(addr, Arc::downgrade(memfd));
    }

    /// The buffer at `addr` (`len` bytes) is being unregistered: forget its memfd, tell every
    /// peer that mapped it to stop, and wait (up to the revoke timeout) until each has
    /// confirmed that nothing of it copies into the buffer any more. A peer that does not
    /// confirm in time is cut off (its socket is shut down), but nothing here can unmap its
    /// mapping: it goes only once that peer reads the close and its copies finish. Such
    /// peers are returned, each with what happened, and remembered for the report.
    pub(crate) fn revoke(&self, addr: usize) -> Vec<Unconfirmed> {
        lock(&self.memfds).remove(&addr);
        let conns: Vec<Arc<Conn>> = lock(&self.conns).clone();
        let mut waits = Vec::new();
        for conn in conns {
            let mut state = lock(&conn.state);
            if state.closed || !state.mapped.remove(&addr) {
                continue;
            }
            let id = self.next_revoke.fetch_add(1, Ordering::Relaxed);
            let frame = Frame::Revoke {
                id,
                addr: addr as u64,
            };
            if wire::send(&conn.stream, &frame.encode()).is_ok() {
                state.revoking.insert(id);
                drop(state);
                waits.push((conn, id));
            }
        }
        let deadline = Instant::now() + self.revoke_timeout;
        let mut unconfirmed_now = Vec::new();
        for (conn, id) in waits {
            let state = lock(&conn.state);
            let left = deadline.saturating_duration_since(Instant::now());
            let (state, _) = conn
                .changed
                .wait_timeout_while(state, left, |s| s.revoking.contains(&id) && !s.closed)
                .unwrap_or_else(|p| p.into_inner());
            if state.revoking.contains(&id) && !state.closed {
                let unconfirmed = Unconfirmed {
                    peer: state.peer.clone(),
                    message: format!(
                        "did not confirm unmapping the buffer at {addr:#x} within {:?}: cut \
                         off, but it may keep the buffer's pages mapped until it reads the close",
                        self.revoke_timeout
                    ),
                };
                tracing::warn!("shm peer {}: {}", unconfirmed.peer, unconfirmed.message);
                let _ = conn.stream.shutdown(std::net::Shutdown::Both);
                unconfirmed_now.push(unconfirmed);
            }
        }
        if !unconfirmed_now.is_empty() {
            let mut kept = lock(&self.unconfirmed);
            kept.extend(unconfirmed_now.iter().cloned());
            let excess = kept.len().saturating_sub(MAX_UNCONFIRMED_KEPT);
            kept.drain(..excess);
        }
        unconfirmed_now
    }

    /// Revocations peers did not confirm (the latest [`MAX_UNCONFIRMED_KEPT`]).
    pub(crate) fn unconfirmed(&self) -> Vec<Unconfirmed> {
        lock(&self.unconfirmed).clone()
    }

    /// Peers connected now.
    pub(crate) fn peers(&self) -> usize {
        lock(&self.conns).len()
    }
}

/// The owners in this process, by socket name: a peer found to be this very process (two
/// engines in one process) is served from its registry directly, since cross-memory attach
/// into oneself is refused.
static IN_PROCESS: Mutex<Vec<(String, Weak<Owner>)>> = Mutex::new(Vec::new());

/// The registry behind `socket` when its owner lives in this process.
pub(crate) fn in_process(socket: &str) -> Option<Arc<MemoryRegistry>> {
    lock(&IN_PROCESS)
        .iter()
        .find(|(name, _)| name == socket)
        .and_then(|(_, owner)| owner.upgrade())
        .map(|owner| owner.registry.clone())
}

/// The listener and its connections; stopped and joined on drop.
pub(crate) struct Server {
    owner: Arc<Owner>,
    acceptor: Option<Acceptor<UnixListener>>,
}

impl Server {
    /// Binds `owner.socket` in the abstract namespace and serves it.
    pub(crate) fn start(owner: Arc<Owner>) -> std::io::Result<Self> {
        let addr = SocketAddr::from_abstract_name(owner.socket.as_bytes())?;
        let listener = UnixListener::bind_addr(&addr)?;
        let limits = ServeLimits {
            max_connections: owner.max_inbound,
            max_opening: owner.max_inbound,
            exchange_timeout: owner.exchange_timeout,
            write_timeout: owner.revoke_timeout,
            ..ServeLimits::default()
        };
        let serving = owner.clone();
        let acceptor = Acceptor::serve_on(
            listener,
            "tern-shm-accept",
            limits,
            Arc::new(move |served: Served<UnixStream>| serve_peer(&serving, &served)),
        )?;
        let mut here = lock(&IN_PROCESS);
        here.retain(|(_, o)| o.strong_count() > 0);
        here.push((owner.socket.clone(), Arc::downgrade(&owner)));
        drop(here);
        Ok(Self {
            owner,
            acceptor: Some(acceptor),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        lock(&IN_PROCESS).retain(|(name, _)| *name != self.owner.socket);
        self.owner.stop.store(true, Ordering::Release);
        // Cuts every connection and joins its thread.
        drop(self.acceptor.take());
    }
}

/// Runs one peer's connection: registered with the owner (for revocations) while it lives.
fn serve_peer(owner: &Arc<Owner>, served: &Served<UnixStream>) {
    let Ok(write_half) = served.stream.try_clone() else {
        return;
    };
    let conn = Arc::new(Conn {
        stream: write_half,
        state: Mutex::default(),
        changed: Condvar::new(),
    });
    lock(&owner.conns).push(conn.clone());
    if let Err(reason) = serve(owner, &conn, served)
        && !owner.stop.load(Ordering::Acquire)
        && !served.stopping()
    {
        let peer = lock(&conn.state).peer.clone();
        tracing::warn!("shm peer {peer:?} refused: {reason}");
        let _ = wire::send(&conn.stream, &Frame::Refused { reason }.encode());
    }
    let mut state = lock(&conn.state);
    state.closed = true;
    conn.changed.notify_all();
    drop(state);
    let _ = conn.stream.shutdown(std::net::Shutdown::Both);
    lock(&owner.conns).retain(|c| !Arc::ptr_eq(c, &conn));
}

/// Bounds the next read of the opening by what is left of it (the acceptor closes the
/// connection at its end in any case; this makes the read fail first, with a reason).
fn bound_opening(served: &Served<UnixStream>) -> Result<(), String> {
    let left = served.opening_deadline().map_or(Duration::ZERO, |d| {
        d.saturating_duration_since(Instant::now())
    });
    if left.is_zero() {
        return Err("the opening took longer than the exchange timeout".into());
    }
    served
        .stream
        .set_read_timeout(Some(left))
        .map_err(|e| format!("setting up the connection: {e}"))
}

/// Serves one peer until it leaves (`Ok`) or misbehaves (`Err(reason)`, which it is told).
fn serve(owner: &Owner, conn: &Conn, served: &Served<UnixStream>) -> Result<(), String> {
    let setup = |e: std::io::Error| format!("setting up the connection: {e}");
    let stream = &served.stream;
    bound_opening(served)?;
    let cred = peer_credentials(stream).map_err(|e| format!("SO_PEERCRED: {e}"))?;
    if cred.uid != owner.uid {
        return Err(format!(
            "process {} runs as uid {}; this node shares memory with uid {} only",
            cred.pid, cred.uid, owner.uid
        ));
    }
    if let Some(secret) = &owner.secret {
        let me = Identity {
            segment: owner.segment.clone(),
            endpoint: owner.socket.clone(),
        };
        let mut io = stream;
        if let Err(e) = auth::server_handshake(&mut io, secret, Channel::Shm, &me) {
            // Nothing was served; the peer did not prove the secret.
            let _ = stream.shutdown(std::net::Shutdown::Both);
            return Err(format!("cluster-secret exchange: {e}"));
        }
    }
    let mut reader = FrameReader::new();
    bound_opening(served)?;
    let hello = match reader.next(stream) {
        Ok(Some(frame)) => frame,
        Ok(None) => return Ok(()),
        Err(e) => return Err(format!("reading its hello: {e}")),
    };
    let Frame::Hello {
        magic,
        version,
        nonce,
        client_segment,
        server_segment,
    } = hello
    else {
        return Err("the first frame is not a hello".into());
    };
    if magic != MAGIC {
        return Err("the hello has the wrong magic".into());
    }
    if u64::from(version) != VERSION {
        return Err(format!("version {version}; this node speaks {VERSION}"));
    }
    lock(&conn.state).peer.clone_from(&client_segment);
    if !server_segment.is_empty() && server_segment != owner.segment {
        return Err(format!(
            "it wants segment {server_segment:?}, but this is {:?}",
            owner.segment
        ));
    }
    // The hello is in: the connection takes a slot of the listener's, or is closed.
    if !served.opened() {
        return Ok(());
    }
    // The peer reads the nonce back from here by cross-memory attach, if the kernel lets
    // it: that proves which process it reached. It lives as long as the connection.
    let probe: Box<[u8; NONCE_LEN]> = Box::new(nonce);
    let welcome = Frame::Welcome {
        version: VERSION as u16,
        probe_addr: probe.as_ptr() as u64,
        segment: owner.segment.clone(),
    };
    {
        let _state = lock(&conn.state);
        wire::send(&conn.stream, &welcome.encode()).map_err(|e| format!("welcome: {e}"))?;
    }
    stream.set_read_timeout(None).map_err(setup)?;
    let mut leases: HashMap<u64, Vec<RegionPin>> = HashMap::new();
    loop {
        let frame = match reader.next(stream) {
            Ok(Some(frame)) => frame,
            Ok(None) => break,
            Err(e) => return Err(e.to_string()),
        };
        match frame {
            Frame::Open { id, addr, len } => open(owner, conn, id, addr, len)?,
            Frame::Lease { id, ranges } => {
                if leases.len() >= owner.max_leases || leases.contains_key(&id) {
                    return Err(format!(
                        "lease {id}: {} leases held already, or this one twice",
                        leases.len()
                    ));
                }
                let mut pins = Vec::with_capacity(ranges.len());
                let granted: Vec<bool> = ranges
                    .iter()
                    .map(|&(addr, len)| match pin(owner, addr, len) {
                        Ok(pin) => {
                            pins.push(pin);
                            true
                        }
                        Err(_) => false,
                    })
                    .collect();
                leases.insert(id, pins);
                let _state = lock(&conn.state);
                wire::send(&conn.stream, &Frame::Leased { id, granted }.encode())
                    .map_err(|e| format!("leased: {e}"))?;
            }
            Frame::Release { id } => {
                leases.remove(&id);
            }
            Frame::Revoked { id } => {
                let mut state = lock(&conn.state);
                state.revoking.remove(&id);
                conn.changed.notify_all();
            }
            other => return Err(format!("unexpected frame {other:?}")),
        }
    }
    drop(probe);
    Ok(())
}

/// Pins the registered, remote-accessible region holding `[addr, addr + len)`.
fn pin(owner: &Owner, addr: u64, len: u64) -> Result<RegionPin, String> {
    let (Ok(addr), Ok(len)) = (usize::try_from(addr), usize::try_from(len)) else {
        return Err("the range does not fit this address space".into());
    };
    if len == 0 {
        return Err("a range of zero bytes".into());
    }
    owner
        .registry
        .pin_remote(addr, len)
        .map_err(|e| e.to_string())
}

/// Answers an Open: the region holding the range, with its memfd attached when it has one,
/// or, for device memory, the chunks of it the range touches with their IPC handles or
/// descriptors. The registry is read and the answer sent under the connection's lock, so a
/// revocation of the same buffer is ordered after it.
fn open(owner: &Owner, conn: &Conn, id: u64, addr: u64, len: u64) -> Result<(), String> {
    let mut state = lock(&conn.state);
    let found = pin(owner, addr, len);
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut memfd = None;
    let outcome = match &found {
        Err(reason) => Opened::Rejected(reason.clone()),
        Ok(pin) if pin.is_device() => match share_device(pin, addr, len) {
            Ok((outcome, chunk_fds)) => {
                fds = chunk_fds;
                outcome
            }
            Err(reason) => Opened::Declined {
                addr: pin.info().addr as u64,
                len: pin.info().len as u64,
                reason,
            },
        },
        Ok(pin) => {
            let info = pin.info();
            memfd = lock(&owner.memfds)
                .get(&info.addr)
                .and_then(Weak::upgrade)
                .filter(|m| m.len() >= info.len);
            match &memfd {
                Some(memfd) => Opened::Memfd {
                    addr: info.addr as u64,
                    len: info.len as u64,
                    map_len: memfd.len() as u64,
                },
                None => Opened::Plain {
                    addr: info.addr as u64,
                    len: info.len as u64,
                },
            }
        }
    };
    let handed_out = memfd.is_some() || matches!(outcome, Opened::Device { .. });
    let bytes = Frame::Opened { id, outcome }.encode();
    let mut attached: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
    if let Some(memfd) = &memfd {
        attached.push(memfd.as_fd());
    }
    let sent = if attached.is_empty() {
        wire::send(&conn.stream, &bytes)
    } else {
        send_with_fds(&conn.stream, &bytes, &attached).and_then(|n| {
            if n < bytes.len() {
                wire::send(&conn.stream, &bytes[n..])
            } else {
                Ok(())
            }
        })
    };
    sent.map_err(|e| format!("opened: {e}"))?;
    if let (true, Ok(pin)) = (handed_out, &found) {
        state.mapped.insert(pin.info().addr);
    }
    Ok(())
}

/// The answer that hands a peer the device memory holding `[addr, addr + len)`, with the
/// descriptors to send along; why not, when the driver cannot share it (the peer then
/// declines the slice to the next transport, with this reason in its stats).
fn share_device(pin: &RegionPin, addr: u64, len: u64) -> Result<(Opened, Vec<OwnedFd>), String> {
    let device = pin
        .device()
        .ok_or_else(|| "device memory without a device".to_owned())?;
    let why = |e: tern_cuda::CudaError| format!("{}: {e}", crate::DEVICE_UNSHARED);
    let bus_id = device.bus_id().map_err(why)?;
    let shared = device.share(addr, len, MAX_DEVICE_CHUNKS).map_err(why)?;
    let mut fds = Vec::new();
    let chunks = shared
        .into_iter()
        .map(|chunk| DeviceChunk {
            base: chunk.base,
            len: chunk.len,
            ipc: match chunk.reach {
                ChunkReach::Ipc(handle) => Some(handle),
                ChunkReach::Fd(fd) => {
                    fds.push(fd);
                    None
                }
            },
        })
        .collect();
    let info = pin.info();
    Ok((
        Opened::Device {
            addr: info.addr as u64,
            len: info.len as u64,
            bus_id,
            chunks,
        },
        fds,
    ))
}
