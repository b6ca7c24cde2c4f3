//! The CUDA driver API, for Tern.
//!
//! This is the only crate that calls the CUDA driver, as `tern-verbs` is for libibverbs. The
//! driver is loaded at run time (`libcuda.so.1`, or the library `TERN_CUDA_DRIVER` names), so
//! building and testing need no CUDA toolkit, no GPU and no driver; a host without one gets
//! [`CudaError::DriverMissing`] from [`driver`], never a panic. It offers what a transfer
//! engine needs and nothing more: what kind of memory an address is ([`memory_kind`]), a
//! device's primary context made current for the length of a call ([`Device::enter`]), so
//! threads with no context work and no call creates a context; copies between host and device
//! memory, synchronous or ordered on a [`Stream`] and fenced by [`Event`]s, all on streams of
//! Tern's, after the device's earlier work where the caller named no stream ([`DeviceOrder`]):
//! no Tern thread ever waits on the legacy default stream; pinned host memory to stage
//! through ([`PinnedBuffer`]); device memory shared with other processes of the host by CUDA
//! IPC handles or, for VMM memory, POSIX file descriptors or fabric handles of its chunks, as
//! each chunk allows ([`Device::share`], [`Device::open_ipc`], [`Device::map_shared`]);
//! dma-bufs of page-aligned ranges for NICs ([`Device::dmabuf`]); device allocations for
//! tests and benchmarks ([`DeviceBuffer`], [`ChunkedBuffer`]); host work ordered on a
//! caller's stream without blocking a host thread ([`CallerStream`]); and what tests ask of
//! the stand-in driver ([`standin`]).
//!
//! It must not know about regions, transports or the engine: `tern-memreg` decides which
//! memory is copied where. Every `unsafe` block cites the Driver API reference's guarantee
//! it rests on; the copy functions over raw device addresses are themselves `unsafe`, and
//! `tern-memreg` calls them only on ranges of registered device memory it checked.

mod device;
mod driver;
mod error;
mod memory;
mod share;
pub mod standin;
mod stream_order;

pub use device::{Current, Device, MemoryKind, memory_kind, memory_kind_loading};
pub use driver::{DEFAULT_DRIVER, DRIVER_ENV, Driver, driver, loaded, use_driver};
pub use driver::{FABRIC_HANDLE_LEN, IPC_HANDLE_LEN};
pub use error::CudaError;
pub use memory::{DeviceBuffer, DeviceOrder, Event, PinnedBuffer, Stream};
pub use share::{ChunkReach, ChunkedBuffer, PeerHandle, PeerMemory, SharedChunk};
pub use stream_order::{CallerStream, Gate, Mark};
