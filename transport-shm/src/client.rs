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

use std::collections::HashMap;
use std::io;
use std::iter::Peekable;
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use std::vec;

use crossbeam_channel::{Receiver, Sender, bounded};
use tern_engine::{
    Opcode, PeerSegment, SharedMovedCounter, Slice, TransferError, TransportContext,
};
use tern_memreg::shm::{AttachFailure, MemFd, PeerProcess, SharedMapping, peer_credentials};
use tern_metadata::auth::{self, Channel, Claims};
use tern_metadata::rpc::RpcType;

use crate::identity::{Extension, VERSION, check_socket_name};
use crate::server::lock;
use crate::wire::{
    self, DeviceChunk, Frame, FrameReader, MAGIC, MAX_LEASE_RANGES, NONCE_LEN, Opened,
};

/// Most bytes one copy through a mapping moves before it checks that its task is still live.
const COPY_PIECE: usize = 4 << 20;

/// How long a peer found not to be same-host is left alone before it is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(10);

/// A mapped memfd buffer of a peer.
#[derive(Debug)]
struct Mapped {
    /// Start of the buffer in the peer.
    addr: u64,
    /// Its registered length.
    len: u64,
    /// The memfd's device and inode: which file this maps.
    file: (u64, u64),
    /// The mapping until revoked or the peer left, then `None`: copies hold the read side
    /// while they run, so the revocation (which takes the write side) waits for them and
    /// then unmaps it at once — not whenever the last holder of this record lets it go,
    /// which may be a copy thread that has completed its slices and not yet returned.
    live: RwLock<Option<SharedMapping>>,
}

impl Mapped {
    /// Waits for the copies into it to finish, then unmaps it; later copies find it gone.
    fn unmap(&self) {
        self.live.write().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// Whether this is a live mapping of the buffer `addr..addr + len` backed by `file`.
    fn is(&self, addr: u64, len: u64, file: (u64, u64)) -> bool {
        (self.addr, self.len, self.file) == (addr, len, file)
            && self
                .live
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .is_some()
    }

    fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr + self.len)
    }
}

/// A chunk of a peer's device buffer, mapped into this process.
#[derive(Debug)]
struct DeviceMapped {
    /// Start of the registered buffer it belongs to in the peer (revocations name it).
    buffer: u64,
    /// The chunk's start in the peer.
    base: u64,
    /// Its length.
    len: u64,
    /// The mapping until revoked or the peer left, then `None` (copies hold the read side,
    /// as for [`Mapped`]).
    live: RwLock<Option<tern_cuda::PeerMemory>>,
}

impl DeviceMapped {
    fn holds(&self, addr: u64) -> bool {
        addr >= self.base && addr - self.base < self.len
    }

    fn unmap(&self) {
        self.live.write().unwrap_or_else(|p| p.into_inner()).take();
    }
}

/// What a request's waiter is told, decided by the reader thread in the order the frames
/// came (so a revocation that follows an open always finds its mapping).
#[derive(Debug)]
enum Reply {
    Mapped(Arc<Mapped>),
    Plain,
    Rejected(String),
    /// The peer's answer is refused: the slice goes to the next transport.
    Refused(String),
    /// The peer's buffer is memory this transport does not carry: this slice goes to the
    /// next transport; the link stays good for other buffers.
    Declined(String),
    /// The peer's device buffer: its chunks are mapped.
    Device,
    Leased(Vec<bool>),
}

/// A request waiting for its reply: an open carries what its answer must satisfy.
#[derive(Debug)]
struct Pending {
    reply: Sender<Reply>,
    open: Option<OpenCheck>,
}

/// What an Opened answer must satisfy: a buffer the peer published, holding the range.
#[derive(Debug)]
struct OpenCheck {
    addr: u64,
    len: u64,
    published: Vec<(u64, u64)>,
}

impl OpenCheck {
    fn admits(&self, addr: u64, len: u64) -> bool {
        let holds = self.addr >= addr
            && self
                .addr
                .checked_add(self.len)
                .is_some_and(|e| addr.checked_add(len).is_some_and(|end| e <= end));
        holds && self.published.contains(&(addr, len))
    }
}

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

/// Slices of device memory declined to the next transport (TCP, which stages it), counted
/// by why, so the stats show a slow path taken instead of hiding it.
#[derive(Debug, Default)]
pub(crate) struct DeviceDeclines {
    /// `(reason, slices, bytes)`, one entry per reason (a handful of constants).
    tally: Mutex<Vec<(&'static str, u64, u64)>>,
}

impl DeviceDeclines {
    /// Declines `slice` for the next transport and counts it under `reason`; `detail` goes
    /// into the slice's message only.
    pub(crate) fn decline(&self, slice: Slice, reason: &'static str, detail: Option<&str>) {
        {
            let mut tally = lock(&self.tally);
            match tally.iter_mut().find(|(r, _, _)| *r == reason) {
                Some(entry) => {
                    entry.1 += 1;
                    entry.2 += slice.len as u64;
                }
                None => tally.push((reason, 1, slice.len as u64)),
            }
        }
        match detail {
            Some(detail) => slice.decline(&format!("{reason}: {detail}")),
            None => slice.decline(reason),
        }
    }

