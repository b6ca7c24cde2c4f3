//! `TransferEngine`: the handle users hold, the state behind it, start-up and shutdown. The
//! other duties live beside it: [`crate::builder`] builds it, `segments` keeps the segment
//! table, `submit` runs batches, `memory` registers memory and publishes the descriptor,
//! `rpc` answers and calls the handshake RPC.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use tern_memreg::{MemoryRegistry, PretouchPolicy};
use tern_metadata::rpc::{RpcClientConfig, RpcServer};
use tern_metadata::{MetadataStore, RpcMeta, SegmentDesc};

use crate::batch::{Helpers, KeptRoom};
use crate::builder::TransferEngineBuilder;
use crate::error::EngineError;
use crate::segments::SegmentTable;
use crate::slicing::SliceSize;
use crate::stats::{EngineCounters, EngineStats, TransportStats};
use crate::transport::{PeerSegment, Transport, TransportContext};
use crate::types::Notify;

pub(crate) struct EngineInner {
    pub(crate) weak: Weak<EngineInner>,
    pub(crate) local_server_name: String,
    pub(crate) segment_name: String,
    pub(crate) advertised_ip: IpAddr,
    pub(crate) rpc_meta: RpcMeta,
    pub(crate) registry: Arc<MemoryRegistry>,
    pub(crate) transports: Vec<Arc<dyn Transport>>,
    /// Each transport's (same index) slice size and tail merge, asked once when the engine
    /// is built: what every submit cuts by.
    pub(crate) slice_sizes: Vec<SliceSize>,
    /// The transports that take a waiter's help ([`Transport::offers_help`]), if any.
    pub(crate) helpers: Option<Helpers>,
    /// The large lists of batches gone, for the batches to come.
    pub(crate) kept: Arc<KeptRoom>,
    /// What each transport (same index) moved, counted as its slices complete.
    pub(crate) counters: Arc<EngineCounters>,
    pub(crate) store: Box<dyn MetadataStore>,
    pub(crate) local: RwLock<Arc<PeerSegment>>,
    pub(crate) local_json: RwLock<Arc<String>>,
    pub(crate) segments: RwLock<SegmentTable>,
    pub(crate) next_segment: AtomicU64,
    pub(crate) notifies: Mutex<VecDeque<Notify>>,
    /// Serialises registration changes and the descriptor publication that follows them.
    pub(crate) change: Mutex<()>,
    pub(crate) transfer_timeout: Option<Duration>,
    pub(crate) wait_spin: Duration,
    /// Whether a submit merges neighbouring requests into runs.
    pub(crate) merge_requests: bool,
    pub(crate) rpc_client: RpcClientConfig,
    pub(crate) pretouch: PretouchPolicy,
    pub(crate) rpc_server: Mutex<Option<RpcServer>>,
    /// The thread that runs transfers ordered on CUDA streams, once there is one.
    pub(crate) stream_watcher: crate::on_stream::StreamWatcher,
}

/// Moves bytes between this process's registered memory and other nodes' segments.
///
/// Dropping the engine stops its listeners and workers and withdraws its metadata.
pub struct TransferEngine {
    pub(crate) inner: Arc<EngineInner>,
    /// Whether dropping this value shuts the engine down: true for the engine the builder
    /// made, false for the handles the engine's own threads use for a moment.
    owner: bool,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("segment_name", &self.inner.segment_name)
            .field("rpc_port", &self.inner.rpc_meta.rpc_port)
            .finish_non_exhaustive()
    }
}

impl TransferEngine {
    /// A builder with the defaults: P2P handshake metadata, RPC port in 15000–17000.
    pub fn builder() -> TransferEngineBuilder {
        TransferEngineBuilder::default()
    }

    pub(crate) fn start(&self) -> Result<(), EngineError> {
        let weak = Arc::downgrade(&self.inner);
        let context = TransportContext {
            registry: self.inner.registry.clone(),
            advertised_ip: self.inner.advertised_ip,
            local_server_name: self.inner.local_server_name.clone(),
            segment_name: self.inner.segment_name.clone(),
            rpc_client: self.inner.rpc_client.clone(),
            republish: Arc::new(move || {
                let engine = weak.upgrade().ok_or("the engine is shutting down")?;
                let _change = engine.change.lock();
                engine.republish().map_err(|e| e.to_string())
            }),
        };
        for transport in &self.inner.transports {
            transport
                .start(context.clone())
                .map_err(|e| EngineError::Transport {
                    protocol: transport.protocol(),
                    source: e,
                })?;
        }
        let inner = &self.inner;
        inner
            .store
            .publish_rpc_meta(&inner.segment_name, &inner.rpc_meta)?;
        inner.republish()?;
        Ok(())
    }

    /// The name other nodes open this node's segment by (`ip:port` in P2P mode).
    pub fn segment_name(&self) -> &str {
        &self.inner.segment_name
    }

    /// The port of the handshake RPC.
    pub fn rpc_port(&self) -> u16 {
        self.inner.rpc_meta.rpc_port
    }

    /// The address this node advertises.
    pub fn advertised_ip(&self) -> IpAddr {
        self.inner.advertised_ip
    }

    /// What each transport has moved, retried and failed, and how it sees its peers.
    pub fn stats(&self) -> EngineStats {
        let tally = self.inner.counters.tally();
        EngineStats {
            transports: self
                .inner
                .transports
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    TransportStats::new(
                        t.protocol(),
                        self.inner.counters.totals(i, &tally),
                        t.report(),
                    )
                })
                .collect(),
            latency: tally.latencies(),
        }
    }

    /// This node's descriptor as currently published.
    pub fn local_descriptor(&self) -> SegmentDesc {
        self.inner.local.read().desc.clone()
    }
}

impl TransferEngine {
    /// The engine the builder made from `inner`: dropping it shuts the engine down.
    pub(crate) fn owning(inner: Arc<EngineInner>) -> Self {
        Self { inner, owner: true }
    }

    /// A handle on a running engine for its own threads: dropping it leaves the engine up.
    pub(crate) fn handle(inner: Arc<EngineInner>) -> Self {
        Self {
            inner,
            owner: false,
        }
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        if !self.owner {
            return;
        }
        self.inner.rpc_server.lock().take();
        for transport in &self.inner.transports {
            transport.shutdown();
        }
        let inner = &self.inner;
        if let Err(e) = inner.store.remove_segment(&inner.segment_name) {
            tracing::warn!("withdrawing segment {}: {e}", inner.segment_name);
        }
        if let Err(e) = inner.store.remove_rpc_meta(&inner.segment_name) {
            tracing::warn!("withdrawing rpc_meta of {}: {e}", inner.segment_name);
        }
        inner.store.shutdown();
    }
}
