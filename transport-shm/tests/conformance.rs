//! The conformance suite over the shared-memory transport alone: with memfd buffers (the
//! initiator maps the target's), and with ordinary memory. The suite runs both engines in
//! one process, where cross-memory attach into oneself is refused and the target's registry
//! is used directly; cross-memory attach between two processes is proved by
//! `bench/tests/shm.rs`.

use tern_engine::TransferEngine;
use tern_transport_shm::{ShmConfig, ShmTransport};

#[test]
fn conformance_memfd_path() {
    tern_engine::conformance::run_all(&|| {
        TransferEngine::builder()
            .local_server_name("127.0.0.1")
            .transport(ShmTransport::default())
    })
    .unwrap();
}

#[test]
fn conformance_plain_memory_in_one_process() {
    tern_engine::conformance::run_all(&|| {
        TransferEngine::builder()
            .local_server_name("127.0.0.1")
            .transport(ShmTransport::new(ShmConfig {
                memfd_buffers: false,
                ..ShmConfig::default()
            }))
    })
    .unwrap();
}