    /// `(reason, slices, bytes)` declined so far.
    pub(crate) fn get(&self) -> Vec<(&'static str, u64, u64)> {
        lock(&self.tally).clone()
    }
}

/// How a peer's plain (not memfd) buffers are reached.
#[derive(Debug)]
enum Attach {
    /// By cross-memory attach into its process.
    Process(PeerProcess),
    /// It is this process (another engine in it): through its registry.
    SameProcess(Arc<tern_memreg::MemoryRegistry>),
    /// Not at all, for this reason.
    Refused(String),
}

/// What became of an attempt to reach a peer.
pub(crate) enum Reach {
    Up(Arc<Link>),
    /// Not same-host after all (or not usable): hand its slices to the next transport.
    Decline(String),
    /// The peer is gone: its slices fail.
    Gone(String),
}

enum Entry {
    Up(Arc<Link>),
    Down { reason: String, retry_at: Instant },
}

/// Every link of this node, by peer segment and socket.
pub(crate) struct Links {
    context: TransportContext,
    connect_timeout: Duration,
    io_timeout: Duration,
    table: Mutex<HashMap<(String, String), Entry>>,
    readers: Mutex<Vec<JoinHandle<()>>>,
    /// Connection set-up, one at a time (it is rare, and a peer then gets one link).
    connecting: Mutex<()>,
    /// Slices declined for device memory, on every link.
    pub(crate) device_declines: Arc<DeviceDeclines>,
}

/// A peer's state, for the transport's report.
pub(crate) struct LinkReport {
    pub(crate) peer: String,
    pub(crate) up: bool,
    pub(crate) mapped: usize,
    pub(crate) bytes: u64,
    pub(crate) slices: u64,
    pub(crate) error: Option<String>,
}

impl Links {
    /// This engine's registry.
    pub(crate) fn registry(&self) -> &tern_memreg::MemoryRegistry {
        &self.context.registry
    }

    pub(crate) fn new(
        context: TransportContext,
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> Self {
        Self {
            context,
            connect_timeout,
            io_timeout,
            table: Mutex::default(),
            readers: Mutex::default(),
            connecting: Mutex::new(()),
            device_declines: Arc::default(),
        }
    }

    /// The link to `peer`, made now if there is none.
    pub(crate) fn reach(&self, peer: &PeerSegment) -> Reach {
        let key = match link_key(peer) {
            Ok(key) => key,
            Err(why) => return Reach::Decline(why),
        };
        if let Some(reach) = self.known(&key) {
            return reach;
        }
        let _one = lock(&self.connecting);
        if let Some(reach) = self.known(&key) {
            return reach;
        }
        let (entry, reach) = match self.connect(peer, &key.1) {
            Ok(link) => (Entry::Up(link.clone()), Reach::Up(link)),
            Err(Unreached::NotSameHost(reason)) => (
                Entry::Down {
                    reason: reason.clone(),
                    retry_at: Instant::now() + RETRY_AFTER,
                },
                Reach::Decline(reason),
            ),
            Err(Unreached::Gone(reason)) => {
                lock(&self.table).remove(&key);
                return Reach::Gone(reason);
            }
        };
        lock(&self.table).insert(key, entry);
        reach
    }

    /// Whether a link to `peer` is up and maps the buffer holding `addr..addr + len`
    /// (without connecting: a hint for how to share out a submit).
    pub(crate) fn maps(&self, peer: &PeerSegment, addr: u64, len: u64) -> bool {
        match link_key(peer).ok().and_then(|key| self.known(&key)) {
            Some(Reach::Up(link)) => link.mapping(addr, len).is_some(),
            _ => false,
        }
    }

    fn known(&self, key: &(String, String)) -> Option<Reach> {
        let table = lock(&self.table);
        match table.get(key)? {
            Entry::Up(link) if link.alive.load(Ordering::Acquire) => Some(Reach::Up(link.clone())),
            Entry::Up(_) => None,
            Entry::Down { reason, retry_at } if Instant::now() < *retry_at => {
                Some(Reach::Decline(reason.clone()))
            }
            Entry::Down { .. } => None,
        }
    }

    fn connect(&self, peer: &PeerSegment, socket: &str) -> Result<Arc<Link>, Unreached> {
        let addr = SocketAddr::from_abstract_name(socket.as_bytes())
            .map_err(|e| Unreached::NotSameHost(format!("socket name {socket:?}: {e}")))?;
        let stream = match UnixStream::connect_addr(&addr) {
            Ok(stream) => stream,
            Err(e) => return Err(self.unreachable(peer, socket, &e)),
        };
        let not_same = |what: &str| {
            let what = what.to_owned();
            move |e: io::Error| Unreached::NotSameHost(format!("{what}: {e}"))
        };
        stream
            .set_read_timeout(Some(self.connect_timeout))
            .map_err(not_same("setting up its socket"))?;
        stream
            .set_write_timeout(Some(self.connect_timeout))
            .map_err(not_same("setting up its socket"))?;
        let cred = peer_credentials(&stream).map_err(not_same("SO_PEERCRED"))?;
        let uid = tern_memreg::shm::effective_uid();
        if cred.uid != uid {
            return Err(Unreached::NotSameHost(format!(
                "its socket {socket:?} belongs to uid {}, this node runs as {uid}",
                cred.uid
            )));
        }
        if let Some(secret) = self.context.cluster_secret() {
            let claims = Claims {
                client_segment: self.context.segment_name.clone(),
                server_segment: peer.name.clone(),
                dialed: socket.to_owned(),
            };
            let mut io = &stream;
            auth::client_handshake(&mut io, secret, Channel::Shm, claims).map_err(|e| {
                Unreached::NotSameHost(format!("cluster-secret exchange on its socket: {e}"))
            })?;
        }
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce)
            .map_err(|e| Unreached::NotSameHost(format!("no random nonce: {e}")))?;
        let hello = Frame::Hello {
            magic: MAGIC,
            version: VERSION as u16,
            nonce,
            client_segment: self.context.segment_name.clone(),
            server_segment: peer.name.clone(),
        };
        wire::send(&stream, &hello.encode()).map_err(not_same("sending hello"))?;
        let mut reader = FrameReader::new();
        let (probe_addr, segment) = match reader.next(&stream) {
            Ok(Some(Frame::Welcome {
                version,
                probe_addr,
                segment,
            })) if u64::from(version) == VERSION => (probe_addr, segment),
            Ok(Some(Frame::Refused { reason })) => {
                return Err(Unreached::NotSameHost(format!(
                    "its socket refused us: {reason}"
                )));
            }
            Ok(other) => {
                return Err(Unreached::NotSameHost(format!(
                    "its socket answered {other:?}, not a welcome"
                )));
            }
            Err(e) => {
                return Err(Unreached::NotSameHost(format!("reading its welcome: {e}")));
            }
        };
        if segment != peer.name {
            return Err(Unreached::NotSameHost(format!(
                "its socket {socket:?} answers as segment {segment:?}, not {:?}",
                peer.name
            )));
        }
        let attach = if cred.pid == std::process::id() as i32 {
            match crate::server::in_process(socket) {
                Some(registry) => Attach::SameProcess(registry),
                None => Attach::Refused("this process, but its engine is gone".into()),
            }
        } else {
            match probe(cred.pid, probe_addr, &nonce) {
                Ok(process) => Attach::Process(process),
                Err(why) => {
                    tracing::debug!("shm peer {}: no cross-memory attach: {why}", peer.name);
                    Attach::Refused(why)
                }
            }
        };
        stream
            .set_read_timeout(None)
            .map_err(not_same("setting up its socket"))?;
        let write_half = stream.try_clone().map_err(not_same("cloning its socket"))?;
        let link = Arc::new(Link {
            peer: peer.name.clone(),
            stream: write_half,
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
            io_timeout: self.io_timeout,
            moved: Default::default(),
            declined: Mutex::default(),
            device_declines: self.device_declines.clone(),
        });
        let reading = link.clone();
        let reader = std::thread::Builder::new()
            .name("tern-shm-link".into())
            .spawn(move || reading.read_loop(&stream, reader))
            .map_err(not_same("starting its reader"))?;
        let mut readers = lock(&self.readers);
        readers.retain(|r| !r.is_finished());
        readers.push(reader);
        Ok(link)
    }

