//! `tern.mooncake.TransferEngine`: Mooncake's `mooncake.engine.TransferEngine`, method for
//! method, with Mooncake's positional arguments, defaults and integer return codes. The
//! Python subclass in `tern/mooncake.py` adds `TransferOpcode`, `TransferNotify` and
//! `get_engine`.
//!
//! Where Mooncake dereferences null or bogus pointers (a call before `initialize`, an
//! unknown batch id, lists of different lengths, `None` for a string), this returns the
//! method's failure code and logs one line with the reason. Every call that registers,
//! moves bytes or waits releases the GIL; waits sleep.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tern_engine::{Batch, BatchState, Opcode, SegmentId, TransferRequest, TransferStatus};

use crate::config::{self, TransportChoice, process_env};
use crate::core::{Core, EngineOptions, Failure, first_failure, unregister_settled};
use crate::descriptors::{self, U64s};
use crate::errors::log_failure;
use crate::raw::LocalMemory;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Copies at least this long run without the GIL.
const COPY_WITHOUT_GIL: usize = 64 << 10;

/// A batch handed out by id (`batch_transfer_async*`, `transfer_submit_write`).
struct AsyncBatch {
    /// `None` for an empty batch, complete from the start.
    batch: Option<Batch>,
    segment: SegmentId,
}

/// Everything `initialize` makes.
struct Initialized {
    batches: Mutex<HashMap<u64, AsyncBatch>>,
    next_batch: AtomicU64,
    memory: LocalMemory,
    core: Core,
}

/// Mooncake's transfer engine, for `tern.mooncake`.
#[pyclass(name = "MooncakeEngine", module = "tern._tern", subclass, frozen)]
pub(crate) struct MooncakeEngine {
    state: OnceLock<Arc<Initialized>>,
    init: Mutex<()>,
    timeout: Duration,
}

fn opcode(value: i64) -> Option<Opcode> {
    match value {
        0 => Some(Opcode::Read),
        1 => Some(Opcode::Write),
        _ => None,
    }
}

/// A call's requests, their `target` set once the segment is open; or why the call fails.
type Requests = Result<Vec<TransferRequest>, String>;

fn request(opcode: Opcode, buffer: u64, peer_buffer_address: u64, length: u64) -> TransferRequest {
    TransferRequest {
        opcode,
        source: buffer as usize,
        target: SegmentId::LOCAL,
        target_offset: peer_buffer_address,
        length: length as usize,
    }
}

/// One request, for the single-transfer methods.
fn one(opcode: Opcode, buffer: u64, peer_buffer_address: u64, length: u64) -> Requests {
    Ok(vec![request(opcode, buffer, peer_buffer_address, length)])
}

fn opcode_of(value: i64) -> Result<Opcode, String> {
    opcode(value).ok_or_else(|| format!("opcode {value} is neither Read (0) nor Write (1)"))
}

/// A batch's three arguments (lists of int, or buffers of uint64) as requests, read in
/// place. A wrong type raises, as it would for a typed argument; a bad opcode or arguments
/// of different lengths fail the call instead.
fn batch_requests(
    opcode: Result<Opcode, String>,
    buffers: &Bound<'_, PyAny>,
    peer_buffer_addresses: &Bound<'_, PyAny>,
    lengths: &Bound<'_, PyAny>,
) -> PyResult<Requests> {
    let opcode = match opcode {
        Ok(opcode) => opcode,
        Err(reason) => return Ok(Err(reason)),
    };
    descriptors::requests(
        request(opcode, 0, 0, 0),
        ["buffers", "peer addresses", "lengths"],
        [buffers, peer_buffer_addresses, lengths],
    )
}

impl MooncakeEngine {
    fn ready(&self, py: Python<'_>, method: &str) -> Option<Arc<Initialized>> {
        let state = self.state.get().cloned();
        if state.is_none() {
            log_failure(py, &format!("{method}: called before initialize"));
        }
        state
    }

