//! What [`crate::TransferEngine::stats`] reports: per transport, peer and NIC, what was
//! declined and served, and the latency histograms — the types users read.

/// How long transfers of one operation and size class took: a histogram.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LatencyStats {
    /// `read` or `write`.
    pub operation: String,
    /// The size class ([`SIZE_CLASSES`](super::SIZE_CLASSES)).
    pub size: String,
    /// `(upper bound in µs, transfers in that bucket)`, not cumulative; transfers above the
    /// last bound are `count` minus their sum.
    pub buckets: Vec<(u64, u64)>,
    /// Transfers timed.
    pub count: u64,
    /// Their total time.
    pub sum_seconds: f64,
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
    /// Its name in snake case, as in JSON and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Self::Connected => "connected",
            Self::Connecting => "connecting",
            Self::Idle => "idle",
            Self::Failed => "failed",
        }
    }

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
    /// Bytes moved with it (of completed slices).
    pub bytes: u64,
    /// Completed slices with it.
    pub slices: u64,
    /// The last failure seen with it, if any.
    pub last_error: Option<String>,
}

/// One NIC of a transport.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NicStats {
    /// Device name.
    pub name: String,
    /// Bytes of completed slices.
    pub bytes: u64,
    /// Completed slices.
    pub slices: u64,
    /// Failed slices.
    pub failures: u64,
    /// Whether the NIC is paused (its port is down, or it kept failing).
    pub paused: bool,
}

/// What a transport reports of itself: what only it knows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransportReport {
    /// Slices it moved again after a failure (to another path, connection or NIC).
    pub retries: u64,
    /// Its peers.
    pub peers: Vec<PeerStats>,
    /// Its NICs (RDMA).
    pub nics: Vec<NicStats>,
    /// What peers moved from or to this node's memory through it.
    pub served: ServedStats,
    /// Slices it handed to the next transport, by why.
    pub declined: Vec<DeclinedStats>,
}

/// Slices a transport declined for one reason (memory it does not carry, a peer it cannot
/// reach), which then went to the next transport: the record that keeps a slower path from
/// being silent.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeclinedStats {
    /// Why, in a few words (`device memory`, …).
    pub reason: String,
    /// Slices declined.
    pub slices: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// Requests peers made of this node's memory through one transport, and their bytes. Only
/// transports whose target side runs on this node's CPU see them (TCP); RDMA's one-sided
/// operations never reach it, and count nothing here.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServedStats {
    /// Reads served (peers took bytes from this node).
    pub reads: u64,
    /// Bytes peers read.
    pub read_bytes: u64,
    /// Writes served (peers put bytes into this node).
    pub writes: u64,
    /// Bytes peers wrote.
    pub write_bytes: u64,
    /// Requests refused (outside registered memory, or not allowed remote access).
    pub rejected: u64,
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
    /// Its NICs (RDMA).
    pub nics: Vec<NicStats>,
    /// What peers moved from or to this node through it.
    pub served: ServedStats,
    /// Slices it handed to the next transport, by why.
    pub declined: Vec<DeclinedStats>,
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
            nics: report.nics,
            served: report.served,
            declined: report.declined,
        }
    }
}

/// Everything [`crate::TransferEngine::stats`] reports.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EngineStats {
    /// One entry per installed transport, in installation order.
    pub transports: Vec<TransportStats>,
    /// How long transfers took, per operation and size class (empty with metrics off).
    pub latency: Vec<LatencyStats>,
}