    /// The peer's socket does not open: not same-host if its handshake RPC answers (it lives
    /// elsewhere, or in another network namespace), gone if that does not answer either.
    fn unreachable(&self, peer: &PeerSegment, socket: &str, error: &io::Error) -> Unreached {
        match self
            .context
            .call_peer(peer, RpcType::Probe, b"{}", Some(self.connect_timeout))
        {
            Ok(_) => Unreached::NotSameHost(format!(
                "cannot connect to its socket {socket:?} ({error}) though it answers: not \
                 same-host (another network namespace or host)"
            )),
            Err(rpc) => Unreached::Gone(format!(
                "its socket {socket:?} refuses ({error}) and its handshake RPC too ({rpc})"
            )),
        }
    }

    /// Every link's state.
    pub(crate) fn report(&self) -> Vec<LinkReport> {
        let table = lock(&self.table);
        table
            .iter()
            .map(|((peer, _), entry)| match entry {
                Entry::Up(link) => {
                    let (bytes, slices) = link.moved.get();
                    LinkReport {
                        peer: peer.clone(),
                        up: link.alive.load(Ordering::Acquire),
                        mapped: link.maps.read().map_or(0, |m| m.len()),
                        bytes,
                        slices,
                        error: lock(&link.ended)
                            .clone()
                            .or_else(|| lock(&link.refusal).clone())
                            .or_else(|| match &link.attach {
                                Attach::Refused(why) => {
                                    Some(format!("no cross-memory attach: {why}"))
                                }
                                Attach::Process(_) | Attach::SameProcess(_) => None,
                            }),
                    }
                }
                Entry::Down { reason, .. } => LinkReport {
                    peer: peer.clone(),
                    up: false,
                    mapped: 0,
                    bytes: 0,
                    slices: 0,
                    error: Some(reason.clone()),
                },
            })
            .collect()
    }

    /// Closes every link and waits for their readers.
    pub(crate) fn close(&self) {
        let links: Vec<Arc<Link>> = lock(&self.table)
            .drain()
            .filter_map(|(_, e)| match e {
                Entry::Up(link) => Some(link),
                Entry::Down { .. } => None,
            })
            .collect();
        for link in &links {
            let _ = link.stream.shutdown(std::net::Shutdown::Both);
        }
        for reader in lock(&self.readers).drain(..) {
            let _ = reader.join();
        }
        for link in links {
            link.end("this node shut down");
        }
    }
}

/// Why a peer could not be reached.
enum Unreached {
    NotSameHost(String),
    Gone(String),
}

/// Reads `nonce` back from `probe_addr` in process `pid`: `Ok` when the kernel permits
/// cross-memory attach to it and it is the process that answered on the socket.
fn probe(pid: i32, probe_addr: u64, nonce: &[u8; NONCE_LEN]) -> Result<PeerProcess, String> {
    let process = PeerProcess::new(pid).map_err(|e| e.to_string())?;
    let mut seen = [0u8; NONCE_LEN];
    process
        .read_bytes(probe_addr, &mut seen)
        .map_err(|e| match AttachFailure::of(&e) {
            AttachFailure::Refused => format!(
                "process_vm_readv into process {pid} refused ({e}): the kernel does not let \
                 this process ptrace it (it is not dumpable, or Yama's ptrace_scope forbids it)"
            ),
            _ => format!("process_vm_readv into process {pid}: {e}"),
        })?;
    if &seen != nonce {
        return Err(format!(
            "process {pid} does not hold the nonce it was given (another PID namespace?)"
        ));
    }
    Ok(process)
}

impl Link {
    fn read_loop(self: &Arc<Self>, stream: &UnixStream, mut reader: FrameReader) {
        let why = loop {
            match reader.next(stream) {
                Ok(Some(Frame::Revoke { id, addr })) => {
                    self.unmap(addr);
                    let _send = lock(&self.send);
                    if let Err(e) = wire::send(&self.stream, &Frame::Revoked { id }.encode()) {
                        break format!("confirming a revocation: {e}");
                    }
                }
                Ok(Some(Frame::Opened { id, outcome })) => {
                    let fds = (0..outcome.descriptors())
                        .map_while(|_| reader.take_fd())
                        .collect();
                    self.opened(id, outcome, fds);
                }
                Ok(Some(Frame::Leased { id, granted })) => {
                    if let Some(pending) = lock(&self.pending).remove(&id) {
                        let _ = pending.reply.send(Reply::Leased(granted));
                    }
                }
                Ok(Some(Frame::Refused { reason })) => {
                    break format!("the peer refused us: {reason}");
                }
                Ok(Some(other)) => break format!("the peer sent {other:?} out of turn"),
                Ok(None) => break "the peer closed its socket (it exited or shut down)".into(),
                Err(e) => break format!("its socket failed: {e}"),
            }
        };
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.end(&why);
    }

