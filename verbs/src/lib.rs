//! Safe, thin wrappers over libibverbs for Tern's RDMA transport.
//!
//! This is the only crate that will call `rdma-sys`: device list, contexts, protection
//! domains, memory regions, completion queues and RC queue pairs, each a safe type with
//! `Drop`, parents outliving children, one error variant per failing verb carrying errno.
//!
//! It must not know about segments, descriptors, batches or any transport policy (which NIC,
//! how many QPs, retries): that belongs to `tern-transport-rdma`.
//!
//! At this stage the crate carries only the facts the rest of the workspace already relies
//! on; the wrappers land together with the Soft-RoCE harness that tests them.

/// Device-list outcome that means "this host has no RDMA": `ibv_get_device_list` returns
/// NULL with `errno == ENOSYS` on kernels built without InfiniBand, which is not an error.
pub const ENOSYS: i32 = 38;

/// Whether a failed `ibv_get_device_list` call (NULL result) with this `errno` means "no
/// devices" rather than a failure worth reporting.
pub fn null_device_list_means_no_devices(errno: i32) -> bool {
    errno == ENOSYS || errno == 0
}

#[cfg(test)]
mod tests {
    #[test]
    fn enosys_means_no_devices() {
        assert!(super::null_device_list_means_no_devices(38));
        assert!(!super::null_device_list_means_no_devices(13));
    }
}
