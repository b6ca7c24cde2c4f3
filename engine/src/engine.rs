//! `TransferEngine`: the memory registry, the segment table, submission and notification.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::time::{Duration, Instant};

use tern_memreg::{
    AlignedBuffer, MemoryError, MemoryRegistry, PretouchPolicy, Region, RegionInfo, RegionPin,
    RegisterRaw,
};
use tern_metadata::net::{self, PortChoice};
use tern_metadata::rpc::{self, RpcClientConfig, RpcError, RpcServer, RpcServerConfig, RpcType};
use tern_metadata::{
    MetadataError, MetadataEvent, MetadataStore, RpcMeta, SegmentDesc, StoreOptions, open_store,
};

use crate::batch::{Batch, BatchInner, SliceCompletion};
use crate::error::{EngineError, TransferError};
use crate::slicing::split;
use crate::transport::{PeerSegment, Slice, Transport, TransportContext, keyless_buffer};
use crate::types::{Notify, SegmentId, TransferRequest, TransferStatus};

/// Environment variable with the default transfer deadline in seconds (as Mooncake's Python
/// layer).
pub const TRANSFER_TIMEOUT_ENV: &str = "MC_TRANSFER_TIMEOUT";

/// Environment variable with [`TransferEngineBuilder::wait_spin`] in microseconds.
pub const WAIT_SPIN_ENV: &str = "TERN_WAIT_SPIN_US";

/// Notifications kept before the oldest is dropped.
const MAX_QUEUED_NOTIFIES: usize = 65_536;

/// Builds a [`TransferEngine`].
pub struct TransferEngineBuilder {
    local_server_name: Option<String>,
    metadata: String,
    advertise: Option<String>,
    rpc_ports: PortChoice,
    transports: Vec<Arc<dyn Transport>>,
    transfer_timeout: Option<Duration>,
    wait_spin: Duration,
    pretouch: PretouchPolicy,
    /// Store settings, including the handshake RPC client's timeouts.
    store: StoreOptions,
}

