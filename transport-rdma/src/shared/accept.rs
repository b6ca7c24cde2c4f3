//! The passive side of the Connection handshake: a peer's request checked, answered with
//! this node's QPs (or refused, having touched nothing), and its ready ACK.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{MAX_QPS_PER_ENDPOINT, Shared};
use crate::endpoint::{PeerQps, State};
use crate::handshake::{HandshakeDesc, check_request, path_mtu};
use crate::worker::Msg;

impl Shared {
    /// The passive side: answers a Connection message (a rejection for anything wrong,
    /// having touched nothing).
    pub fn handle_connection(&self, body: &[u8]) -> Vec<u8> {
        let reply = match HandshakeDesc::parse(body) {
            Err(e) => HandshakeDesc::rejection(format!("malformed handshake: {e}")),
            Ok(desc) => self.answer(&desc).unwrap_or_else(HandshakeDesc::rejection),
        };
        reply.to_body()
    }

    fn answer(&self, desc: &HandshakeDesc) -> Result<HandshakeDesc, String> {
        let _span = tracing::debug_span!("rdma_accept", peer = %desc.local_nic_path).entered();
        if self.stopping.load(Ordering::Acquire) {
            return Err("this node is shutting down".into());
        }
        let names: Vec<&str> = self.names.iter().map(String::as_str).collect();
        let request = check_request(
            desc,
            &self.context.segment_name,
            &names,
            MAX_QPS_PER_ENDPOINT,
        )?;
        let nic = self
            .names
            .iter()
            .position(|n| *n == request.local_nic)
            .ok_or_else(|| format!("no NIC {}", request.local_nic))?;
        let slot = &self.nics[nic];
        let key: Arc<str> = Arc::from(request.peer.to_string());
        if desc.is_ready_ack() {
            let ep = slot.store.lock().get(&key);
            return match ep {
                Some(ep) if ep.peer_qps() == request.peer_qps => {
                    if ep.state() == State::WaitAck && ep.set_state(State::Ready) {
                        let _ = slot.workers[ep.worker].send(Msg::Changed(ep));
                    }
                    Ok(HandshakeDesc::ack_reply())
                }
                _ => Err(format!(
                    "no connection from {key} with QPs {:?} awaits a ready ACK",
                    request.peer_qps
                )),
            };
        }
        let remote = PeerQps {
            gid: request.peer_gid,
            lid: request.peer_lid,
            qps: request.peer_qps.clone(),
            mtu: path_mtu(slot.nic.mtu, request.peer_mtu),
            psn: request.peer_psn,
        };
        let worker = self.worker_index(&key);
        let mut store = slot.store.lock();
        let existing = store.get(&key);
        let ep = match existing {
            Some(ep) if ep.state() == State::Connecting && ep.qps.len() == remote.qps.len() => {
                // Both sides opened at once: our pending QPs pair with theirs, and our own
                // handshake, answered the same way, completes the pairing.
                ep.connect(&slot.nic, &remote, &self.template)?;
                ep
            }
            _ => {
                let state = if request.wants_ready_ack {
                    State::WaitAck
                } else {
                    State::Ready
                };
                let ep = self.new_endpoint(slot, &key, worker, remote.qps.len(), state)?;
                ep.connect(&slot.nic, &remote, &self.template)?;
                let displaced = store.insert(ep.clone());
                drop(store);
                self.decommission_displaced(displaced);
                ep
            }
        };
        // Our PSN only to a peer that sent its own: a Mooncake peer starts at 0 both ways.
        let psn = request.peer_psn.map(|_| ep.psn);
        Ok(self.my_desc(nic, &key, ep.qp_nums(), psn))
    }
}
