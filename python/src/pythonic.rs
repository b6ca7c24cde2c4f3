//! The engine under the Pythonic `tern.TransferEngine` (`tern/_engine.py` wraps it with keyword
//! arguments, duck-typed registration, segments, batches and asyncio): typed exceptions
//! instead of codes, owned buffers, batches that wait, report per task and cancel, and a
//! [`Waker`] that tells an event loop a batch is done without a polling thread.

use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixDatagram;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tern_engine::{
    Batch, BatchState, EngineError, Opcode, OwnedBuffer, SegmentId, TransferRequest, TransferStatus,
};

use crate::config::{self, TransportChoice, process_env};
use crate::core::{Core, EngineOptions, Failure, first_failure};
use crate::descriptors;
use crate::errors::{self, engine_error, invalid, log_failure};
use crate::raw::HeldRegions;

struct Open {
    held: HeldRegions,
    core: Core,
}

impl Drop for Open {
    /// An engine that was never closed (dropped by the garbage collector) still unregisters
    /// its held regions before it lets their objects go.
    fn drop(&mut self) {
        let (released, _leaked) = self.held.close(&self.core.engine);
        drop(released);
    }
}

/// A running engine, or a closed one.
#[pyclass(name = "Engine", module = "tern._tern", frozen)]
pub(crate) struct Engine {
    open: Mutex<Option<Arc<Open>>>,
}

fn seconds(value: Option<f64>, what: &str) -> Result<Option<Duration>, String> {
    value
        .map(|secs| {
            Duration::try_from_secs_f64(secs)
                .map_err(|_| format!("{what}={secs} is not a number of seconds"))
        })
        .transpose()
}

impl Engine {
    fn open(&self, py: Python<'_>) -> PyResult<Arc<Open>> {
        self.open
            .lock()
            .clone()
            .ok_or_else(|| invalid(py, "the engine is closed"))
    }

