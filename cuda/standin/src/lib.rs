//! A stand-in for the CUDA driver (`libcuda.so.1`), which tests load through
//! `TERN_CUDA_DRIVER` on machines without a GPU.
//!
//! Its "device memory" is address space the CPU cannot touch: each allocation is a memfd
//! mapped twice, once `PROT_NONE` at the address handed out (any CPU access there faults the
//! process) and once readable and writable at an address only this library knows, through
//! which its copy calls move the bytes. A test that passes with it proves Tern reached device
//! memory only through driver copies and never with the CPU. It tests the logic above the
//! driver; it is not the proof that GPUs work.
//!
//! It implements the entry points `tern-cuda` resolves, with the Driver API's signatures and
//! error codes, plus `ternStandin*` counters for tests: contexts retained per device, bytes
//! copied each way, a "kernel" left on a stream (`ternStandinFill`). Each stream (the null
//! stream too) runs its operations in order on a thread of its own, asynchronously to the
//! caller as a device does: copies, event records, waits on an event (`cuStreamWaitEvent`) or
//! on a word of mapped host memory (`cuStreamWaitValue32`), so a caller that reads a buffer
//! before the event after its copy has completed reads stale bytes, here as on a GPU. The
//! legacy stream and blocking streams synchronize as the Driver API says, non-blocking ones
//! run unordered with them; synchronous copies are legacy-stream work, and one from pageable
//! memory to the device lands a moment after it returns (`stream`, `copy`). The number of
//! devices comes from `TERN_STANDIN_DEVICES` (default 2); `TERN_STANDIN_DMA_BUF=1` makes them
//! export dma-bufs, `TERN_STANDIN_IMEX=1` VMM chunks as fabric handles only,
//! `TERN_STANDIN_NO_MAPPING_ATTRS=1` refuses the pointer attributes of VMM mappings, and
//! `TERN_STANDIN_UNSHAREABLE=1` makes VMM chunks no other process can map.
//!
//! Sharing between processes works as the driver's does, on the same memfds: an IPC handle
//! names the owner's process and its memfd (opened in the peer through `/proc/<pid>/fd`, so
//! only in another process of the same user), and VMM memory (`cuMemCreate`, `cuMemMap` into
//! `cuMemAddressReserve`d space) exports each physical piece as a descriptor of its memfd.
//! Copies split at the edges of mapped pieces, as the driver's do over address space mapped
//! back to back; a copy into reserved space with nothing mapped fails.
//!
//! It must not be loaded outside tests. Every entry point is `unsafe extern "C"` with the
//! contract the Driver API reference gives it; the `unsafe` blocks inside rely on those
//! contracts and on the kernel's `mmap`/`memfd_create` guarantees.
//!
//! One file an idea: `codes` (status codes), `state` (the tables of memory and handles),
//! `device` and `context`, `pointer` (what an address is), `alloc` (device and pinned host
//! memory), `copy` (synchronous copies), `stream` and `event`, `ipc` (IPC handles), `vmm`
//! (physical memory mapped into reserved space), `shareable` (descriptors of physical
//! memory) and `counters` (what tests ask).
#![allow(clippy::missing_safety_doc, missing_docs, non_snake_case)]

mod alloc;
mod codes;
mod context;
mod copy;
mod counters;
mod device;
mod event;
mod ipc;
mod pointer;
mod shareable;
mod state;
mod stream;
mod vmm;
