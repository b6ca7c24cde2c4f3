//! Addresses and ports (what a node advertises, how it binds its listeners), the one accept
//! loop every listener runs ([`Acceptor`]), frame deadlines ([`DeadlineRead`]) and the one
//! way to dial a peer ([`dial`]).

use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServeLimits {
    /// Connections served at once; one more is closed at once, with one log line.
    pub max_connections: usize,
    /// A frame (a request header, an RPC frame, an HTTP request) must arrive whole within
    /// this of its first byte, however the bytes trickle in.
    pub frame_deadline: Duration,
    /// How long a connection may sit idle between frames (and before its first).
    pub idle_timeout: Duration,
    /// How long one write may block on a peer that does not read.
    pub write_timeout: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            max_connections: 256,
            frame_deadline: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(30),
        }
    }
}

/// A connection an [`Acceptor`] hands its handler: no Nagle, reads that wake every
/// [`READ_TICK`], writes bounded by the listener's `write_timeout`.
#[derive(Debug)]
pub struct Served {
    /// The connection.
    pub stream: TcpStream,
    /// Who connected, for log lines.
    pub peer: String,
    /// The listener's limits.
    pub limits: ServeLimits,
    stop: Arc<AtomicBool>,
}

impl Served {
    /// Whether the listener is shutting down (its handler should return).
    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// The listener's stop flag, to look at after the connection is gone.
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        self.stop.clone()
    }

    /// Reads the start of a frame into `start` (as much of it as has arrived, at least one
    /// byte), waiting up to the idle timeout; returns how many bytes, 0 when the peer closed
    /// (or the listener stopped) before sending one.
    pub fn await_frame(&mut self, start: &mut [u8]) -> io::Result<usize> {
        let deadline = Instant::now() + self.limits.idle_timeout;
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

    /// The stream, read under a deadline of `frame_deadline` from now: what a handler reads
    /// the rest of a frame through.
    pub fn frame(&mut self) -> DeadlineRead<'_, TcpStream> {
        let deadline = Instant::now() + self.limits.frame_deadline;
        DeadlineRead::new(&mut self.stream, deadline)
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
}

impl<'a, S> DeadlineRead<'a, S> {
    /// Reads of `inner` until `deadline`.
    pub fn new(inner: &'a mut S, deadline: Instant) -> Self {
        Self {
            inner,
            deadline,
            stop: None,
        }
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

/// One accept loop for every listener: a connection limit, connections set up the same way
/// ([`Served`]), one thread each, and on drop every connection cut and every thread joined,
/// so that nothing a listener started outlives it.
#[derive(Debug)]
pub struct Acceptor {
    local: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// What an [`Acceptor`] runs for each connection.
pub type Handler = Arc<dyn Fn(Served) + Send + Sync>;

impl Acceptor {
    /// Serves `listener` on a thread named `name`, running `handler` on a thread of its own
    /// for each connection, at most `limits.max_connections` at once.
    pub fn serve(
        listener: TcpListener,
        name: &str,
        limits: ServeLimits,
        handler: Handler,
    ) -> io::Result<Self> {
        let local = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let conn_name = format!("{name}-conn");
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || accept_loop(listener, &conn_name, limits, &handler, &flag))?;
        Ok(Self {
            local,
            stop,
            thread: Some(thread),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

/// The sockets of live connections (clones, to cut them at shutdown), by connection id.
type Live = Arc<Mutex<Vec<(u64, TcpStream)>>>;

/// How long a new connection waits for a slot when every one is taken: a connection that
/// has sent its last answer holds its slot until its thread ends, a moment after its client
/// (which may already be opening the next connection) has the answer.
const FINISHING_GRACE: Duration = Duration::from_millis(50);

/// Whether fewer than `max` connections are live, now or within `grace`.
fn slot_frees_within(live: &Live, max: usize, grace: Duration) -> bool {
    let until = Instant::now() + grace;
    loop {
        if lock(live).len() < max {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn accept_loop(
    listener: TcpListener,
    conn_name: &str,
    limits: ServeLimits,
    handler: &Handler,
    stop: &Arc<AtomicBool>,
) {
    let live: Live = Arc::default();
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    let mut next_id = 0u64;
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        threads.retain(|t| !t.is_finished());
        let stream = match conn {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!("{conn_name}: accept failed: {e}");
                continue;
            }
        };
        let peer = stream
            .peer_addr()
            .map_or_else(|_| "?".to_owned(), |a| a.to_string());
        if !slot_frees_within(&live, limits.max_connections, FINISHING_GRACE) {
            tracing::warn!(
                "{conn_name}: {} connections already; closing the one from {peer}",
                limits.max_connections
            );
            continue;
        }
        let setup = stream
            .set_nodelay(true)
            .and_then(|()| stream.set_read_timeout(Some(READ_TICK)))
            .and_then(|()| stream.set_write_timeout(Some(limits.write_timeout)))
            .and_then(|()| stream.try_clone());
        let handle = match setup {
            Ok(handle) => handle,
            Err(e) => {
                tracing::warn!("{conn_name}: setting up the connection from {peer}: {e}");
                continue;
            }
        };
        next_id += 1;
        let id = next_id;
        lock(&live).push((id, handle));
        let served = Served {
            stream,
            peer,
            limits,
            stop: stop.clone(),
        };
        let (handler, live_here) = (handler.clone(), live.clone());
        let spawned = std::thread::Builder::new()
            .name(conn_name.to_owned())
            .spawn(move || {
                handler(served);
                lock(&live_here).retain(|(other, _)| *other != id);
            });
        match spawned {
            Ok(thread) => threads.push(thread),
            Err(e) => {
                tracing::warn!("{conn_name}: cannot start a thread: {e}");
                lock(&live).retain(|(other, _)| *other != id);
            }
        }
    }
    // Stopping: cut every connection and wait for its thread, so that no peer is served once
    // the listener is gone.
    for (_, socket) in lock(&live).iter() {
        let _ = socket.shutdown(Shutdown::Both);
    }
    for thread in threads {
        let _ = thread.join();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        wake_acceptor(self.local);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
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