    /// The link is over: every mapping goes (after the copies into it finish), every
    /// waiting request fails.
    fn end(&self, why: &str) {
        self.alive.store(false, Ordering::Release);
        lock(&self.ended).get_or_insert_with(|| why.to_owned());
        let maps = std::mem::take(&mut *self.maps.write().unwrap_or_else(|p| p.into_inner()));
        for mapped in maps {
            mapped.unmap();
        }
        let chunks =
            std::mem::take(&mut *self.device_maps.write().unwrap_or_else(|p| p.into_inner()));
        for chunk in chunks {
            chunk.unmap();
        }
        lock(&self.pending).clear();
    }

    fn unmap(&self, addr: u64) {
        let mut maps = self.maps.write().unwrap_or_else(|p| p.into_inner());
        if let Some(at) = maps.iter().position(|m| m.addr == addr) {
            let mapped = maps.remove(at);
            drop(maps);
            mapped.unmap();
        }
        let chunks: Vec<Arc<DeviceMapped>> = self
            .device_maps
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .extract_if(.., |c| c.buffer == addr)
            .collect();
        chunks.iter().for_each(|c| c.unmap());
    }

    /// Settles an Opened answer: checks it against what was asked and what the peer
    /// published, adopts and maps a memfd, and tells the waiter.
    fn opened(&self, id: u64, outcome: Opened, mut fds: Vec<OwnedFd>) {
        let Some(Pending {
            reply,
            open: Some(check),
        }) = lock(&self.pending).remove(&id)
        else {
            return;
        };
        let answer = match outcome {
            Opened::Rejected(reason) => Reply::Rejected(reason),
            Opened::Declined { addr, len, reason } => {
                lock(&self.declined).push((addr, len, crate::DEVICE_PEER_DECLINED));
                Reply::Declined(reason)
            }
            Opened::Device {
                addr, len, chunks, ..
            } if !check.admits(addr, len) || chunks.is_empty() => Reply::Refused(format!(
                "the peer offered device memory [{addr:#x}, +{len}) in {} chunks, which is not \
                 a buffer it published holding [{:#x}, +{}]",
                chunks.len(),
                check.addr,
                check.len
            )),
            Opened::Device {
                addr,
                len,
                bus_id,
                chunks,
            } => self.map_device(addr, len, &bus_id, chunks, fds),
            Opened::Plain { addr, len } if check.admits(addr, len) => {
                lock(&self.plain).push((addr, len));
                Reply::Plain
            }
            Opened::Plain { addr, len } => Reply::Refused(format!(
                "the peer offered [{addr:#x}, +{len}), which is not a buffer it published \
                 holding [{:#x}, +{})",
                check.addr, check.len
            )),
            Opened::Memfd { addr, len, map_len } => match fds.pop() {
                None => Reply::Refused("the peer sent a memfd answer without a descriptor".into()),
                Some(_) if !check.admits(addr, len) || map_len < len => Reply::Refused(format!(
                    "the peer offered a memfd for [{addr:#x}, +{len}) ({map_len} bytes), which \
                     is not a buffer it published holding [{:#x}, +{}]",
                    check.addr, check.len
                )),
                Some(fd) => self.map(addr, len, fd),
            },
        };
        let _ = reply.send(answer);
    }

