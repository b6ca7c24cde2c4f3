//! A peer's pool: its lanes, the queue that feeds them, its connections and its stats.

use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use tern_engine::{MovedCounter, PeerState, PeerStats, Slice, TransferError};
use tern_metadata::auth::{Channel, ClusterSecret};
use tern_metadata::net::{Dial, DialAuth, dial};

use super::lane::lane_loop;
use crate::TcpConfig;

/// After a failed connect, further slices to the same peer fail at once for this long
/// instead of each waiting for its own connect timeout.
const FAST_FAIL: Duration = Duration::from_millis(100);

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
pub(super) struct PoolShared {
    pub(super) endpoint: String,
    pub(super) config: TcpConfig,
    /// Proved to the peer on every new connection, before the first request.
    pub(super) auth: Option<PoolAuth>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) last_connect_failure: Mutex<Option<(Instant, String)>>,
    /// The last failure with this peer (connecting, or a connection breaking), for stats.
    pub(super) last_error: Mutex<Option<String>>,
    /// A clone of each lane's current connection, so shutdown can cut I/O in progress.
    pub(super) open: Mutex<Vec<Option<TcpStream>>>,
    /// What each lane moved, each written by its lane alone.
    pub(super) moved: Box<[MovedCounter]>,
    /// Raised by each cut-off request: a lane that sees it change cuts off the slices of
    /// ended tasks it holds.
    pub(super) cut: AtomicU64,
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
        let sender = self.sender.lock();
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
    /// gives back those it holds within `CUT_CHECK` (see [`window`](super::window)), dropping
    /// its connection if one of them is on the wire.
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
        let endpoints = self.shared.open.lock().iter().flatten().count();
        let last_error = self.shared.last_error.lock().clone();
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
        self.sender.lock().take();
        for stream in self.shared.open.lock().iter().flatten() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        for lane in self.lanes.lock().drain(..) {
            let _ = lane.join();
        }
    }
}

fn config_lanes(config: &TcpConfig) -> usize {
    config.connections_per_peer.max(1)
}

impl PoolShared {
    pub(super) fn connect(&self) -> Result<TcpStream, String> {
        {
            let last = self.last_connect_failure.lock();
            if let Some((at, message)) = last.as_ref().filter(|(at, _)| at.elapsed() < FAST_FAIL) {
                return Err(format!("{message} ({} ms ago)", at.elapsed().as_millis()));
            }
        }
        let result = self.try_connect();
        let mut last = self.last_connect_failure.lock();
        match &result {
            Ok(_) => *last = None,
            Err(message) => {
                *last = Some((Instant::now(), message.clone()));
                *self.last_error.lock() = Some(message.clone());
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
