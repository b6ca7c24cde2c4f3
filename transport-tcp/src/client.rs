//! The client side: a pool of persistent connections per peer, each with one lane thread
//! taking slices from the pool's queue, so slices stripe across connections.
//!
//! A lane pipelines: it keeps up to [`PIPELINE_SLICES`] requests (and [`PIPELINE_BYTES`]; of
//! writes [`WRITE_PIPELINE_BYTES`]) on its connection, and sends requests and takes replies at
//! the same time over a non-blocking socket, waiting in `poll(2)` for whichever can move. Reads
//! and writes mixed in one group therefore never deadlock: read replies filling the socket
//! buffers are taken while write bodies are still going out.
//!
//! A slice whose task has ended is never started; one already on the wire is cut off when
//! the engine asks ([`Pool::cut_off`]): the lane drops its connection, so that no reply lands
//! in that slice's memory and no more of a write's body is read from it, gives the slice
//! back, and sends the live slices that were on that connection again on a new one.

use std::collections::VecDeque;
use std::io::{self, Read};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use tern_engine::{
    MovedCounter, Opcode, PeerState, PeerStats, ReportTogether, Slice, TransferError,
};
use tern_memreg::{RegionIo, Stage, wait_ready};
use tern_metadata::auth::{Channel, ClusterSecret};
use tern_metadata::net::{Dial, DialAuth, dial};

use crate::TcpConfig;
use crate::wire::{FRAME_ALIGN, Header, OP_READ, OP_WRITE, Status, version_bits};

/// After a failed connect, further slices to the same peer fail at once for this long
/// instead of each waiting for its own connect timeout.
const FAST_FAIL: Duration = Duration::from_millis(100);

/// Most requests one lane has on its connection at once.
const PIPELINE_SLICES: usize = 32;
/// Most bytes one lane has on its connection at once (but two requests, whatever their
/// size): bytes in flight wait in the socket buffers, and beyond what keeps the connection
/// busy they only fall out of cache — on loopback 1 MiB reads moved 8.4 GB/s with 2 MiB in
/// flight against 6.1 with 8 MiB (alternating A/B runs).
const PIPELINE_BYTES: usize = 2 << 20;
/// Most bytes of writes one lane has on its connection at once (but two writes, whatever
/// their size). A write's bytes wait in the two socket buffers on their way, and fewer of
/// them in flight keeps them in cache: on loopback, 64 KiB writes moved 4.9 GB/s with 8 in
/// flight against 4.1 with 32, and 1 MiB writes 7.8 with 2 against 6.9 with 8 (alternating
/// A/B runs). Reads keep the deeper pipeline: their headers go out together, and they lost
/// 10 % at 8.
const WRITE_PIPELINE_BYTES: usize = 512 << 10;

/// A connection unused for longer than this is checked before reuse: the server may have
/// closed it for idleness, and a request sent into a closed connection would fail.
const IDLE_CHECK: Duration = Duration::from_millis(50);

/// Longest a lane waits in poll(2) before it looks whether it was asked to cut off slices of
/// ended tasks: the bound on how long a cut-off takes to reach a lane waiting on a peer that
/// sends nothing.
const CUT_CHECK: Duration = Duration::from_millis(5);

#[derive(Debug)]
pub(crate) struct Pool {
    sender: Mutex<Option<Sender<Slice>>>,
    /// The lanes' queue, to take out the slices of ended tasks no lane has taken yet (none
    /// when no lane started: slices then fail at once).
    receiver: Option<Receiver<Slice>>,
    shared: Arc<PoolShared>,
    lanes: Mutex<Vec<JoinHandle<()>>>,
}

/// Who this node is and whom a pool's connections must reach, for the cluster-secret
/// exchange.
#[derive(Debug, Clone)]
pub(crate) struct PoolAuth {
    pub secret: ClusterSecret,
    pub local_segment: String,
    pub peer_segment: String,
}