impl std::fmt::Debug for TransferEngineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngineBuilder")
            .field("local_server_name", &self.local_server_name)
            .field("metadata", &self.metadata)
            .field(
                "transports",
                &self
                    .transports
                    .iter()
                    .map(|t| t.protocol())
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Default for TransferEngineBuilder {
    fn default() -> Self {
        let timeout_secs = std::env::var(TRANSFER_TIMEOUT_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .unwrap_or(30);
        Self {
            local_server_name: None,
            metadata: "P2PHANDSHAKE".to_owned(),
            advertise: None,
            rpc_ports: PortChoice::default(),
            transports: Vec::new(),
            transfer_timeout: Some(Duration::from_secs(timeout_secs)),
            wait_spin: Duration::from_micros(
                std::env::var(WAIT_SPIN_ENV)
                    .ok()
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .unwrap_or(200)
                    .min(100_000),
            ),
            pretouch: PretouchPolicy::default(),
            store: StoreOptions::default(),
        }
    }
}

impl TransferEngineBuilder {
    /// The name others open this node by (P2P mode replaces it with `ip:rpc_port`). Defaults
    /// to the advertised address.
    pub fn local_server_name(mut self, name: impl Into<String>) -> Self {
        self.local_server_name = Some(name.into());
        self
    }

    /// The metadata connection string: `P2PHANDSHAKE` (default), `etcd://..`, `http://..`.
    pub fn metadata(mut self, conn: impl Into<String>) -> Self {
        self.metadata = conn.into();
        self
    }

    /// The IP address to advertise and bind to (else `MC_TCP_BIND_ADDRESS`, else the host of
    /// the server name if it is an address, else the first non-loopback interface).
    pub fn advertise_address(mut self, ip: impl Into<String>) -> Self {
        self.advertise = Some(ip.into());
        self
    }

    /// Where the handshake RPC listens (default: a free port in 15000–17000).
    pub fn rpc_ports(mut self, ports: PortChoice) -> Self {
        self.rpc_ports = ports;
        self
    }

    /// Installs a transport. Every registered region is offered to every transport.
    pub fn transport(mut self, transport: impl Transport) -> Self {
        self.transports.push(Arc::new(transport));
        self
    }

    /// Default deadline of a batch, counted from its first submit (`None`: no deadline).
    /// Defaults to `MC_TRANSFER_TIMEOUT` seconds, else 30 s.
    pub fn transfer_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.transfer_timeout = timeout;
        self
    }

    /// How long [`Batch::wait`] polls for completion before it sleeps (default 200 µs, or
    /// `TERN_WAIT_SPIN_US`): a short transfer is then seen done at once instead of after a
    /// wake-up, at the price of that much CPU per wait.
    pub fn wait_spin(mut self, spin: Duration) -> Self {
        self.wait_spin = spin;
        self
    }

    /// Timeouts of outgoing handshake RPCs.
    pub fn rpc_client(mut self, config: RpcClientConfig) -> Self {
        self.store.rpc_client = config;
        self
    }

    /// Metadata store settings that override the environment: cluster ID, etcd lease TTL,
    /// start-up retry.
    pub fn store_options(mut self, options: StoreOptions) -> Self {
        let rpc_client = std::mem::take(&mut self.store.rpc_client);
        self.store = StoreOptions {
            rpc_client,
            ..options
        };
        self
    }

    /// When [`TransferEngine::allocate`] pre-touches its buffers.
    pub fn pretouch(mut self, policy: PretouchPolicy) -> Self {
        self.pretouch = policy;
        self
    }

    /// Starts the handshake RPC server and the transports, and publishes this node.
    pub fn build(self) -> Result<TransferEngine, EngineError> {
        if self.transports.is_empty() {
            return Err(EngineError::InvalidArgument(
                "install at least one transport".into(),
            ));
        }
        let rpc_client = self.store.rpc_client.clone();
        let store = open_store(&self.metadata, self.store)?;
        let configured = self
            .advertise
            .clone()
            .or_else(|| std::env::var(net::BIND_ADDRESS_ENV).ok());
        let requested_name = self.local_server_name.clone().unwrap_or_default();
        let advertised_ip =
            net::advertised_ip(configured.as_deref(), &requested_name).map_err(|source| {
                EngineError::Io {
                    context: "choosing the advertised address".into(),
                    source,
                }
            })?;
        let local_server_name = if requested_name.is_empty() {
            advertised_ip.to_string()
        } else {
            requested_name
        };
        let listener = net::bind_listener(advertised_ip, self.rpc_ports).map_err(|source| {
            EngineError::Io {
                context: format!("binding the handshake RPC on {advertised_ip}"),
                source,
            }
        })?;
        let rpc_port = listener
            .local_addr()
            .map_err(|source| EngineError::Io {
                context: "reading the handshake RPC address".into(),
                source,
            })?
            .port();
        let rpc_meta = RpcMeta {
            ip_or_host_name: advertised_ip.to_string(),
            rpc_port,
        };
        let segment_name = store.segment_name(&local_server_name, &rpc_meta);
        let mut serve_error = None;

        let inner = Arc::new_cyclic(|weak: &Weak<EngineInner>| EngineInner {
            weak: weak.clone(),
            local_server_name,
            segment_name,
            advertised_ip,
            rpc_meta,
            registry: Arc::new(MemoryRegistry::new()),
            transports: self.transports,
            store,
            local: RwLock::new(Arc::new(PeerSegment {
                id: SegmentId::LOCAL,
                name: String::new(),
                desc: SegmentDesc::new("", "tcp"),
                rpc: RpcMeta {
                    ip_or_host_name: String::new(),
                    rpc_port: 0,
                },
            })),
            local_json: RwLock::new(Arc::new(String::new())),
            segments: RwLock::new(SegmentTable::default()),
            next_segment: AtomicU64::new(1),
            notifies: Mutex::new(VecDeque::new()),
            change: Mutex::new(()),
            transfer_timeout: self.transfer_timeout,
            wait_spin: self.wait_spin,
            rpc_client,
            pretouch: self.pretouch,
            rpc_server: Mutex::new({
                let weak = weak.clone();
                let handler = move |ty: RpcType, body: &[u8]| handle_rpc(&weak, ty, body);
                RpcServer::serve(listener, RpcServerConfig::default(), Arc::new(handler))
                    .map_err(|e| serve_error = Some(e))
                    .ok()
            }),
        });
        if let Some(source) = serve_error {
            return Err(EngineError::Io {
                context: "starting the handshake RPC server".into(),
                source,
            });
        }
        let engine = TransferEngine { inner };
        engine.start()?;
        let weak = Arc::downgrade(&engine.inner);
        engine
            .inner
            .store
            .subscribe(Arc::new(move |event| handle_event(&weak, event)));
        Ok(engine)
    }
}

#[derive(Debug, Default)]
struct SegmentTable {
    by_name: HashMap<String, SegmentId>,
    by_id: HashMap<SegmentId, Arc<PeerSegment>>,
    /// Open segments whose descriptor was withdrawn (the node died or left); they come back
    /// if it is published again.
    vanished: HashMap<SegmentId, String>,
}

struct EngineInner {
    weak: Weak<EngineInner>,
    local_server_name: String,
    segment_name: String,
    advertised_ip: IpAddr,
    rpc_meta: RpcMeta,
    registry: Arc<MemoryRegistry>,
    transports: Vec<Arc<dyn Transport>>,
    store: Box<dyn MetadataStore>,
    local: RwLock<Arc<PeerSegment>>,
    local_json: RwLock<Arc<String>>,
    segments: RwLock<SegmentTable>,
    next_segment: AtomicU64,
    notifies: Mutex<VecDeque<Notify>>,
    /// Serialises registration changes and the descriptor publication that follows them.
    change: Mutex<()>,
    transfer_timeout: Option<Duration>,
    wait_spin: Duration,
    rpc_client: RpcClientConfig,
    pretouch: PretouchPolicy,
    rpc_server: Mutex<Option<RpcServer>>,
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|p| p.into_inner())
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Moves bytes between this process's registered memory and other nodes' segments.
///
/// Dropping the engine stops its listeners and workers and withdraws its metadata.
pub struct TransferEngine {
    inner: Arc<EngineInner>,
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

    fn start(&self) -> Result<(), EngineError> {
        let weak = Arc::downgrade(&self.inner);
        let context = TransportContext {
            registry: self.inner.registry.clone(),
            advertised_ip: self.inner.advertised_ip,
            local_server_name: self.inner.local_server_name.clone(),
            segment_name: self.inner.segment_name.clone(),
            rpc_client: self.inner.rpc_client.clone(),
            republish: Arc::new(move || {
                let engine = weak.upgrade().ok_or("the engine is shutting down")?;
                let _change = lock(&engine.change);
                engine.republish().map_err(|e| e.to_string())
            }),
        };
        for transport in &self.inner.transports {
            transport
                .start(context.clone())
                .map_err(|e| EngineError::Transport {
                    protocol: transport.protocol(),
                    message: e.0,
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

    /// This node's descriptor as currently published.
    pub fn local_descriptor(&self) -> SegmentDesc {
        read(&self.inner.local).desc.clone()
    }

    /// Allocates `len` bytes owned by the engine, registers them remote-accessible with
    /// `location` (e.g. `cpu:0`, or `*`), and returns the buffer. Dropping it unregisters.
    pub fn allocate(&self, len: usize, location: &str) -> Result<OwnedBuffer, EngineError> {
        if len == 0 {
            return Err(EngineError::InvalidArgument(
                "allocate of zero bytes".into(),
            ));
        }
        let mut buffer = AlignedBuffer::new(len)
            .ok_or_else(|| EngineError::InvalidArgument(format!("cannot allocate {len} bytes")))?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = self
            .inner
            .pretouch
            .threads_for(len, cores, self.inner.transports.len());
        if threads > 0 {
            buffer.pretouch(threads);
        }
        let region = self
            .inner
            .register(vec![Region::owned(buffer, location, true)])?
            .pop()
            .ok_or_else(|| EngineError::InvalidArgument("registration returned nothing".into()))?;
        let pin = region
            .pin_owned()
            .ok_or_else(|| EngineError::InvalidArgument("owned region cannot be pinned".into()))?;
        Ok(OwnedBuffer {
            pin,
            engine: self.inner.weak.clone(),
        })
    }

    /// Unregisters the region starting at `addr`. Fails with `RegionInUse` while a submitted
    /// task still uses it, and with `AddressNotRegistered` for an unknown address.
    pub fn unregister_memory(&self, addr: usize) -> Result<(), EngineError> {
        self.unregister_memory_batch(&[addr])
    }

    /// Unregisters several regions: all or none.
    pub fn unregister_memory_batch(&self, addrs: &[usize]) -> Result<(), EngineError> {
        self.inner.unregister(addrs)
    }

    /// Opens a segment by name and returns its ID; the local segment is
    /// [`SegmentId::LOCAL`]. Opening an open segment returns the same ID.
    pub fn open_segment(&self, name: &str) -> Result<SegmentId, EngineError> {
        let name = name.trim_start_matches('/');
        if name.is_empty() {
            return Err(EngineError::InvalidArgument("empty segment name".into()));
        }
        if name == self.inner.segment_name {
            return Ok(SegmentId::LOCAL);
        }
        if let Some(id) = read(&self.inner.segments).by_name.get(name) {
            return Ok(*id);
        }
        let peer = self.inner.fetch_segment(name, None)?;
        let mut table = write(&self.inner.segments);
        if let Some(id) = table.by_name.get(name) {
            return Ok(*id);
        }
        let id = peer.id;
        table.by_name.insert(name.to_owned(), id);
        table.by_id.insert(id, Arc::new(peer));
        Ok(id)
    }

    /// Re-fetches an open segment's descriptor (after the peer re-registered or restarted).
    pub fn refresh_segment(&self, id: SegmentId) -> Result<(), EngineError> {
        if id == SegmentId::LOCAL {
            return Ok(());
        }
        let name = self
            .inner
            .segment_name_of(id)
            .ok_or(EngineError::UnknownSegment(id))?;
        self.inner.refresh(id, &name)
    }

    /// Closes a segment: later submissions to it fail with `UnknownSegment`. Transfers in
    /// flight finish.
    pub fn close_segment(&self, id: SegmentId) -> Result<(), EngineError> {
        if id == SegmentId::LOCAL {
            return Ok(());
        }
        let mut table = write(&self.inner.segments);
        let peer = table
            .by_id
            .remove(&id)
            .ok_or(EngineError::UnknownSegment(id))?;
        table.by_name.remove(&peer.name);
        Ok(())
    }

    /// The descriptor and address of an open segment.
    pub fn segment(&self, id: SegmentId) -> Option<Arc<PeerSegment>> {
        self.inner.segment(id)
    }

    /// A new batch taking up to `capacity` requests.
    pub fn allocate_batch(&self, capacity: usize) -> Result<Batch, EngineError> {
        if capacity == 0 || capacity > u32::MAX as usize {
            return Err(EngineError::InvalidArgument(format!(
                "batch capacity {capacity} is not in 1..=2^32-1"
            )));
        }
        Ok(Batch {
            inner: Arc::new(BatchInner::with_spin(capacity, self.inner.wait_spin)),
        })
    }

    /// Frees a batch. Fails with `BatchBusy` while tasks are in flight (wait or cancel first)
    /// and with `BatchFreed` the second time.
    pub fn free_batch(&self, batch: &Batch) -> Result<(), EngineError> {
        batch.inner.mark_freed()
    }

    /// Submits requests into `batch`. Fails as a whole (nothing submitted) when the batch
    /// lacks room or was freed. A request that is invalid (zero length, source outside
    /// registered memory, unknown segment, target outside the segment's buffers) fails as a
    /// task, with the reason in its status, before anything is sent. A target outside the
    /// cached descriptor triggers one re-fetch of that descriptor first (the peer may have
    /// registered more memory since it was opened).
    pub fn submit(&self, batch: &Batch, requests: &[TransferRequest]) -> Result<(), EngineError> {
        let batch_inner = &batch.inner;
        let first = batch_inner.reserve(requests.len())?;
        if let Some(timeout) = self.inner.transfer_timeout {
            batch_inner.set_deadline_if_unset(Instant::now() + timeout);
        }
        let mut groups: Vec<Vec<Slice>> =
            self.inner.transports.iter().map(|_| Vec::new()).collect();
        let mut cached: Option<Arc<PeerSegment>> = None;
        let mut refreshed: Vec<SegmentId> = Vec::new();
        for (i, request) in requests.iter().enumerate() {
            let task = first + i;
            let peer = match &cached {
                Some(peer) if peer.id == request.target => Some(peer.clone()),
                _ => {
                    cached = self.inner.segment(request.target);
                    cached.clone()
                }
            };
            let mut prepared = self.prepare(batch_inner, task, request, peer);
            if let Err(TransferError::TargetOutOfRange { .. }) = prepared
                && request.target != SegmentId::LOCAL
                && !refreshed.contains(&request.target)
            {
                // The cached descriptor may predate the peer's latest registration: re-fetch it
                // once per submit (only on this error path) before failing the task.
                refreshed.push(request.target);
                if self.refresh_segment(request.target).is_ok() {
                    cached = self.inner.segment(request.target);
                    prepared = self.prepare(batch_inner, task, request, cached.clone());
                }
            }
            match prepared {
                Ok((transport, slices)) => groups[transport].extend(slices),
                Err(error) => batch_inner.fail_task(task, error),
            }
        }
        batch_inner.publish(first + requests.len());
        for (transport, slices) in self.inner.transports.iter().zip(groups) {
            if !slices.is_empty() {
                transport.submit(slices);
            }
        }
        Ok(())
    }

    fn prepare(
        &self,
        batch: &Arc<BatchInner>,
        task: usize,
        request: &TransferRequest,
        peer: Option<Arc<PeerSegment>>,
    ) -> Result<(usize, Vec<Slice>), TransferError> {
        let len = request.length;
        if len == 0 {
            return Err(TransferError::ZeroLength);
        }
        let local = self.inner.registry.pin(request.source, len).map_err(|_| {
            TransferError::SourceNotRegistered {
                addr: request.source,
                len,
            }
        })?;
        let peer = peer.ok_or_else(|| self.inner.missing_segment(request.target))?;
        if peer
            .desc
            .buffer_containing(request.target_offset, len as u64)
            .is_none()
        {
            return Err(TransferError::TargetOutOfRange {
                segment: peer.name.clone(),
                addr: request.target_offset,
                len,
            });
        }
        let transport_index = self.inner.transport_for(&peer.desc).ok_or_else(|| {
            TransferError::NoCommonTransport {
                segment: peer.name.clone(),
                protocols: peer.desc.protocol.clone(),
            }
        })?;
        let transport = &self.inner.transports[transport_index];
        let pieces = split(
            len,
            transport.max_slice_size(),
            transport.merge_tail_below(),
        );
        batch.start_task(task, pieces.clone().count() as u32);
        let slices = pieces
            .map(|(offset, piece)| Slice {
                opcode: request.opcode,
                local: local.clone(),
                local_addr: request.source + offset,
                len: piece,
                peer: peer.clone(),
                remote_addr: request.target_offset + offset as u64,
                completion: SliceCompletion::new(batch.clone(), task),
            })
            .collect();
        Ok((transport_index, slices))
    }

    /// Submits one request, waits for it, and returns the bytes moved.
    pub fn transfer_sync(&self, request: TransferRequest) -> Result<u64, EngineError> {
        let batch = self.allocate_batch(1)?;
        self.submit(&batch, &[request])?;
        let wait_for = self
            .inner
            .transfer_timeout
            .map_or(Duration::from_secs(u64::from(u32::MAX)), |t| {
                t + Duration::from_secs(1)
            });
        batch.wait(wait_for);
        let (status, bytes) = batch
            .task_status(0)
            .map_or((TransferStatus::Waiting, 0), |s| {
                (s.status, s.transferred_bytes)
            });
        if status == TransferStatus::Pending {
            batch.cancel();
            return Err(EngineError::TransferFailed {
                status: TransferStatus::Timeout,
            });
        }
        let _ = self.free_batch(&batch);
        match status {
            TransferStatus::Completed => Ok(bytes),
            status => Err(EngineError::TransferFailed { status }),
        }
    }

    /// Sends a small message to a segment's node over the handshake RPC; it shows up in the
    /// peer's [`TransferEngine::get_notifies`].
    pub fn send_notify(
        &self,
        target: SegmentId,
        name: &str,
        message: &str,
    ) -> Result<(), EngineError> {
        let peer = self
            .segment(target)
            .ok_or(EngineError::UnknownSegment(target))?;
        let endpoint = peer.rpc.endpoint();
        let body = serde_json::to_vec(&Notify {
            name: name.to_owned(),
            notify_msg: message.to_owned(),
        })
        .map_err(|e| EngineError::InvalidArgument(e.to_string()))?;
        let reply = rpc::call(&endpoint, RpcType::Notify, &body, &self.inner.rpc_client)
            .map_err(MetadataError::from)?;
        let accepted = serde_json::from_slice::<Notify>(&reply)
            .map(|n| !n.notify_msg.is_empty())
            .unwrap_or(false);
        if !accepted {
            return Err(MetadataError::from(RpcError::Rejected {
                peer: endpoint,
                ty: RpcType::Notify,
                reason: String::from_utf8_lossy(&reply).trim().to_owned(),
            })
            .into());
        }
        Ok(())
    }

    /// Takes every notification received so far, oldest first.
    pub fn get_notifies(&self) -> Vec<Notify> {
        lock(&self.inner.notifies).drain(..).collect()
    }

    /// Whether a segment's node answers a Probe RPC.
    pub fn probe(&self, target: SegmentId) -> Result<(), EngineError> {
        let peer = self
            .segment(target)
            .ok_or(EngineError::UnknownSegment(target))?;
        rpc::call(
            &peer.rpc.endpoint(),
            RpcType::Probe,
            b"{}",
            &self.inner.rpc_client,
        )
        .map_err(MetadataError::from)?;
        Ok(())
    }

    /// The facts of every registered region.
    pub fn registered_regions(&self) -> Vec<RegionInfo> {
        self.inner.registry.snapshot()
    }
}

impl RegisterRaw for TransferEngine {
    type Error = EngineError;

    fn register_region(&self, region: Region) -> Result<(), EngineError> {
        self.inner.register(vec![region]).map(|_| ())
    }

    fn register_regions(&self, regions: Vec<Region>) -> Result<(), EngineError> {
        self.inner.register(regions).map(|_| ())
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        lock(&self.inner.rpc_server).take();
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

impl EngineInner {
    /// The installed transport that moves slices to a peer: the highest-priority one that
    /// can reach it (the first installed among equals).
    fn transport_for(&self, peer: &SegmentDesc) -> Option<usize> {
        let mut best: Option<(usize, u8)> = None;
        for (i, transport) in self.transports.iter().enumerate() {
            let priority = transport.priority();
            if best.is_none_or(|(_, p)| priority > p) && transport.can_reach(peer) {
                best = Some((i, priority));
            }
        }
        best.map(|(i, _)| i)
    }

    fn segment(&self, id: SegmentId) -> Option<Arc<PeerSegment>> {
        if id == SegmentId::LOCAL {
            return Some(read(&self.local).clone());
        }
        read(&self.segments).by_id.get(&id).cloned()
    }

    fn segment_name_of(&self, id: SegmentId) -> Option<String> {
        let table = read(&self.segments);
        table
            .by_id
            .get(&id)
            .map(|p| p.name.clone())
            .or_else(|| table.vanished.get(&id).cloned())
    }

    /// Why an open-looking segment ID has no descriptor.
    fn missing_segment(&self, id: SegmentId) -> TransferError {
        match read(&self.segments).vanished.get(&id) {
            Some(name) => TransferError::SegmentVanished(name.clone()),
            None => TransferError::UnknownSegment(id),
        }
    }

    /// Re-fetches one open segment: replaced when found, marked vanished when the store no
    /// longer has it.
    fn refresh(&self, id: SegmentId, name: &str) -> Result<(), EngineError> {
        match self.fetch_segment(name, Some(id)) {
            Ok(peer) => {
                let mut table = write(&self.segments);
                if table.by_name.get(name) == Some(&id) {
                    table.vanished.remove(&id);
                    table.by_id.insert(id, Arc::new(peer));
                }
                Ok(())
            }
            Err(EngineError::Metadata(MetadataError::SegmentNotFound(_))) => {
                self.mark_vanished(name);
                Err(MetadataError::SegmentNotFound(name.to_owned()).into())
            }
            Err(e) => Err(e),
        }
    }

    fn mark_vanished(&self, name: &str) {
        let mut table = write(&self.segments);
        if let Some(&id) = table.by_name.get(name)
            && table.by_id.remove(&id).is_some()
        {
            table.vanished.insert(id, name.to_owned());
        }
    }

    /// Applies a change seen by the metadata store's watch to the segment cache.
    fn apply(&self, event: MetadataEvent) {
        match event {
            MetadataEvent::Segment { name, desc: None } => self.mark_vanished(&name),
            MetadataEvent::Segment {
                name,
                desc: Some(desc),
            } => {
                let mut table = write(&self.segments);
                let Some(&id) = table.by_name.get(&name) else {
                    return;
                };
                let rpc = match (table.by_id.get(&id), table.vanished.contains_key(&id)) {
                    (Some(peer), _) => peer.rpc.clone(),
                    (None, true) => {
                        // Back from the dead: its RPC location is fetched in the background,
                        // as the store must not be called from its own watch thread.
                        drop(table);
                        self.refresh_in_background(vec![(id, name)]);
                        return;
                    }
                    (None, false) => return,
                };
                table.by_id.insert(
                    id,
                    Arc::new(PeerSegment {
                        id,
                        name,
                        desc,
                        rpc,
                    }),
                );
            }
            MetadataEvent::RpcMeta {
                server,
                meta: Some(meta),
            } => {
                let mut table = write(&self.segments);
                let Some(&id) = table.by_name.get(&server) else {
                    return;
                };
                if let Some(peer) = table.by_id.get(&id) {
                    let mut updated = PeerSegment::clone(peer);
                    updated.rpc = meta;
                    table.by_id.insert(id, Arc::new(updated));
                }
            }
            MetadataEvent::RpcMeta { meta: None, .. } => {}
            MetadataEvent::Resync => {
                let table = read(&self.segments);
                let open: Vec<(SegmentId, String)> = table
                    .by_name
                    .iter()
                    .map(|(n, id)| (*id, n.clone()))
                    .collect();
                drop(table);
                self.refresh_in_background(open);
            }
        }
    }

    fn refresh_in_background(&self, segments: Vec<(SegmentId, String)>) {
        let weak = self.weak.clone();
        let spawned = std::thread::Builder::new()
            .name("tern-resync".into())
            .spawn(move || {
                for (id, name) in segments {
                    let Some(engine) = weak.upgrade() else { return };
                    if let Err(e) = engine.refresh(id, &name) {
                        tracing::debug!("refreshing segment {name}: {e}");
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot start a segment refresh: {e}");
        }
    }

    fn fetch_segment(&self, name: &str, id: Option<SegmentId>) -> Result<PeerSegment, EngineError> {
        let desc = self.store.fetch_segment(name)?;
        let rpc = self.store.rpc_meta(name)?;
        let id = id.unwrap_or_else(|| SegmentId(self.next_segment.fetch_add(1, Ordering::Relaxed)));
        Ok(PeerSegment {
            id,
            name: name.to_owned(),
            desc,
            rpc,
        })
    }

    /// Registers regions on the registry and every transport, all or none, then publishes.
    fn register(&self, regions: Vec<Region>) -> Result<Vec<Arc<Region>>, EngineError> {
        let _change = lock(&self.change);
        let mut done: Vec<Arc<Region>> = Vec::with_capacity(regions.len());
        let mut failure = None;
        'regions: for region in regions {
            let region = match self.registry.register(region) {
                Ok(region) => region,
                Err(e) => {
                    failure = Some(EngineError::from(e));
                    break;
                }
            };
            for (i, transport) in self.transports.iter().enumerate() {
                if let Err(e) = transport.register_memory(region.info()) {
                    for earlier in &self.transports[..i] {
                        earlier.unregister_memory(region.info());
                    }
                    self.forget(region.addr());
                    failure = Some(EngineError::Transport {
                        protocol: transport.protocol(),
                        message: e.0,
                    });
                    break 'regions;
                }
            }
            done.push(region);
        }
        if let Some(error) = failure {
            for region in &done {
                for transport in &self.transports {
                    transport.unregister_memory(region.info());
                }
                self.forget(region.addr());
            }
            return Err(error);
        }
        self.republish()?;
        Ok(done)
    }

    /// Removes a region that was registered a moment ago and never handed out.
    fn forget(&self, addr: usize) {
        if self.registry.unregister(addr).is_err() {
            self.registry.remove_owned(addr);
        }
    }

    fn unregister(&self, addrs: &[usize]) -> Result<(), EngineError> {
        let _change = lock(&self.change);
        let removed = self.registry.unregister_all(addrs)?;
        for region in &removed {
            for transport in &self.transports {
                transport.unregister_memory(region.info());
            }
        }
        self.republish()
    }

    fn release_owned(&self, addr: usize) {
        let _change = lock(&self.change);
        if let Some(region) = self.registry.remove_owned(addr) {
            for transport in &self.transports {
                transport.unregister_memory(region.info());
            }
            if let Err(e) = self.republish() {
                tracing::warn!("republishing after freeing {addr:#x}: {e}");
            }
        }
    }

    /// Rebuilds the local descriptor from the registry and the transports and publishes it.
    fn republish(&self) -> Result<(), EngineError> {
        let name = &self.segment_name;
        let mut desc = SegmentDesc::new(name.clone(), "");
        desc.protocol = self
            .transports
            .iter()
            .map(|t| t.protocol().to_owned())
            .collect();
        let regions: Vec<RegionInfo> = self
            .registry
            .snapshot()
            .into_iter()
            .filter(|r| r.remote_accessible)
            .collect();
        desc.buffers = regions.iter().map(|r| keyless_buffer(r, name)).collect();
        let mut by_priority: Vec<&Arc<dyn Transport>> = self.transports.iter().collect();
        by_priority.sort_by_key(|t| t.priority());
        for transport in by_priority {
            transport.describe(&mut desc, &regions);
        }
        desc.stamp_now();
        let json = desc.to_json();
        *write(&self.local) = Arc::new(PeerSegment {
            id: SegmentId::LOCAL,
            name: name.clone(),
            desc: desc.clone(),
            rpc: self.rpc_meta.clone(),
        });
        *write(&self.local_json) = Arc::new(json);
        self.store.publish_segment(name, &desc)?;
        Ok(())
    }

    fn push_notify(&self, notify: Notify) {
        let mut queue = lock(&self.notifies);
        if queue.len() >= MAX_QUEUED_NOTIFIES {
            tracing::warn!("notify queue full; dropping the oldest notification");
            queue.pop_front();
        }
        queue.push_back(notify);
    }
}

fn handle_event(engine: &Weak<EngineInner>, event: MetadataEvent) {
    if let Some(engine) = engine.upgrade() {
        engine.apply(event);
    }
}

/// Answers the handshake RPC for one engine.
fn handle_rpc(engine: &Weak<EngineInner>, ty: RpcType, body: &[u8]) -> Result<Vec<u8>, String> {
    let engine = engine.upgrade().ok_or("engine is shutting down")?;
    let line = |value: serde_json::Value| {
        let mut text = value.to_string();
        text.push('\n');
        text.into_bytes()
    };
    let parse = || -> Result<serde_json::Value, String> {
        serde_json::from_slice(body).map_err(|e| format!("malformed JSON: {e}"))
    };
    match ty {
        RpcType::Metadata => {
            parse()?;
            Ok(read(&engine.local_json).as_bytes().to_vec())
        }
        RpcType::Probe => {
            parse()?;
            Ok(line(serde_json::json!({"status": "success"})))
        }
        RpcType::Notify => {
            let notify: Notify =
                serde_json::from_value(parse()?).map_err(|e| format!("malformed notify: {e}"))?;
            engine.push_notify(notify);
            Ok(line(
                serde_json::json!({"name": "", "notify_msg": "success"}),
            ))
        }
        // The body belongs to the transport that speaks it, malformed or not: that transport
        // answers with a rejection rather than a dropped connection.
        RpcType::Connection => {
            let mut by_priority: Vec<&Arc<dyn Transport>> = engine.transports.iter().collect();
            by_priority.sort_by_key(|t| std::cmp::Reverse(t.priority()));
            Ok(by_priority
                .iter()
                .find_map(|t| t.handle_connection(body))
                .unwrap_or_else(|| {
                    line(serde_json::json!({
                        "reply_msg": "no RDMA transport is installed on this node"
                    }))
                }))
        }
    }
}

/// Memory allocated and registered by the engine. Dropping it unregisters it; transfers
/// still in flight keep the memory alive until they finish.
#[derive(Debug)]
pub struct OwnedBuffer {
    pin: RegionPin,
    engine: Weak<EngineInner>,
}

impl OwnedBuffer {
    /// Start address, for [`TransferRequest::source`] and for peers.
    pub fn addr(&self) -> usize {
        self.pin.info().addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.pin.info().len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Copies `data` into the buffer at `offset`.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<(), EngineError> {
        self.pin
            .copy_from_slice(self.at(offset)?, data)
            .map_err(range_error)
    }

    /// Copies bytes at `offset` out into `out`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<(), EngineError> {
        self.pin
            .copy_to_slice(self.at(offset)?, out)
            .map_err(range_error)
    }

    fn at(&self, offset: usize) -> Result<usize, EngineError> {
        self.addr()
            .checked_add(offset)
            .ok_or_else(|| EngineError::InvalidArgument(format!("offset {offset} overflows")))
    }
}

fn range_error(error: MemoryError) -> EngineError {
    EngineError::InvalidArgument(error.to_string())
}

impl Drop for OwnedBuffer {
    fn drop(&mut self) {
        if let Some(engine) = self.engine.upgrade() {
            engine.release_owned(self.addr());
        }
    }
}
