//! The data server: with a cluster secret, refuses every connection whose peer does not prove
//! it knows it (before a header is read); then checks every request against registered memory
//! and moves the bytes. Connections are accepted, limited and joined by the one
//! [`Acceptor`]: a connection that has not sent its first request header (with a secret:
//! its proof) within the exchange timeout of being accepted is closed, and only one past
//! that holds one of `max_inbound` slots; a request must arrive within its deadline from its
//! first byte.

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tern_engine::ServedStats;
use tern_memreg::{MemoryRegistry, RegionIo, RegionSlice, Stage, recv_now};
use tern_metadata::auth::{self, Channel, ClusterSecret, Identity};
use tern_metadata::net::{
    Acceptor, DeadlineRead, Replayed, ServeLimits, Served, bind_listener, is_tick,
};

use crate::TcpConfig;
use crate::wire::{FRAME_ALIGN, HEADER_LEN, Header, OP_READ, OP_WRITE, Status};

/// The body of a rejected write is read and thrown away to keep the stream in step, up to
/// this size; a larger one closes the connection instead.
const MAX_DRAIN: u64 = 256 << 20;

/// Status frames of writes a connection holds back at most, to send with the next.
const HELD_STATUSES: usize = 4;

/// A write's status is held back only while the request behind it, already arrived, is a
/// write at most this long: it delays the held status by that write's body, a few
/// microseconds.
const HOLD_BEHIND: u64 = 256 << 10;

/// The slowest a request body may arrive (or a read reply be taken) on average, on top of
/// the I/O timeout: a peer trickling bytes holds a connection no longer than that allows.
const MIN_BODY_RATE: u64 = 1 << 20;

#[derive(Debug)]
pub(crate) struct Server {
    acceptor: Acceptor,
    counts: Arc<OutcomeCounts>,
}

impl Server {
    pub(crate) fn start(
        ip: IpAddr,
        registry: Arc<MemoryRegistry>,
        config: TcpConfig,
        secret: Option<ClusterSecret>,
        segment: String,
    ) -> io::Result<Self> {
        let listener = bind_listener(ip, config.ports)?;
        // Accepted sockets inherit the listener's buffer sizes.
        crate::size_buffers((&listener).into(), config.socket_buffer_bytes)?;
        let local = listener.local_addr()?;
        let name = format!("tern-tcp-{}", local.port());
        let identity = Identity {
            segment,
            endpoint: local.to_string(),
        };
        let limits = ServeLimits {
            max_connections: config.max_inbound,
            max_opening: config.max_inbound,
            exchange_timeout: config.exchange_timeout,
            frame_deadline: config.io_timeout.min(auth::EXCHANGE_TIMEOUT),
            idle_timeout: config.idle_timeout,
            write_timeout: config.io_timeout,
        };
        let (io_timeout, proto_version) = (config.io_timeout, config.proto_version);
        let counts = Arc::new(OutcomeCounts::default());
        let tallies = counts.clone();
        let serve = move |served: Served| {
            let peer = served.peer.clone();
            let stopping = served.stop_flag();
            let outcome = serve(
                served,
                &registry,
                io_timeout,
                proto_version,
                secret.as_ref(),
                &identity,
                &tallies,
            );
            if let Err(reason) = outcome
                && !stopping.load(Ordering::Acquire)
            {
                tracing::warn!("tcp data connection from {peer} dropped: {reason}");
            }
        };
        let acceptor = Acceptor::serve(listener, &name, limits, Arc::new(serve))?;
        Ok(Self { acceptor, counts })
    }

    pub(crate) fn served(&self) -> ServedStats {
        self.counts.stats()
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.acceptor.local_addr()
    }
}

