//! Safe, thin wrappers over libibverbs for Tern's RDMA transport.
//!
//! This is the only crate that calls `rdma-sys`: the device list, [`Context`] (an open
//! device), port and GID queries with GID auto-selection, [`ProtectionDomain`],
//! [`MemoryRegion`], [`CompletionQueue`] and RC [`QueuePair`]s with explicit
//! INIT → RTR → RTS transitions, and posting RDMA READ/WRITE (and WRITE_WITH_IMM, SEND)
//! work requests, safely: each request's [`MemoryGuard`] is kept until its completion has
//! been retrieved ([`ledger`]). Every handle owns its verbs object and releases it on drop; children hold
//! an `Arc` of their parent, so a parent always outlives its children. Every failing verb is
//! its own [`VerbsError`] variant carrying `errno`.
//!
//! It must not know about segments, descriptors, batches or policy (which NIC, how many QPs,
//! retries): that belongs to `tern-transport-rdma`.

mod cq;
mod device;
mod error;
mod gid;
pub mod ledger;
mod mr;
mod pd;
mod qp;

pub use cq::{Completion, CompletionError, CompletionQueue};
pub use device::{Context, DeviceLimits, PortInfo, device_names};
pub use error::{ENOSYS, VerbsError, null_device_list_means_no_devices};
pub use gid::{Gid, GidEntry, GidKind, rank_gids, read_gid_table};
pub use ledger::{Outcome, leaked_guards, tracked_in_flight};
pub use mr::{Access, MemoryRegion, live_memory_regions};
pub use pd::ProtectionDomain;
pub use qp::{
    MemoryGuard, PathConfig, Peer, QpCaps, QueuePair, RecvWork, SendOp, SendRequest, SendWork, Sge,
    live_queue_pairs,
};

#[cfg(test)]
mod tests {
    use super::*;
    use rdma_sys as sys;

    #[test]
    fn enosys_means_no_devices() {
        assert!(null_device_list_means_no_devices(38));
        assert!(!null_device_list_means_no_devices(13));
    }

    /// The C structs rdma-sys writes by hand must match libibverbs' layout.
    #[test]
    fn hand_written_structs_have_the_c_sizes() {
        assert_eq!(std::mem::size_of::<sys::ibv_sge>(), 16);
        assert_eq!(std::mem::size_of::<sys::ibv_send_wr>(), 128);
        assert_eq!(std::mem::size_of::<sys::ibv_recv_wr>(), 32);
        assert_eq!(std::mem::size_of::<sys::ibv_wc>(), 48);
        assert_eq!(std::mem::size_of::<sys::ibv_gid>(), 16);
        assert_eq!(std::mem::size_of::<sys::ibv_ah_attr>(), 32);
    }

    #[test]
    fn no_rdma_in_the_kernel_is_an_empty_list_not_an_error() {
        // On hosts without RDMA this is the ENOSYS path; in the guest it lists rxe0.
        let names = device_names().unwrap();
        if std::env::var_os("TERN_IN_GUEST").is_some() {
            assert!(names.iter().any(|n| n == "rxe0"), "{names:?}");
        }
        assert!(matches!(
            Context::open("no-such-device"),
            Err(VerbsError::NoSuchDevice(_))
        ));
    }

    #[test]
    fn mtu_enum_maps_to_bytes() {
        let port = |mtu| PortInfo {
            active: true,
            active_mtu: mtu,
            lid: 0,
            gid_table_len: 1,
            link_layer: 2,
            max_msg_sz: 1 << 31,
        };
        assert_eq!(port(1).mtu_bytes(), 256);
        assert_eq!(port(5).mtu_bytes(), 4096);
    }
}