    /// Allocates a batch for `requests` and submits them, without the GIL.
    fn submit_requests(
        &self,
        py: Python<'_>,
        open: Arc<Open>,
        requests: Vec<TransferRequest>,
        segments: Vec<SegmentId>,
    ) -> PyResult<PyBatch> {
        let batch = py
            .detach(|| -> Result<Batch, EngineError> {
                let batch = open.core.engine.allocate_batch(requests.len())?;
                open.core.engine.submit(&batch, &requests)?;
                Ok(batch)
            })
            .map_err(|e| engine_error(py, &e));
        descriptors::give_back(requests);
        let batch = batch?;
        Ok(PyBatch {
            batch,
            open,
            segments,
            segments_dropped: Mutex::new(false),
        })
    }
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (local_server_name, metadata, protocols, devices, cluster_secret, transfer_timeout))]
    fn new(
        py: Python<'_>,
        local_server_name: Option<String>,
        metadata: String,
        protocols: Vec<String>,
        devices: Vec<String>,
        cluster_secret: Option<String>,
        transfer_timeout: Option<f64>,
    ) -> PyResult<Self> {
        let mut transports = Vec::new();
        for protocol in &protocols {
            transports.push(match protocol.as_str() {
                "tcp" => TransportChoice::Tcp,
                "shm" => TransportChoice::Shm,
                "auto" => TransportChoice::RdmaOrTcp(devices.clone()),
                "rdma" if cfg!(feature = "rdma") => TransportChoice::Rdma(devices.clone()),
                "rdma" => {
                    return Err(invalid(
                        py,
                        "this tern wheel was built without RDMA (--tcp-only)",
                    ));
                }
                other => {
                    return Err(invalid(
                        py,
                        format!(
                            "protocol {other:?} is not one of \"tcp\", \"rdma\", \"auto\", \"shm\""
                        ),
                    ));
                }
            });
        }
        if transports.is_empty() {
            return Err(invalid(py, "protocols is empty"));
        }
        let transfer_timeout =
            seconds(transfer_timeout, "transfer_timeout").map_err(|e| invalid(py, e))?;
        let (rpc_ports, refused) = config::rpc_ports_or_default(&process_env);
        if let Some(reason) = refused {
            log_failure(py, &reason);
        }
        let options = EngineOptions {
            local_server_name,
            metadata,
            transports,
            cluster_secret,
            transfer_timeout,
            rpc_ports: Some(rpc_ports),
        };
        let (core, _) = py
            .detach(|| Core::build(&options))
            .map_err(|reason| errors::transport_failed(py, reason))?;
        Ok(Self {
            open: Mutex::new(Some(Arc::new(Open {
                held: HeldRegions::default(),
                core,
            }))),
        })
    }

    /// The name peers open this engine's segment by (`ip:port` in P2P mode).
    #[getter]
    fn segment_name(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.open(py)?.core.engine.segment_name().to_owned())
    }

    /// The handshake RPC port.
    #[getter]
    fn rpc_port(&self, py: Python<'_>) -> PyResult<u16> {
        Ok(self.open(py)?.core.engine.rpc_port())
    }

    /// The installed transports.
    #[getter]
    fn protocols(&self, py: Python<'_>) -> PyResult<Vec<&'static str>> {
        Ok(self.open(py)?.core.protocols.clone())
    }

    /// Seconds a batch may take from its first submit (`None`: no deadline).
    #[getter]
    fn transfer_timeout(&self, py: Python<'_>) -> PyResult<Option<f64>> {
        Ok(self.open(py)?.core.timeout.map(|t| t.as_secs_f64()))
    }

    /// Registers `[addr, addr + nbytes)`, kept valid by `keepalive` (held until unregistered).
    fn register_held(
        &self,
        py: Python<'_>,
        addr: usize,
        nbytes: usize,
        location: String,
        remote_accessible: bool,
        keepalive: Py<PyAny>,
    ) -> PyResult<()> {
        let open = self.open(py)?;
        let outcome = py.detach(|| {
            open.held.register(
                &open.core.engine,
                addr,
                nbytes,
                &location,
                remote_accessible,
                keepalive,
            )
        });
        outcome.map_err(|(e, keepalive)| {
            drop(keepalive);
            engine_error(py, &e)
        })
    }

    /// Unregisters the region that starts at `addr`.
    fn unregister(&self, py: Python<'_>, addr: usize) -> PyResult<()> {
        let open = self.open(py)?;
        let released = py
            .detach(|| open.held.unregister(&open.core.engine, addr))
            .map_err(|e| engine_error(py, &e))?;
        drop(released);
        Ok(())
    }

    /// `(addr, nbytes, location, remote_accessible)` of every registered region.
    fn regions(&self, py: Python<'_>) -> PyResult<Vec<(usize, usize, String, bool)>> {
        Ok(self
            .open(py)?
            .core
            .engine
            .registered_regions()
            .into_iter()
            .map(|r| (r.addr, r.len, r.location, r.remote_accessible))
            .collect())
    }

    /// Allocates `nbytes` owned by the engine, registered for peers.
    fn allocate(&self, py: Python<'_>, nbytes: usize, location: String) -> PyResult<OwnedMemory> {
        let open = self.open(py)?;
        let buffer = py
            .detach(|| open.core.engine.allocate(nbytes, &location))
            .map_err(|e| engine_error(py, &e))?;
        Ok(OwnedMemory {
            buffer: Arc::new(buffer),
        })
    }

    /// Opens a segment by name; returns its id.
    fn open_segment(&self, py: Python<'_>, name: &str) -> PyResult<u64> {
        let open = self.open(py)?;
        py.detach(|| open.core.engine.open_segment(name))
            .map(|id| id.0)
            .map_err(|e| engine_error(py, &e))
    }

    /// Fetches a segment's descriptor again.
    fn refresh_segment(&self, py: Python<'_>, segment: u64) -> PyResult<()> {
        let open = self.open(py)?;
        py.detach(|| open.core.engine.refresh_segment(SegmentId(segment)))
            .map_err(|e| engine_error(py, &e))
    }

    /// Forgets an open segment (the next open fetches it afresh).
    fn close_segment(&self, py: Python<'_>, segment: u64) -> PyResult<()> {
        self.open(py)?
            .core
            .engine
            .close_segment(SegmentId(segment))
            .map_err(|e| engine_error(py, &e))
    }

    /// `(name, [(addr, nbytes), ...])` of an open segment.
    fn segment_info(&self, py: Python<'_>, segment: u64) -> PyResult<(String, Vec<(u64, u64)>)> {
        let open = self.open(py)?;
        let peer = open
            .core
            .engine
            .segment(SegmentId(segment))
            .ok_or_else(|| engine_error(py, &EngineError::UnknownSegment(SegmentId(segment))))?;
        Ok((
            if segment == 0 {
                open.core.engine.segment_name().to_owned()
            } else {
                peer.name.clone()
            },
            peer.desc
                .buffers
                .iter()
                .map(|b| (b.addr, b.length))
                .collect(),
        ))
    }

    /// Submits `(write, local, segment, remote, nbytes)` requests as one batch.
    fn submit(
        &self,
        py: Python<'_>,
        requests: Vec<(bool, usize, u64, u64, usize)>,
    ) -> PyResult<PyBatch> {
        let open = self.open(py)?;
        if requests.is_empty() {
            return Err(invalid(py, "no requests to submit"));
        }
        let requests: Vec<TransferRequest> = requests
            .into_iter()
            .map(
                |(write, source, segment, target_offset, length)| TransferRequest {
                    opcode: if write { Opcode::Write } else { Opcode::Read },
                    source,
                    target: SegmentId(segment),
                    target_offset,
                    length,
                },
            )
            .collect();
        let segments: Vec<SegmentId> = {
            let mut ids: Vec<SegmentId> = requests.iter().map(|r| r.target).collect();
            ids.sort();
            ids.dedup();
            ids
        };
        self.submit_requests(py, open, requests, segments)
    }

    /// Submits one batch to one segment from three equally long arguments, each a buffer of
    /// `uint64` (a numpy array) or a list of int, read in place: a batch of many descriptors
    /// then builds no Python object, and no list, per descriptor.
    fn submit_arrays(
        &self,
        py: Python<'_>,
        write: bool,
        segment: u64,
        local_addrs: &Bound<'_, PyAny>,
        remote_addrs: &Bound<'_, PyAny>,
        lengths: &Bound<'_, PyAny>,
    ) -> PyResult<PyBatch> {
        let open = self.open(py)?;
        let template = TransferRequest {
            opcode: if write { Opcode::Write } else { Opcode::Read },
            source: 0,
            target: SegmentId(segment),
            target_offset: 0,
            length: 0,
        };
        let requests = descriptors::requests(
            template,
            ["local_addrs", "remote_addrs", "lengths"],
            [local_addrs, remote_addrs, lengths],
        )?
        .map_err(|reason| invalid(py, reason))?;
        if requests.is_empty() {
            return Err(invalid(py, "no requests to submit"));
        }
        self.submit_requests(py, open, requests, vec![SegmentId(segment)])
    }

    /// Sends a notification to a segment's node.
    fn notify(&self, py: Python<'_>, segment: u64, name: &str, message: &str) -> PyResult<()> {
        let open = self.open(py)?;
        py.detach(|| {
            open.core
                .engine
                .send_notify(SegmentId(segment), name, message)
        })
        .map_err(|e| engine_error(py, &e))
    }

    /// Takes the notifications received so far, oldest first.
    fn notifications(&self, py: Python<'_>) -> PyResult<Vec<(String, String)>> {
        Ok(self.open(py)?.core.take_notifies())
    }

    /// Raises unless the segment's node answers a probe.
    fn probe(&self, py: Python<'_>, segment: u64) -> PyResult<()> {
        let open = self.open(py)?;
        py.detach(|| open.core.engine.probe(SegmentId(segment)))
            .map_err(|e| engine_error(py, &e))
    }

    /// The engine's statistics as JSON.
    fn stats_json(&self, py: Python<'_>) -> PyResult<String> {
        serde_json::to_string(&self.open(py)?.core.engine.stats())
            .map_err(|e| invalid(py, e.to_string()))
    }

    /// The engine's statistics in the Prometheus text format.
    fn metrics_text(&self, py: Python<'_>) -> PyResult<String> {
        Ok(self.open(py)?.core.engine.stats().prometheus())
    }

    /// Stops the engine: held regions are unregistered and their objects released, then the
    /// listeners and workers stop and the metadata is withdrawn. Idempotent.
    fn close(&self, py: Python<'_>) {
        let Some(open) = self.open.lock().take() else {
            return;
        };
        let (released, leaked) = py.detach(|| {
            let outcome = open.held.close(&open.core.engine);
            // The engine goes when the last batch handle that holds it does.
            drop(open);
            outcome
        });
        drop(released);
        if leaked > 0 {
            log_failure(
                py,
                &format!(
                    "close: {leaked} region(s) were still in use by canceled transfers; their objects are kept alive"
                ),
            );
        }
    }

    /// Whether `close` has run.
    #[getter]
    fn closed(&self) -> bool {
        self.open.lock().is_none()
    }
}

