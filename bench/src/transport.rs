//! The engine a run uses, with the transport `--protocol` names (tcp, rdma, or shm with TCP
//! beside it) set up from the flags.

use tern_engine::TransferEngine;
use tern_transport_rdma::topology::parse_device_list;
use tern_transport_rdma::{RdmaConfig, RdmaTransport};
use tern_transport_shm::{PtracePolicy, ShmConfig, ShmTransport};
use tern_transport_tcp::{TcpConfig, TcpTransport};

use crate::flags::{Args, ShmMemory, ShmPtrace};

/// Builds the engine: the transport of `--protocol`, the metadata server, the cluster secret,
/// and `--local_server_name` (else `default_name`).
pub(crate) fn engine(args: &Args, default_name: Option<&str>) -> Result<TransferEngine, String> {
    let mut builder = TransferEngine::builder()
        .metadata(args.metadata_server.clone())
        .merge_requests(!args.no_merge);
    if let Some(secret) = &args.cluster_secret {
        builder = builder.cluster_secret(secret);
    }
    let tcp = || {
        let defaults = TcpConfig::default();
        TcpTransport::new(TcpConfig {
            connections_per_peer: args
                .tcp_connections
                .unwrap_or(defaults.connections_per_peer),
            slice_size: args.tcp_slice_size.unwrap_or(defaults.slice_size),
            ..defaults
        })
    };
    builder = match args.protocol.as_str() {
        "tcp" => builder.transport(tcp()),
        "shm" => builder
            .transport(ShmTransport::new(ShmConfig {
                memfd_buffers: args.shm_memory == ShmMemory::Memfd,
                ptrace: match args.shm_ptrace {
                    ShmPtrace::Keep => PtracePolicy::Keep,
                    ShmPtrace::AllowSameUser => PtracePolicy::AllowSameUser,
                    ShmPtrace::Refuse => PtracePolicy::Refuse,
                },
                ..ShmConfig::default()
            }))
            .transport(tcp()),
        "rdma" => {
            let mut config = RdmaConfig::from_env();
            if let Some(list) = &args.device_name {
                config.devices = parse_device_list(list);
            }
            if let Some(path) = &args.nic_priority_matrix {
                config.topology_file = Some(path.clone());
            }
            builder.transport(RdmaTransport::discover(config).map_err(|e| e.to_string())?)
        }
        other => {
            return Err(format!(
                "--protocol={other} is not available; use --protocol=tcp, rdma or shm"
            ));
        }
    };
    if let Some(name) = args.local_server_name.as_deref().or(default_name) {
        builder = builder.local_server_name(name);
    }
    builder
        .build()
        .map_err(|e| format!("starting the engine: {e}"))
}
