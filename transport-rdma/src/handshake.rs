//! Mooncake's RDMA Connection handshake message (`HandShakeDesc`): the JSON body of
//! handshake-RPC frames of type 0, and the checks the passive side makes before it touches a
//! queue pair.
//!
//! The JSON must stay byte-identical to Mooncake's (compact, keys sorted, one trailing
//! newline), so fields are declared in alphabetical order and Tern's extensions are omitted
//! when unset. This module must not frame messages (the metadata crate's RPC does that), open
//! sockets, or touch verbs objects.

use std::collections::HashSet;
use std::fmt;

use serde::{Deserialize, Serialize};
use tern_verbs::Gid;

/// A Connection message, either direction. Field order is alphabetical on purpose: serde
/// writes fields in declaration order and Mooncake's JSON has sorted keys.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct HandshakeDesc {
    /// The sender's GID, sixteen lowercase hex pairs joined by `:`.
    #[serde(default)]
    pub local_gid: String,
    /// The sender's LID (0 on RoCE).
    #[serde(default)]
    pub local_lid: u16,
    /// The sender's NIC path, `<server name>@<device>`.
    #[serde(default)]
    pub local_nic_path: String,
    /// Tern's extension: the sender's path MTU in bytes (256..=4096). Peers without it
    /// (Mooncake) omit it; the receiver then uses its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    /// Opaque; Mooncake sends it empty.
    #[serde(default)]
    pub payload: String,
    /// The NIC path the sender wants to reach, `<server name>@<device>`.
    #[serde(default)]
    pub peer_nic_path: String,
    /// Tern's extension: the first packet sequence number of the sender's QPs (24 bits,
    /// random per endpoint), which the receiver's QPs expect. Peers without it (Mooncake)
    /// omit it and ignore it; both ends then start at 0, as Mooncake does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub psn: Option<u32>,
    /// The sender's QP numbers, one per QP of the endpoint; `qp_num[i]` pairs with the
    /// receiver's `qp_num[i]`.
    #[serde(default)]
    pub qp_num: Vec<u32>,
    /// Present = the sender supports the ready-ACK extension; true = this frame IS the ready
    /// ACK.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_ack: Option<bool>,
    /// Non-empty = the handshake was rejected, and this is why.
    #[serde(default)]
    pub reply_msg: String,
}

/// Why a handshake body could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HandshakeError {
    /// The body is not a JSON object of `HandShakeDesc`'s shape (the message names the field
    /// and position). The peer speaks something else or is broken; answer with a rejection
    /// and do not touch the endpoint.
    #[error("malformed handshake JSON: {0}")]
    MalformedJson(String),
}

impl HandshakeDesc {
    /// Reads a Connection body. Surrounding whitespace (Mooncake's trailing newline) and keys
    /// of other transports (`efa_addr`, `cxi_addr`, `jetty_num`, `barex_port`, ...) are
    /// accepted; a known key of the wrong type is an error.
    pub fn parse(body: &[u8]) -> Result<Self, HandshakeError> {
        serde_json::from_slice(body).map_err(|e| HandshakeError::MalformedJson(e.to_string()))
    }

    /// The body to send: compact JSON with sorted keys and one trailing newline, as Mooncake
    /// writes it.
    pub fn to_body(&self) -> Vec<u8> {
        // Strings, integers, a bool and a list of integers always serialize, so the error arm
        // is unreachable; it still yields a parseable (empty) desc rather than a panic.
        let mut body = serde_json::to_vec(self).unwrap_or_else(|_| b"{}".to_vec());
        body.push(b'\n');
        body
    }

    /// The passive side's answer to a request it refuses: an empty desc carrying `reason`.
    pub fn rejection(reason: impl Into<String>) -> Self {
        Self {
            reply_msg: reason.into(),
            ..Self::default()
        }
    }

    /// The passive side's answer to a ready ACK: an empty desc.
    pub fn ack_reply() -> Self {
        Self::default()
    }

    /// Whether this frame is the ready ACK itself (sent once the active side's QPs are in
    /// RTS).
    pub fn is_ready_ack(&self) -> bool {
        self.ready_ack == Some(true)
    }

    /// Whether this frame refuses the handshake (`reply_msg` is set).
    pub fn is_rejection(&self) -> bool {
        !self.reply_msg.is_empty()
    }
}