/// Memory the engine owns and has registered; it lives while this object (or a transfer
/// using it) does.
#[pyclass(name = "OwnedMemory", module = "tern._tern", frozen)]
pub(crate) struct OwnedMemory {
    buffer: Arc<OwnedBuffer>,
}

#[pymethods]
impl OwnedMemory {
    /// Start address.
    #[getter]
    fn addr(&self) -> usize {
        self.buffer.addr()
    }

    /// Length in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.buffer.len()
    }

    /// Copies `nbytes` at `offset` out.
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: usize,
        nbytes: usize,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mut out = vec![0u8; nbytes];
        py.detach(|| self.buffer.read_at(offset, &mut out))
            .map_err(|e| engine_error(py, &e))?;
        Ok(PyBytes::new(py, &out))
    }

    /// Copies `data` in at `offset`.
    fn write(&self, py: Python<'_>, offset: usize, data: &[u8]) -> PyResult<()> {
        py.detach(|| self.buffer.write_at(offset, data))
            .map_err(|e| engine_error(py, &e))
    }
}

/// A submitted batch.
#[pyclass(name = "Batch", module = "tern._tern", frozen)]
pub(crate) struct PyBatch {
    batch: Batch,
    open: Arc<Open>,
    segments: Vec<SegmentId>,
    /// Whether the failure has dropped the segments (once).
    segments_dropped: Mutex<bool>,
}