    /// Maps the peer's memfd for `addr..addr + len`, or hands out the mapping of it this
    /// link already holds: the hands of one submit (copy threads and the waiter) each open
    /// a buffer they find unmapped, so the answers to several opens of one buffer can come
    /// one after another, and each must not map it again. A mapping of one buffer twice
    /// would keep the first one mapped while a hand held it, and no revocation would ever
    /// find it (the revocation unmaps what the list holds).
    fn map(&self, addr: u64, len: u64, fd: OwnedFd) -> Reply {
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
        let mut maps = self.maps.write().unwrap_or_else(|p| p.into_inner());
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

    /// Maps the chunks of the peer's device buffer `addr..addr + len` that this link does
    /// not hold yet, each with the IPC handle or descriptor it came with. A chunk that does
    /// not map here (another GPU this process cannot reach, a driver that refuses) makes the
    /// whole buffer declined to the next transport, remembered for its later slices.
    fn map_device(
        &self,
        addr: u64,
        len: u64,
        bus_id: &str,
        chunks: Vec<DeviceChunk>,
        fds: Vec<OwnedFd>,
    ) -> Reply {
        let mut fds = fds.into_iter();
        let mut fresh = Vec::new();
        let mut failure = None;
        for chunk in chunks {
            let way = match chunk.ipc {
                Some(handle) => Ok(handle),
                None => match fds.next() {
                    Some(fd) => Err(fd),
                    None => {
                        return Reply::Refused(
                            "the peer sent a device chunk without its descriptor".into(),
                        );
                    }
                },
            };
            if chunk.len == 0 || self.device_chunk(chunk.base).is_some() {
                continue;
            }
            let mapped = tern_cuda::Device::by_bus_id(bus_id).and_then(|device| match &way {
                Ok(handle) => device.open_ipc(handle, chunk.len),
                Err(fd) => device.map_shared(fd, chunk.len),
            });
            match mapped {
                Ok(memory) => fresh.push(Arc::new(DeviceMapped {
                    buffer: addr,
                    base: chunk.base,
                    len: chunk.len,
                    live: RwLock::new(Some(memory)),
                })),
                Err(e) => {
                    failure = Some(e.to_string());
                    break;
                }
            }
        }
        if let Some(why) = failure {
            tracing::warn!("shm peer {}: {}: {why}", self.peer, crate::DEVICE_UNMAPPED);
            lock(&self.declined).push((addr, len, crate::DEVICE_UNMAPPED));
            return Reply::Declined(why);
        }
        self.device_maps
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .extend(fresh);
        Reply::Device
    }

    /// The mapped chunk of a peer's device buffer holding `addr`.
    fn device_chunk(&self, addr: u64) -> Option<Arc<DeviceMapped>> {
        let chunks = self.device_maps.read().unwrap_or_else(|p| p.into_inner());
        chunks.iter().find(|c| c.holds(addr)).cloned()
    }

    fn gone(&self) -> TransferError {
        TransferError::Connection {
            peer: self.peer.clone(),
            message: lock(&self.ended)
                .clone()
                .unwrap_or_else(|| "the shared-memory link ended".into()),
        }
    }

    /// Sends `frame` (whose ID is `id`) and returns a receiver for its reply.
    fn ask(
        &self,
        id: u64,
        frame: &Frame,
        open: Option<OpenCheck>,
    ) -> Result<Receiver<Reply>, TransferError> {
        if !self.alive.load(Ordering::Acquire) {
            return Err(self.gone());
        }
        let (tx, rx) = bounded(1);
        lock(&self.pending).insert(id, Pending { reply: tx, open });
        let sent = {
            let _send = lock(&self.send);
            wire::send(&self.stream, &frame.encode())
        };
        if let Err(e) = sent {
            lock(&self.pending).remove(&id);
            return Err(TransferError::Connection {
                peer: self.peer.clone(),
                message: format!("writing to its socket: {e}"),
            });
        }
        Ok(rx)
    }

    fn wait(&self, id: u64, rx: &Receiver<Reply>) -> Result<Reply, TransferError> {
        rx.recv_timeout(self.io_timeout).map_err(|_| {
            // No answer in time, or the link ended: forget the request.
            lock(&self.pending).remove(&id);
            if self.alive.load(Ordering::Acquire) {
                TransferError::Connection {
                    peer: self.peer.clone(),
                    message: format!("no answer on its socket within {:?}", self.io_timeout),
                }
            } else {
                self.gone()
            }
        })
    }

    fn mapping(&self, addr: u64, len: u64) -> Option<Arc<Mapped>> {
        let maps = self.maps.read().unwrap_or_else(|p| p.into_inner());
        maps.iter().find(|m| m.contains(addr, len)).cloned()
    }

    /// Why the peer's buffer holding the range is declined, if it is.
    fn declined_why(&self, addr: u64, len: u64) -> Option<&'static str> {
        lock(&self.declined)
            .iter()
            .find(|&&(a, l, _)| addr >= a && addr.checked_add(len).is_some_and(|e| e <= a + l))
            .map(|&(_, _, why)| why)
    }

    fn is_plain(&self, addr: u64, len: u64) -> bool {
        lock(&self.plain)
            .iter()
            .any(|&(a, l)| addr >= a && addr.checked_add(len).is_some_and(|e| e <= a + l))
    }

    /// Copies `first` and the slices after it that fall in the same mapping (a submit's
    /// slices usually do) under one hold of the mapping, then counts them for the peer once
    /// and completes them. What the mapping cannot take because it died meanwhile goes to
    /// `back`.
    fn copy_mapped(
        &self,
        mapped: &Mapped,
        first: Slice,
        rest: &mut Peekable<vec::IntoIter<Slice>>,
        back: &mut Vec<Slice>,
    ) {
        let inside = |s: &Slice| mapped.contains(s.remote_addr, s.len as u64);
        let live = mapped.live.read().unwrap_or_else(|p| p.into_inner());
        let Some(mapping) = live.as_ref() else {
            back.push(first);
            back.extend(std::iter::from_fn(|| rest.next_if(inside)));
            return;
        };
        let mut done = Vec::new();
        let mut bytes = 0u64;
        for slice in std::iter::once(first).chain(std::iter::from_fn(|| rest.next_if(inside))) {
            if !slice.is_live() {
                slice.abandon();
                continue;
            }
            let offset = (slice.remote_addr - mapped.addr) as usize;
            // A long slice goes in pieces, its task checked before each: a canceled or timed
            // out transfer stops touching memory within one piece.
            let mut at = 0;
            let mut outcome = Ok(());
            while at < slice.len && outcome.is_ok() {
                if at > 0 && !slice.is_live_by_clock() {
                    break;
                }
                let piece = (slice.len - at).min(COPY_PIECE);
                outcome = if slice.local().is_device() {
                    // Device memory here, the peer's memfd mapped here: a GPU copy.
                    mapping.copy_with_device(
                        offset + at,
                        slice.local(),
                        slice.local_addr + at,
                        piece,
                        slice.opcode() == Opcode::Write,
                    )
                } else {
                    slice
                        .local()
                        .slice(slice.local_addr + at, piece)
                        .and_then(|local| match slice.opcode() {
                            Opcode::Write => mapping.write_from(offset + at, local),
                            Opcode::Read => mapping.read_into(offset + at, local),
                        })
                };
                at += piece;
            }
            if outcome.is_ok() && at < slice.len {
                // Nothing more of it lands anywhere: the copy was this thread's.
                slice.cut_off(false);
                continue;
            }
            match outcome {
                Ok(()) => {
                    bytes += slice.len as u64;
                    done.push(slice);
                }
                Err(e) => slice.fail(TransferError::Protocol {
                    peer: self.peer.clone(),
                    message: format!("copy through the mapping: {e}"),
                }),
            }
        }
        drop(live);
        self.count(bytes, done.len() as u64);
        done.into_iter().for_each(Slice::complete);
    }