    /// Runs requests to `target` and waits: 0 when every byte has landed, else -1.
    fn transfer(
        &self,
        py: Python<'_>,
        method: &str,
        target: Option<String>,
        requests: Requests,
        notify: Option<(String, String)>,
    ) -> i32 {
        let Some(state) = self.ready(py, method) else {
            return -1;
        };
        let Some(target) = target else {
            log_failure(py, &format!("{method}: target_hostname is None"));
            return -1;
        };
        let requests = match requests {
            Ok(requests) => requests,
            Err(reason) => {
                log_failure(py, &format!("{method} to {target}: {reason}"));
                return -1;
            }
        };
        if requests.is_empty() && notify.is_none() {
            return 0;
        }
        let mut requests = requests;
        let outcome = py.detach(|| -> Result<(), Failure> {
            let segment = if requests.is_empty() {
                state.core.engine.open_segment(&target)?
            } else {
                state.core.run_to(&target, &mut requests)?
            };
            if let Some((name, message)) = &notify {
                state.core.engine.send_notify(segment, name, message)?;
            }
            Ok(())
        });
        match outcome {
            Ok(()) => 0,
            Err(failure) => {
                log_failure(py, &format!("{method} to {target}: {failure}"));
                -1
            }
        }
    }

    /// Submits without waiting; returns a batch id, 0 on failure.
    fn submit_async(
        &self,
        py: Python<'_>,
        method: &str,
        target: Option<String>,
        requests: Requests,
    ) -> u64 {
        let Some(state) = self.ready(py, method) else {
            return 0;
        };
        let Some(target) = target else {
            log_failure(py, &format!("{method}: target_hostname is None"));
            return 0;
        };
        let requests = match requests {
            Ok(requests) => requests,
            Err(reason) => {
                log_failure(py, &format!("{method} to {target}: {reason}"));
                return 0;
            }
        };
        let mut requests = requests;
        let submitted = py.detach(|| -> Result<AsyncBatch, Failure> {
            let engine = &state.core.engine;
            let segment = engine.open_segment(&target)?;
            if requests.is_empty() {
                return Ok(AsyncBatch {
                    batch: None,
                    segment,
                });
            }
            for request in &mut requests {
                request.target = segment;
            }
            let batch = engine.allocate_batch(requests.len())?;
            if let Err(e) = engine.submit(&batch, &requests) {
                let _ = engine.close_segment(segment);
                return Err(e.into());
            }
            Ok(AsyncBatch {
                batch: Some(batch),
                segment,
            })
        });
        match submitted {
            Ok(batch) => {
                let id = state.next_batch.fetch_add(1, Ordering::Relaxed);
                lock(&state.batches).insert(id, batch);
                id
            }
            Err(failure) => {
                log_failure(py, &format!("{method} to {target}: {failure}"));
                0
            }
        }
    }

    /// Orders requests on a CUDA stream; a `RuntimeError` when that cannot start, as in
    /// Mooncake.
    fn on_cuda(
        &self,
        py: Python<'_>,
        method: &str,
        target: Option<String>,
        requests: Requests,
        stream_ptr: u64,
    ) -> PyResult<crate::on_stream::StreamTransfer> {
        let refuse = |reason: String| {
            pyo3::exceptions::PyRuntimeError::new_err(format!("{method}: {reason}"))
        };
        let state = self
            .ready(py, method)
            .ok_or_else(|| refuse("called before initialize".into()))?;
        let target = target.ok_or_else(|| refuse("target_hostname is None".into()))?;
        let requests = requests.map_err(refuse)?;
        crate::on_stream::submit(py, &state.core, &target, requests, stream_ptr)
    }

    /// Registers `(address, length)` ranges, all or none: 0, or a negative code.
    fn register_ranges(
        &self,
        py: Python<'_>,
        ranges: Vec<(usize, usize)>,
        location: Option<String>,
    ) -> i32 {
        let Some(state) = self.ready(py, "register_memory") else {
            return -1;
        };
        let location = location.unwrap_or_else(|| "*".to_owned());
        match py.detach(|| {
            state
                .memory
                .register_promised(&state.core.engine, &ranges, &location)
        }) {
            Ok(()) => 0,
            Err(e) => {
                log_failure(py, &format!("register_memory: {e}"));
                e.mooncake_code()
            }
        }
    }

    /// Unregisters regions by start address, all or none: 0, or a negative code.
    fn unregister_addrs(&self, py: Python<'_>, addrs: &[usize]) -> i32 {
        let Some(state) = self.ready(py, "unregister_memory") else {
            return -1;
        };
        match py.detach(|| unregister_settled(&state.core.engine, addrs)) {
            Ok(()) => 0,
            Err(e) => {
                log_failure(py, &format!("unregister_memory: {e}"));
                e.mooncake_code()
            }
        }
    }