/// A NIC path, `<server name>@<device>`: one NIC of one node.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NicPath {
    /// The server name (`host:port` in P2P mode, or the segment name).
    pub server: String,
    /// The RDMA device name (`mlx5_0`, `rxe0`).
    pub nic: String,
}

impl NicPath {
    /// A path from its two parts.
    pub fn new(server: impl Into<String>, nic: impl Into<String>) -> Self {
        Self {
            server: server.into(),
            nic: nic.into(),
        }
    }

    /// Splits `text` at its last `@` (device names never contain one); both parts must be
    /// non-empty.
    pub fn parse(text: &str) -> Option<Self> {
        let (server, nic) = text.rsplit_once('@')?;
        (!server.is_empty() && !nic.is_empty()).then(|| Self::new(server, nic))
    }
}

impl fmt::Display for NicPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.server, self.nic)
    }
}

/// A Connection request that passed [`check_request`]: everything the passive side needs to
/// bring its QPs up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectRequest {
    /// The sender's NIC (its `local_nic_path`): the key of the endpoint on this side.
    pub peer: NicPath,
    /// Our device the sender wants to reach (from its `peer_nic_path`).
    pub local_nic: String,
    /// The sender's GID.
    pub peer_gid: Gid,
    /// The sender's LID.
    pub peer_lid: u16,
    /// The sender's QP numbers, in pairing order.
    pub peer_qps: Vec<u32>,
    /// The sender's path MTU, if it is a Tern node.
    pub peer_mtu: Option<u32>,
    /// The sender's first packet sequence number, if it is a Tern node.
    pub peer_psn: Option<u32>,
    /// The sender supports the ready-ACK extension (the key was present).
    pub wants_ready_ack: bool,
}

/// The path MTUs an RDMA QP can use, in bytes.
pub const VALID_MTUS: [u32; 5] = [256, 512, 1024, 2048, 4096];

/// QP numbers are 24 bits on the wire; a larger one cannot name a real QP.
const MAX_QP_NUMBER: u32 = 0x00ff_ffff;

/// Packet sequence numbers are 24 bits on the wire too.
pub const MAX_PSN: u32 = 0x00ff_ffff;

/// A random first packet sequence number (24 bits) for a new endpoint's QPs. Between Tern
/// peers it makes a packet injected into an established connection by a host that did not
/// see the handshake land outside the expected sequence window; it is no authentication.
pub fn random_psn() -> u32 {
    let mut bytes = [0u8; 4];
    if getrandom::fill(&mut bytes).is_err() {
        // No system randomness: the standard library's per-process random hash keys, mixed
        // with the time, still vary per endpoint and per process.
        use std::hash::{BuildHasher, Hasher};
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        bytes = (hasher.finish() as u32).to_le_bytes();
    }
    u32::from_le_bytes(bytes) & MAX_PSN
}

/// A peer's `psn` field, checked: `Err` names a value that does not fit 24 bits.
pub fn check_psn(psn: Option<u32>) -> Result<Option<u32>, String> {
    match psn {
        Some(psn) if psn > MAX_PSN => Err(format!(
            "psn {psn} does not fit the 24 bits of a packet sequence number"
        )),
        psn => Ok(psn),
    }
}

/// Checks a Connection request before anything is created for it. `Err` holds the reason to
/// send back in [`HandshakeDesc::rejection`]; it names the offending values.
///
/// A ready ACK passes the same checks (it repeats the request with `ready_ack` true), so the
/// caller can use this to find the endpoint it acknowledges.
pub fn check_request(
    desc: &HandshakeDesc,
    my_server_name: &str,
    my_nics: &[&str],
    max_qps: usize,
) -> Result<ConnectRequest, String> {
    if desc.is_rejection() {
        return Err(format!(
            "a request must not carry reply_msg, got {:?}",
            desc.reply_msg
        ));
    }
    let peer = NicPath::parse(&desc.local_nic_path).ok_or_else(|| {
        format!(
            "local_nic_path {:?} is not <server name>@<device>",
            desc.local_nic_path
        )
    })?;
    let target = NicPath::parse(&desc.peer_nic_path).ok_or_else(|| {
        format!(
            "peer_nic_path {:?} is not <server name>@<device>",
            desc.peer_nic_path
        )
    })?;
    if target.server != my_server_name {
        return Err(format!(
            "peer nic path inconsistency, expect {my_server_name}@{} while got {target}",
            target.nic
        ));
    }
    if !my_nics.contains(&target.nic.as_str()) {
        return Err(format!(
            "peer_nic_path {target} names device {:?}, which this node does not have (it has: {})",
            target.nic,
            my_nics.join(", ")
        ));
    }
    check_qp_numbers(&desc.qp_num, max_qps)?;
    let peer_gid = Gid::parse(&desc.local_gid)
        .ok_or_else(|| format!("local_gid {:?} is not a GID", desc.local_gid))?;
    if peer_gid.is_zero() {
        return Err(format!("local_gid {:?} is all zero", desc.local_gid));
    }
    if let Some(mtu) = desc.mtu
        && !VALID_MTUS.contains(&mtu)
    {
        return Err(format!(
            "mtu {mtu} is not one of 256, 512, 1024, 2048, 4096"
        ));
    }
    let peer_psn = check_psn(desc.psn)?;
    Ok(ConnectRequest {
        peer,
        local_nic: target.nic,
        peer_gid,
        peer_lid: desc.local_lid,
        peer_qps: desc.qp_num.clone(),
        peer_mtu: desc.mtu,
        peer_psn,
        wants_ready_ack: desc.ready_ack.is_some(),
    })
}