    /// Moves slices to this peer: through mappings where its buffers are memfds (opening
    /// them first where needed), by the GPU where they are device memory, else by
    /// cross-memory attach under a lease. Local device memory moves only to the peer's device
    /// memory here (the CPU reaches its host memory); the rest goes to the next transport.
    pub(crate) fn carry(&self, slices: Vec<Slice>) {
        let slices = match &self.attach {
            // Another engine of this process: its device memory is this process's too, and
            // the GPU copies between the two registries directly (IPC handles do not open in
            // the process that made them).
            Attach::SameProcess(registry) => {
                let (device, host): (Vec<Slice>, Vec<Slice>) = slices.into_iter().partition(|s| {
                    s.local().is_device()
                        || usize::try_from(s.remote_addr).is_ok_and(|addr| {
                            registry
                                .pin_remote(addr, s.len)
                                .is_ok_and(|pin| pin.is_device())
                        })
                });
                if !device.is_empty() {
                    self.in_process(registry, device);
                }
                host
            }
            _ => slices,
        };
        let mut unknown = Vec::new();
        let mut plain = Vec::new();
        let mut device = Vec::new();
        let mut rest = slices.into_iter().peekable();
        while let Some(slice) = rest.next() {
            if !slice.is_live() {
                slice.abandon();
                continue;
            }
            let (addr, len) = (slice.remote_addr, slice.len as u64);
            if self.device_chunk(addr).is_some() {
                device.push(slice);
                continue;
            }
            let local_device = slice.local().is_device();
            match self.mapping(addr, len) {
                None if local_device && self.is_plain(addr, len) => {
                    self.device_declines
                        .decline(slice, crate::DEVICE_TO_HOST_DECLINED, None)
                }
                Some(mapped) => self.copy_mapped(&mapped, slice, &mut rest, &mut unknown),
                None if self.is_plain(addr, len) => plain.push(slice),
                None => unknown.push(slice),
            }
        }
        let mut revoked = Vec::new();
        let mut unknown = unknown.into_iter().peekable();
        while let Some(slice) = unknown.next() {
            let (addr, len) = (slice.remote_addr, slice.len as u64);
            if self.device_chunk(addr).is_some() {
                device.push(slice);
                continue;
            }
            let local_device = slice.local().is_device();
            if local_device && self.mapping(addr, len).is_none() && self.is_plain(addr, len) {
                self.device_declines
                    .decline(slice, crate::DEVICE_TO_HOST_DECLINED, None);
                continue;
            }
            if let Some(mapped) = self.mapping(addr, len) {
                // What comes back was revoked between the lookup and the copy: the buffer
                // is going.
                self.copy_mapped(&mapped, slice, &mut unknown, &mut revoked);
                continue;
            }
            if self.is_plain(addr, len) {
                plain.push(slice);
                continue;
            }
            if let Some(why) = self.declined_why(addr, len) {
                self.device_declines.decline(slice, why, None);
                continue;
            }
            match self.open(&slice, addr, len) {
                Ok(Way::Device) => device.push(slice),
                Ok(Way::Plain) if local_device => {
                    self.device_declines
                        .decline(slice, crate::DEVICE_TO_HOST_DECLINED, None)
                }
                Ok(Way::Mapped(mapped)) => {
                    self.copy_mapped(&mapped, slice, &mut unknown, &mut revoked)
                }
                Ok(Way::Plain) => plain.push(slice),
                Err(Refusal::Fail(e)) => slice.fail(e),
                Err(Refusal::Decline(why)) => slice.decline(&why),
                Err(Refusal::Device(reason, why)) => {
                    self.device_declines.decline(slice, reason, Some(&why))
                }
            }
        }
        revoked.into_iter().for_each(|slice| self.reject(slice));
        device.into_iter().for_each(|slice| self.copy_device(slice));
        if !plain.is_empty() {
            self.attach(plain);
        }
    }

    /// Moves one slice to or from the peer's device memory, chunk by chunk, each piece by a
    /// GPU copy between the local range and the chunk mapped here; asks the peer for the
    /// chunks it has not mapped yet on the way. The task is checked between pieces, as for
    /// mappings.
    fn copy_device(&self, slice: Slice) {
        if !slice.is_live() {
            slice.abandon();
            return;
        }
        let mut at = 0usize;
        let mut asked_at = None;
        while at < slice.len {
            if at > 0 && !slice.is_live_by_clock() {
                slice.cut_off(false);
                return;
            }
            let remote = slice.remote_addr + at as u64;
            let Some(chunk) = self.device_chunk(remote) else {
                if asked_at == Some(at) {
                    return slice.fail(TransferError::Protocol {
                        peer: self.peer.clone(),
                        message: format!("its answer did not map the device memory at {remote:#x}"),
                    });
                }
                asked_at = Some(at);
                match self.open(&slice, remote, (slice.len - at) as u64) {
                    Ok(Way::Device) => continue,
                    Ok(_) => {
                        return slice.fail(TransferError::Protocol {
                            peer: self.peer.clone(),
                            message: format!(
                                "part of a device buffer at {remote:#x} was answered as host \
                                 memory"
                            ),
                        });
                    }
                    Err(Refusal::Fail(e)) => return slice.fail(e),
                    Err(Refusal::Decline(why)) => return slice.decline(&why),
                    Err(Refusal::Device(reason, why)) if at == 0 => {
                        return self.device_declines.decline(slice, reason, Some(&why));
                    }
                    Err(Refusal::Device(_, why)) => {
                        return slice.fail(TransferError::Protocol {
                            peer: self.peer.clone(),
                            message: format!("device memory at {remote:#x}: {why}"),
                        });
                    }
                }
            };
            let live = chunk.live.read().unwrap_or_else(|p| p.into_inner());
            let Some(memory) = live.as_ref() else {
                drop(live);
                return self.reject(slice);
            };
            let offset = remote - chunk.base;
            let piece = (slice.len - at)
                .min(usize::try_from(chunk.len - offset).unwrap_or(usize::MAX))
                .min(COPY_PIECE);
            let copied = slice.local().copy_with_peer_device(
                slice.local_addr + at,
                piece,
                memory,
                offset,
                slice.opcode() == Opcode::Write,
            );
            drop(live);
            if let Err(e) = copied {
                return slice.fail(TransferError::Protocol {
                    peer: self.peer.clone(),
                    message: format!("device copy: {e}"),
                });
            }
            at += piece;
        }
        self.completed(slice);
    }