    /// Drops the cached segment of a failed batch and frees the batch once it is idle.
    fn retire(state: &Initialized, entry: &AsyncBatch, failed: bool) {
        if failed {
            let _ = state.core.engine.close_segment(entry.segment);
        }
        if let Some(batch) = &entry.batch {
            batch.cancel();
            let _ = state.core.engine.free_batch(batch);
        }
    }
}

#[pymethods]
impl MooncakeEngine {
    #[new]
    fn new() -> Self {
        Self {
            state: OnceLock::new(),
            init: Mutex::new(()),
            timeout: config::mooncake_transfer_timeout(&process_env),
        }
    }

    /// Starts the engine: 0 on success, -1 on failure (logged).
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name, /))]
    fn initialize(
        &self,
        py: Python<'_>,
        local_hostname: Option<String>,
        metadata_server: Option<String>,
        protocol: Option<String>,
        device_name: Option<String>,
    ) -> i32 {
        self.initialize_ext(
            py,
            local_hostname,
            metadata_server,
            protocol,
            device_name,
            Some(String::new()),
        )
    }

    /// `initialize` with the metadata type given apart (`etcd`, `http`, …).
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name, metadata_type, /))]
    fn initialize_ext(
        &self,
        py: Python<'_>,
        local_hostname: Option<String>,
        metadata_server: Option<String>,
        protocol: Option<String>,
        device_name: Option<String>,
        metadata_type: Option<String>,
    ) -> i32 {
        let (Some(local_hostname), Some(metadata_server), Some(protocol)) =
            (local_hostname, metadata_server, protocol)
        else {
            log_failure(
                py,
                "initialize: local_hostname, metadata_server and protocol must be strings, not None",
            );
            return -1;
        };
        let metadata = config::metadata_conn(&metadata_server, &metadata_type.unwrap_or_default());
        let device_name = device_name.unwrap_or_default();
        let (transport, note) = match config::mooncake_transport(
            &protocol,
            &device_name,
            cfg!(feature = "rdma"),
            &process_env,
        ) {
            Ok(choice) => choice,
            Err(reason) => {
                log_failure(py, &format!("initialize: {reason}"));
                return -1;
            }
        };
        let (rpc_ports, refused) = config::rpc_ports_or_default(&process_env);
        if let Some(reason) = refused {
            log_failure(py, &format!("initialize: {reason}"));
        }
        let options = EngineOptions {
            local_server_name: Some(local_hostname),
            metadata,
            // Shared memory reaches only peers on this host: TCP carries the rest.
            transports: match transport {
                TransportChoice::Shm => vec![TransportChoice::Shm, TransportChoice::Tcp],
                other => vec![other],
            },
            cluster_secret: None,
            transfer_timeout: Some(self.timeout),
            rpc_ports: Some(rpc_ports),
        };
        let _init = lock(&self.init);
        if self.state.get().is_some() {
            log_failure(py, "initialize: this engine is already initialized");
            return -1;
        }
        match py.detach(|| Core::build(&options)) {
            Ok((core, notes)) => {
                for line in note.into_iter().chain(notes) {
                    log_failure(py, &format!("initialize: {line}"));
                }
                let _ = self.state.set(Arc::new(Initialized {
                    batches: Mutex::new(HashMap::new()),
                    next_batch: AtomicU64::new(1),
                    memory: LocalMemory::default(),
                    core,
                }));
                0
            }
            Err(reason) => {
                log_failure(py, &format!("initialize: {reason}"));
                -1
            }
        }
    }

    /// The handshake RPC port (peers reach this engine at `ip:port` in P2P mode); -1 before
    /// `initialize`.
    fn get_rpc_port(&self, py: Python<'_>) -> i32 {
        self.ready(py, "get_rpc_port")
            .map_or(-1, |s| i32::from(s.core.engine.rpc_port()))
    }

    /// The local segment name (`ip:port` in P2P mode); not in Mooncake, handy for logs.
    fn get_local_segment_name(&self, py: Python<'_>) -> Option<String> {
        self.ready(py, "get_local_segment_name")
            .map(|s| s.core.engine.segment_name().to_owned())
    }

    /// Allocates and registers `length` bytes owned by the engine: their address, or 0.
    fn allocate_managed_buffer(&self, py: Python<'_>, length: u64) -> u64 {
        let Some(state) = self.ready(py, "allocate_managed_buffer") else {
            return 0;
        };
        match py.detach(|| state.memory.allocate(&state.core.engine, length as usize)) {
            Ok(addr) => addr as u64,
            Err(e) => {
                log_failure(py, &format!("allocate_managed_buffer({length}): {e}"));
                0
            }
        }
    }

    /// Frees a managed buffer: 0, or -1 for an address that is not one (logged).
    fn free_managed_buffer(&self, py: Python<'_>, buffer_addr: u64, length: u64) -> i32 {
        let Some(state) = self.ready(py, "free_managed_buffer") else {
            return -1;
        };
        match py.detach(|| state.memory.free(buffer_addr as usize, length as usize)) {
            Ok(()) => 0,
            Err(e) => {
                log_failure(py, &format!("free_managed_buffer: {e}"));
                e.mooncake_code()
            }
        }
    }

    /// Copies `length` bytes of `src` to `dest_address`, inside registered or managed
    /// memory: 0, or -1.
    fn write_bytes_to_buffer(
        &self,
        py: Python<'_>,
        dest_address: u64,
        src: &Bound<'_, PyBytes>,
        length: u64,
    ) -> i32 {
        let Some(state) = self.ready(py, "write_bytes_to_buffer") else {
            return -1;
        };
        let data = src.as_bytes();
        let Some(data) = data.get(..length as usize) else {
            log_failure(
                py,
                &format!(
                    "write_bytes_to_buffer: length {length} is more than the {} bytes given",
                    data.len()
                ),
            );
            return -1;
        };
        let copy = || {
            state
                .memory
                .write(&state.core.engine, dest_address as usize, data)
        };
        let outcome = if data.len() >= COPY_WITHOUT_GIL {
            py.detach(copy)
        } else {
            copy()
        };
        match outcome {
            Ok(()) => 0,
            Err(e) => {
                log_failure(py, &format!("write_bytes_to_buffer: {e}"));
                -1
            }
        }
    }

    /// Copies `length` bytes at `source_address` (registered or managed memory) out; raises
    /// ValueError where Mooncake would read arbitrary memory.
    fn read_bytes_from_buffer<'py>(
        &self,
        py: Python<'py>,
        source_address: u64,
        length: u64,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let Some(state) = self.ready(py, "read_bytes_from_buffer") else {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "read_bytes_from_buffer: called before initialize",
            ));
        };
        let mut out = vec![0u8; length as usize];
        let large = out.len() >= COPY_WITHOUT_GIL;
        let mut copy = || {
            state
                .memory
                .read(&state.core.engine, source_address as usize, &mut out)
        };
        let outcome = if large { py.detach(copy) } else { copy() };
        match outcome {
            Ok(()) => Ok(PyBytes::new(py, &out)),
            Err(e) => {
                log_failure(py, &format!("read_bytes_from_buffer: {e}"));
                Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "read_bytes_from_buffer: {e}"
                )))
            }
        }
    }

    /// Registers memory the caller owns and keeps valid until it unregisters it: 0, or a
    /// negative Mooncake code (-1 invalid argument, -7 overlapped, ...).
    #[pyo3(signature = (buffer_addr, capacity, location = None))]
    fn register_memory(
        &self,
        py: Python<'_>,
        buffer_addr: u64,
        capacity: u64,
        location: Option<String>,
    ) -> i32 {
        self.register_ranges(
            py,
            vec![(buffer_addr as usize, capacity as usize)],
            location,
        )
    }

    /// Unregisters the region starting at `buffer_addr`: 0, or a negative code.
    fn unregister_memory(&self, py: Python<'_>, buffer_addr: u64) -> i32 {
        self.unregister_addrs(py, &[buffer_addr as usize])
    }

    /// Registers several regions, all or none: 0, or a negative code.
    #[pyo3(signature = (buffer_addresses, capacities, location = None))]
    fn batch_register_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: &Bound<'_, PyAny>,
        capacities: &Bound<'_, PyAny>,
        location: Option<String>,
    ) -> PyResult<i32> {
        let addrs = U64s::of(buffer_addresses, "buffer_addresses")?;
        let capacities = U64s::of(capacities, "capacities")?;
        if addrs.len() != capacities.len() {
            if self.ready(py, "register_memory").is_some() {
                log_failure(
                    py,
                    &format!(
                        "batch_register_memory: {} addresses but {} capacities",
                        addrs.len(),
                        capacities.len()
                    ),
                );
            }
            return Ok(-1);
        }
        let mut ranges = vec![(0, 0); addrs.len()];
        addrs.fill(&mut ranges, |r, v| r.0 = v as usize)?;
        capacities.fill(&mut ranges, |r, v| r.1 = v as usize)?;
        Ok(self.register_ranges(py, ranges, location))
    }

    /// Unregisters several regions, all or none: 0, or a negative code.
    fn batch_unregister_memory(
        &self,
        py: Python<'_>,
        buffer_addresses: &Bound<'_, PyAny>,
    ) -> PyResult<i32> {
        let addrs = U64s::of(buffer_addresses, "buffer_addresses")?;
        let mut out = vec![0; addrs.len()];
        addrs.fill(&mut out, |slot, v| *slot = v as usize)?;
        Ok(self.unregister_addrs(py, &out))
    }

    /// Writes and waits: 0 when every byte has landed at the peer, else -1.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = None))]
    fn transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: Option<String>,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: Option<&str>,
    ) -> i32 {
        let _ = transport_hint;
        let requests = one(Opcode::Write, buffer, peer_buffer_address, length);
        self.transfer(py, "transfer_sync_write", target_hostname, requests, None)
    }

    /// Reads and waits: 0 when every byte has arrived, else -1.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = None))]
    fn transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: Option<String>,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: Option<&str>,
    ) -> i32 {
        let _ = transport_hint;
        let requests = one(Opcode::Read, buffer, peer_buffer_address, length);
        self.transfer(py, "transfer_sync_read", target_hostname, requests, None)
    }

    /// One transfer with an opcode (`TransferOpcode.Read`/`.Write`) and an optional
    /// `TransferNotify` sent once the bytes have landed: 0, or -1.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, opcode, notify = None, transport_hint = None))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: Option<String>,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        opcode: i64,
        notify: Option<&Bound<'_, PyAny>>,
        transport_hint: Option<&str>,
    ) -> i32 {
        let _ = transport_hint;
        let notify = match notify.map(notify_parts).transpose() {
            Ok(notify) => notify,
            Err(reason) => {
                log_failure(py, &format!("transfer_sync: {reason}"));
                return -1;
            }
        };
        let requests =
            opcode_of(opcode).and_then(|op| one(op, buffer, peer_buffer_address, length));
        self.transfer(py, "transfer_sync", target_hostname, requests, notify)
    }

    /// A batch of writes, waited for: 0 when every byte has landed at the peer, else -1.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = None))]
    fn batch_transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: Option<String>,
        buffers: &Bound<'_, PyAny>,
        peer_buffer_addresses: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        transport_hint: Option<&str>,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        let requests = batch_requests(Ok(Opcode::Write), buffers, peer_buffer_addresses, lengths)?;
        Ok(self.transfer(
            py,
            "batch_transfer_sync_write",
            target_hostname,
            requests,
            None,
        ))
    }

    /// A batch of reads, waited for: 0, or -1.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = None))]
    fn batch_transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: Option<String>,
        buffers: &Bound<'_, PyAny>,
        peer_buffer_addresses: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        transport_hint: Option<&str>,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        let requests = batch_requests(Ok(Opcode::Read), buffers, peer_buffer_addresses, lengths)?;
        Ok(self.transfer(
            py,
            "batch_transfer_sync_read",
            target_hostname,
            requests,
            None,
        ))
    }

    /// A batch with an opcode and an optional notify: 0, or -1.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, notify = None, transport_hint = None))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_sync(
        &self,
        py: Python<'_>,
        target_hostname: Option<String>,
        buffers: &Bound<'_, PyAny>,
        peer_buffer_addresses: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        opcode: i64,
        notify: Option<&Bound<'_, PyAny>>,
        transport_hint: Option<&str>,
    ) -> PyResult<i32> {
        let _ = transport_hint;
        let requests = batch_requests(opcode_of(opcode), buffers, peer_buffer_addresses, lengths)?;
        let notify = match notify.map(notify_parts).transpose() {
            Ok(notify) => notify,
            Err(reason) => {
                log_failure(py, &format!("batch_transfer_sync: {reason}"));
                return Ok(-1);
            }
        };
        Ok(self.transfer(py, "batch_transfer_sync", target_hostname, requests, notify))
    }

    /// Submits writes without waiting: a batch id, 0 on failure.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = None))]
    fn batch_transfer_async_write(
        &self,
        py: Python<'_>,
        target_hostname: Option<String>,
        buffers: &Bound<'_, PyAny>,
        peer_buffer_addresses: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        transport_hint: Option<&str>,
    ) -> PyResult<u64> {
        let _ = transport_hint;
        let requests = batch_requests(Ok(Opcode::Write), buffers, peer_buffer_addresses, lengths)?;
        Ok(self.submit_async(py, "batch_transfer_async_write", target_hostname, requests))
    }

    /// Submits reads without waiting: a batch id, 0 on failure.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, transport_hint = None))]
    fn batch_transfer_async_read(
        &self,
        py: Python<'_>,
        target_hostname: Option<String>,
        buffers: &Bound<'_, PyAny>,
        peer_buffer_addresses: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        transport_hint: Option<&str>,
    ) -> PyResult<u64> {
        let _ = transport_hint;
        let requests = batch_requests(Ok(Opcode::Read), buffers, peer_buffer_addresses, lengths)?;
        Ok(self.submit_async(py, "batch_transfer_async_read", target_hostname, requests))
    }

    /// Submits with an opcode without waiting: a batch id, 0 on failure.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, opcode, transport_hint = None))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_async(
        &self,
        py: Python<'_>,
        target_hostname: Option<String>,
        buffers: &Bound<'_, PyAny>,
        peer_buffer_addresses: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        opcode: i64,
        transport_hint: Option<&str>,
    ) -> PyResult<u64> {
        let _ = transport_hint;
        let requests = batch_requests(opcode_of(opcode), buffers, peer_buffer_addresses, lengths)?;
        Ok(self.submit_async(py, "batch_transfer_async", target_hostname, requests))
    }

    /// One write submitted without waiting: a batch id, 0 on failure.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, transport_hint = None))]
    fn transfer_submit_write(
        &self,
        py: Python<'_>,
        target_hostname: Option<String>,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        transport_hint: Option<&str>,
    ) -> u64 {
        let _ = transport_hint;
        let requests = one(Opcode::Write, buffer, peer_buffer_address, length);
        self.submit_async(py, "transfer_submit_write", target_hostname, requests)
    }

    /// Waits (sleeping) for every batch: 0 when all completed, -1 when one failed or timed
    /// out or an id is unknown. Finished batches are freed, as in Mooncake.
    fn get_batch_transfer_status(&self, py: Python<'_>, batch_ids: Vec<u64>) -> i32 {
        let Some(state) = self.ready(py, "get_batch_transfer_status") else {
            return -1;
        };
        let entries: Vec<(u64, Option<Batch>)> = {
            let batches = lock(&state.batches);
            if let Some(unknown) = batch_ids.iter().find(|id| !batches.contains_key(id)) {
                drop(batches);
                log_failure(
                    py,
                    &format!(
                        "get_batch_transfer_status: unknown or already freed batch id {unknown}"
                    ),
                );
                return -1;
            }
            batch_ids
                .iter()
                .map(|id| (*id, batches[id].batch.clone()))
                .collect()
        };
        let wait = state.core.default_wait();
        let failure = py.detach(|| {
            entries.iter().find_map(|(id, batch)| {
                let batch = batch.as_ref()?;
                state
                    .core
                    .finish(batch, wait)
                    .err()
                    .map(|failure| (*id, failure))
            })
        });
        let retired: Vec<AsyncBatch> = {
            let mut batches = lock(&state.batches);
            batch_ids
                .iter()
                .filter_map(|id| batches.remove(id))
                .collect()
        };
        for entry in &retired {
            Self::retire(&state, entry, failure.is_some());
        }
        match failure {
            None => 0,
            Some((id, failure)) => {
                log_failure(
                    py,
                    &format!("get_batch_transfer_status: batch {id}: {failure}"),
                );
                -1
            }
        }
    }

    /// One look at a batch: 1 completed (freed), 0 pending, -1 failed or unknown (freed),
    /// -2 timed out (not freed).
    fn transfer_check_status(&self, py: Python<'_>, batch_id: u64) -> i32 {
        let Some(state) = self.ready(py, "transfer_check_status") else {
            return -1;
        };
        let batch = {
            let batches = lock(&state.batches);
            match batches.get(&batch_id) {
                Some(entry) => entry.batch.clone(),
                None => {
                    drop(batches);
                    log_failure(
                        py,
                        &format!(
                            "transfer_check_status: unknown or already freed batch id {batch_id}"
                        ),
                    );
                    return -1;
                }
            }
        };
        let (code, failure) = match &batch {
            None => (1, None),
            Some(batch) => match batch.status().state {
                BatchState::Pending => return 0,
                BatchState::Completed => (1, None),
                BatchState::Failed => match first_failure(batch) {
                    Some(Failure::Task {
                        status: TransferStatus::Timeout,
                        ..
                    }) => return -2,
                    failure => (-1, failure),
                },
            },
        };
        if let Some(entry) = lock(&state.batches).remove(&batch_id) {
            Self::retire(&state, &entry, code != 1);
        }
        if let Some(failure) = failure {
            log_failure(
                py,
                &format!("transfer_check_status: batch {batch_id}: {failure}"),
            );
        }
        code
    }

    /// The address of the first buffer a segment publishes (fetched afresh), 0 if none.
    fn get_first_buffer_address(&self, py: Python<'_>, segment_name: Option<String>) -> u64 {
        let Some(state) = self.ready(py, "get_first_buffer_address") else {
            return 0;
        };
        let Some(name) = segment_name else {
            log_failure(py, "get_first_buffer_address: segment_name is None");
            return 0;
        };
        let found = py.detach(|| -> Result<Option<u64>, tern_engine::EngineError> {
            let engine = &state.core.engine;
            let segment = engine.open_segment(&name)?;
            engine.refresh_segment(segment)?;
            Ok(engine
                .segment(segment)
                .and_then(|peer| peer.desc.buffers.first().map(|b| b.addr)))
        });
        match found {
            Ok(Some(addr)) => addr,
            Ok(None) => {
                log_failure(
                    py,
                    &format!("get_first_buffer_address: {name} has no buffers"),
                );
                0
            }
            Err(e) => {
                log_failure(py, &format!("get_first_buffer_address({name}): {e}"));
                0
            }
        }
    }

    /// The notifications received so far, as `(name, msg)` pairs (the Python class turns
    /// them into `TransferNotify`); empty before `initialize`.
    fn get_notifies(&self, py: Python<'_>) -> Vec<(String, String)> {
        self.ready(py, "get_notifies")
            .map_or_else(Vec::new, |state| {
                state
                    .core
                    .engine
                    .get_notifies()
                    .into_iter()
                    .map(|n| (n.name, n.notify_msg))
                    .collect()
            })
    }

    /// Whether a peer answers: 0, or a negative code (-200: its metadata cannot be found).
    fn send_probe(&self, py: Python<'_>, peer_server_name: Option<String>) -> i32 {
        let Some(state) = self.ready(py, "send_probe") else {
            return -1;
        };
        let Some(peer) = peer_server_name else {
            log_failure(py, "send_probe: peer_server_name is None");
            return -1;
        };
        let probed = py.detach(|| {
            let engine = &state.core.engine;
            let segment = engine.open_segment(&peer)?;
            let outcome = engine.probe(segment);
            if outcome.is_err() {
                let _ = engine.close_segment(segment);
            }
            outcome
        });
        match probed {
            Ok(()) => 0,
            Err(e) => {
                log_failure(py, &format!("send_probe({peer}): {e}"));
                match e.mooncake_code() {
                    -102 | -103 => -200,
                    code => code,
                }
            }
        }
    }

    /// EFA pre-connect in Mooncake; nothing to do here.
    #[pyo3(signature = (segment_name = None))]
    fn warmup_efa_segment(&self, segment_name: Option<String>) -> i32 {
        let _ = segment_name;
        0
    }

    /// Which transports this engine runs (`["tcp"]`, `["rdma"]`); not in Mooncake.
    fn get_protocols(&self, py: Python<'_>) -> Vec<&'static str> {
        self.ready(py, "get_protocols")
            .map_or_else(Vec::new, |s| s.core.protocols.clone())
    }

    /// What this engine moved, as JSON (`TransferEngine::stats`); not in Mooncake.
    fn get_stats_json(&self, py: Python<'_>) -> String {
        self.ready(py, "get_stats_json").map_or_else(
            || "{}".to_owned(),
            |s| serde_json::to_string(&s.core.engine.stats()).unwrap_or_default(),
        )
    }

    /// A write ordered on CUDA stream `stream_ptr` (0: the current context's default
    /// stream): it starts after the work enqueued there before it, and the work enqueued
    /// after it waits for it. Returns at once with a `StreamTransfer` (Mooncake returns
    /// `None`); a failure is raised by its `wait()`, never by ending the process.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, stream_ptr = 0, transport_hint = None))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_write_on_cuda(
        &self,
        py: Python<'_>,
        target_hostname: Option<String>,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        stream_ptr: u64,
        transport_hint: Option<&str>,
    ) -> PyResult<crate::on_stream::StreamTransfer> {
        let _ = transport_hint;
        let requests = one(Opcode::Write, buffer, peer_buffer_address, length);
        self.on_cuda(
            py,
            "transfer_write_on_cuda",
            target_hostname,
            requests,
            stream_ptr,
        )
    }

    /// A read ordered on CUDA stream `stream_ptr`, as `transfer_write_on_cuda`.
    #[pyo3(signature = (target_hostname, buffer, peer_buffer_address, length, stream_ptr = 0, transport_hint = None))]
    #[allow(clippy::too_many_arguments)]
    fn transfer_read_on_cuda(
        &self,
        py: Python<'_>,
        target_hostname: Option<String>,
        buffer: u64,
        peer_buffer_address: u64,
        length: u64,
        stream_ptr: u64,
        transport_hint: Option<&str>,
    ) -> PyResult<crate::on_stream::StreamTransfer> {
        let _ = transport_hint;
        let requests = one(Opcode::Read, buffer, peer_buffer_address, length);
        self.on_cuda(
            py,
            "transfer_read_on_cuda",
            target_hostname,
            requests,
            stream_ptr,
        )
    }

    /// A batch of writes ordered on CUDA stream `stream_ptr`, as `transfer_write_on_cuda`.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, stream_ptr = 0, transport_hint = None))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_write_on_cuda(
        &self,
        py: Python<'_>,
        target_hostname: Option<String>,
        buffers: &Bound<'_, PyAny>,
        peer_buffer_addresses: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        stream_ptr: u64,
        transport_hint: Option<&str>,
    ) -> PyResult<crate::on_stream::StreamTransfer> {
        let _ = transport_hint;
        let requests = batch_requests(Ok(Opcode::Write), buffers, peer_buffer_addresses, lengths)?;
        self.on_cuda(
            py,
            "batch_transfer_write_on_cuda",
            target_hostname,
            requests,
            stream_ptr,
        )
    }

    /// A batch of reads ordered on CUDA stream `stream_ptr`, as `transfer_write_on_cuda`.
    #[pyo3(signature = (target_hostname, buffers, peer_buffer_addresses, lengths, stream_ptr = 0, transport_hint = None))]
    #[allow(clippy::too_many_arguments)]
    fn batch_transfer_read_on_cuda(
        &self,
        py: Python<'_>,
        target_hostname: Option<String>,
        buffers: &Bound<'_, PyAny>,
        peer_buffer_addresses: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
        stream_ptr: u64,
        transport_hint: Option<&str>,
    ) -> PyResult<crate::on_stream::StreamTransfer> {
        let _ = transport_hint;
        let requests = batch_requests(Ok(Opcode::Read), buffers, peer_buffer_addresses, lengths)?;
        self.on_cuda(
            py,
            "batch_transfer_read_on_cuda",
            target_hostname,
            requests,
            stream_ptr,
        )
    }
}

