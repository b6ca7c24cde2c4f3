//! Addresses and ports (what a node advertises, how it binds its listeners), the one accept
//! loop every listener runs ([`Acceptor`]), frame deadlines ([`DeadlineRead`]) and the one
//! way to dial a peer ([`dial`]).

use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::auth::{self, AuthError, Channel, Claims, ClusterSecret};

/// Environment variable that fixes the advertised address (as in Mooncake).
pub const BIND_ADDRESS_ENV: &str = "MC_TCP_BIND_ADDRESS";

/// The default port range for the handshake RPC and the TCP data port (Mooncake's).
pub const DEFAULT_PORT_RANGE: (u16, u16) = (15000, 17000);

/// How many random ports are tried before giving up on a range.
pub const BIND_ATTEMPTS: usize = 500;

/// Where a listener binds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortChoice {
    /// Exactly this port (0 = any port the kernel picks).
    Fixed(u16),
    /// A random free port in `[lo, hi]`, retrying on EADDRINUSE.
    Range(u16, u16),
}

impl Default for PortChoice {
    fn default() -> Self {
        Self::Range(DEFAULT_PORT_RANGE.0, DEFAULT_PORT_RANGE.1)
    }
}

/// Binds a TCP listener on `ip` as `ports` says.
pub fn bind_listener(ip: IpAddr, ports: PortChoice) -> io::Result<TcpListener> {
    match ports {
        PortChoice::Fixed(port) => TcpListener::bind(SocketAddr::new(ip, port)),
        PortChoice::Range(lo, hi) => {
            if lo > hi || lo == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("bad port range {lo}-{hi}"),
                ));
            }
            let span = u64::from(hi - lo) + 1;
            let mut seed = random_seed();
            let mut last = io::Error::from(io::ErrorKind::AddrInUse);
            for _ in 0..BIND_ATTEMPTS {
                seed = xorshift(seed);
                let port = lo + (seed % span) as u16;
                match TcpListener::bind(SocketAddr::new(ip, port)) {
                    Ok(listener) => return Ok(listener),
                    Err(e) if e.kind() == io::ErrorKind::AddrInUse => last = e,
                    Err(e) => return Err(e),
                }
            }
            Err(io::Error::new(
                last.kind(),
                format!("no free port in {lo}-{hi} on {ip} after {BIND_ATTEMPTS} attempts"),
            ))
        }
    }
}

/// How long a blocked read on a served or dialed connection waits before it looks at its
/// deadline again: reads never block longer, so a deadline is kept to within this.
pub const READ_TICK: Duration = Duration::from_millis(250);

/// What every listener holds its clients to.
///
/// A connection first goes through its opening: its first frame (and, with a cluster
/// secret, the proof before it) until its handler says it is in ([`Served::opened`]). Silent
/// or trickling connections only ever hold opening places, which are bounded by
/// [`exchange_timeout`](Self::exchange_timeout) each and given up to newer connections, so
/// they never take a slot of [`max_connections`](Self::max_connections) from a peer that
/// completes its opening.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// Connections served at once past their opening. One more that completes its opening
    /// waits up to 50 ms, on its own thread, for one of them to finish (a connection that
    /// has sent its last answer holds its slot a moment after its client has it), and is
    /// then closed, with one log line.
    pub max_connections: usize,
    /// Connections in their opening at once. A new connection beyond this closes the oldest
    /// of them at once (the accept thread never waits for a place): a newcomer is always
    /// let in, and a place is taken from the connection that has had longest to open.
    pub max_opening: usize,
    /// How long a connection may take from being accepted to the end of its opening; one
    /// that has not completed it by then is closed.
    pub exchange_timeout: Duration,
    /// A frame (a request header, an RPC frame, an HTTP request) must arrive whole within
    /// this of its first byte, however the bytes trickle in.
    pub frame_deadline: Duration,
    /// How long a connection may sit idle between frames (before its first, the exchange
    /// timeout holds).
    pub idle_timeout: Duration,
    /// How long one write may block on a peer that does not read.
    pub write_timeout: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            max_opening: 256,
            exchange_timeout: auth::EXCHANGE_TIMEOUT,
            frame_deadline: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(30),
        }
    }
}