    fn reject(&self, slice: Slice) {
        let error = TransferError::RemoteRejected {
            peer: self.peer.clone(),
            addr: slice.remote_addr,
            len: slice.len,
        };
        slice.fail(error);
    }

    /// Asks the peer how to reach the buffer holding `[addr, addr + len)` (the slice's
    /// range, or the rest of it): a mapping (memfd), plain memory, device memory (its chunks
    /// now mapped), or a refusal.
    fn open(&self, slice: &Slice, addr: u64, len: u64) -> Result<Way, Refusal> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let check = OpenCheck {
            addr,
            len,
            published: slice
                .peer()
                .desc
                .buffers
                .iter()
                .map(|b| (b.addr, b.length))
                .collect(),
        };
        let rx = self
            .ask(id, &Frame::Open { id, addr, len }, Some(check))
            .map_err(Refusal::Fail)?;
        match self.wait(id, &rx).map_err(Refusal::Fail)? {
            Reply::Mapped(mapped) => Ok(Way::Mapped(mapped)),
            Reply::Plain => Ok(Way::Plain),
            Reply::Device => Ok(Way::Device),
            Reply::Rejected(reason) => {
                tracing::debug!("shm peer {} rejected a range: {reason}", self.peer);
                Err(Refusal::Fail(TransferError::RemoteRejected {
                    peer: self.peer.clone(),
                    addr,
                    len: len as usize,
                }))
            }
            Reply::Refused(why) => {
                tracing::warn!("shm peer {}: {why}", self.peer);
                *lock(&self.refusal) = Some(why.clone());
                Err(Refusal::Decline(why))
            }
            Reply::Declined(why) => {
                let reason = self
                    .declined_why(addr, len)
                    .unwrap_or(crate::DEVICE_PEER_DECLINED);
                Err(Refusal::Device(reason, why))
            }
            Reply::Leased(_) => Err(Refusal::Decline(
                "the peer answered an open with a lease".into(),
            )),
        }
    }

    /// Cross-memory attach for slices into plain buffers: one lease for all of them (in
    /// chunks of at most [`MAX_LEASE_RANGES`]), the copies, then the release.
    fn attach(&self, mut slices: Vec<Slice>) {
        let process = match &self.attach {
            Attach::Process(process) => *process,
            Attach::SameProcess(registry) => return self.in_process(registry, slices),
            Attach::Refused(why) => {
                let why = format!("no cross-memory attach into {}: {why}", self.peer);
                for slice in slices {
                    slice.decline(&why);
                }
                return;
            }
        };
        while !slices.is_empty() {
            let rest = slices.split_off(slices.len().min(MAX_LEASE_RANGES));
            self.attach_chunk(process, slices);
            slices = rest;
        }
    }

    fn attach_chunk(&self, process: PeerProcess, slices: Vec<Slice>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        // Released on every way out, the wait's timeout included: an owner that grants late
        // (after this side stopped waiting) still holds the pins until it reads the release.
        let _lease = LeaseRelease { link: self, id };
        let ranges = slices
            .iter()
            .map(|s| (s.remote_addr, s.len as u64))
            .collect();
        let granted = self
            .ask(id, &Frame::Lease { id, ranges }, None)
            .and_then(|rx| self.wait(id, &rx));
        let granted = match granted {
            Ok(Reply::Leased(granted)) if granted.len() == slices.len() => granted,
            Ok(_) => {
                for slice in slices {
                    slice.decline("the peer answered a lease wrongly");
                }
                return;
            }
            Err(e) => {
                for slice in slices {
                    slice.fail(e.clone());
                }
                return;
            }
        };
        // Where the peer granted every range and the slices go one way, one system call
        // moves them all; what it leaves (an error somewhere) goes one by one below, which
        // learns each slice's outcome.
        let mut slices = slices;
        let whole = if granted.iter().all(|&g| g) {
            attach_many(process, &slices)
        } else {
            0
        };
        let rest = slices.split_off(whole);
        if whole > 0 {
            self.count(slices.iter().map(|s| s.len as u64).sum(), whole as u64);
            slices.into_iter().for_each(Slice::complete);
        }
        for (slice, granted) in rest.into_iter().zip(granted.into_iter().skip(whole)) {
            if !granted {
                self.reject(slice);
                continue;
            }
            let moved = slice
                .local()
                .slice(slice.local_addr, slice.len)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
                .and_then(|local| match slice.opcode() {
                    Opcode::Write => process.write_from(slice.remote_addr, local),
                    Opcode::Read => process.read_into(slice.remote_addr, local),
                });
            match moved {
                Ok(()) => self.completed(slice),
                // Permission withdrawn since the probe (the peer made itself undumpable).
                Err(e) if AttachFailure::of(&e) == AttachFailure::Refused => {
                    slice.decline(&format!("cross-memory attach refused: {e}"))
                }
                Err(e) if AttachFailure::of(&e) == AttachFailure::Gone => {
                    slice.fail(TransferError::Connection {
                        peer: self.peer.clone(),
                        message: format!("its process is gone: {e}"),
                    })
                }
                Err(e) => slice.fail(TransferError::Protocol {
                    peer: self.peer.clone(),
                    message: format!("cross-memory attach: {e}"),
                }),
            }
        }
    }
}

