//! What the engine and its transports have done: bytes, slices, retries and failures per
//! transport, and the state of each peer. Counting costs two relaxed atomic adds per slice;
//! everything else is gathered only when asked.

use std::sync::atomic::{AtomicU64, Ordering};

/// Per-transport counters the engine keeps as slices complete.
#[derive(Debug, Default)]
pub(crate) struct TransportCounters {
    bytes: AtomicU64,
    slices: AtomicU64,
    failures: AtomicU64,
}

/// The counters of every installed transport (same index).
#[derive(Debug, Default)]
pub(crate) struct EngineCounters {
    transports: Vec<TransportCounters>,
}

impl EngineCounters {
    pub(crate) fn new(transports: usize) -> Self {
        Self {
            transports: (0..transports)
                .map(|_| TransportCounters::default())
                .collect(),
        }
    }

    pub(crate) fn moved(&self, transport: usize, bytes: u64) {
        if let Some(c) = self.transports.get(transport) {
            c.bytes.fetch_add(bytes, Ordering::Relaxed);
            c.slices.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn failed(&self, transport: usize) {
        if let Some(c) = self.transports.get(transport) {
            c.failures.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `(bytes, slices, failures)` of one transport.
    pub(crate) fn totals(&self, transport: usize) -> (u64, u64, u64) {
        self.transports.get(transport).map_or((0, 0, 0), |c| {
            (
                c.bytes.load(Ordering::Relaxed),
                c.slices.load(Ordering::Relaxed),
                c.failures.load(Ordering::Relaxed),
            )
        })
    }
}

/// How a transport sees one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum PeerState {
    /// At least one connection or endpoint is up.
    Connected,
    /// A connection or handshake is under way, none is up yet.
    Connecting,
    /// Known, but nothing is open (closed after idling, or never used).
    Idle,
    /// The last attempt failed; see `last_error`.
    Failed,
}

impl PeerState {
    /// The state of a peer with `open` connections or endpoints up, `connecting` under way,
    /// and whether the last attempt failed.
    pub fn of(open: usize, connecting: usize, failed: bool) -> Self {
        if open > 0 {
            Self::Connected
        } else if connecting > 0 {
            Self::Connecting
        } else if failed {
            Self::Failed
        } else {
            Self::Idle
        }
    }
}

/// One peer of one transport.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PeerStats {
    /// The peer: its data endpoint (TCP `host:port`) or its server name (RDMA).
    pub peer: String,
    /// Where it stands.
    pub state: PeerState,
    /// Open connections (TCP) or endpoints (RDMA) to it.
    pub endpoints: usize,
    /// The last failure seen with it, if any.
    pub last_error: Option<String>,
}

/// What a transport reports of itself: what only it knows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransportReport {
    /// Slices it moved again after a failure (to another path, connection or NIC).
    pub retries: u64,
    /// Its peers.
    pub peers: Vec<PeerStats>,
}

/// One transport's totals since the engine started.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TransportStats {
    /// Its protocol (`tcp`, `rdma`).
    pub protocol: String,
    /// Bytes of slices that completed.
    pub bytes: u64,
    /// Slices that completed.
    pub slices: u64,
    /// Slices retried after a failure.
    pub retries: u64,
    /// Slices that failed (a task fails with its first; others of the same task may fail
    /// too before they learn of it).
    pub failures: u64,
    /// Its peers.
    pub peers: Vec<PeerStats>,
}

impl TransportStats {
    pub(crate) fn new(protocol: &str, totals: (u64, u64, u64), report: TransportReport) -> Self {
        let (bytes, slices, failures) = totals;
        Self {
            protocol: protocol.to_owned(),
            bytes,
            slices,
            retries: report.retries,
            failures,
            peers: report.peers,
        }
    }
}

/// Everything [`crate::TransferEngine::stats`] reports.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct EngineStats {
    /// One entry per installed transport, in installation order.
    pub transports: Vec<TransportStats>,
}