/// Serves one connection until the peer closes it (`Ok`) or misbehaves (`Err(reason)`).
fn serve(
    mut served: Served,
    registry: &MemoryRegistry,
    io_timeout: Duration,
    proto_version: u8,
    secret: Option<&ClusterSecret>,
    me: &Identity,
    counts: &OutcomeCounts,
) -> Result<(), String> {
    if let Some(secret) = secret {
        // The exchange is one frame: bounded from the first byte by the frame deadline.
        let mut first = [0u8; 1];
        if served.await_frame(&mut first).map_err(|e| e.to_string())? == 0 {
            return Ok(());
        }
        let mut frame = served.frame();
        let mut stream = Replayed::new(&first, &mut frame);
        if let Err(e) = auth::server_handshake(&mut stream, secret, Channel::TcpData, me) {
            return Err(format!("refused, nothing served: {e}"));
        }
        if !served.opened() {
            return Ok(());
        }
    }
    // What arrived beyond the last request: the next headers (a client sends the headers of
    // consecutive reads together) or the start of a write's body, taken in one read.
    let mut staged = Staging::default();
    // Status frames not sent yet (see `keep_holding`).
    let mut held = Held::default();
    // Pinned buffers for device memory, made at the first request for it.
    let mut stage = Stage::new();
    loop {
        if staged.len() < HEADER_LEN {
            staged.compact();
            if staged.is_empty() {
                let got = served.await_frame(staged.spare()).map_err(|e| match e {
                    e if is_tick(&e) => "idle for too long".to_owned(),
                    e => e.to_string(),
                })?;
                if got == 0 {
                    return Ok(());
                }
                staged.end += got;
            }
            if staged.len() < HEADER_LEN {
                read_rest(&mut served.frame(), &mut staged, HEADER_LEN)?;
            }
        }
        if !served.opened() {
            return Ok(());
        }
        let header = Header::decode(staged.peek_header());
        if header.version() > u32::from(proto_version.max(1)) {
            // As a server of that version would: it knows no such opcode.
            return Err(format!(
                "a v{} request to a server that speaks up to v{proto_version}",
                header.version()
            ));
        }
        let frame_len = header.frame_len();
        if staged.len() < frame_len {
            staged.compact();
            read_rest(&mut served.frame(), &mut staged, frame_len)?;
        }
        staged.start += frame_len;
        let deadline = Instant::now()
            + io_timeout
            + Duration::from_secs(header.size.min(MAX_DRAIN) / MIN_BODY_RATE);
        let mut conn = Deadlined {
            stream: &mut served.stream,
            deadline,
            staged: &mut staged,
            held: &mut held,
        };
        let outcome = match serve_request(&mut conn, &header, registry, &mut stage) {
            Ok(outcome) => outcome,
            Err(reason) => {
                // The writes before this request were applied: say so before closing.
                let _ = conn.send_held();
                return Err(reason);
            }
        };
        if !conn.held.is_empty() && !keep_holding(&mut conn) {
            conn.send_held()
                .map_err(|e| format!("{e} sending status frames"))?;
        }
        match outcome {
            RequestOutcome::Read(bytes) => {
                counts.reads.fetch_add(1, Ordering::Relaxed);
                counts.read_bytes.fetch_add(bytes, Ordering::Relaxed);
            }
            RequestOutcome::Wrote(bytes) => {
                counts.writes.fetch_add(1, Ordering::Relaxed);
                counts.write_bytes.fetch_add(bytes, Ordering::Relaxed);
            }
            RequestOutcome::Rejected => {
                counts.rejected.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Status frames of writes that the connection has not sent yet, oldest first.
#[derive(Debug, Default)]
struct Held {
    bytes: Vec<u8>,
    frames: usize,
}

impl Held {
    fn is_empty(&self) -> bool {
        self.frames == 0
    }
}

/// Whether the status frames held (a write's, just applied) may wait for the next request's:
/// only if that request is a short write already arriving, so that the client, busy
/// sending it, gets both frames in one packet and one wake-up instead of two — and a frame
/// is never held while the server would wait for the client. On loopback each status frame
/// sent alone costs the client a wake-up, the most a 64 KiB write paid beyond a plain stream.
fn keep_holding(conn: &mut Deadlined<'_>) -> bool {
    if conn.held.frames >= HELD_STATUSES {
        return false;
    }
    let staged = &mut *conn.staged;
    // Room for the longest header and a byte of its body.
    if staged.len() <= FRAME_ALIGN {
        staged.compact();
        if let Ok(got) = recv_now(conn.stream.as_fd(), staged.spare()) {
            staged.end += got;
        }
    }
    if staged.len() < HEADER_LEN {
        return false;
    }
    // The next write's body has begun to arrive: a client sends a write's body with its
    // header, not after the status of the write before.
    let next = Header::decode(staged.peek_header());
    next.operation() == OP_WRITE
        && next.is_v2()
        && staged.len() > next.frame_len()
        && next.size <= HOLD_BEHIND
}

/// What the server's connections served, summed over all of them (each request costs a
/// syscall or more; two relaxed adds beside that are nothing).
#[derive(Debug, Default)]
pub(crate) struct OutcomeCounts {
    reads: AtomicU64,
    read_bytes: AtomicU64,
    writes: AtomicU64,
    write_bytes: AtomicU64,
    rejected: AtomicU64,
}

impl OutcomeCounts {
    pub(crate) fn stats(&self) -> ServedStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ServedStats {
            reads: get(&self.reads),
            read_bytes: get(&self.read_bytes),
            writes: get(&self.writes),
            write_bytes: get(&self.write_bytes),
            rejected: get(&self.rejected),
        }
    }
}

/// Reads into `staged` within the frame deadline until it holds `need` bytes of header
/// (room for them is behind what it holds).
fn read_rest(
    frame: &mut DeadlineRead<'_, TcpStream>,
    staged: &mut Staging,
    need: usize,
) -> Result<(), String> {
    while staged.len() < need {
        match frame.read(staged.spare()) {
            Ok(0) => {
                return Err(format!(
                    "truncated header ({} of {need} bytes)",
                    staged.len()
                ));
            }
            Ok(n) => staged.end += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_tick(&e) => {
                return Err(format!(
                    "silent mid-header ({} of {need} bytes)",
                    staged.len()
                ));
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(())
}

/// Bytes read off a connection ahead of the request that needs them.
struct Staging {
    buf: Box<[u8; STAGING]>,
    start: usize,
    end: usize,
}

/// How much one read off a connection may take ahead: a page, so that a write's body beyond
/// it goes straight into registered memory.
const STAGING: usize = 4096;

impl Default for Staging {
    fn default() -> Self {
        Self {
            buf: Box::new([0; STAGING]),
            start: 0,
            end: 0,
        }
    }
}

impl Staging {
    fn len(&self) -> usize {
        self.end - self.start
    }

    fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// Moves what is held to the front, making room behind it.
    fn compact(&mut self) {
        self.buf.copy_within(self.start..self.end, 0);
        self.end -= self.start;
        self.start = 0;
    }

    /// The room behind what is held.
    fn spare(&mut self) -> &mut [u8] {
        &mut self.buf[self.end..]
    }

    /// The first [`HEADER_LEN`] bytes held (the caller made sure that many are), left held.
    fn peek_header(&self) -> &[u8; HEADER_LEN] {
        self.buf[self.start..]
            .first_chunk()
            .unwrap_or(&[0; HEADER_LEN])
    }

    fn held(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }
}

/// What [`serve_request`] did with a request the connection survives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOutcome {
    /// Sent this many bytes of registered memory.
    Read(u64),
    /// Took this many bytes into registered memory.
    Wrote(u64),
    /// Refused the range, told the peer so, and kept the stream in step.
    Rejected,
}

/// Serves one request whose header has been read from `conn`: admits it against the
/// registered, remote-accessible memory of `registry` (the server's only admission check) and
/// moves its bytes over `conn` (device memory through `stage`'s pinned buffers, the same
/// admission for both kinds). `Ok` (with what it did) to go on with the next request; `Err`
/// with the reason to close the connection. What the server runs for every request, public
/// so that it can be fuzzed without a socket.
pub fn serve_request<C: RegionIo + Read + Write>(
    conn: &mut C,
    header: &Header,
    registry: &MemoryRegistry,
    stage: &mut Stage,
) -> Result<RequestOutcome, String> {
    let op = header.operation();
    if op != OP_READ && op != OP_WRITE {
        if header.size.to_le_bytes() == auth::MAGIC {
            return Err(
                "the peer wants to authenticate with a cluster secret and this node has none"
                    .into(),
            );
        }
        return Err(format!("unknown opcode {:#04x}", header.opcode));
    }
    let pin = usize::try_from(header.size)
        .ok()
        .zip(usize::try_from(header.addr).ok())
        .ok_or_else(|| "address or size beyond this machine's address space".to_owned())
        .and_then(|(size, addr)| {
            registry
                .pin_remote(addr, size)
                .map_err(|e| e.to_string())
                .map(|pin| (pin, addr, size))
        });
    let io = |e: io::Error| format!("{e} during a {} byte transfer", header.size);
    let status_len = header.status_len();
    let ok = Status::Ok.encode_padded();
    match (op, pin) {
        (OP_READ, Ok((pin, addr, size))) => {
            stage
                .write_prefixed_to(&pin, &ok[..status_len], addr, size, conn)
                .map_err(io)?;
            Ok(RequestOutcome::Read(header.size))
        }
        (_, Ok((pin, addr, size))) => {
            stage.read_exact_from(&pin, addr, size, conn).map_err(io)?;
            conn.write_all(&ok[..status_len]).map_err(io)?;
            Ok(RequestOutcome::Wrote(header.size))
        }
        (_, Err(reason)) if !header.is_v2() => Err(format!(
            "v1 request rejected ({reason}); v1 cannot signal it"
        )),
        (OP_READ, Err(reason)) => {
            tracing::debug!(
                "rejecting read at {:#x}+{}: {reason}",
                header.addr,
                header.size
            );
            conn.write_all(&Status::AddressRejected.encode_padded()[..status_len])
                .map_err(io)?;
            Ok(RequestOutcome::Rejected)
        }
        (_, Err(reason)) => {
            if header.size > MAX_DRAIN {
                return Err(format!(
                    "rejected write of {} bytes is too large to drain ({reason})",
                    header.size
                ));
            }
            tracing::debug!(
                "rejecting write at {:#x}+{}: {reason}",
                header.addr,
                header.size
            );
            let drained = io::copy(&mut conn.take(header.size), &mut io::sink()).map_err(io)?;
            if drained != header.size {
                return Err("peer closed during a rejected write".into());
            }
            conn.write_all(&Status::AddressRejected.encode_padded()[..status_len])
                .map_err(io)?;
            Ok(RequestOutcome::Rejected)
        }
    }
}

/// A served connection under one request's deadline: reads and writes that wake at the
/// socket's tick go on until the deadline, then fail with `TimedOut`. Status frames written
/// to it are held (`held`), and go out before anything else is sent.
struct Deadlined<'a> {
    stream: &'a mut TcpStream,
    deadline: Instant,
    /// Taken before the stream.
    staged: &'a mut Staging,
    held: &'a mut Held,
}

impl Deadlined<'_> {
    /// Sends the held status frames.
    fn send_held(&mut self) -> io::Result<()> {
        let bytes = std::mem::take(&mut self.held.bytes);
        let sent = self.write_through(&bytes);
        self.held.bytes = bytes;
        self.held.bytes.clear();
        self.held.frames = 0;
        sent
    }

    fn write_through(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            match self.retry(|s| s.write(bytes)) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Runs `op` until it does not merely wake at a tick, or the deadline passes.
    fn retry<T>(&mut self, mut op: impl FnMut(&mut TcpStream) -> io::Result<T>) -> io::Result<T> {
        loop {
            match op(self.stream) {
                Err(e) if is_tick(&e) && Instant::now() < self.deadline => {}
                Err(e) if is_tick(&e) => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the request did not move by its deadline",
                    ));
                }
                other => return other,
            }
        }
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !self.staged.is_empty() {
            let n = buf.len().min(self.staged.len());
            buf[..n].copy_from_slice(&self.staged.held()[..n]);
            self.staged.start += n;
            return Ok(n);
        }
        self.retry(|s| s.read(buf))
    }
}

/// What `serve_request` writes is its status frames (a read's data goes by `write_from`):
/// each is held, and `serve` sends it, or keeps it for the next (`keep_holding`).
impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if !buf.is_empty() {
            self.held.bytes.extend_from_slice(buf);
            self.held.frames += 1;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl RegionIo for Deadlined<'_> {
    fn read_into(&mut self, dst: RegionSlice<'_>) -> io::Result<usize> {
        if !self.staged.is_empty() {
            let n = dst.copy_from(self.staged.held());
            self.staged.start += n;
            return Ok(n);
        }
        self.retry(|s| s.read_into(dst))
    }

    fn write_from(&mut self, prefix: &[u8], src: RegionSlice<'_>) -> io::Result<usize> {
        if !self.held.is_empty() {
            self.send_held()?;
        }
        self.retry(|s| s.write_from(prefix, src))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_hands_out_headers_in_order_and_keeps_the_rest() {
        let mut staged = Staging::default();
        let bytes: Vec<u8> = (0..(2 * HEADER_LEN + 5) as u8).collect();
        staged.spare()[..bytes.len()].copy_from_slice(&bytes);
        staged.end += bytes.len();
        assert_eq!(&staged.peek_header()[..], &bytes[..HEADER_LEN]);
        staged.start += HEADER_LEN;
        assert_eq!(
            &staged.peek_header()[..],
            &bytes[HEADER_LEN..2 * HEADER_LEN]
        );
        staged.start += HEADER_LEN;
        assert_eq!(staged.held(), &bytes[2 * HEADER_LEN..]);
        staged.compact();
        assert_eq!(staged.start, 0);
        assert_eq!(staged.held(), &bytes[2 * HEADER_LEN..]);
        assert_eq!(staged.spare().len(), STAGING - 5);
    }
}