/// Sends the release of lease `id` when dropped. The owner reads frames in order, so a
/// release always follows its lease there, and one for a lease it refused is nothing to it.
struct LeaseRelease<'a> {
    link: &'a Link,
    id: u64,
}

impl Drop for LeaseRelease<'_> {
    fn drop(&mut self) {
        let _send = lock(&self.link.send);
        let _ = wire::send(&self.link.stream, &Frame::Release { id: self.id }.encode());
    }
}

impl Link {
    /// Slices to another engine of this process.
    fn in_process(&self, registry: &tern_memreg::MemoryRegistry, slices: Vec<Slice>) {
        for slice in slices {
            copy_in_registry(registry, slice, |moved| self.completed(moved));
        }
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

/// What a link to `peer` is known by: its segment name and the socket its descriptor names
/// (a peer that starts again gets a new socket, and so a new link); why not, without a
/// usable `tern.shm` or with a socket name that is not one Tern binds (never dialed).
fn link_key(peer: &PeerSegment) -> Result<(String, String), String> {
    let ext = peer
        .desc
        .tern
        .get("shm")
        .and_then(Extension::from_json)
        .ok_or("the peer publishes no shared-memory socket")?;
    check_socket_name(&ext.socket).map_err(|e| e.to_string())?;
    Ok((peer.name.clone(), ext.socket))
}

/// Moves the leading slices that go the same way as the first with one system call (or a
/// few: `IOV_MAX` ranges per call): how many of them moved whole.
fn attach_many(process: PeerProcess, slices: &[Slice]) -> usize {
    let Some(opcode) = slices.first().map(Slice::opcode) else {
        return 0;
    };
    let run = slices.iter().take_while(|s| s.opcode() == opcode);
    let pairs: Result<Vec<_>, tern_memreg::MemoryError> = run
        .clone()
        .map(|s| Ok((s.remote_addr, s.local().slice(s.local_addr, s.len)?)))
        .collect();
    let moved = match (pairs, opcode) {
        (Ok(pairs), Opcode::Write) => process.write_many(&pairs),
        (Ok(pairs), Opcode::Read) => process.read_many(&pairs),
        (Err(_), _) => 0,
    };
    // The slices wholly inside what moved.
    run.scan(0usize, |covered, s| {
        *covered += s.len;
        Some(*covered)
    })
    .take_while(|&covered| covered <= moved)
    .count()
}

/// Moves one slice between its local region and a remote range of `registry` (an engine of
/// this process, or this engine): the range is pinned there first, the same check the owner
/// makes for a lease, then the bytes are copied between the two regions (by the GPU when
/// either is device memory), and the slice goes to `moved` (which completes it).
pub(crate) fn copy_in_registry(
    registry: &tern_memreg::MemoryRegistry,
    slice: Slice,
    moved: impl FnOnce(Slice),
) {
    let peer = slice.peer().name.clone();
    let remote = usize::try_from(slice.remote_addr)
        .ok()
        .and_then(|addr| registry.pin_remote(addr, slice.len).ok().map(|p| (addr, p)));
    let Some((addr, pin)) = remote else {
        let error = TransferError::RemoteRejected {
            peer,
            addr: slice.remote_addr,
            len: slice.len,
        };
        slice.fail(error);
        return;
    };
    if pin.is_device() || slice.local().is_device() {
        let copied = match slice.opcode() {
            Opcode::Write => {
                slice
                    .local()
                    .copy_to_with_device(slice.local_addr, &pin, addr, slice.len)
            }
            Opcode::Read => {
                pin.copy_to_with_device(addr, slice.local(), slice.local_addr, slice.len)
            }
        };
        drop(pin);
        return match copied {
            Ok(()) => moved(slice),
            Err(e) => slice.fail(TransferError::Protocol {
                peer,
                message: e.to_string(),
            }),
        };
    }
    let copied = pin.slice(addr, slice.len).and_then(|remote| {
        let local = slice.local().slice(slice.local_addr, slice.len)?;
        match slice.opcode() {
            Opcode::Write => remote.copy_from_region(local),
            Opcode::Read => local.copy_from_region(remote),
        };
        Ok(())
    });
    drop(pin);
    match copied {
        Ok(()) => moved(slice),
        Err(e) => slice.fail(TransferError::Protocol {
            peer,
            message: e.to_string(),
        }),
    }
}

/// The device and inode of a memfd.
fn memfd_file(memfd: &MemFd) -> io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::File::from(memfd.as_fd().try_clone_to_owned()?).metadata()?;
    Ok((meta.dev(), meta.ino()))
}

/// How an Open found the peer's buffer is reached.
enum Way {
    Mapped(Arc<Mapped>),
    Plain,
    Device,
}

/// Why an Open did not give a way to the bytes.
enum Refusal {
    Fail(TransferError),
    Decline(String),
    /// The peer's buffer is device memory this link cannot reach: why (for the stats), and
    /// the detail.
    Device(&'static str, String),
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    /// A link over one end of a socket pair, reaching no process: enough to settle answers.
    fn link() -> (Link, UnixStream) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let link = Link {
            peer: "peer".into(),
            stream: ours,
            send: Mutex::new(()),
            pending: Mutex::default(),
            next_id: AtomicU64::new(1),
            alive: AtomicBool::new(true),
            maps: RwLock::default(),
            device_maps: RwLock::default(),
            plain: Mutex::default(),
            attach: Attach::Refused("a test".into()),
            ended: Mutex::new(None),
            refusal: Mutex::new(None),
            io_timeout: Duration::from_secs(1),
            moved: Default::default(),
            declined: Mutex::default(),
            device_declines: Default::default(),
        };
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
        assert!(first.live.read().unwrap().is_none());
        assert_eq!(mappings_of(inode(&new)), 1);
        // A revocation finds the one mapping the link holds.
        link.unmap(addr);
        assert_eq!(mappings_of(inode(&new)), 0);
        drop((first, second, third));
    }
}
