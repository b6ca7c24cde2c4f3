//! The data server: with a cluster secret, refuses every connection whose peer does not prove
//! it knows it (before a header is read); then checks every request against registered memory
//! and moves the bytes.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use tern_memreg::MemoryRegistry;
use tern_metadata::auth::{self, Channel, ClusterSecret};
use tern_metadata::net::{Acceptor, bind_listener};

use crate::TcpConfig;
use crate::wire::{HEADER_LEN, Header, OP_READ, OP_WRITE, Status};

/// The body of a rejected write is read and thrown away to keep the stream in step, up to
/// this size; a larger one closes the connection instead.
const MAX_DRAIN: u64 = 256 << 20;

#[derive(Debug)]
pub(crate) struct Server {
    acceptor: Acceptor,
}

impl Server {
    pub(crate) fn start(
        ip: IpAddr,
        registry: Arc<MemoryRegistry>,
        config: TcpConfig,
        secret: Option<ClusterSecret>,
        stop: Arc<AtomicBool>,
    ) -> io::Result<Self> {
        let listener = bind_listener(ip, config.ports)?;
        let name = format!("tern-tcp-{}", listener.local_addr()?.port());
        let flag = stop.clone();
        let acceptor = Acceptor::spawn(listener, name, stop, move |listener| {
            accept_loop(listener, registry, config, secret, flag)
        })?;
        Ok(Self { acceptor })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.acceptor.local_addr()
    }
}

/// Inbound connections: a clone of each socket (to shut it down) and its thread.
#[derive(Default)]
struct Connections {
    sockets: Mutex<Vec<(u64, TcpStream)>>,
}

fn accept_loop(
    listener: TcpListener,
    registry: Arc<MemoryRegistry>,
    config: TcpConfig,
    secret: Option<ClusterSecret>,
    stop: Arc<AtomicBool>,
) {
    let active = Arc::new(AtomicUsize::new(0));
    let connections = Arc::new(Connections::default());
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
                tracing::warn!("tcp data accept failed: {e}");
                continue;
            }
        };
        if active.load(Ordering::Acquire) >= config.max_inbound {
            tracing::warn!(
                "tcp data server at {} connections; closing a new one",
                config.max_inbound
            );
            continue;
        }
        let Ok(handle) = stream.try_clone() else {
            continue;
        };
        next_id += 1;
        let id = next_id;
        lock(&connections.sockets).push((id, handle));
        active.fetch_add(1, Ordering::AcqRel);
        let (registry, config, secret, stop, active, connections) = (
            registry.clone(),
            config.clone(),
            secret.clone(),
            stop.clone(),
            active.clone(),
            connections.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("tern-tcp-conn".into())
            .spawn(move || {
                let peer = stream
                    .peer_addr()
                    .map_or_else(|_| "?".to_owned(), |a| a.to_string());
                if let Err(reason) = serve(stream, &registry, &config, secret.as_ref(), &stop)
                    && !stop.load(Ordering::Acquire)
                {
                    tracing::warn!("tcp data connection from {peer} dropped: {reason}");
                }
                lock(&connections.sockets).retain(|(other, _)| *other != id);
                active.fetch_sub(1, Ordering::AcqRel);
            });
        match spawned {
            Ok(thread) => threads.push(thread),
            Err(e) => tracing::warn!("tcp data server cannot spawn a thread: {e}"),
        }
    }
    // Stopping: cut every inbound connection and wait for its thread, so that no peer
    // touches registered memory once the transport has shut down.
    for (_, socket) in lock(&connections.sockets).iter() {
        let _ = socket.shutdown(Shutdown::Both);
    }
    for thread in threads {
        let _ = thread.join();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Serves one connection until the peer closes it (`Ok`) or misbehaves (`Err(reason)`).
fn serve(
    mut stream: TcpStream,
    registry: &MemoryRegistry,
    config: &TcpConfig,
    secret: Option<&ClusterSecret>,
    stop: &AtomicBool,
) -> Result<(), String> {
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    stream
        .set_write_timeout(Some(config.io_timeout))
        .map_err(|e| e.to_string())?;
    if let Some(secret) = secret {
        // A peer that never speaks holds its slot no longer than the exchange's bound.
        stream
            .set_read_timeout(Some(config.io_timeout.min(auth::EXCHANGE_TIMEOUT)))
            .map_err(|e| e.to_string())?;
        match auth::server_handshake(&mut stream, secret, Channel::TcpData) {
            Ok(()) => {}
            Err(e) if e.is_silent_close() => return Ok(()),
            Err(e) => return Err(format!("refused, nothing served: {e}")),
        }
    }
    loop {
        if stop.load(Ordering::Acquire) {
            return Ok(());
        }
        stream
            .set_read_timeout(Some(config.idle_timeout))
            .map_err(|e| e.to_string())?;
        let Some(header) = read_header(&mut stream)? else {
            return Ok(());
        };
        stream
            .set_read_timeout(Some(config.io_timeout))
            .map_err(|e| e.to_string())?;
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
        match (op, pin) {
            (OP_READ, Ok((pin, addr, size))) => {
                let status = Status::Ok.encode();
                let prefix: &[u8] = if header.is_v2() { &status } else { &[] };
                pin.write_prefixed_to(prefix, addr, size, &mut stream)
                    .map_err(io)?;
            }
            (_, Ok((pin, addr, size))) => {
                pin.read_exact_from(addr, size, &mut stream).map_err(io)?;
                if header.is_v2() {
                    stream.write_all(&Status::Ok.encode()).map_err(io)?;
                }
            }
            (_, Err(reason)) if !header.is_v2() => {
                return Err(format!(
                    "v1 request rejected ({reason}); v1 cannot signal it"
                ));
            }
            (OP_READ, Err(reason)) => {
                tracing::debug!(
                    "rejecting read at {:#x}+{}: {reason}",
                    header.addr,
                    header.size
                );
                stream
                    .write_all(&Status::AddressRejected.encode())
                    .map_err(io)?;
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
                let drained =
                    io::copy(&mut (&mut stream).take(header.size), &mut io::sink()).map_err(io)?;
                if drained != header.size {
                    return Err("peer closed during a rejected write".into());
                }
                stream
                    .write_all(&Status::AddressRejected.encode())
                    .map_err(io)?;
            }
        }
    }
}

/// Reads a header; `None` when the peer closed cleanly between requests.
fn read_header(stream: &mut TcpStream) -> Result<Option<Header>, String> {
    let mut bytes = [0u8; HEADER_LEN];
    let mut filled = 0;
    while filled < HEADER_LEN {
        match stream.read(&mut bytes[filled..]) {
            Ok(0) if filled == 0 => return Ok(None),
            Ok(0) => return Err(format!("truncated header ({filled} of {HEADER_LEN} bytes)")),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(if filled == 0 {
                    "idle for too long".to_owned()
                } else {
                    format!("silent mid-header ({filled} of {HEADER_LEN} bytes)")
                });
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(Some(Header::decode(&bytes)))
}
