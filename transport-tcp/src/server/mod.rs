//! The data server: with a cluster secret, refuses every connection whose peer does not prove
//! it knows it (before a header is read); then checks every request against registered memory
//! and moves the bytes. Connections are accepted, limited and joined by the one
//! [`Acceptor`]: a connection that has not sent its first request header (with a secret:
//! its proof) within the exchange timeout of being accepted is closed, and only one past
//! that holds one of `max_inbound` slots; a request must arrive within its deadline from its
//! first byte.
//!
//! The admission path is [`serve`] (check the peer, read a header) and
//! [`serve_request`] (pin the range, copy). Beside it: [`staging`] (bytes read ahead of the
//! request that needs them), [`deadlined`] (a connection under one request's deadline),
//! [`held`] (a speed trick: write statuses held back to go out in pairs), [`replies`] (a
//! speed trick: the replies of reads that arrived together sent together) and [`counts`].

mod counts;
mod deadlined;
mod held;
mod replies;
mod request;
mod staging;

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tern_engine::ServedStats;
use tern_memreg::{MemoryRegistry, Stage};
use tern_metadata::auth::{self, Channel, ClusterSecret, Identity};
use tern_metadata::net::{Acceptor, Replayed, ServeLimits, Served, bind_listener, is_tick};

use crate::TcpConfig;
use crate::wire::{HEADER_LEN, Header};
use counts::OutcomeCounts;
use deadlined::Deadlined;
use held::Held;
use replies::gather_reads;
use request::MAX_DRAIN;
pub use request::{RequestOutcome, serve_request};
use staging::{Staging, read_rest};

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
    if let Some(secret) = secret
        && !authenticate(&mut served, secret, me)?
    {
        return Ok(());
    }
    // What arrived beyond the last request: the next headers (a client sends the headers of
    // consecutive reads together) or the start of a write's body, taken in one read.
    let mut staged = Staging::default();
    // Status frames not sent yet (see `held`).
    let mut held = Held::default();
    // Pinned buffers for device memory, made at the first request for it.
    let mut stage = Stage::new();
    loop {
        let Some(header) = next_header(&mut served, &mut staged, proto_version)? else {
            return Ok(());
        };
        if let Some(replies) = gather_reads(&header, &mut staged, registry, proto_version) {
            let bytes: u64 = replies.iter().map(|reply| reply.size as u64).sum();
            let mut conn = Deadlined {
                stream: &mut served.stream,
                deadline: deadline_for(io_timeout, bytes),
                staged: &mut staged,
                held: &mut held,
            };
            conn.send_replies(&replies)
                .map_err(|e| format!("{e} sending the replies of {} reads", replies.len()))?;
            for reply in &replies {
                counts.add(RequestOutcome::Read(reply.size as u64));
            }
            continue;
        }
        let mut conn = Deadlined {
            stream: &mut served.stream,
            deadline: deadline_for(io_timeout, header.size),
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
        conn.send_held_unless_paired()
            .map_err(|e| format!("{e} sending status frames"))?;
        counts.add(outcome);
    }
}

/// When a request of `bytes` must have moved: the I/O timeout, and its bytes at no less
/// than [`MIN_BODY_RATE`].
fn deadline_for(io_timeout: Duration, bytes: u64) -> Instant {
    Instant::now() + io_timeout + Duration::from_secs(bytes.min(MAX_DRAIN) / MIN_BODY_RATE)
}

/// Runs the cluster-secret exchange, one frame bounded from its first byte by the frame
/// deadline: `Ok(true)` once the peer has proved it knows the secret and the connection has
/// completed its opening, `Ok(false)` when it closed (or did not open in time) first.
fn authenticate(
    served: &mut Served,
    secret: &ClusterSecret,
    me: &Identity,
) -> Result<bool, String> {
    let Some(first) = served.opening_byte().map_err(|e| e.to_string())? else {
        return Ok(false);
    };
    let mut frame = served.frame();
    let mut stream = Replayed::new(&first, &mut frame);
    if let Err(e) = auth::server_handshake(&mut stream, secret, Channel::TcpData, me) {
        return Err(format!("refused, nothing served: {e}"));
    }
    Ok(served.opened())
}

/// The next request's header, whole (its frame taken out of `staged`, the bytes behind it
/// left there); `None` when the peer closed between requests or the connection did not
/// complete its opening. A header of a version above `proto_version` is an error, as at a
/// server of that version, which knows no such opcode.
fn next_header(
    served: &mut Served,
    staged: &mut Staging,
    proto_version: u8,
) -> Result<Option<Header>, String> {
    if staged.len() < HEADER_LEN {
        staged.compact();
        if staged.is_empty() {
            let got = served.await_frame(staged.spare()).map_err(|e| match e {
                e if is_tick(&e) => "idle for too long".to_owned(),
                e => e.to_string(),
            })?;
            if got == 0 {
                return Ok(None);
            }
            staged.filled(got);
        }
        if staged.len() < HEADER_LEN {
            read_rest(&mut served.frame(), staged, HEADER_LEN)?;
        }
    }
    if !served.opened() {
        return Ok(None);
    }
    let header = Header::decode(staged.peek_header());
    if header.version() > u32::from(proto_version.max(1)) {
        return Err(format!(
            "a v{} request to a server that speaks up to v{proto_version}",
            header.version()
        ));
    }
    let frame_len = header.frame_len();
    if staged.len() < frame_len {
        staged.compact();
        read_rest(&mut served.frame(), staged, frame_len)?;
    }
    staged.consume(frame_len);
    Ok(Some(header))
}