/// A connection an [`Acceptor`] hands its handler: no Nagle (on TCP), reads that wake every
/// [`READ_TICK`], writes bounded by the listener's `write_timeout`, and until its handler
/// calls [`opened`](Self::opened), every read bounded by the exchange timeout from accept.
#[derive(Debug)]
pub struct Served<S = TcpStream> {
    /// The connection.
    pub stream: S,
    /// Who connected, for log lines.
    pub peer: String,
    /// The listener's limits.
    pub limits: ServeLimits,
    stop: Arc<AtomicBool>,
    opening: Opening,
}

impl<S> Served<S> {
    /// Whether the listener is shutting down (its handler should return).
    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// The listener's stop flag, to look at after the connection is gone.
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        self.stop.clone()
    }

    /// Says the connection has completed its opening (its first frame is in, and with a
    /// cluster secret the peer proved it): from now on it holds one of the listener's
    /// `max_connections` slots, and the exchange timeout no longer applies. Waits up to
    /// 50 ms for a slot when all are taken; `false` when none freed (or the connection was
    /// closed meanwhile, for taking too long): the connection is closed and its handler
    /// must return without serving it.
    pub fn opened(&self) -> bool {
        self.opening.open()
    }

    /// Until when the connection may still complete its opening; `None` once it has.
    pub fn opening_deadline(&self) -> Option<Instant> {
        self.opening.deadline()
    }

    /// `deadline`, or the end of the opening if that comes first.
    fn bounded(&self, deadline: Instant) -> Instant {
        self.opening_deadline()
            .map_or(deadline, |opening| opening.min(deadline))
    }
}

impl<S: Read> Served<S> {
    /// Reads the start of a frame into `start` (as much of it as has arrived, at least one
    /// byte), waiting up to the idle timeout (the opening's end, for the first frame);
    /// returns how many bytes, 0 when the peer closed (or the listener stopped, or the
    /// connection was closed for not opening in time) before sending one.
    pub fn await_frame(&mut self, start: &mut [u8]) -> io::Result<usize> {
        let deadline = self.bounded(Instant::now() + self.limits.idle_timeout);
        let stop = self.stop.clone();
        let mut reader = DeadlineRead::new(&mut self.stream, deadline).stop_on(&stop);
        match reader.read(start) {
            Err(e)
                if e.kind() == io::ErrorKind::ConnectionAborted && stop.load(Ordering::Acquire) =>
            {
                Ok(0)
            }
            other => other,
        }
    }

    /// The stream, read under a deadline of `frame_deadline` from now (or the opening's end,
    /// if that comes first): what a handler reads the rest of a frame through.
    pub fn frame(&mut self) -> DeadlineRead<'_, S> {
        let deadline = self.bounded(Instant::now() + self.limits.frame_deadline);
        DeadlineRead {
            inner: &mut self.stream,
            deadline,
            stop: None,
            opening: Some(&self.opening),
        }
    }
}

/// Reads and writes through a stream whose reads wake every [`READ_TICK`], failing with
/// `TimedOut` once `deadline` has passed: a peer that sends one byte a second is cut off at
/// the deadline, not kept alive by its trickle.
#[derive(Debug)]
pub struct DeadlineRead<'a, S> {
    inner: &'a mut S,
    deadline: Instant,
    stop: Option<&'a AtomicBool>,
    opening: Option<&'a Opening>,
}

impl<'a, S> DeadlineRead<'a, S> {
    /// Reads of `inner` until `deadline`.
    pub fn new(inner: &'a mut S, deadline: Instant) -> Self {
        Self {
            inner,
            deadline,
            stop: None,
            opening: None,
        }
    }

    /// For a frame of a served connection ([`Served::frame`]): [`Served::opened`]. Always
    /// `true` for any other stream.
    pub fn opened(&self) -> bool {
        self.opening.is_none_or(Opening::open)
    }

    /// Also gives up (with `ConnectionAborted`) once `stop` is raised.
    pub fn stop_on(self, stop: &'a AtomicBool) -> Self {
        Self {
            stop: Some(stop),
            ..self
        }
    }

    /// The stream underneath.
    pub fn get_mut(&mut self) -> &mut S {
        self.inner
    }

    /// When reads give up.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether the deadline has passed; the error to return if so.
    pub fn check(&self) -> io::Result<()> {
        if self.stop.is_some_and(|s| s.load(Ordering::Acquire)) {
            return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "stopping"));
        }
        if Instant::now() >= self.deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the frame did not arrive by its deadline",
            ));
        }
        Ok(())
    }
}

