//! Memory before a transport sees it.
//!
//! `tern-memreg` owns everything about the bytes Tern moves, and nothing about moving them:
//!
//! - [`AlignedBuffer`]: owned, page-aligned, zeroed memory, optionally pre-touched in parallel
//!   so that the first transfer does not pay for page faults; huge pages on request;
//! - [`numa_node_of`]: where a page lives, to name memory registered with location `*`;
//! - [`RegionMap`]: an address map (a sorted vector) with overlap detection and
//!   containing-range lookup in O(log n);
//! - [`Region`] and [`MemoryRegistry`]: registered memory, with pins ([`RegionPin`]) that keep a
//!   region from being unregistered while a transfer still touches it, and the only safe way
//!   for a transport to read or write those bytes: [`RegionSlice`] (pointer and length, never
//!   a Rust reference) moved by system calls on a file descriptor ([`RegionIo`]) or by copies;
//! - [`shm`]: memory shared with same-host peers — sealed memfds and their mappings,
//!   descriptors passed over Unix sockets, peer credentials, cross-memory attach
//!   (`process_vm_readv`/`writev`) and the ptrace settings that govern it;
//! - [`wait_ready`] and [`recv_now`]: the two socket calls transports that drive their own
//!   connections need (`poll(2)`, and `recv(2)` without waiting).
//!
//! It must not know about protocols, descriptors or the engine: it moves bytes to and from
//! file descriptors and NICs' memory registrations, and nothing above that. Together with `tern-verbs`
//! it is one of the two crates allowed `unsafe`; every block names the invariant it relies on.

mod buffer;
mod counting;
mod device;
mod map;
#[cfg(feature = "verbs")]
pub mod nic;
mod numa;
mod region;
pub mod shm;
mod socket;

pub use buffer::{AlignedBuffer, HUGE_PAGE_SIZE, PAGE_SIZE, PretouchPolicy};
pub use counting::CountingAllocator;
pub use device::{STAGE_CHUNK, Stage};
pub use map::{MapError, RegionMap};
pub use numa::{numa_node_of, resolve_location};
pub use region::{
    HoldsPin, MAX_FRAMES_PER_SEND, MemoryError, MemoryKind, MemoryRegistry, Pinned, Region,
    RegionInfo, RegionIo, RegionPin, RegionSlice, RegisterRaw, Staged, send_frames,
    skip_sent_frames,
};
pub use socket::{Ready, recv_now, wait_ready};
pub use tern_cuda::DeviceOrder;
