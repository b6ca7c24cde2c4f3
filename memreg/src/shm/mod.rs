//! Memory shared with other processes of the same host, behind safe types: sealed memfds
//! ([`MemFd`]) and mappings of them ([`SharedMapping`]), file descriptors passed over Unix
//! sockets (`SCM_RIGHTS`: [`send_with_fds`], [`recv_with_fds`]), the credentials of a
//! socket's peer ([`peer_credentials`]), cross-memory attach into a peer process
//! (`process_vm_readv`/`process_vm_writev`: [`PeerProcess`]), and the process settings that
//! decide whether the kernel permits it ([`set_dumpable`], [`allow_ptrace_by_same_user`]).
//!
//! Region memory is reached only through [`RegionSlice`](crate::RegionSlice) (a pointer and
//! a length), never a Rust reference: a peer process writes a shared mapping at any moment,
//! as a NIC would.

mod attach;
mod credentials;
mod error;
mod fd_passing;
mod mapping;
mod memfd;
mod ptrace;

pub use attach::{AttachFailure, PeerProcess};
pub use credentials::{PeerCredentials, effective_uid, peer_credentials};
pub use error::ShmError;
pub use fd_passing::{MAX_FDS, recv_with_fds, send_with_fds};
pub use mapping::SharedMapping;
pub use memfd::MemFd;
pub use ptrace::{allow_ptrace_by_same_user, is_dumpable, set_dumpable, yama_ptrace_scope};
