//! The client side: a pool of persistent connections per peer, each with one worker thread
//! taking slices from the pool's queue, so slices stripe across connections.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use tern_engine::{Opcode, PeerState, PeerStats, Slice, TransferError};
use tern_metadata::auth::{self, Channel, ClusterSecret};

use crate::TcpConfig;
use crate::wire::{Header, OP_READ, OP_V2, OP_WRITE, Status};

/// After a failed connect, further slices to the same peer fail at once for this long
/// instead of each waiting for its own connect timeout.
const FAST_FAIL: Duration = Duration::from_millis(100);

#[derive(Debug)]
pub(crate) struct Pool {
    sender: Mutex<Option<Sender<Slice>>>,
    shared: Arc<PoolShared>,
    lanes: Mutex<Vec<JoinHandle<()>>>,
}

#[derive(Debug)]
struct PoolShared {
    endpoint: String,
    config: TcpConfig,
    /// Proved to the peer on every new connection, before the first request.
    secret: Option<ClusterSecret>,
    stop: Arc<AtomicBool>,
    last_connect_failure: Mutex<Option<(Instant, String)>>,
    /// The last failure with this peer (connecting, or a connection breaking), for stats.
    last_error: Mutex<Option<String>>,
    /// A clone of each lane's current connection, so shutdown can cut I/O in progress.
    open: Mutex<Vec<Option<TcpStream>>>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl Pool {
    pub(crate) fn start(
        endpoint: String,
        config: TcpConfig,
        secret: Option<ClusterSecret>,
        stop: Arc<AtomicBool>,
    ) -> Arc<Self> {
        let (sender, receiver) = crossbeam_channel::unbounded();
        let lane_count = config_lanes(&config);
        let shared = Arc::new(PoolShared {
            endpoint,
            config,
            secret,
            stop,
            last_connect_failure: Mutex::new(None),
            last_error: Mutex::new(None),
            open: Mutex::new((0..lane_count).map(|_| None).collect()),
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
            shared,
            lanes: Mutex::new(lanes),
        })
    }

    pub(crate) fn push(&self, slice: Slice) {
        let sender = self.sender.lock().unwrap_or_else(|p| p.into_inner());
        match sender.as_ref() {
            Some(sender) => {
                if let Err(returned) = sender.send(slice) {
                    returned
                        .into_inner()
                        .fail(TransferError::Dropped("TCP lanes have stopped".into()));
                }
            }
            None => slice.fail(TransferError::Dropped("TCP transport shut down".into())),
        }
    }

    /// How this peer stands: open connections, and the last failure.
    pub(crate) fn peer_stats(&self) -> PeerStats {
        let endpoints = lock(&self.shared.open).iter().flatten().count();
        let last_error = lock(&self.shared.last_error).clone();
        PeerStats {
            peer: self.shared.endpoint.clone(),
            state: PeerState::of(endpoints, 0, last_error.is_some()),
            endpoints,
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

/// Most slices one lane sends before reading their replies.
const PIPELINE_SLICES: usize = 32;
/// Most bytes one lane has in flight.
const PIPELINE_BYTES: usize = 8 << 20;

fn config_lanes(config: &TcpConfig) -> usize {
    config.connections_per_peer.max(1)
}

fn lane_loop(shared: &PoolShared, lane: usize, receiver: &Receiver<Slice>) {
    let mut connection: Option<TcpStream> = None;
    let mut last_used = Instant::now();
    let mut group: Vec<Slice> = Vec::with_capacity(PIPELINE_SLICES);
    while let Ok(first) = receiver.recv() {
        let mut bytes = first.len;
        group.push(first);
        while group.len() < PIPELINE_SLICES && bytes < PIPELINE_BYTES {
            match receiver.try_recv() {
                Ok(slice) => {
                    bytes += slice.len;
                    group.push(slice);
                }
                Err(_) => break,
            }
        }
        let mut live = Vec::with_capacity(group.len());
        for slice in group.drain(..) {
            if shared.stop.load(Ordering::Acquire) {
                slice.fail(TransferError::Dropped("TCP transport shut down".into()));
            } else if slice.is_live() {
                live.push(slice);
            } else {
                slice.abandon();
            }
        }
        if live.is_empty() {
            continue;
        }
        if connection.is_some()
            && last_used.elapsed() > IDLE_CHECK
            && !still_open(connection.as_ref())
        {
            connection = None;
        }
        last_used = Instant::now();
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
                    for slice in live {
                        slice.fail(TransferError::Connection {
                            peer: shared.endpoint.clone(),
                            message: message.clone(),
                        });
                    }
                    continue;
                }
            },
        };
        if !run_pipelined(shared, stream, live) {
            connection = None;
            lock(&shared.open)[lane] = None;
        }
    }
}

/// A connection unused for longer than this is checked before reuse: the server may have
/// closed it for idleness, and a request sent into a closed connection would fail.
const IDLE_CHECK: Duration = Duration::from_millis(50);

/// Whether the peer has not closed `stream` (nothing may be pending on it between requests).
fn still_open(stream: Option<&TcpStream>) -> bool {
    let Some(stream) = stream else {
        return false;
    };
    if stream.set_nonblocking(true).is_err() {
        return false;
    }
    let alive =
        matches!(stream.peek(&mut [0u8; 1]), Err(ref e) if e.kind() == io::ErrorKind::WouldBlock);
    alive && stream.set_nonblocking(false).is_ok()
}

/// Sends every request of `slices`, then takes the replies in order (the server answers a
/// connection's requests one after another). Returns whether the connection is still good.
fn run_pipelined(shared: &PoolShared, stream: &mut TcpStream, slices: Vec<Slice>) -> bool {
    let v2 =
        |slice: &Slice| shared.config.proto_version >= 2 && slice.peer.desc.tcp_proto_version >= 2;
    let mut sent = 0;
    let mut send_error = None;
    for slice in &slices {
        if let Err(e) = send_request(stream, slice, v2(slice)) {
            send_error = Some(e);
            break;
        }
        sent += 1;
    }
    let mut replies = slices.into_iter();
    let connection_failed = |slice: Slice, e: &io::Error| {
        slice.fail(TransferError::Connection {
            peer: shared.endpoint.clone(),
            message: format!("{e} (mid-transfer)"),
        });
    };
    for slice in replies.by_ref().take(sent) {
        match receive_reply(stream, &slice, v2(&slice)) {
            Ok(()) => slice.complete(),
            Err(Failure::Rejected) => {
                let error = TransferError::RemoteRejected {
                    peer: shared.endpoint.clone(),
                    addr: slice.remote_addr,
                    len: slice.len,
                };
                slice.fail(error);
            }
            Err(Failure::Protocol(message)) => {
                slice.fail(TransferError::Protocol {
                    peer: shared.endpoint.clone(),
                    message,
                });
                send_error = Some(io::Error::other("protocol error"));
                break;
            }
            Err(Failure::Io(e)) => {
                connection_failed(slice, &e);
                send_error = Some(e);
                break;
            }
        }
    }
    match send_error {
        None => true,
        Some(e) => {
            *lock(&shared.last_error) = Some(format!("{e} (mid-transfer)"));
            for slice in replies {
                connection_failed(slice, &e);
            }
            false
        }
    }
}

impl PoolShared {
    fn connect(&self) -> Result<TcpStream, String> {
        {
            let last = self
                .last_connect_failure
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if let Some((at, message)) = last.as_ref().filter(|(at, _)| at.elapsed() < FAST_FAIL) {
                return Err(format!("{message} ({} ms ago)", at.elapsed().as_millis()));
            }
        }
        let result = self.try_connect();
        let mut last = self
            .last_connect_failure
            .lock()
            .unwrap_or_else(|p| p.into_inner());
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
        let addrs: Vec<SocketAddr> = self
            .endpoint
            .to_socket_addrs()
            .map_err(|e| format!("cannot resolve: {e}"))?
            .collect();
        let mut last = "no address".to_owned();
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, self.config.connect_timeout) {
                Ok(mut stream) => {
                    stream.set_nodelay(true).map_err(|e| e.to_string())?;
                    if let Some(secret) = &self.secret {
                        // Part of connecting: bounded like it, before any request leaves.
                        let bound = Some(self.config.connect_timeout.min(self.config.io_timeout));
                        stream
                            .set_read_timeout(bound)
                            .and_then(|()| stream.set_write_timeout(bound))
                            .map_err(|e| e.to_string())?;
                        auth::client_handshake(&mut stream, secret, Channel::TcpData)
                            .map_err(|e| format!("authentication failed: {e}"))?;
                    }
                    let setup = stream
                        .set_read_timeout(Some(self.config.io_timeout))
                        .and_then(|()| stream.set_write_timeout(Some(self.config.io_timeout)));
                    return setup.map(|()| stream).map_err(|e| e.to_string());
                }
                Err(e) => last = format!("connect: {e}"),
            }
        }
        Err(last)
    }
}

