//! The transfer engine: the one API a user of Tern holds.
//!
//! [`TransferEngine`] owns the local memory registry (zero length and overlap rejected),
//! publishes the local segment descriptor when it changes, opens remote segments, and runs
//! batches: a batch holds tasks, a task is cut into slices, transports move slices and report
//! each one from their own threads, and the task completes when all its slices have. Status
//! reads take no lock; waits sleep. Deadlines and cancellation live here, not in transports.
//!
//! The engine must not move bytes itself or know any wire format: that is what the
//! [`Transport`] implementations in their own crates do. It must not use `unsafe`; raw
//! registration goes through [`RegisterRaw`] from `tern-memreg`.
//!
//! ```no_run
//! use tern_engine::{TransferEngine, TransferRequest};
//! # fn run(tcp: impl tern_engine::Transport) -> Result<(), tern_engine::EngineError> {
//! let engine = TransferEngine::builder()
//!     .metadata("P2PHANDSHAKE")
//!     .local_server_name("127.0.0.1")
//!     .transport(tcp)
//!     .build()?;
//! let buf = engine.allocate(1 << 20, "cpu:0")?;
//! let peer = engine.open_segment("127.0.0.1:15123")?;
//! let remote = engine.segment(peer).unwrap().desc.buffers[0].addr;
//! let batch = engine.allocate_batch(1)?;
//! engine.submit(&batch, &[TransferRequest::read(buf.addr(), peer, remote, 4096)])?;
//! batch.wait(std::time::Duration::from_secs(5));
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

mod batch;
mod builder;
#[cfg(feature = "conformance")]
pub mod conformance;
mod engine;
mod error;
mod memory;
mod merge;
mod on_stream;
mod rpc;
mod segments;
pub mod slicing;
mod stats;
mod submit;
mod transport;
mod types;

pub use batch::{Batch, DRAIN};
pub use builder::{METRICS_ENV, TRANSFER_TIMEOUT_ENV, TransferEngineBuilder, WAIT_SPIN_ENV};
pub use engine::TransferEngine;
pub use error::{EngineError, TransferError};
pub use memory::OwnedBuffer;
pub use on_stream::StreamTransfer;
pub use stats::{
    DeclinedStats, EngineStats, LATENCY_BUCKETS_US, LatencyStats, LocalCounter, MovedCounter,
    NicStats, PROMETHEUS_CONTENT_TYPE, PeerState, PeerStats, ReportTogether, SIZE_CLASSES,
    ServedStats, SharedMovedCounter, TransportReport, TransportStats,
};
/// The CUDA driver, loaded on first use (device memory needs one).
pub use tern_cuda::{CallerStream, CudaError, DeviceOrder, driver as cuda_driver};
pub use tern_memreg::{
    AlignedBuffer, MemoryKind, Pinned, PretouchPolicy, Region, RegionInfo, RegionPin, RegisterRaw,
};
pub use tern_metadata::net::PortChoice;
pub use tern_metadata::{BufferDesc, RpcMeta, SegmentDesc, StoreOptions};
pub use transport::{
    PeerSegment, Slice, Submission, Transport, TransportContext, TransportError, keyless_buffer,
};
pub use types::{
    BatchState, BatchStatus, Notify, Opcode, SegmentId, TaskStatus, TransferRequest, TransferStatus,
};