fn state_name(status: &TransferStatus) -> &'static str {
    match status {
        TransferStatus::Waiting => "waiting",
        TransferStatus::Pending => "pending",
        TransferStatus::Completed => "completed",
        TransferStatus::Failed(_) => "failed",
        TransferStatus::Timeout => "timeout",
        TransferStatus::Canceled => "canceled",
    }
}

impl PyBatch {
    /// After a failure, forgets the segments involved, so their next use fetches them again.
    fn drop_segments(&self) {
        let mut dropped = self.segments_dropped.lock();
        if !*dropped {
            *dropped = true;
            for segment in &self.segments {
                let _ = self.open.core.engine.close_segment(*segment);
            }
        }
    }

    fn outcome(&self, py: Python<'_>) -> PyResult<bool> {
        match self.batch.status().state {
            BatchState::Pending => Ok(false),
            BatchState::Completed => Ok(true),
            BatchState::Failed => {
                self.drop_segments();
                let failure = first_failure(&self.batch).unwrap_or(Failure::Task {
                    index: 0,
                    status: TransferStatus::Canceled,
                });
                Err(errors::failure(py, &failure))
            }
        }
    }
}

#[pymethods]
impl PyBatch {
    /// Sleeps until every task has ended (or `timeout` seconds pass): True when all
    /// completed, False when some still run; raises the first failure's exception.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let wait = seconds(timeout, "timeout")
            .map_err(|e| invalid(py, e))?
            .unwrap_or_else(|| self.open.core.default_wait());
        py.detach(|| self.batch.wait(wait));
        self.outcome(py)
    }

    /// True when every task has ended (reading it enforces the deadline); never raises.
    #[getter]
    fn done(&self) -> bool {
        self.batch.status().state != BatchState::Pending
    }

    /// Like `wait(0)`: True when completed, False while running; raises on failure.
    fn result(&self, py: Python<'_>) -> PyResult<bool> {
        self.outcome(py)
    }

    /// The aggregate: `(state, submitted, completed, failed, pending, transferred_bytes)`.
    fn status(&self) -> (&'static str, usize, usize, usize, usize, u64) {
        let s = self.batch.status();
        let state = match s.state {
            BatchState::Pending => "pending",
            BatchState::Completed => "completed",
            BatchState::Failed => "failed",
        };
        (
            state,
            s.submitted,
            s.completed,
            s.failed,
            s.pending,
            s.transferred_bytes,
        )
    }

    /// Task `index`: `(state, transferred_bytes, exception or None)`.
    fn task(
        &self,
        py: Python<'_>,
        index: usize,
    ) -> PyResult<(&'static str, u64, Option<Py<PyAny>>)> {
        let status = self
            .batch
            .task_status(index)
            .ok_or_else(|| invalid(py, format!("the batch has no task {index}")))?;
        let error = match &status.status {
            TransferStatus::Completed | TransferStatus::Pending | TransferStatus::Waiting => None,
            other => Some(
                errors::failure(
                    py,
                    &Failure::Task {
                        index,
                        status: other.clone(),
                    },
                )
                .into_value(py)
                .into_any(),
            ),
        };
        Ok((state_name(&status.status), status.transferred_bytes, error))
    }

    /// Number of tasks.
    fn __len__(&self) -> usize {
        self.batch.capacity()
    }

    /// Cancels every unfinished task; returns how many.
    fn cancel(&self, py: Python<'_>) -> usize {
        // Waits (bounded) for slices on the wire to be cut off: without the GIL.
        py.detach(|| self.batch.cancel())
    }

    /// Rings `waker` once when no task is unfinished (at once if none is).
    fn notify_on_complete(&self, waker: &Waker) {
        let bell = waker.bell.clone();
        self.batch.on_complete(move || {
            // A full socket means the event loop has wake-ups pending already.
            let _ = bell.send(&[1]);
        });
    }
}

