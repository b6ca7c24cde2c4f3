//! Steps through a `TransferEngine` that the transports' and the bench's tests take alike.
//! Included by path (`#[path]`) into tests that depend on `tern-engine`, like `local.rs`.
// Each test binary takes only what it needs of this file.
#![allow(dead_code)]

use std::time::Duration;

use tern_engine::{
    OwnedBuffer, SegmentId, TransferEngine, TransferRequest, TransferStatus, Transport,
    TransportStats,
};

/// An engine on loopback with the cluster `secret` whose only transport is `transport`; its
/// transfers give up after 20 s, so a test fails rather than hangs.
pub fn secured_engine(secret: &str, transport: impl Transport) -> TransferEngine {
    TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .cluster_secret(secret)
        .transfer_timeout(Some(Duration::from_secs(20)))
        .transport(transport)
        .build()
        .unwrap()
}

/// Submits `requests` in one batch and waits (60 s at most): every task must complete with
/// all its bytes.
pub fn run_to_completion(engine: &TransferEngine, requests: &[TransferRequest]) {
    let batch = engine.allocate_batch(requests.len()).unwrap();
    engine.submit(&batch, requests).unwrap();
    batch.wait(Duration::from_secs(60));
    for (task, request) in requests.iter().enumerate() {
        let status = batch.task_status(task).unwrap();
        assert_eq!(
            status.status,
            TransferStatus::Completed,
            "task {task}: {status:?}"
        );
        assert_eq!(status.transferred_bytes, request.length as u64);
    }
}

/// What the engine's transport for `protocol` has counted.
pub fn transport_stats(engine: &TransferEngine, protocol: &str) -> TransportStats {
    engine
        .stats()
        .transports
        .into_iter()
        .find(|t| t.protocol == protocol)
        .unwrap()
}

/// Writes `data` from the start of `local` to the start of `remote` at `peer`, reads it back
/// into `local` just past it, and returns what came back.
pub fn write_then_read_back(
    engine: &TransferEngine,
    peer: SegmentId,
    local: &OwnedBuffer,
    remote: &OwnedBuffer,
    data: &[u8],
) -> Vec<u8> {
    let (len, remote) = (data.len(), remote.addr() as u64);
    local.write_at(0, data).unwrap();
    engine
        .transfer_sync(TransferRequest::write(local.addr(), peer, remote, len))
        .expect("the write there");
    engine
        .transfer_sync(TransferRequest::read(local.addr() + len, peer, remote, len))
        .expect("the read back");
    let mut back = vec![0u8; len];
    local.read_at(len, &mut back).unwrap();
    back
}