enum Failure {
    Rejected,
    Protocol(String),
    Io(io::Error),
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

fn send_request(stream: &mut TcpStream, slice: &Slice, v2: bool) -> io::Result<()> {
    let op = match slice.opcode {
        Opcode::Read => OP_READ,
        Opcode::Write => OP_WRITE,
    };
    let header = Header {
        size: slice.len as u64,
        addr: slice.remote_addr,
        opcode: if v2 { op | OP_V2 } else { op },
    }
    .encode();
    match slice.opcode {
        Opcode::Write => {
            slice
                .local
                .write_prefixed_to(&header, slice.local_addr, slice.len, stream)
        }
        Opcode::Read => stream.write_all(&header),
    }
}

fn receive_reply(stream: &mut TcpStream, slice: &Slice, v2: bool) -> Result<(), Failure> {
    if v2 {
        read_status(stream)?;
    }
    if slice.opcode == Opcode::Read {
        slice
            .local
            .read_exact_from(slice.local_addr, slice.len, stream)?;
    }
    Ok(())
}

fn read_status(stream: &mut TcpStream) -> Result<(), Failure> {
    let mut frame = [0u8; 8];
    stream.read_exact(&mut frame)?;
    match Status::decode(frame) {
        Ok(Status::Ok) => Ok(()),
        Ok(Status::AddressRejected) => Err(Failure::Rejected),
        Err(raw) => Err(Failure::Protocol(format!(
            "unknown status frame {raw:#018x}"
        ))),
    }
}