fn check_qp_numbers(qps: &[u32], max_qps: usize) -> Result<(), String> {
    if qps.is_empty() {
        return Err("qp_num is empty: the request names no QP to pair with".to_owned());
    }
    if qps.len() > max_qps {
        return Err(format!(
            "qp_num lists {} QPs, more than the {max_qps} this node pairs per endpoint",
            qps.len()
        ));
    }
    let mut seen = HashSet::with_capacity(qps.len());
    for &qp in qps {
        if qp == 0 || qp > MAX_QP_NUMBER {
            return Err(format!(
                "qp_num {qps:?} contains {qp}, which is not a valid QP number (1..=16777215)"
            ));
        }
        if !seen.insert(qp) {
            return Err(format!("qp_num {qps:?} lists QP {qp} twice"));
        }
    }
    Ok(())
}

/// The path MTU both sides can use: the smaller of ours and the peer's, ours when the peer
/// did not say (a Mooncake node).
pub fn path_mtu(own: u32, peer: Option<u32>) -> u32 {
    peer.map_or(own, |peer| own.min(peer))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GID: &str = "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:4d:00:01";
    const ME: &str = "10.0.0.2:17777";

    fn request() -> HandshakeDesc {
        HandshakeDesc {
            local_gid: GID.to_owned(),
            local_lid: 0,
            local_nic_path: "10.0.0.1:15671@mlx5_0".to_owned(),
            mtu: None,
            payload: String::new(),
            peer_nic_path: format!("{ME}@mlx5_1"),
            psn: None,
            qp_num: vec![17, 18],
            ready_ack: Some(false),
            reply_msg: String::new(),
        }
    }

    fn check(desc: &HandshakeDesc) -> Result<ConnectRequest, String> {
        check_request(desc, ME, &["mlx5_0", "mlx5_1"], 4)
    }

    fn rejected_with(desc: &HandshakeDesc, needles: &[&str]) {
        let reason = check(desc).expect_err("request should be rejected");
        for needle in needles {
            assert!(
                reason.contains(needle),
                "{reason:?} does not mention {needle:?}"
            );
        }
    }

    #[test]
    fn accepts_a_good_request() {
        let accepted = check(&request()).unwrap();
        assert_eq!(
            accepted,
            ConnectRequest {
                peer: NicPath::new("10.0.0.1:15671", "mlx5_0"),
                local_nic: "mlx5_1".to_owned(),
                peer_gid: Gid::parse(GID).unwrap(),
                peer_lid: 0,
                peer_qps: vec![17, 18],
                peer_mtu: None,
                peer_psn: None,
                wants_ready_ack: true,
            }
        );
    }

    #[test]
    fn a_tern_peer_sends_its_psn_in_sorted_position_and_mooncake_omits_it() {
        let tern = HandshakeDesc {
            psn: Some(0x00ab_cdef),
            ..request()
        };
        let body = String::from_utf8(tern.to_body()).unwrap();
        let (nic_path, psn, qps) = (
            body.find("\"peer_nic_path\"").unwrap(),
            body.find("\"psn\":11259375").unwrap(),
            body.find("\"qp_num\"").unwrap(),
        );
        assert!(nic_path < psn && psn < qps, "keys stay sorted: {body}");
        assert_eq!(HandshakeDesc::parse(body.as_bytes()), Ok(tern.clone()));
        assert_eq!(check(&tern).unwrap().peer_psn, Some(0x00ab_cdef));
        let mooncake = String::from_utf8(request().to_body()).unwrap();
        assert!(!mooncake.contains("psn"), "{mooncake}");
        assert_eq!(check(&request()).unwrap().peer_psn, None);
    }

    #[test]
    fn rejects_a_psn_beyond_24_bits() {
        let desc = HandshakeDesc {
            psn: Some(MAX_PSN + 1),
            ..request()
        };
        rejected_with(&desc, &["psn", "16777216", "24 bits"]);
        assert!(check_psn(Some(MAX_PSN)).is_ok());
    }

    #[test]
    fn random_psns_fit_24_bits_and_vary() {
        let psns: HashSet<u32> = (0..64).map(|_| random_psn()).collect();
        assert!(psns.iter().all(|&psn| psn <= MAX_PSN));
        // 64 draws of 24 bits: a repeat is a 1-in-8000 chance, all the same none.
        assert!(psns.len() > 32, "{psns:?}");
    }

    #[test]
    fn ready_ack_absent_means_no_extension() {
        let desc = HandshakeDesc {
            ready_ack: None,
            mtu: Some(1024),
            ..request()
        };
        let accepted = check(&desc).unwrap();
        assert!(!accepted.wants_ready_ack);
        assert_eq!(accepted.peer_mtu, Some(1024));
    }

    #[test]
    fn rejects_a_request_carrying_reply_msg() {
        let desc = HandshakeDesc {
            reply_msg: "oops".to_owned(),
            ..request()
        };
        rejected_with(&desc, &["reply_msg", "oops"]);
    }

    #[test]
    fn rejects_bad_local_nic_paths() {
        for path in ["", "no-at-sign", "@mlx5_0", "10.0.0.1:1@"] {
            let desc = HandshakeDesc {
                local_nic_path: path.to_owned(),
                ..request()
            };
            rejected_with(&desc, &["local_nic_path", &format!("{path:?}")]);
        }
    }

    #[test]
    fn rejects_bad_peer_nic_paths() {
        let desc = HandshakeDesc {
            peer_nic_path: "mlx5_1".to_owned(),
            ..request()
        };
        rejected_with(&desc, &["peer_nic_path", "\"mlx5_1\""]);
    }

    #[test]
    fn rejects_a_request_for_another_server() {
        let desc = HandshakeDesc {
            peer_nic_path: "10.0.0.9:17777@mlx5_1".to_owned(),
            ..request()
        };
        rejected_with(&desc, &["inconsistency", ME, "10.0.0.9:17777@mlx5_1"]);
    }

    #[test]
    fn rejects_a_nic_this_node_lacks() {
        let desc = HandshakeDesc {
            peer_nic_path: format!("{ME}@mlx5_7"),
            ..request()
        };
        rejected_with(&desc, &["mlx5_7", "mlx5_0, mlx5_1"]);
    }

    #[test]
    fn rejects_bad_qp_lists() {
        let cases: [(Vec<u32>, &[&str]); 5] = [
            (vec![], &["qp_num", "empty"]),
            (vec![1, 2, 3, 4, 5], &["5 QPs", "4"]),
            (vec![17, 0], &["[17, 0]", "contains 0"]),
            (vec![17, 18, 17], &["[17, 18, 17]", "17 twice"]),
            (vec![0x0100_0000], &["16777216"]),
        ];
        for (qps, needles) in cases {
            let desc = HandshakeDesc {
                qp_num: qps,
                ..request()
            };
            rejected_with(&desc, needles);
        }
        let four = HandshakeDesc {
            qp_num: vec![1, 2, 3, 0x00ff_ffff],
            ..request()
        };
        assert!(check(&four).is_ok());
    }

    #[test]
    fn rejects_bad_gids() {
        for gid in [
            "",
            "fe80::1",
            "zz:00:00:00:00:00:00:00:00:00:ff:ff:0a:4d:00:01",
        ] {
            let desc = HandshakeDesc {
                local_gid: gid.to_owned(),
                ..request()
            };
            rejected_with(&desc, &["local_gid", &format!("{gid:?}"), "not a GID"]);
        }
        let zero = HandshakeDesc {
            local_gid: ["00"; 16].join(":"),
            ..request()
        };
        rejected_with(&zero, &["all zero"]);
    }

    #[test]
    fn rejects_bad_mtus_and_accepts_valid_ones() {
        for mtu in [0, 255, 1000, 1500, 8192, 9000] {
            let desc = HandshakeDesc {
                mtu: Some(mtu),
                ..request()
            };
            rejected_with(&desc, &[&format!("mtu {mtu}")]);
        }
        for mtu in VALID_MTUS {
            let desc = HandshakeDesc {
                mtu: Some(mtu),
                ..request()
            };
            assert_eq!(check(&desc).unwrap().peer_mtu, Some(mtu));
        }
    }

    #[test]
    fn nic_path_splits_at_the_last_at_sign() {
        assert_eq!(
            NicPath::parse("user@host:1@rxe0"),
            Some(NicPath::new("user@host:1", "rxe0"))
        );
        assert_eq!(NicPath::parse("a@b").unwrap().to_string(), "a@b");
        assert_eq!(NicPath::parse("a@"), None);
        assert_eq!(NicPath::parse("@b"), None);
        assert_eq!(NicPath::parse("ab"), None);
    }

    #[test]
    fn parse_is_tolerant_of_whitespace_and_unknown_keys() {
        let body = b"  {\"qp_num\":[5],\"efa_addr\":\"0a0b\",\"jetty_num\":[1],\"barex_port\":7,\"cxi_addr\":{\"x\":1}}\r\n\n";
        let desc = HandshakeDesc::parse(body).unwrap();
        assert_eq!(desc.qp_num, vec![5]);
        assert_eq!(desc.ready_ack, None);
        assert_eq!(desc.local_gid, "");
    }

    #[test]
    fn parse_names_the_problem_with_wrong_types() {
        let cases: [(&[u8], &str); 6] = [
            (br#"{"local_lid":"zero"}"#, "invalid type"),
            (br#"{"local_lid":70000}"#, "70000"),
            (br#"{"qp_num":[-1]}"#, "-1"),
            (br#"{"ready_ack":"yes"}"#, "invalid type"),
            (b"[1,2]", "invalid type"),
            (b"", "EOF"),
        ];
        for (body, needle) in cases {
            let HandshakeError::MalformedJson(reason) = HandshakeDesc::parse(body).unwrap_err();
            assert!(reason.contains(needle), "{reason:?} lacks {needle:?}");
        }
        assert!(HandshakeDesc::parse(b"{} trailing").is_err());
        assert!(HandshakeDesc::parse(&[0xff, 0xfe]).is_err());
    }

    #[test]
    fn to_body_is_compact_sorted_and_newline_terminated() {
        let desc = HandshakeDesc {
            mtu: Some(1024),
            ready_ack: Some(true),
            ..request()
        };
        let body = String::from_utf8(desc.to_body()).unwrap();
        assert_eq!(
            body,
            format!(
                "{{\"local_gid\":\"{GID}\",\"local_lid\":0,\"local_nic_path\":\"10.0.0.1:15671@mlx5_0\",\"mtu\":1024,\"payload\":\"\",\"peer_nic_path\":\"{ME}@mlx5_1\",\"qp_num\":[17,18],\"ready_ack\":true,\"reply_msg\":\"\"}}\n"
            )
        );
        assert_eq!(HandshakeDesc::parse(body.as_bytes()).unwrap(), desc);
    }

    #[test]
    fn rejection_and_ack_reply_shapes() {
        let rejection = HandshakeDesc::rejection("no");
        assert!(rejection.is_rejection());
        assert!(!rejection.is_ready_ack());
        assert_eq!(rejection.ready_ack, None);
        assert_eq!(rejection.mtu, None);
        let ack = HandshakeDesc::ack_reply();
        assert!(!ack.is_rejection());
        assert!(!ack.is_ready_ack());
        assert_eq!(ack, HandshakeDesc::default());
        assert!(!request().is_ready_ack());
        let ready = HandshakeDesc {
            ready_ack: Some(true),
            ..request()
        };
        assert!(ready.is_ready_ack());
    }

    #[test]
    fn path_mtu_takes_the_smaller() {
        assert_eq!(path_mtu(4096, None), 4096);
        assert_eq!(path_mtu(4096, Some(1024)), 1024);
        assert_eq!(path_mtu(1024, Some(4096)), 1024);
    }
}