/// Whether an I/O error is a read that woke at its tick without data.
pub fn is_tick(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

impl<S: Read> Read for DeadlineRead<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            self.check()?;
            match self.inner.read(buf) {
                Err(e) if is_tick(&e) => {}
                other => return other,
            }
        }
    }
}

impl<S: Write> Write for DeadlineRead<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A stream with bytes already read from it put back in front (a frame's first byte, taken
/// while waiting for it).
#[derive(Debug)]
pub struct Replayed<'a, S> {
    first: &'a [u8],
    inner: &'a mut S,
}

impl<'a, S> Replayed<'a, S> {
    /// `first`, then the rest of `inner`.
    pub fn new(first: &'a [u8], inner: &'a mut S) -> Self {
        Self { first, inner }
    }
}

impl<S: Read> Read for Replayed<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.first.is_empty() {
            return self.inner.read(buf);
        }
        self.first.read(buf)
    }
}

impl<S: Write> Write for Replayed<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A listener an [`Acceptor`] serves: a TCP socket, or a Unix one.
pub trait Listen: Send + 'static {
    /// The connections it accepts.
    type Stream: ServeStream;
    /// Its address.
    type Addr: Clone + std::fmt::Debug + Send + Sync + 'static;
    /// Its address, as bound.
    fn address(&self) -> io::Result<Self::Addr>;
    /// Waits for the next connection; returns it and who connected (for log lines).
    fn next_connection(&self) -> io::Result<(Self::Stream, String)>;
    /// Unblocks a thread waiting in `next_connection` on `addr` (by connecting once).
    fn wake(addr: &Self::Addr);
}

/// A connection an [`Acceptor`] serves.
pub trait ServeStream: Read + Write + Send + Sized + 'static {
    /// Sets the connection up as every served one is (no Nagle where there is one, reads
    /// that wake every [`READ_TICK`], writes bounded by `write_timeout`); returns a second
    /// handle to it, to cut it with.
    fn prepare(&self, write_timeout: Duration) -> io::Result<Self>;
    /// Shuts the connection down both ways: a read blocked on it returns at once.
    fn cut(&self);
}

impl Listen for TcpListener {
    type Stream = TcpStream;
    type Addr = SocketAddr;

    fn address(&self) -> io::Result<SocketAddr> {
        self.local_addr()
    }

    fn next_connection(&self) -> io::Result<(TcpStream, String)> {
        let (stream, peer) = self.accept()?;
        Ok((stream, peer.to_string()))
    }

    fn wake(addr: &SocketAddr) {
        wake_acceptor(*addr);
    }
}

impl ServeStream for TcpStream {
    fn prepare(&self, write_timeout: Duration) -> io::Result<Self> {
        self.set_nodelay(true)?;
        self.set_read_timeout(Some(READ_TICK))?;
        self.set_write_timeout(Some(write_timeout))?;
        self.try_clone()
    }