/// A doorbell an event loop watches: batches ring it from transport threads (a datagram on
/// a socket pair, no GIL), the loop's reader drains it and looks at its batches.
#[pyclass(name = "Waker", module = "tern._tern", frozen)]
pub(crate) struct Waker {
    reader: UnixDatagram,
    bell: Arc<UnixDatagram>,
}

#[pymethods]
impl Waker {
    #[new]
    fn new(py: Python<'_>) -> PyResult<Self> {
        let (reader, bell) = UnixDatagram::pair()
            .and_then(|(r, w)| {
                r.set_nonblocking(true)?;
                w.set_nonblocking(true)?;
                Ok((r, w))
            })
            .map_err(|e| errors::transport_failed(py, format!("cannot make a waker: {e}")))?;
        Ok(Self {
            reader,
            bell: Arc::new(bell),
        })
    }

    /// The file descriptor to watch for reading (`loop.add_reader`); it stays owned here.
    fn fileno(&self) -> i32 {
        self.reader.as_raw_fd()
    }

    /// Takes every pending ring; returns how many there were.
    fn drain(&self) -> usize {
        let mut buf = [0u8; 64];
        let mut rings = 0;
        loop {
            match self.reader.recv(&mut buf) {
                Ok(_) => rings += 1,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return rings,
            }
        }
    }

    /// Rings the bell from Python (for tests and for waking the loop by hand).
    fn ring(&self) {
        let _ = self.bell.send(&[1]);
    }
}
