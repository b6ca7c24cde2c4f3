//! Setting the engine up: the constructor, `initialize` (Mooncake's arguments turned into
//! [`EngineOptions`]), what the running engine tells about itself, and the NIC topology.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use pyo3::prelude::*;

use super::{Initialized, MooncakeEngine};
use crate::config::{self, TransportChoice, process_env};
use crate::core::{Core, EngineOptions};
use crate::errors::log_failure;
use crate::raw::LocalMemory;

#[pymethods]
impl MooncakeEngine {
    #[new]
    fn new() -> Self {
        Self {
            state: OnceLock::new(),
            init: Mutex::new(()),
            timeout: config::mooncake_transfer_timeout(&process_env),
        }
    }

    /// Starts the engine: 0 on success, -1 on failure (logged).
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name, /))]
    fn initialize(
        &self,
        py: Python<'_>,
        local_hostname: Option<String>,
        metadata_server: Option<String>,
        protocol: Option<String>,
        device_name: Option<String>,
    ) -> i32 {
        self.initialize_ext(
            py,
            local_hostname,
            metadata_server,
            protocol,
            device_name,
            Some(String::new()),
        )
    }

    /// `initialize` with the metadata type given apart (`etcd`, `http`, …).
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name, metadata_type, /))]
    fn initialize_ext(
        &self,
        py: Python<'_>,
        local_hostname: Option<String>,
        metadata_server: Option<String>,
        protocol: Option<String>,
        device_name: Option<String>,
        metadata_type: Option<String>,
    ) -> i32 {
        let (Some(local_hostname), Some(metadata_server), Some(protocol)) =
            (local_hostname, metadata_server, protocol)
        else {
            log_failure(
                py,
                "initialize: local_hostname, metadata_server and protocol must be strings, not None",
            );
            return -1;
        };
        let metadata = config::metadata_conn(&metadata_server, &metadata_type.unwrap_or_default());
        let device_name = device_name.unwrap_or_default();
        let (transport, note) = match config::mooncake_transport(
            &protocol,
            &device_name,
            cfg!(feature = "rdma"),
            &process_env,
        ) {
            Ok(choice) => choice,
            Err(reason) => {
                log_failure(py, &format!("initialize: {reason}"));
                return -1;
            }
        };
        let (rpc_ports, refused) = config::rpc_ports_or_default(&process_env);
        if let Some(reason) = refused {
            log_failure(py, &format!("initialize: {reason}"));
        }
        let options = EngineOptions {
            local_server_name: Some(local_hostname),
            metadata,
            // Shared memory reaches only peers on this host: TCP carries the rest.
            transports: match transport {
                TransportChoice::Shm => vec![TransportChoice::Shm, TransportChoice::Tcp],
                other => vec![other],
            },
            cluster_secret: None,
            transfer_timeout: Some(self.timeout),
            rpc_ports: Some(rpc_ports),
        };
        let _init = self.init.lock();
        if self.state.get().is_some() {
            log_failure(py, "initialize: this engine is already initialized");
            return -1;
        }
        match py.detach(|| Core::build(&options)) {
            Ok((core, notes)) => {
                for line in note.into_iter().chain(notes) {
                    log_failure(py, &format!("initialize: {line}"));
                }
                let _ = self.state.set(Arc::new(Initialized {
                    batches: Mutex::new(HashMap::new()),
                    next_batch: AtomicU64::new(1),
                    memory: LocalMemory::default(),
                    core,
                }));
                0
            }
            Err(reason) => {
                log_failure(py, &format!("initialize: {reason}"));
                -1
            }
        }
    }

    /// The handshake RPC port (peers reach this engine at `ip:port` in P2P mode); -1 before
    /// `initialize`.
    fn get_rpc_port(&self, py: Python<'_>) -> i32 {
        self.ready(py, "get_rpc_port")
            .map_or(-1, |s| i32::from(s.core.engine.rpc_port()))
    }

    /// The local segment name (`ip:port` in P2P mode); not in Mooncake, handy for logs.
    fn get_local_segment_name(&self, py: Python<'_>) -> Option<String> {
        self.ready(py, "get_local_segment_name")
            .map(|s| s.core.engine.segment_name().to_owned())
    }

    /// Which transports this engine runs (`["tcp"]`, `["rdma"]`); not in Mooncake.
    fn get_protocols(&self, py: Python<'_>) -> Vec<&'static str> {
        self.ready(py, "get_protocols")
            .map_or_else(Vec::new, |s| s.core.protocols.clone())
    }

    /// What this engine moved, as JSON (`TransferEngine::stats`); not in Mooncake.
    fn get_stats_json(&self, py: Python<'_>) -> String {
        self.ready(py, "get_stats_json").map_or_else(
            || "{}".to_owned(),
            |s| serde_json::to_string(&s.core.engine.stats()).unwrap_or_default(),
        )
    }
}

/// The local NIC topology as Mooncake's JSON priority matrix (`{}` without RDMA devices).
#[pyfunction]
#[pyo3(signature = (device_name = None))]
pub(crate) fn local_topology(py: Python<'_>, device_name: Option<String>) -> String {
    let devices = config::parse_devices(&device_name.unwrap_or_default());
    py.detach(|| topology_json(&devices))
}

#[cfg(feature = "rdma")]
fn topology_json(devices: &[String]) -> String {
    let mut config = tern_transport_rdma::RdmaConfig::from_env();
    if !devices.is_empty() {
        config.devices = devices.to_vec();
    }
    tern_transport_rdma::RdmaTransport::discover(config)
        .ok()
        .and_then(|rdma| serde_json::to_string(rdma.priority_matrix()).ok())
        .unwrap_or_else(|| "{}".to_owned())
}

#[cfg(not(feature = "rdma"))]
fn topology_json(_devices: &[String]) -> String {
    "{}".to_owned()
}