    fn cut(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

impl Listen for UnixListener {
    type Stream = UnixStream;
    type Addr = UnixAddr;

    fn address(&self) -> io::Result<UnixAddr> {
        self.local_addr()
    }

    fn next_connection(&self) -> io::Result<(UnixStream, String)> {
        let (stream, peer) = self.accept()?;
        Ok((stream, format!("{peer:?}")))
    }

    fn wake(addr: &UnixAddr) {
        let _ = UnixStream::connect_addr(addr);
    }
}

impl ServeStream for UnixStream {
    fn prepare(&self, write_timeout: Duration) -> io::Result<Self> {
        self.set_read_timeout(Some(READ_TICK))?;
        self.set_write_timeout(Some(write_timeout))?;
        self.try_clone()
    }

    fn cut(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

/// One accept loop for every listener: the connection limits of [`ServeLimits`] (a budget
/// for connections past their opening, a separate one for connections still in it, and the
/// exchange timeout), connections set up the same way ([`Served`]), one thread each, and on
/// drop every connection cut and every thread joined, so that nothing a listener started
/// outlives it. The accept thread never waits for a slot: a connection over the opening
/// budget takes the place of the oldest still opening, and a thread of its own closes every
/// connection whose opening outlasts the exchange timeout.
pub struct Acceptor<L: Listen = TcpListener> {
    local: L::Addr,
    table: Arc<Table>,
    thread: Option<JoinHandle<()>>,
    reaper: Option<JoinHandle<()>>,
}

impl<L: Listen> std::fmt::Debug for Acceptor<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Acceptor")
            .field("local", &self.local)
            .field("name", &self.table.name)
            .finish_non_exhaustive()
    }
}

/// What an [`Acceptor`] runs for each connection.
pub type Handler<S = TcpStream> = Arc<dyn Fn(Served<S>) + Send + Sync>;

impl Acceptor {
    /// Serves `listener` on a thread named `name`, running `handler` on a thread of its own
    /// for each connection, within `limits`.
    pub fn serve(
        listener: TcpListener,
        name: &str,
        limits: ServeLimits,
        handler: Handler,
    ) -> io::Result<Self> {
        Self::serve_on(listener, name, limits, handler)
    }
}

impl<L: Listen> Acceptor<L> {
    /// [`Acceptor::serve`] for any listener (a Unix socket's, say).
    pub fn serve_on(
        listener: L,
        name: &str,
        limits: ServeLimits,
        handler: Handler<L::Stream>,
    ) -> io::Result<Self> {
        let local = listener.address()?;
        let table = Arc::new(Table {
            slots: Mutex::default(),
            changed: Condvar::new(),
            limits,
            name: name.to_owned(),
            stop: Arc::new(AtomicBool::new(false)),
        });
        let reaping = table.clone();
        let reaper = std::thread::Builder::new()
            .name(format!("{name}-reap"))
            .spawn(move || reap(&reaping))?;
        let serving = table.clone();
        let conn_name = format!("{name}-conn");
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || accept_loop(&listener, &conn_name, &serving, &handler));
        let mut acceptor = Self {
            local,
            table,
            thread: None,
            reaper: Some(reaper),
        };
        // On an error the reaper is stopped and joined by the drop.
        acceptor.thread = Some(thread?);
        Ok(acceptor)
    }

    /// The bound address.
    pub fn local_addr(&self) -> L::Addr {
        self.local.clone()
    }
}

/// How long a connection that has completed its opening waits for a slot when every one
/// is taken: a connection that has sent its last answer holds its slot until its thread
/// ends, a moment after its client (which may already be opening the next connection) has
/// the answer. The connection waits on its own thread, never the accept thread.
const FINISHING_GRACE: Duration = Duration::from_millis(50);

/// At most one log line a second about each kind of connection closed for the limits: a
/// flood of them would otherwise flood the log.
const QUIET: Duration = Duration::from_secs(1);

/// The connections of one listener and its limits, shared by its accept thread, its reaper
/// and its connections.
struct Table {
    slots: Mutex<Slots>,
    /// Raised whenever a connection leaves, opens or is closed, and when a new one arrives.
    changed: Condvar,
    limits: ServeLimits,
    name: String,
    stop: Arc<AtomicBool>,
}

#[derive(Default)]
struct Slots {
    /// Live connections, oldest first.
    conns: Vec<Conn>,
    opening: usize,
    open: usize,
    /// Log lines held back (see [`QUIET`]).
    displaced: Quiet,
    expired: Quiet,
    refused: Quiet,
}

/// A live connection.
struct Conn {
    id: u64,
    phase: Phase,
    /// When its opening must be complete.
    deadline: Instant,
    peer: String,
    cut: Box<dyn Fn() + Send>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Opening,
    Open,
    /// Cut by the listener; its thread has not ended yet.
    Cut,
}

impl Slots {
    fn position(&self, id: u64) -> Option<usize> {
        self.conns.iter().position(|c| c.id == id)
    }

    /// Cuts the connection at `at`; it stops counting against the limits at once (its
    /// thread, whose read the cut ends, removes it).
    fn cut(&mut self, at: usize) {
        let conn = &mut self.conns[at];
        match conn.phase {
            Phase::Opening => self.opening -= 1,
            Phase::Open => self.open -= 1,
            Phase::Cut => return,
        }
        conn.phase = Phase::Cut;
        (conn.cut)();
    }

    fn remove(&mut self, id: u64) {
        if let Some(at) = self.position(id) {
            match self.conns[at].phase {
                Phase::Opening => self.opening -= 1,
                Phase::Open => self.open -= 1,
                Phase::Cut => {}
            }
            self.conns.remove(at);
        }
    }
}

/// Counts events whose log line is held back.
#[derive(Default)]
struct Quiet {
    last: Option<Instant>,
    held: u64,
}

impl Quiet {
    /// One more event: `Some(events since the last line)` when a line is due.
    fn note(&mut self, events: u64) -> Option<u64> {
        self.held += events;
        let now = Instant::now();
        if self
            .last
            .is_some_and(|last| now.duration_since(last) < QUIET)
        {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.held))
    }
}

