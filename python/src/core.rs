//! What both faces share: building an engine from their settings, and running a batch to
//! its end (with the segment cache dropped after a failure, so the next call handshakes
//! again). Everything here runs without the GIL.

use std::fmt;
use std::time::Duration;

use tern_engine::{
    Batch, BatchState, EngineError, PortChoice, SegmentId, TransferEngine, TransferError,
    TransferRequest, TransferStatus,
};
use tern_transport_tcp::TcpTransport;

use crate::config::TransportChoice;

/// How an engine is built.
#[derive(Debug, Clone)]
pub(crate) struct EngineOptions {
    pub(crate) local_server_name: Option<String>,
    pub(crate) metadata: String,
    pub(crate) transports: Vec<TransportChoice>,
    pub(crate) cluster_secret: Option<String>,
    /// `None`: the engine's default (`MC_TRANSFER_TIMEOUT`, else 30 s).
    pub(crate) transfer_timeout: Option<Duration>,
    pub(crate) rpc_ports: Option<PortChoice>,
}

/// An engine and the deadline its batches get.
#[derive(Debug)]
pub(crate) struct Core {
    pub(crate) engine: TransferEngine,
    pub(crate) timeout: Option<Duration>,
    /// What the transports ended up being (`tcp`, `rdma`), for log lines and `repr`.
    pub(crate) protocols: Vec<&'static str>,
}

/// Why a transfer did not complete.
#[derive(Debug)]
pub(crate) enum Failure {
    /// An engine call failed (opening the segment, submitting).
    Engine(EngineError),
    /// A task ended without success.
    Task {
        /// Its index in the batch.
        index: usize,
        /// How it ended.
        status: TransferStatus,
    },
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Engine(e) => write!(f, "{e}"),
            Self::Task { index, status } => write!(f, "task {index} {status}"),
        }
    }
}

impl From<EngineError> for Failure {
    fn from(error: EngineError) -> Self {
        Self::Engine(error)
    }
}

/// Waiting "for ever" still ends: the engine's deadline fires first.
const FOREVER: Duration = Duration::from_secs(u32::MAX as u64);

#[cfg(feature = "rdma")]
fn rdma_transport(devices: &[String]) -> Result<tern_transport_rdma::RdmaTransport, String> {
    let mut config = tern_transport_rdma::RdmaConfig::from_env();
    if !devices.is_empty() {
        config.devices = devices.to_vec();
    }
    tern_transport_rdma::RdmaTransport::discover(config).map_err(|e| e.to_string())
}

#[cfg(not(feature = "rdma"))]
fn rdma_transport(_devices: &[String]) -> Result<TcpTransport, String> {
    Err("this tern wheel was built without RDMA (--tcp-only)".into())
}