#[derive(Debug)]
struct PoolShared {
    endpoint: String,
    config: TcpConfig,
    /// Proved to the peer on every new connection, before the first request.
    auth: Option<PoolAuth>,
    stop: Arc<AtomicBool>,
    last_connect_failure: Mutex<Option<(Instant, String)>>,
    /// The last failure with this peer (connecting, or a connection breaking), for stats.
    last_error: Mutex<Option<String>>,
    /// A clone of each lane's current connection, so shutdown can cut I/O in progress.
    open: Mutex<Vec<Option<TcpStream>>>,
    /// What each lane moved, each written by its lane alone.
    moved: Box<[MovedCounter]>,
    /// Raised by each cut-off request: a lane that sees it change cuts off the slices of
    /// ended tasks it holds.
    cut: AtomicU64,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl Pool {
    pub(crate) fn start(
        endpoint: String,
        config: TcpConfig,
        auth: Option<PoolAuth>,
        stop: Arc<AtomicBool>,
    ) -> Arc<Self> {
        let (sender, receiver) = crossbeam_channel::unbounded();
        let lane_count = config_lanes(&config);
        let shared = Arc::new(PoolShared {
            endpoint,
            config,
            auth,
            stop,
            last_connect_failure: Mutex::new(None),
            last_error: Mutex::new(None),
            open: Mutex::new((0..lane_count).map(|_| None).collect()),
            moved: (0..lane_count).map(|_| Default::default()).collect(),
            cut: AtomicU64::new(0),
        });
        let mut lanes = Vec::new();
        for lane in 0..lane_count {
            let (lane_shared, receiver) = (shared.clone(), receiver.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("tern-tcp-lane-{lane}"))
                .spawn(move || lane_loop(&lane_shared, lane, &receiver));
            match spawned {
                Ok(handle) => lanes.push(handle),
                Err(e) => {
                    tracing::warn!("cannot start TCP lane {lane} to {}: {e}", shared.endpoint)
                }
            }
        }
        Arc::new(Self {
            sender: Mutex::new(Some(sender)),
            receiver: (!lanes.is_empty()).then_some(receiver),
            shared,
            lanes: Mutex::new(lanes),
        })
    }

    /// Queues slices for the lanes: the lock once for all of them, one channel send each (so
    /// that whichever lane is free takes the next).
    pub(crate) fn push_all(&self, slices: impl IntoIterator<Item = Slice>) {
        let sender = self.sender.lock().unwrap_or_else(|p| p.into_inner());
        for slice in slices {
            match sender.as_ref() {
                Some(sender) => {
                    if let Err(returned) = sender.send(slice) {
                        returned
                            .into_inner()
                            .fail_unsent(TransferError::Dropped("TCP lanes have stopped".into()));
                    }
                }
                None => slice.fail_unsent(TransferError::Dropped("TCP transport shut down".into())),
            }
        }
    }

    /// Cuts off the slices of ended tasks: those still queued are given back here; each lane
    /// gives back those it holds within [`CUT_CHECK`], dropping its connection if one of
    /// them is on the wire.
    pub(crate) fn cut_off(&self) {
        self.shared.cut.fetch_add(1, Ordering::Release);
        let Some(receiver) = &self.receiver else {
            return;
        };
        let mut live = Vec::new();
        for _ in 0..receiver.len() {
            match receiver.try_recv() {
                Ok(slice) if slice.is_live() => live.push(slice),
                Ok(slice) => slice.abandon(),
                Err(_) => break,
            }
        }
        if !live.is_empty() {
            self.push_all(live);
        }
    }

    /// How this peer stands: open connections, and the last failure.
    pub(crate) fn peer_stats(&self) -> PeerStats {
        let endpoints = lock(&self.shared.open).iter().flatten().count();
        let last_error = lock(&self.shared.last_error).clone();
        let moved = &self.shared.moved;
        PeerStats {
            peer: self.shared.endpoint.clone(),
            state: PeerState::of(endpoints, 0, last_error.is_some()),
            endpoints,
            bytes: moved.iter().map(|m| m.get().0).sum(),
            slices: moved.iter().map(|m| m.get().1).sum(),
            last_error,
        }
    }

    /// Stops taking slices, cuts connections in use, fails what is queued (the stop flag is
    /// set) and waits for the lanes, so no lane touches local memory once this returns.
    pub(crate) fn close(&self) {
        lock(&self.sender).take();
        for stream in lock(&self.shared.open).iter().flatten() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for lane in lock(&self.lanes).drain(..) {
            let _ = lane.join();
        }
    }
}

fn config_lanes(config: &TcpConfig) -> usize {
    config.connections_per_peer.max(1)
}

fn lane_loop(shared: &PoolShared, lane: usize, receiver: &Receiver<Slice>) {
    let mut connection: Option<TcpStream> = None;
    let mut last_used = Instant::now();
    // Empty between runs; kept for its buffers.
    let mut window = Window::default();
    loop {
        // Blocks for the first slice only when nothing is in flight (a window can hold
        // slices here: those a cut-off sends again on a new connection).
        if window.is_empty() {
            match receiver.recv() {
                Ok(first) => window.take(shared, first),
                Err(_) => break,
            }
        }
        window.fill(shared, receiver);
        if window.is_empty() {
            continue;
        }
        if connection.is_some()
            && last_used.elapsed() > IDLE_CHECK
            && !still_open(connection.as_ref())
        {
            connection = None;
        }
        let stream = match connection.as_mut() {
            Some(stream) => stream,
            None => match shared.connect() {
                Ok(stream) => {
                    lock(&shared.open)[lane] = stream.try_clone().ok();
                    if shared.stop.load(Ordering::Acquire) {
                        let _ = stream.shutdown(Shutdown::Both);
                    }
                    connection.insert(stream)
                }
                Err(message) => {
                    window.fail_all(|| TransferError::Connection {
                        peer: shared.endpoint.clone(),
                        message: message.clone(),
                    });
                    continue;
                }
            },
        };
        let healthy = window.run(shared, lane, stream, receiver);
        last_used = Instant::now();
        if !healthy {
            connection = None;
        }
    }
}

/// Whether the peer has not closed `stream` (nothing may be pending on it between requests;
/// the socket is non-blocking).
fn still_open(stream: Option<&TcpStream>) -> bool {
    stream.is_some_and(|stream| {
        matches!(stream.peek(&mut [0u8; 1]), Err(ref e) if e.kind() == io::ErrorKind::WouldBlock)
    })
}

/// A request being sent: its header, and how many of its bytes (header and body) are out.
#[derive(Debug)]
struct Sending {
    slice: Slice,
    header: Framed,
    sent: usize,
}

impl Sending {
    fn total(&self) -> usize {
        self.header.len
            + match self.slice.opcode() {
                Opcode::Write => self.slice.len,
                Opcode::Read => 0,
            }
    }
}

/// A request on the wire, waiting for (the rest of) its reply.
#[derive(Debug)]
struct Awaiting {
    slice: Slice,
    /// Bytes of its status frame (0 under v1).
    status_len: usize,
    status: [u8; FRAME_ALIGN],
    /// Bytes of the status frame received.
    status_got: usize,
    /// Bytes of a read's data received.
    body_got: usize,
    /// Whether the status frame has been decoded (and was Ok).
    checked: bool,
}

impl Awaiting {
    fn new(slice: Slice, status_len: usize) -> Self {
        Self {
            slice,
            status_len,
            status: [0; FRAME_ALIGN],
            status_got: 0,
            body_got: 0,
            checked: false,
        }
    }
}

/// A request header as its framing sends it.
#[derive(Debug)]
struct Framed {
    bytes: [u8; FRAME_ALIGN],
    /// Bytes of `bytes` sent.
    len: usize,
    /// Bytes of each status frame the server sends back (0 under v1).
    status_len: usize,
}

/// The wire header of `slice`'s request, in the newest framing both this node and the peer
/// speak (v3 aligned, v2 with status frames, or v1).
fn request_header(shared: &PoolShared, slice: &Slice) -> Framed {
    let version = u32::from(shared.config.proto_version).min(slice.peer().desc.tcp_proto_version);
    let op = match slice.opcode() {
        Opcode::Read => OP_READ,
        Opcode::Write => OP_WRITE,
    };
    let header = Header {
        size: slice.len as u64,
        addr: slice.remote_addr,
        opcode: op | version_bits(version),
    };
    let (bytes, len) = header.encode_framed();
    Framed {
        bytes,
        len,
        status_len: header.status_len(),
    }
}

/// What one lane has taken on: requests to send, the one being sent, and those awaiting
/// replies, oldest first.
#[derive(Debug, Default)]
struct Window {
    queued: VecDeque<Slice>,
    /// Headers of reads that await replies, not all on the wire yet (kept for reuse).
    read_headers: Vec<u8>,
    read_headers_sent: usize,
    sending: Option<Sending>,
    awaiting: VecDeque<Awaiting>,
    bytes: usize,
    /// Writes in the window, and their bytes.
    writes: usize,
    write_bytes: usize,
    /// The socket took less than it was given (its send buffer is full) and has not been
    /// reported writable since: another send now would only fail with `WouldBlock`.
    send_full: bool,
    /// The socket gave less than was asked (nothing more had arrived) and has not been
    /// reported readable since.
    drained: bool,
    /// The pool's cut-off count this lane last acted on.
    seen_cut: u64,
    /// How many of the slices at the front of `queued` were on a connection a cut-off
    /// dropped: bytes of such a write may have left.
    resent: usize,
    /// Pinned buffers through which device memory reaches the socket.
    stage: Stage,
}

/// How one pass over the connection went.
enum Step {
    /// Something moved.
    Moved,
    /// Nothing could move without waiting.
    Blocked,
}

impl Window {
    fn is_empty(&self) -> bool {
        self.queued.is_empty() && self.sending.is_none() && self.awaiting.is_empty()
    }