/// A served connection's place in its listener's table, until its handler returns.
struct Opening {
    table: Arc<Table>,
    id: u64,
    deadline: Instant,
    done: AtomicBool,
}

impl std::fmt::Debug for Opening {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opening")
            .field("id", &self.id)
            .field("deadline", &self.deadline)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl Opening {
    fn deadline(&self) -> Option<Instant> {
        (!self.done.load(Ordering::Acquire)).then_some(self.deadline)
    }

    fn open(&self) -> bool {
        if self.done.load(Ordering::Acquire) {
            return true;
        }
        let table = &*self.table;
        let max = table.limits.max_connections;
        let until = (Instant::now() + FINISHING_GRACE).min(self.deadline);
        let mut slots = lock(&table.slots);
        loop {
            let Some(at) = slots
                .position(self.id)
                .filter(|&at| slots.conns[at].phase == Phase::Opening)
            else {
                return false;
            };
            if slots.open < max {
                slots.conns[at].phase = Phase::Open;
                slots.opening -= 1;
                slots.open += 1;
                self.done.store(true, Ordering::Release);
                return true;
            }
            let now = Instant::now();
            if now >= until {
                if let Some(more) = slots.refused.note(1) {
                    tracing::warn!(
                        "{}: {max} connections already; closing the one from {}{}",
                        table.name,
                        slots.conns[at].peer,
                        also(more - 1)
                    );
                }
                slots.cut(at);
                table.changed.notify_all();
                return false;
            }
            slots = table
                .changed
                .wait_timeout(slots, until - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// The tail of a log line that stands for others held back.
fn also(held: u64) -> String {
    if held == 0 {
        String::new()
    } else {
        format!(" ({held} more like it since the last line)")
    }
}

fn accept_loop<L: Listen>(
    listener: &L,
    conn_name: &str,
    table: &Arc<Table>,
    handler: &Handler<L::Stream>,
) {
    let limits = table.limits;
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    let mut next_id = 0u64;
    loop {
        let accepted = listener.next_connection();
        if table.stop.load(Ordering::Acquire) {
            break;
        }
        threads.retain(|t| !t.is_finished());
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!("{conn_name}: accept failed: {e}");
                continue;
            }
        };
        let handle = match stream.prepare(limits.write_timeout) {
            Ok(handle) => handle,
            Err(e) => {
                tracing::warn!("{conn_name}: setting up the connection from {peer}: {e}");
                continue;
            }
        };
        next_id += 1;
        let id = next_id;
        let deadline = Instant::now() + limits.exchange_timeout;
        {
            let mut slots = lock(&table.slots);
            if slots.opening >= limits.max_opening.max(1)
                && let Some(oldest) = slots.conns.iter().position(|c| c.phase == Phase::Opening)
            {
                if let Some(more) = slots.displaced.note(1) {
                    tracing::warn!(
                        "{}: {} connections still opening; closing the oldest, from {}, for \
                         the one from {peer}{}",
                        table.name,
                        limits.max_opening,
                        slots.conns[oldest].peer,
                        also(more - 1)
                    );
                }
                slots.cut(oldest);
            }
            slots.conns.push(Conn {
                id,
                phase: Phase::Opening,
                deadline,
                peer: peer.clone(),
                cut: Box::new(move || handle.cut()),
            });
            slots.opening += 1;
        }
        table.changed.notify_all();
        let served = Served {
            stream,
            peer,
            limits,
            stop: table.stop.clone(),
            opening: Opening {
                table: table.clone(),
                id,
                deadline,
                done: AtomicBool::new(false),
            },
        };
        let (handler, table_here) = (handler.clone(), table.clone());
        let spawned = std::thread::Builder::new()
            .name(conn_name.to_owned())
            .spawn(move || {
                handler(served);
                lock(&table_here.slots).remove(id);
                table_here.changed.notify_all();
            });
        match spawned {
            Ok(thread) => threads.push(thread),
            Err(e) => {
                tracing::warn!("{conn_name}: cannot start a thread: {e}");
                lock(&table.slots).remove(id);
            }
        }
    }
    // Stopping: cut every connection and wait for its thread, so that no peer is served once
    // the listener is gone.
    for conn in lock(&table.slots).conns.iter() {
        (conn.cut)();
    }
    table.changed.notify_all();
    for thread in threads {
        let _ = thread.join();
    }
}

/// Closes every connection still opening past its deadline, as the deadlines come, until
/// the listener stops.
fn reap(table: &Table) {
    let mut slots = lock(&table.slots);
    loop {
        if table.stop.load(Ordering::Acquire) {
            return;
        }
        let now = Instant::now();
        let mut expired = 0;
        let mut next: Option<Instant> = None;
        for at in 0..slots.conns.len() {
            let (phase, deadline) = (slots.conns[at].phase, slots.conns[at].deadline);
            if phase != Phase::Opening {
                continue;
            }
            if deadline <= now {
                slots.cut(at);
                expired += 1;
            } else {
                next = Some(next.map_or(deadline, |n| n.min(deadline)));
            }
        }
        if expired > 0 {
            if let Some(closed) = slots.expired.note(expired) {
                tracing::warn!(
                    "{}: closed {closed} connection(s) that did not complete their opening \
                     within {:?} of being accepted",
                    table.name,
                    table.limits.exchange_timeout
                );
            }
            table.changed.notify_all();
        }
        let wait = next.map_or(Duration::from_secs(1), |n| n.saturating_duration_since(now));
        slots = table
            .changed
            .wait_timeout(slots, wait)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl<L: Listen> Drop for Acceptor<L> {
    fn drop(&mut self) {
        self.table.stop.store(true, Ordering::Release);
        // Under the lock, so that the reaper is either waiting (and woken) or sees the flag.
        drop(lock(&self.table.slots));
        self.table.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            L::wake(&self.local);
            let _ = thread.join();
        }
        if let Some(reaper) = self.reaper.take() {
            let _ = reaper.join();
        }
    }
}

/// Why dialing a peer failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DialError {
    /// The name did not resolve.
    #[error("cannot resolve: {0}")]
    Dns(io::Error),
    /// No address accepted the connection in time.
    #[error("connect: {0}")]
    Connect(io::Error),
    /// The connection could not be set up.
    #[error("setting up the connection: {0}")]
    Setup(io::Error),
    /// The cluster-secret exchange failed.
    #[error("authentication failed: {0}")]
    Auth(AuthError),
}

/// How to reach a peer.
#[derive(Debug, Clone, Copy)]
pub struct Dial<'a> {
    /// `host:port`.
    pub endpoint: &'a str,
    /// Bound on connecting, authentication included.
    pub connect_timeout: Duration,
    /// With a secret: the channel, this node's segment, and the segment wanted there (empty
    /// when any will do). The endpoint bound is the address actually connected.
    pub auth: Option<DialAuth<'a>>,
}

/// The cluster-secret part of a [`Dial`].
#[derive(Debug, Clone, Copy)]
pub struct DialAuth<'a> {
    /// The secret.
    pub secret: &'a ClusterSecret,
    /// Which kind of connection.
    pub channel: Channel,
    /// This node's segment name.
    pub client_segment: &'a str,
    /// The segment wanted at the endpoint.
    pub server_segment: &'a str,
}

/// Connects to `dial.endpoint` (each resolved address in turn), turns Nagle off, runs the
/// cluster-secret exchange if asked to (bounded by the connect timeout), and leaves reads
/// bounded by `io_timeout`: the one way Tern opens a connection to a peer.
pub fn dial(dial: &Dial<'_>, io_timeout: Duration) -> Result<TcpStream, DialError> {
    let addrs: Vec<SocketAddr> = dial
        .endpoint
        .to_socket_addrs()
        .map_err(DialError::Dns)?
        .collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    for addr in addrs {
        let mut stream = match TcpStream::connect_timeout(&addr, dial.connect_timeout) {
            Ok(stream) => stream,
            Err(e) => {
                last = e;
                continue;
            }
        };
        stream.set_nodelay(true).map_err(DialError::Setup)?;
        if let Some(auth) = dial.auth {
            let bound = Some(dial.connect_timeout.min(io_timeout));
            stream
                .set_read_timeout(bound)
                .and_then(|()| stream.set_write_timeout(bound))
                .map_err(DialError::Setup)?;
            let claims = Claims {
                client_segment: auth.client_segment.to_owned(),
                server_segment: auth.server_segment.to_owned(),
                dialed: addr.to_string(),
            };
            auth::client_handshake(&mut stream, auth.secret, auth.channel, claims)
                .map_err(DialError::Auth)?;
        }
        stream
            .set_read_timeout(Some(io_timeout))
            .and_then(|()| stream.set_write_timeout(Some(io_timeout)))
            .map_err(DialError::Setup)?;
        return Ok(stream);
    }
    Err(DialError::Connect(last))
}

/// Unblocks a thread sitting in `accept` on `local` by connecting to it once.
pub fn wake_acceptor(local: SocketAddr) {
    let mut target = local;
    if target.ip().is_unspecified() {
        target.set_ip(IpAddr::from([127, 0, 0, 1]));
    }
    let _ = TcpStream::connect_timeout(&target, Duration::from_secs(1));
}

fn random_seed() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let stack_addr = &nanos as *const u64 as u64;
    (nanos ^ u64::from(std::process::id()).rotate_left(32) ^ stack_addr) | 1
}

fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// The host part of `host:port`, `[v6]:port` or a bare host.
pub fn host_part(name: &str) -> &str {
    if let Some(rest) = name.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match name.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.parse::<u16>().is_ok() => host,
        _ => name,
    }
}

/// Splits `host:port`; `None` when there is no valid port.
pub fn split_host_port(name: &str) -> Option<(&str, u16)> {
    let (host, port) = name.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = port.parse().ok()?;
    (!host.is_empty()).then_some((host, port))
}

/// The address a node advertises: `configured` (builder, or `MC_TCP_BIND_ADDRESS`) when set;
/// else the host part of `local_server_name` when that is an IP address; else the first
/// up, non-loopback IPv4 interface address (IPv6 if there is no IPv4), as Mooncake does.
pub fn advertised_ip(configured: Option<&str>, local_server_name: &str) -> io::Result<IpAddr> {
    if let Some(addr) = configured.filter(|a| !a.is_empty()) {
        return addr.parse().map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("advertised address {addr:?} is not an IP address"),
            )
        });
    }
    if let Ok(ip) = host_part(local_server_name).parse::<IpAddr>() {
        return Ok(ip);
    }
    first_non_loopback_ip()
}

fn first_non_loopback_ip() -> io::Result<IpAddr> {
    let interfaces = if_addrs::get_if_addrs()?;
    let candidates: Vec<IpAddr> = interfaces
        .iter()
        .filter(|i| !i.is_loopback() && i.is_oper_up())
        .map(|i| i.ip())
        .filter(|ip| !ip.is_unspecified())
        .collect();
    candidates
        .iter()
        .find(|ip| ip.is_ipv4())
        .or_else(|| candidates.first())
        .copied()
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("no non-loopback interface is up; set {BIND_ADDRESS_ENV}"),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn host_parts() {
        assert_eq!(host_part("127.0.0.1:15000"), "127.0.0.1");
        assert_eq!(host_part("node-a"), "node-a");
        assert_eq!(host_part("[::1]:80"), "::1");
        assert_eq!(host_part("::1"), "::1");
        assert_eq!(
            split_host_port("127.0.0.1:15000"),
            Some(("127.0.0.1", 15000))
        );
        assert_eq!(split_host_port("node"), None);
        assert_eq!(split_host_port(":5"), None);
        assert_eq!(split_host_port("h:99999"), None);
    }

    #[test]
    fn advertised_address_prefers_configuration_then_the_server_name() {
        assert_eq!(
            advertised_ip(Some("127.0.0.2"), "10.1.1.1:5").unwrap(),
            IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2))
        );
        assert_eq!(
            advertised_ip(None, "127.0.0.3:5").unwrap(),
            IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3))
        );
        assert!(advertised_ip(Some("not-an-ip"), "x").is_err());
        if let Ok(ip) = advertised_ip(None, "a-host-name") {
            assert!(!ip.is_loopback());
        }
    }

    #[test]
    fn range_binding_retries_past_ports_in_use() {
        let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let first = bind_listener(ip, PortChoice::Range(17990, 17991)).unwrap();
        let second = bind_listener(ip, PortChoice::Range(17990, 17991)).unwrap();
        assert_ne!(first.local_addr().unwrap(), second.local_addr().unwrap());
        // The range is now full: the third bind gives up with a clear error.
        let err = bind_listener(ip, PortChoice::Range(17990, 17991)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        assert!(bind_listener(ip, PortChoice::Range(5, 4)).is_err());
    }
}
