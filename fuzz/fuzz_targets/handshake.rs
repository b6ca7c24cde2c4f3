//! The RDMA Connection handshake body (`HandShakeDesc` JSON, the payload of handshake-RPC
//! frames of type 0): `HandshakeDesc::parse`, then `check_request` as the passive side of
//! `10.77.0.1:17777` with NICs `rxe0` and `rxe1` runs it before touching a queue pair.
//! Properties: a parsed desc survives `to_body` → `parse` unchanged; an accepted request
//! names one of our NICs, 1..=4 distinct 24-bit QP numbers, a non-zero GID that prints and
//! parses back, a valid MTU if any, and the sender's NIC path verbatim; a refused one yields
//! a rejection whose body parses back as a rejection.
#![cfg_attr(fuzzing, no_main)]

use std::collections::HashSet;

use tern_transport_rdma::handshake::{HandshakeDesc, VALID_MTUS, check_request};
use tern_verbs::Gid;

const ME: &str = "10.77.0.1:17777";
const NICS: [&str; 2] = ["rxe0", "rxe1"];
const MAX_QPS: usize = 4;

tern_fuzz::target!(|data| {
    let Ok(desc) = HandshakeDesc::parse(data) else {
        return;
    };
    let body = desc.to_body();
    assert_eq!(body.last(), Some(&b'\n'));
    assert_eq!(
        HandshakeDesc::parse(&body).as_ref(),
        Ok(&desc),
        "round trip"
    );
    match check_request(&desc, ME, &NICS, MAX_QPS) {
        Ok(request) => {
            assert!(!desc.is_rejection());
            assert!(NICS.contains(&request.local_nic.as_str()));
            assert_eq!(desc.peer_nic_path, format!("{ME}@{}", request.local_nic));
            assert_eq!(request.peer.to_string(), desc.local_nic_path);
            assert_eq!(request.peer_qps, desc.qp_num);
            assert!(!request.peer_qps.is_empty() && request.peer_qps.len() <= MAX_QPS);
            assert!(
                request
                    .peer_qps
                    .iter()
                    .all(|&qp| (1..=0x00ff_ffff).contains(&qp))
            );
            let distinct: HashSet<u32> = request.peer_qps.iter().copied().collect();
            assert_eq!(distinct.len(), request.peer_qps.len());
            assert!(!request.peer_gid.is_zero());
            assert_eq!(
                Gid::parse(&request.peer_gid.to_string()),
                Some(request.peer_gid)
            );
            assert_eq!(request.peer_lid, desc.local_lid);
            assert_eq!(request.peer_mtu, desc.mtu);
            assert!(request.peer_mtu.is_none_or(|mtu| VALID_MTUS.contains(&mtu)));
            assert_eq!(request.wants_ready_ack, desc.ready_ack.is_some());
        }
        Err(reason) => {
            assert!(!reason.is_empty());
            let rejection = HandshakeDesc::rejection(reason.clone());
            let back = HandshakeDesc::parse(&rejection.to_body()).expect("a rejection parses");
            assert!(back.is_rejection() && !back.is_ready_ack());
            assert_eq!(back.reply_msg, reason);
        }
    }
});
