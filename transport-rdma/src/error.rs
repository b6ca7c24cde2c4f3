//! Why the RDMA transport could not start or register memory.

use std::path::PathBuf;

use tern_verbs::VerbsError;

use crate::topology::TopologyError;

/// A failure of the RDMA transport outside any one transfer. Transfers fail with the
/// engine's `TransferError` instead.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RdmaError {
    /// No RDMA device could be used. `looked_for` says which devices were wanted (the
    /// allow-list, or any), `found` what the host has and why each was passed over. Load an
    /// RDMA driver (or `rdma link add rxe0 type rxe netdev eth0` for Soft-RoCE), fix the
    /// allow-list, or install the TCP transport instead.
    #[error("no usable RDMA device: looked for {looked_for}; {found}")]
    NoDevice {
        /// What was looked for.
        looked_for: String,
        /// What there is.
        found: String,
    },
    /// A verb failed on a device while opening it or registering memory.
    #[error("RDMA device {device}: {source}")]
    Device {
        /// The device.
        device: String,
        /// The verb that failed.
        source: VerbsError,
    },
    /// The priority matrix (from the builder, or the file `MC_CUSTOM_TOPO_JSON` names) is
    /// malformed or names no usable device.
    #[error("NIC priority matrix: {0}")]
    Topology(#[from] TopologyError),
    /// The topology file could not be read.
    #[error("reading the NIC priority matrix file {path:?}: {source}")]
    TopologyFile {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The settings cannot be used with these devices (a slice size too large for one work
    /// request, for one).
    #[error("RDMA settings: {0}")]
    Config(#[from] crate::config::ConfigError),
    /// The transport was asked to start twice, or used before it started.
    #[error("{0}")]
    State(&'static str),
}