impl Core {
    /// Builds an engine; the second value says why a fallback was taken, if one was.
    pub(crate) fn build(options: &EngineOptions) -> Result<(Self, Vec<String>), String> {
        let mut builder = TransferEngine::builder().metadata(options.metadata.clone());
        if let Some(name) = options
            .local_server_name
            .as_deref()
            .filter(|n| !n.is_empty())
        {
            builder = builder.local_server_name(name);
        }
        if let Some(secret) = &options.cluster_secret {
            builder = builder.cluster_secret(secret);
        }
        if let Some(timeout) = options.transfer_timeout {
            builder = builder.transfer_timeout(Some(timeout));
        }
        if let Some(ports) = options.rpc_ports {
            builder = builder.rpc_ports(ports);
        }
        let mut protocols = Vec::new();
        let mut notes = Vec::new();
        for choice in &options.transports {
            match choice {
                TransportChoice::Tcp => {
                    builder = builder.transport(TcpTransport::default());
                    protocols.push("tcp");
                }
                TransportChoice::Shm => {
                    builder = builder.transport(tern_transport_shm::ShmTransport::default());
                    protocols.push("shm");
                }
                TransportChoice::Rdma(devices) => {
                    builder = builder.transport(
                        rdma_transport(devices).map_err(|e| format!("RDMA transport: {e}"))?,
                    );
                    protocols.push("rdma");
                }
                TransportChoice::RdmaOrTcp(devices) => match rdma_transport(devices) {
                    Ok(rdma) => {
                        builder = builder.transport(rdma);
                        protocols.push("rdma");
                    }
                    Err(e) => {
                        notes.push(format!("no RDMA device ({e}): using TCP"));
                        builder = builder.transport(TcpTransport::default());
                        protocols.push("tcp");
                    }
                },
            }
        }
        let engine = builder.build().map_err(|e| e.to_string())?;
        let timeout = options.transfer_timeout.or_else(|| {
            // The builder's default, read the same way.
            std::env::var(tern_engine::TRANSFER_TIMEOUT_ENV)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs)
                .or(Some(Duration::from_secs(30)))
        });
        Ok((
            Self {
                engine,
                timeout,
                protocols,
            },
            notes,
        ))
    }

    /// How long a caller with no timeout of its own waits: past the batch deadline, so that
    /// the deadline decides.
    pub(crate) fn default_wait(&self) -> Duration {
        self.timeout.map_or(FOREVER, |t| t + Duration::from_secs(1))
    }

    /// Takes the notifications received so far, oldest first, as `(name, message)` pairs.
    pub(crate) fn take_notifies(&self) -> Vec<(String, String)> {
        self.engine
            .get_notifies()
            .into_iter()
            .map(|n| (n.name, n.notify_msg))
            .collect()
    }

    /// Submits requests to the segment `target` (their `target` is set here, once it is
    /// open) and waits for all of them. On failure the segment is closed, so the next call
    /// opens it afresh (a handshake in P2P mode). A submission that failed only because
    /// another thread closed the segment meanwhile (nothing was sent) is retried once on the
    /// reopened segment.
    pub(crate) fn run_to(
        &self,
        target: &str,
        requests: &mut [TransferRequest],
    ) -> Result<SegmentId, Failure> {
        let mut retried = false;
        loop {
            let segment = self.engine.open_segment(target)?;
            for request in requests.iter_mut() {
                request.target = segment;
            }
            match self.run(requests) {
                Ok(()) => return Ok(segment),
                Err(Failure::Task {
                    status: TransferStatus::Failed(TransferError::UnknownSegment(_)),
                    ..
                }) if !retried => retried = true,
                Err(failure) => {
                    let _ = self.engine.close_segment(segment);
                    return Err(failure);
                }
            }
        }
    }

    /// Submits `requests` as one batch and waits until every task has ended.
    pub(crate) fn run(&self, requests: &[TransferRequest]) -> Result<(), Failure> {
        let batch = self.engine.allocate_batch(requests.len())?;
        self.engine.submit(&batch, requests)?;
        let outcome = self.finish(&batch, self.default_wait());
        let _ = self.engine.free_batch(&batch);
        outcome
    }

    /// Waits for `batch` up to `wait`, then reports its first failure; a batch still
    /// running then is canceled and reported as timed out.
    pub(crate) fn finish(&self, batch: &Batch, wait: Duration) -> Result<(), Failure> {
        let status = batch.wait(wait);
        if status.state == BatchState::Failed && status.pending > 0 {
            // The call fails: the tasks still running end with it, and it returns once the
            // engine has cut them off (their memory is then free).
            batch.cancel();
        }
        match status.state {
            BatchState::Completed => Ok(()),
            BatchState::Pending => {
                batch.cancel();
                Err(first_failure(batch).unwrap_or(Failure::Task {
                    index: 0,
                    status: TransferStatus::Timeout,
                }))
            }
            BatchState::Failed => Err(first_failure(batch).unwrap_or(Failure::Task {
                index: 0,
                status: TransferStatus::Failed(TransferError::Dropped("no reason recorded".into())),
            })),
        }
    }
}

/// How long an unregister waits for pins that slices of a just-ended transfer still hold.
const SETTLE: Duration = Duration::from_millis(100);

/// Unregisters regions, all or none, waiting up to [`SETTLE`] while the only obstacle is a
/// region in use: a task that failed or timed out ends at its first failed slice, while its
/// other slices may still be finishing (and hold their pins until they do), so an unregister
/// right after such a transfer returned would fail spuriously. A transfer truly in flight
/// still fails it, [`SETTLE`] later.
pub(crate) fn unregister_settled(
    engine: &TransferEngine,
    addrs: &[usize],
) -> Result<(), EngineError> {
    let started = std::time::Instant::now();
    loop {
        match engine.unregister_memory_batch(addrs) {
            Err(EngineError::RegionInUse { .. }) if started.elapsed() < SETTLE => {
                std::thread::sleep(Duration::from_micros(50));
            }
            outcome => return outcome,
        }
    }
}

/// The first task of `batch` that ended without success, if one has.
pub(crate) fn first_failure(batch: &Batch) -> Option<Failure> {
    (0..batch.capacity())
        .map_while(|i| batch.task_status(i).map(|s| (i, s.status)))
        .find(|(_, status)| status.is_finished() && *status != TransferStatus::Completed)
        .map(|(index, status)| Failure::Task { index, status })
}