    fn count(&self) -> usize {
        self.queued.len() + usize::from(self.sending.is_some()) + self.awaiting.len()
    }

    fn room(&self) -> bool {
        let count = self.count();
        count < PIPELINE_SLICES
            && (self.bytes < PIPELINE_BYTES || count < 2)
            && (self.write_bytes < WRITE_PIPELINE_BYTES || self.writes < 2)
    }

    /// A slice leaves the window (moved, failed or abandoned).
    fn leave(&mut self, slice: &Slice) {
        self.bytes -= slice.len;
        if slice.opcode() == Opcode::Write {
            self.writes -= 1;
            self.write_bytes -= slice.len;
        }
    }

    /// Takes a slice into the window (or settles it at once if it should not run).
    fn take(&mut self, shared: &PoolShared, slice: Slice) {
        if shared.stop.load(Ordering::Acquire) {
            slice.fail_unsent(TransferError::Dropped("TCP transport shut down".into()));
        } else if slice.is_live() {
            self.bytes += slice.len;
            if slice.opcode() == Opcode::Write {
                self.writes += 1;
                self.write_bytes += slice.len;
            }
            self.queued.push_back(slice);
        } else {
            slice.abandon();
        }
    }

    /// Takes queued slices while there is room.
    fn fill(&mut self, shared: &PoolShared, receiver: &Receiver<Slice>) {
        while self.room() {
            match receiver.try_recv() {
                Ok(slice) => self.take(shared, slice),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
    }

    /// The front of the queue, to send now; a slice of an ended task is given back instead
    /// (None then, with the queue not empty).
    fn pop_queued(&mut self) -> Option<Option<Slice>> {
        let resent = self.resent > 0;
        self.resent = self.resent.saturating_sub(1);
        let slice = self.queued.pop_front()?;
        if slice.is_live() {
            return Some(Some(slice));
        }
        self.leave(&slice);
        if resent {
            // It was on a connection a cut-off dropped: a write's bytes may have left.
            slice.cut_off(true);
        } else {
            slice.abandon();
        }
        Some(None)
    }

    fn fail_all(&mut self, error: impl Fn() -> TransferError) {
        self.settle();
        let sending = self.sending.take().map(|s| s.slice);
        let awaiting = self.awaiting.drain(..).map(|a| a.slice);
        let resent = std::mem::take(&mut self.resent).min(self.queued.len());
        let on_the_wire = awaiting
            .chain(sending)
            .chain(self.queued.drain(..resent))
            .collect::<Vec<_>>();
        for slice in on_the_wire {
            slice.fail(error());
        }
        for slice in self.queued.drain(..) {
            slice.fail_unsent(error());
        }
        self.read_headers.clear();
        self.read_headers_sent = 0;
        self.bytes = 0;
        self.writes = 0;
        self.write_bytes = 0;
    }

    /// Runs the window over `stream` until it is empty (taking more slices as room frees up);
    /// returns whether the connection is still good.
    fn run(
        &mut self,
        shared: &PoolShared,
        lane: usize,
        stream: &mut TcpStream,
        receiver: &Receiver<Slice>,
    ) -> bool {
        let io_timeout = shared.config.io_timeout;
        let mut last_progress = Instant::now();
        // A send or receive the socket cannot serve costs a system call that returns
        // `WouldBlock`; after a short one the lane waits in poll(2) for that direction instead.
        (self.send_full, self.drained) = (false, false);
        while !self.is_empty() {
            let cut = shared.cut.load(Ordering::Acquire);
            if cut != self.seen_cut {
                self.seen_cut = cut;
                if !self.cut_off(shared, lane, stream) {
                    return false;
                }
                continue;
            }
            let outcome = self.send(shared, stream).and_then(|sent| {
                let received = self.receive(shared, lane, stream)?;
                Ok(matches!(sent, Step::Moved) || matches!(received, Step::Moved))
            });
            match outcome {
                Ok(true) => {
                    last_progress = Instant::now();
                    self.fill(shared, receiver);
                }
                Ok(false) => {
                    let left = io_timeout.saturating_sub(last_progress.elapsed());
                    if left.is_zero() {
                        return self.broken(
                            shared,
                            lane,
                            "no progress within the I/O timeout".into(),
                        );
                    }
                    let want_write = self.sending.is_some()
                        || !self.queued.is_empty()
                        || self.read_headers_sent < self.read_headers.len();
                    let want_read = !self.awaiting.is_empty();
                    let nap = left.min(CUT_CHECK);
                    match wait_ready(stream.as_fd(), want_read, want_write, Some(nap)) {
                        Ok(ready) => {
                            self.send_full &= !(ready.write || ready.failed);
                            self.drained &= !(ready.read || ready.failed);
                        }
                        Err(e) => return self.broken(shared, lane, e.to_string()),
                    }
                }
                Err(Failure::Protocol(message)) => {
                    if let Some(front) = self.awaiting.pop_front() {
                        self.leave(&front.slice);
                        front.slice.fail(TransferError::Protocol {
                            peer: shared.endpoint.clone(),
                            message,
                        });
                    }
                    return self.broken(shared, lane, "protocol error".into());
                }
                Err(Failure::Io(e)) => {
                    return self.broken(shared, lane, format!("{e} (mid-transfer)"));
                }
            }
        }
        true
    }

    /// Gives back the slices of ended tasks: those queued at once; if one is on the wire,
    /// the connection goes (its replies would land in that slice's memory, and a write's
    /// body is read from it), and the live slices that were on it are queued again for a
    /// new one. Returns whether the connection is still good.
    fn cut_off(&mut self, shared: &PoolShared, lane: usize, stream: &TcpStream) -> bool {
        let queued = std::mem::take(&mut self.queued);
        let resent = std::mem::take(&mut self.resent);
        let mut kept_resent = 0;
        for (i, slice) in queued.into_iter().enumerate() {
            if slice.is_live() {
                kept_resent += usize::from(i < resent);
                self.queued.push_back(slice);
            } else {
                self.leave(&slice);
                if i < resent {
                    slice.cut_off(true);
                } else {
                    slice.abandon();
                }
            }
        }
        self.resent = kept_resent;
        let dead_on_the_wire = self.sending.as_ref().is_some_and(|s| !s.slice.is_live())
            || self.awaiting.iter().any(|a| !a.slice.is_live());
        if !dead_on_the_wire {
            return true;
        }
        let _ = stream.shutdown(Shutdown::Both);
        if let Some(open) = lock(&shared.open).get_mut(lane) {
            *open = None;
        }
        self.settle();
        // Oldest first: those awaiting replies, the one being sent, then the queue.
        let mut again = VecDeque::with_capacity(self.count());
        let awaiting = std::mem::take(&mut self.awaiting);
        for awaiting in awaiting {
            if awaiting.slice.is_live() {
                again.push_back(awaiting.slice);
            } else {
                self.leave(&awaiting.slice);
                // A write awaiting its status has sent its body whole.
                awaiting.slice.cut_off(true);
            }
        }
        if let Some(sending) = self.sending.take() {
            if sending.slice.is_live() {
                again.push_back(sending.slice);
            } else {
                self.leave(&sending.slice);
                let body_left = sending.sent > sending.header.len;
                sending.slice.cut_off(body_left);
            }
        }
        self.resent += again.len();
        again.append(&mut self.queued);
        self.queued = again;
        self.read_headers.clear();
        self.read_headers_sent = 0;
        tracing::debug!(
            "TCP lane {lane} to {}: connection dropped to cut off slices of ended tasks",
            shared.endpoint
        );
        false
    }

    /// Waits for the device copies of the slices on the wire, before any is given back.
    fn settle(&mut self) {
        if let Err(e) = self.stage.settle() {
            tracing::warn!("TCP lane: waiting for device copies: {e}");
        }
    }

    /// Fails everything in the window after the connection broke. The lane's connection
    /// leaves the stats first, so whoever sees a failed slice also sees the peer's loss.
    fn broken(&mut self, shared: &PoolShared, lane: usize, message: String) -> bool {
        if let Some(open) = lock(&shared.open).get_mut(lane) {
            *open = None;
        }
        *lock(&shared.last_error) = Some(message.clone());
        self.fail_all(|| TransferError::Connection {
            peer: shared.endpoint.clone(),
            message: message.clone(),
        });
        false
    }

    /// Sends as much of the pending requests as the socket takes now. The headers of reads
    /// queued one after another go out together, in one write.
    fn send(&mut self, shared: &PoolShared, stream: &mut TcpStream) -> Result<Step, Failure> {
        let mut step = Step::Blocked;
        loop {
            if self.send_full {
                return Ok(step);
            }
            if self.read_headers_sent < self.read_headers.len() {
                let unsent = self.read_headers.len() - self.read_headers_sent;
                match io::Write::write(stream, &self.read_headers[self.read_headers_sent..]) {
                    Ok(0) => return Err(Failure::Io(io::ErrorKind::WriteZero.into())),
                    Ok(n) => {
                        self.read_headers_sent += n;
                        self.send_full = n < unsent;
                        step = Step::Moved;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        self.send_full = true;
                        return Ok(step);
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(Failure::Io(e)),
                }
                continue;
            }
            self.read_headers.clear();
            self.read_headers_sent = 0;
            if self.sending.is_none() {
                // Reads first in the queue: their headers, all at once. They await their
                // replies already: the server answers none before its header arrives.
                while self
                    .queued
                    .front()
                    .is_some_and(|slice| slice.opcode() == Opcode::Read)
                {
                    let Some(read) = self.pop_queued() else {
                        break;
                    };
                    let Some(read) = read else {
                        continue;
                    };
                    let header = request_header(shared, &read);
                    self.read_headers
                        .extend_from_slice(&header.bytes[..header.len]);
                    self.awaiting
                        .push_back(Awaiting::new(read, header.status_len));
                }
                if !self.read_headers.is_empty() {
                    continue;
                }
                let Some(slice) = self.pop_queued() else {
                    return Ok(step);
                };
                let Some(slice) = slice else {
                    continue;
                };
                self.stage.begin_outbound();
                self.sending = Some(Sending {
                    header: request_header(shared, &slice),
                    slice,
                    sent: 0,
                });
            }
            let Some(sending) = self.sending.as_mut() else {
                return Ok(step);
            };
            let (total, header_len) = (sending.total(), sending.header.len);
            while sending.sent < total {
                if self.send_full {
                    return Ok(step);
                }
                let head = &sending.header.bytes[sending.sent.min(header_len)..header_len];
                let body_from = sending.sent.saturating_sub(header_len);
                let result = match sending.slice.opcode() {
                    Opcode::Write => self
                        .stage
                        .outbound(
                            sending.slice.local(),
                            sending.slice.local_addr,
                            sending.slice.len,
                            body_from,
                        )
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
                        .and_then(|body| stream.write_from(head, body)),
                    Opcode::Read => io::Write::write(stream, head),
                };
                match result {
                    Ok(0) => return Err(Failure::Io(io::ErrorKind::WriteZero.into())),
                    Ok(n) => {
                        self.send_full = sending.sent + n < total;
                        sending.sent += n;
                        step = Step::Moved;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        self.send_full = true;
                        return Ok(step);
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(Failure::Io(e)),
                }
            }
            if let Some(done) = self.sending.take() {
                self.awaiting
                    .push_back(Awaiting::new(done.slice, done.header.status_len));
            }
        }
    }

    /// Reads (part of) the front request's status frame, and with it those of the writes
    /// right behind it: a write's reply is its status frame alone, so the frames of the
    /// writes at the front can be taken in one read without taking a byte beyond them.
    fn read_statuses(&mut self, stream: &mut TcpStream) -> io::Result<usize> {
        let mut statuses = [0u8; FRAME_ALIGN * PIPELINE_SLICES];
        let mut wanted = 0;
        for (i, awaiting) in self.awaiting.iter().enumerate() {
            let write = awaiting.status_len > 0 && awaiting.slice.opcode() == Opcode::Write;
            if (i > 0 && !write) || wanted + awaiting.status_len > statuses.len() {
                break;
            }
            wanted += awaiting.status_len - awaiting.status_got;
            if !write {
                break;
            }
        }
        let got = stream.read(&mut statuses[..wanted])?;
        self.drained = got < wanted;
        let mut taken = 0;
        for awaiting in self.awaiting.iter_mut() {
            let room = (awaiting.status_len - awaiting.status_got).min(got - taken);
            if room == 0 {
                break;
            }
            awaiting.status[awaiting.status_got..awaiting.status_got + room]
                .copy_from_slice(&statuses[taken..taken + room]);
            awaiting.status_got += room;
            taken += room;
        }
        Ok(got)
    }

    /// Takes as much of the replies as the socket holds now, completing each slice whose
    /// reply is whole.
    fn receive(
        &mut self,
        shared: &PoolShared,
        lane: usize,
        stream: &mut TcpStream,
    ) -> Result<Step, Failure> {
        let mut step = Step::Blocked;
        // Writes whose statuses came in one read ended together: one clock reading times them.
        let mut together: Option<ReportTogether> = None;
        while let Some(front) = self.awaiting.front() {
            let status_len = front.status_len;
            let (is_read, len) = (front.slice.opcode() == Opcode::Read, front.slice.len);
            // A write's status comes after its data reached the server, a read's before its
            // data: either way the status is first on the wire for this request.
            if front.status_got < status_len {
                drop(together.take());
                if self.drained {
                    return Ok(step);
                }
                match self.read_statuses(stream) {
                    Ok(0) => return Err(Failure::Io(io::ErrorKind::UnexpectedEof.into())),
                    Ok(_) => {
                        step = Step::Moved;
                        together = Some(ReportTogether::begin());
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        self.drained = true;
                        return Ok(step);
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(Failure::Io(e)),
                }
                continue;
            }
            let Some(front) = self.awaiting.front_mut() else {
                break;
            };
            if status_len > 0 && !front.checked {
                front.checked = true;
                match Status::decode(*front.status.first_chunk().unwrap_or(&[0; 8])) {
                    Ok(Status::Ok) => {}
                    Ok(Status::AddressRejected) => {
                        let Some(done) = self.awaiting.pop_front() else {
                            break;
                        };
                        self.leave(&done.slice);
                        let error = TransferError::RemoteRejected {
                            peer: shared.endpoint.clone(),
                            addr: done.slice.remote_addr,
                            len: done.slice.len,
                        };
                        done.slice.fail(error);
                        continue;
                    }
                    Err(raw) => {
                        return Err(Failure::Protocol(format!(
                            "unknown status frame {raw:#018x}"
                        )));
                    }
                }
            }
            if is_read && front.body_got < len {
                drop(together.take());
                if self.drained {
                    return Ok(step);
                }
                let (local_addr, got) = (front.slice.local_addr, front.body_got);
                let received = self
                    .stage
                    .inbound(front.slice.local(), local_addr, len, got)
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
                    .and_then(|body| stream.read_into(body));
                let received = match received {
                    Ok(n) if n > 0 => self
                        .stage
                        .received(front.slice.local(), local_addr, len, got, n)
                        .map(|()| n)
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e)),
                    other => other,
                };
                match received {
                    Ok(0) => return Err(Failure::Io(io::ErrorKind::UnexpectedEof.into())),
                    Ok(n) => {
                        self.drained = front.body_got + n < len;
                        front.body_got += n;
                        step = Step::Moved;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        self.drained = true;
                        return Ok(step);
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(Failure::Io(e)),
                }
                if front.body_got < len {
                    continue;
                }
            }
            if let Some(done) = self.awaiting.pop_front() {
                self.leave(&done.slice);
                if let Some(moved) = shared.moved.get(lane) {
                    moved.add(done.slice.len as u64, 1);
                }
                done.slice.complete();
            }
        }
        Ok(step)
    }
}

impl PoolShared {
    fn connect(&self) -> Result<TcpStream, String> {
        {
            let last = lock(&self.last_connect_failure);
            if let Some((at, message)) = last.as_ref().filter(|(at, _)| at.elapsed() < FAST_FAIL) {
                return Err(format!("{message} ({} ms ago)", at.elapsed().as_millis()));
            }
        }
        let result = self.try_connect();
        let mut last = lock(&self.last_connect_failure);
        match &result {
            Ok(_) => *last = None,
            Err(message) => {
                *last = Some((Instant::now(), message.clone()));
                *lock(&self.last_error) = Some(message.clone());
            }
        }
        result
    }

    fn try_connect(&self) -> Result<TcpStream, String> {
        let _span = tracing::debug_span!("tcp_connect", peer = %self.endpoint).entered();
        let dialing = Dial {
            endpoint: &self.endpoint,
            connect_timeout: self.config.connect_timeout,
            auth: self.auth.as_ref().map(|auth| DialAuth {
                secret: &auth.secret,
                channel: Channel::TcpData,
                client_segment: &auth.local_segment,
                server_segment: &auth.peer_segment,
            }),
        };
        let stream = dial(&dialing, self.config.io_timeout).map_err(|e| e.to_string())?;
        crate::size_buffers((&stream).into(), self.config.socket_buffer_bytes)
            .map_err(|e| e.to_string())?;
        // Lanes wait in poll(2), bounded by the I/O timeout, and never block in a call.
        stream.set_nonblocking(true).map_err(|e| e.to_string())?;
        Ok(stream)
    }
}

enum Failure {
    Protocol(String),
    Io(io::Error),
}
