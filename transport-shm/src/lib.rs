//! Tern's same-host transport: transfers between engines on one machine at memory speed, for
//! any registered memory, chosen by the engine on its own.
//!
//! Two paths, chosen per buffer of the peer:
//!
//! - **memfd**: memory the engine allocated ([`TransferEngine::allocate`]) lives in a sealed
//!   memfd ([`Transport::allocate`]). A same-host peer asks for it over the owner's Unix
//!   socket, receives the descriptor (`SCM_RIGHTS`), maps it once, and from then on a slice
//!   is one `memcpy` in the initiator, READ as WRITE. The owner only hands out the memfd of
//!   a registered, remote-accessible buffer it published; the initiator maps only a sealed
//!   memfd at least as large as a buffer the peer's descriptor lists. Unregistering such a
//!   buffer tells every peer that mapped it, which unmaps it (after the copies into it
//!   finish) and confirms before unregistering returns; a peer that does not confirm within
//!   [`ShmConfig::revoke_timeout`] is cut off and shown failed in the report (it may keep the
//!   pages mapped until it reads the close); a peer that leaves has everything unmapped, and
//!   its later slices fail with `Connection`.
//! - **cross-memory attach**: any other registered memory (a tensor, memory registered raw)
//!   moves with `process_vm_readv`/`process_vm_writev` from the initiator, where the kernel
//!   permits it (same user, the target dumpable, Yama's `ptrace_scope` allowing it). The
//!   owner pins the ranges for a lease first, over the socket, refusing those not inside its
//!   registered remote-accessible memory, so a buffer under a lease is in use (unregistering
//!   it fails) until the lease ends.
//!
//! **What the checks cover.** The owner checks every range a peer asks for against its
//! registry, and for memfds hands out only those buffers. Cross-memory attach, though, is
//! done by the *initiator's* process on the owner's memory: the owner cannot check each
//! access itself. What holds it to granted ranges is the initiator's engine (it attaches
//! only inside leases the owner granted) and the kernel (it allows attaching only to a
//! process the initiator could ptrace anyway, which could then read or write all of the
//! owner's memory by other means). It protects against stale descriptors and bugs, not
//! against a hostile process of the same user. [`PtracePolicy::Refuse`] makes a process
//! unreachable by cross-memory attach; memfd buffers stay shared.
//!
//! **Same host, proven.** The descriptor carries `tern.shm` (a field Mooncake peers ignore):
//! boot ID, network namespace, host name, user, and the name of an abstract Unix socket.
//! [`can_reach`](tern_engine::Transport::can_reach) is true only when all of them match this process;
//! the first slice then confirms it: the socket lives in the peer's network namespace (a
//! peer elsewhere cannot be connected to), the kernel's credentials of the connection must
//! show the same user, a cluster secret is proved as on every other connection, the peer
//! must answer as the segment asked for, and reading back a nonce by cross-memory attach
//! proves which process answered. A peer that fails any of it is not same-host: its slices
//! are declined ([`Slice::decline`]) and the engine hands them to the next transport (RDMA,
//! then TCP), without failing the task. A Mooncake descriptor (no `tern.shm`) never matches.
//!
//! It must not decide what to transfer, keep deadlines or publish metadata (the engine
//! does), and it has no `unsafe`: mappings, descriptor passing and cross-memory attach are
//! `tern-memreg`'s safe types.
//!
//! **How it is laid out.** A slice takes the admission path: `route` hands each peer's
//! slices to its link (`client`: the link made and the peer confirmed, the peer's buffers
//! mapped or leased, the copies), and the owner's side (`server`) checks each range against
//! its registry (`pin`) before it hands out a memfd or grants a lease. What only makes it
//! faster stands apart: sharing a submit among the copy threads and the waiter (`share`),
//! and moving several admitted slices at once (`client::coalesce`). The transport itself
//! (`transport`), its settings (`config`) and its report (`report`) sit around them.
//!
//! [`TransferEngine::allocate`]: tern_engine::TransferEngine::allocate
//! [`Transport::allocate`]: tern_engine::Transport::allocate
//! [`Slice::decline`]: tern_engine::Slice::decline
#![forbid(unsafe_code)]

mod client;
mod config;
mod declines;
mod error;
pub mod identity;
mod pin;
mod report;
mod route;
mod server;
mod share;
mod transport;
pub mod wire;

pub use config::{PtracePolicy, ShmConfig};
pub use error::ShmError;
pub use transport::ShmTransport;

/// The protocol name: the key of this transport's field in descriptors (`tern.shm`).
pub const PROTOCOL: &str = "shm";

/// Environment variable with the number of copy threads ([`ShmConfig::workers`]).
pub const WORKERS_ENV: &str = "TERN_SHM_WORKERS";
