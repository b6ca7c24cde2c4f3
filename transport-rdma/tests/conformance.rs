//! The engine's transport conformance suite over RDMA, on Soft-RoCE: two engines in one
//! process on one rxe device. Ignored on hosts without RDMA; `cargo xtask test` runs it in
//! the Soft-RoCE guest.

mod support;

use std::time::Duration;

use tern_engine::{TransferEngine, conformance};
use tern_transport_rdma::{RdmaConfig, RdmaError, RdmaTransport};

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn rdma_passes_the_conformance_suite() {
    support::setup(
        "rdma_passes_the_conformance_suite",
        Duration::from_secs(600),
    );
    conformance::run_all(&|| {
        TransferEngine::builder()
            .local_server_name("127.0.0.1")
            .transport(support::rdma_with(|_| {}))
    })
    .unwrap();
}

/// Without RDMA devices, discovery fails with an error that says what it looked for.
#[test]
fn no_rdma_devices_is_a_clear_error() {
    if std::env::var_os("TERN_IN_GUEST").is_some() {
        return;
    }
    let error = RdmaTransport::discover(RdmaConfig::default()).unwrap_err();
    assert!(matches!(error, RdmaError::NoDevice { .. }), "{error:?}");
    let text = error.to_string();
    assert!(text.contains("looked for any device"), "{text}");
    assert!(text.contains("no device"), "{text}");
    let error = RdmaTransport::discover(RdmaConfig {
        devices: vec!["mlx5_7".into()],
        ..RdmaConfig::default()
    })
    .unwrap_err();
    assert!(error.to_string().contains("mlx5_7"), "{error}");
}
