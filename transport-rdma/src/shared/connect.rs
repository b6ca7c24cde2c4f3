//! The active side of the Connection handshake: this node's QPs go out, the peer's come back
//! and this node's connect to them.

use tern_engine::PeerSegment;
use tern_metadata::rpc::RpcType;
use tern_verbs::Gid;

use super::Shared;
use crate::endpoint::{Endpoint, PeerQps};
use crate::handshake::{HandshakeDesc, check_psn, path_mtu};

impl Shared {
    pub(super) fn my_desc(
        &self,
        nic: usize,
        peer_path: &str,
        qp_num: Vec<u32>,
        psn: Option<u32>,
    ) -> HandshakeDesc {
        let n = &self.nics[nic].nic;
        HandshakeDesc {
            local_gid: n.gid.gid.to_string(),
            local_lid: n.lid,
            local_nic_path: self.local_path(nic),
            mtu: Some(n.mtu),
            payload: String::new(),
            peer_nic_path: peer_path.to_owned(),
            psn,
            qp_num,
            ready_ack: Some(false),
            reply_msg: String::new(),
        }
    }

    /// The active side of the Connection handshake: our QPs go out, the peer's come back and
    /// ours connect to them; then the ready ACK, if the peer speaks it.
    pub(super) fn handshake(&self, ep: &Endpoint, peer: &PeerSegment) -> Result<(), String> {
        let nic = &self.nics[ep.nic].nic;
        let _span = tracing::debug_span!("rdma_connect", path = %ep.key, nic = %nic.name).entered();
        let mut request = self.my_desc(ep.nic, &ep.key, ep.qp_nums(), Some(ep.psn));
        let call = |request: &HandshakeDesc| -> Result<HandshakeDesc, String> {
            let reply = self
                .context
                .call_peer(
                    peer,
                    RpcType::Connection,
                    &request.to_body(),
                    Some(self.config.handshake_timeout),
                )
                .map_err(|e| e.to_string())?;
            let reply = HandshakeDesc::parse(&reply)
                .map_err(|e| format!("{} answered the handshake with {e}", ep.key))?;
            if reply.is_rejection() {
                return Err(format!(
                    "{} refused the connection: {}",
                    ep.key, reply.reply_msg
                ));
            }
            Ok(reply)
        };
        let reply = call(&request)?;
        ep.mark_answered();
        let gid = Gid::parse(&reply.local_gid)
            .filter(|g| !g.is_zero())
            .ok_or_else(|| format!("{} answered with GID {:?}", ep.key, reply.local_gid))?;
        let remote = PeerQps {
            gid,
            lid: reply.local_lid,
            qps: reply.qp_num.clone(),
            mtu: path_mtu(nic.mtu, reply.mtu),
            psn: check_psn(reply.psn).map_err(|e| format!("{} answered with {e}", ep.key))?,
        };
        ep.connect(nic, &remote, &self.template)?;
        if reply.ready_ack.is_some() {
            request.ready_ack = Some(true);
            call(&request)?;
        }
        Ok(())
    }
}