/// `TransferNotify`'s two strings.
fn notify_parts(notify: &Bound<'_, PyAny>) -> Result<(String, String), String> {
    let part = |attr: &str| -> Result<String, String> {
        notify
            .getattr(attr)
            .and_then(|v| v.extract::<String>())
            .map_err(|_| format!("notify.{attr} must be a str"))
    };
    Ok((part("name")?, part("msg")?))
}

/// The local NIC topology as Mooncake's JSON priority matrix (`{}` without RDMA devices).
#[pyfunction]
#[pyo3(signature = (device_name = None))]
pub(crate) fn local_topology(py: Python<'_>, device_name: Option<String>) -> String {
    let devices = config::parse_devices(&device_name.unwrap_or_default());
    py.detach(|| topology_json(&devices))
}

#[cfg(feature = "rdma")]
fn topology_json(devices: &[String]) -> String {
    let mut config = tern_transport_rdma::RdmaConfig::from_env();
    if !devices.is_empty() {
        config.devices = devices.to_vec();
    }
    tern_transport_rdma::RdmaTransport::discover(config)
        .ok()
        .and_then(|rdma| serde_json::to_string(rdma.priority_matrix()).ok())
        .unwrap_or_else(|| "{}".to_owned())
}

#[cfg(not(feature = "rdma"))]
fn topology_json(_devices: &[String]) -> String {
    "{}".to_owned()
}
