//! The handshake RPC from the engine's side: answering Metadata, Probe, Notify (and handing
//! Connection to the transport that speaks it), and sending notifications and probes.

use std::sync::{Arc, Weak};

use tern_metadata::MetadataError;
use tern_metadata::rpc::{self, RpcError, RpcType};

use crate::engine::{EngineInner, TransferEngine};
use crate::error::EngineError;
use crate::transport::Transport;
use crate::types::{Notify, SegmentId};

/// Notifications kept before the oldest is dropped.
const MAX_QUEUED_NOTIFIES: usize = 65_536;

impl TransferEngine {
    /// Sends a small message to a segment's node over the handshake RPC; it shows up in the
    /// peer's [`TransferEngine::get_notifies`].
    pub fn send_notify(
        &self,
        target: SegmentId,
        name: &str,
        message: &str,
    ) -> Result<(), EngineError> {
        let peer = self
            .segment(target)
            .ok_or(EngineError::UnknownSegment(target))?;
        let endpoint = peer.rpc.endpoint();
        let body = serde_json::to_vec(&Notify {
            name: name.to_owned(),
            notify_msg: message.to_owned(),
        })
        .map_err(|e| EngineError::InvalidArgument(e.to_string()))?;
        let reply = rpc::call_segment(
            &endpoint,
            &peer.desc.name,
            RpcType::Notify,
            &body,
            &self.inner.rpc_client,
        )
        .map_err(MetadataError::from)?;
        let accepted = serde_json::from_slice::<Notify>(&reply)
            .map(|n| !n.notify_msg.is_empty())
            .unwrap_or(false);
        if !accepted {
            return Err(MetadataError::from(RpcError::Rejected {
                peer: endpoint,
                ty: RpcType::Notify,
                reason: String::from_utf8_lossy(&reply).trim().to_owned(),
            })
            .into());
        }
        Ok(())
    }

    /// Takes every notification received so far, oldest first.
    pub fn get_notifies(&self) -> Vec<Notify> {
        self.inner.notifies.lock().drain(..).collect()
    }

    /// Whether a segment's node answers a Probe RPC.
    pub fn probe(&self, target: SegmentId) -> Result<(), EngineError> {
        let peer = self
            .segment(target)
            .ok_or(EngineError::UnknownSegment(target))?;
        rpc::call_segment(
            &peer.rpc.endpoint(),
            &peer.desc.name,
            RpcType::Probe,
            b"{}",
            &self.inner.rpc_client,
        )
        .map_err(MetadataError::from)?;
        Ok(())
    }
}

impl EngineInner {
    pub(crate) fn push_notify(&self, notify: Notify) {
        let mut queue = self.notifies.lock();
        if queue.len() >= MAX_QUEUED_NOTIFIES {
            tracing::warn!("notify queue full; dropping the oldest notification");
            queue.pop_front();
        }
        queue.push_back(notify);
    }
}

/// Answers the handshake RPC for one engine.
pub(crate) fn handle_rpc(
    engine: &Weak<EngineInner>,
    ty: RpcType,
    body: &[u8],
) -> Result<Vec<u8>, String> {
    let engine = engine.upgrade().ok_or("engine is shutting down")?;
    let line = |value: serde_json::Value| {
        let mut text = value.to_string();
        text.push('\n');
        text.into_bytes()
    };
    let parse = || -> Result<serde_json::Value, String> {
        serde_json::from_slice(body).map_err(|e| format!("malformed JSON: {e}"))
    };
    match ty {
        RpcType::Metadata => {
            parse()?;
            Ok(engine.local_json.read().as_bytes().to_vec())
        }
        RpcType::Probe => {
            parse()?;
            Ok(line(serde_json::json!({"status": "success"})))
        }
        RpcType::Notify => {
            let notify: Notify =
                serde_json::from_value(parse()?).map_err(|e| format!("malformed notify: {e}"))?;
            engine.push_notify(notify);
            Ok(line(
                serde_json::json!({"name": "", "notify_msg": "success"}),
            ))
        }
        // The body belongs to the transport that speaks it, malformed or not: that transport
        // answers with a rejection rather than a dropped connection.
        RpcType::Connection => {
            let mut by_priority: Vec<&Arc<dyn Transport>> = engine.transports.iter().collect();
            by_priority.sort_by_key(|t| std::cmp::Reverse(t.priority()));
            Ok(by_priority
                .iter()
                .find_map(|t| t.handle_connection(body))
                .unwrap_or_else(|| {
                    line(serde_json::json!({
                        "reply_msg": "no RDMA transport is installed on this node"
                    }))
                }))
        }
    }
}
