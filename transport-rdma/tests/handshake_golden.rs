//! The Connection messages recorded from real Mooncake nodes must survive a parse and
//! re-encode byte for byte, and the passive-side checks must accept what Mooncake sends.

use tern_transport_rdma::handshake::{HandshakeDesc, NicPath, check_request};

const RECORDING: &str = include_str!("golden/mooncake-rdma-connection-rpc.txt");

/// One recorded frame: its direction (`REQ`/`REP`), type byte and JSON body without the
/// trailing newline.
struct Frame<'a> {
    direction: &'a str,
    kind: u8,
    json: &'a str,
}

fn frames() -> Vec<Frame<'static>> {
    let frames: Vec<Frame<'static>> = RECORDING
        .lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| {
            let mut parts = line.splitn(3, ' ');
            let direction = parts.next().unwrap();
            let kind = parts.next().unwrap().parse().unwrap();
            let json = parts.next().unwrap();
            Frame {
                direction,
                kind,
                json,
            }
        })
        .collect();
    assert_eq!(frames.len(), 5, "the recording has five frames");
    frames
}

fn parsed(frame: &Frame<'_>) -> HandshakeDesc {
    HandshakeDesc::parse(format!("{}\n", frame.json).as_bytes()).unwrap()
}

#[test]
fn every_frame_reencodes_byte_for_byte() {
    for (i, frame) in frames().iter().enumerate() {
        assert!(matches!(frame.direction, "REQ" | "REP"), "line {}", i + 1);
        assert_eq!(frame.kind, 0, "line {} is a Connection frame", i + 1);
        let body = parsed(frame).to_body();
        assert_eq!(
            String::from_utf8(body).unwrap(),
            format!("{}\n", frame.json),
            "line {}",
            i + 1
        );
    }
}

#[test]
fn line_4_is_the_ack_reply() {
    let frames = frames();
    assert_eq!(
        HandshakeDesc::ack_reply().to_body(),
        format!("{}\n", frames[3].json).into_bytes()
    );
    assert!(!parsed(&frames[3]).is_rejection());
}

#[test]
fn line_5_is_a_rejection() {
    let frames = frames();
    let desc = parsed(&frames[4]);
    assert!(desc.is_rejection());
    assert!(desc.reply_msg.contains("peer nic path inconsistency"));
    assert_eq!(
        HandshakeDesc::rejection(desc.reply_msg.clone()).to_body(),
        format!("{}\n", frames[4].json).into_bytes()
    );
}

#[test]
fn lines_1_and_3_differ_only_in_ready_ack() {
    let frames = frames();
    let (request, ready) = (parsed(&frames[0]), parsed(&frames[2]));
    assert_eq!(request.ready_ack, Some(false));
    assert!(!request.is_ready_ack());
    assert!(ready.is_ready_ack());
    assert_ne!(request, ready);
    assert_eq!(
        HandshakeDesc {
            ready_ack: Some(true),
            ..request
        },
        ready
    );
}

#[test]
fn line_2_answers_line_1() {
    let frames = frames();
    let (request, reply) = (parsed(&frames[0]), parsed(&frames[1]));
    assert_eq!(reply.peer_nic_path, request.local_nic_path);
    assert_eq!(reply.local_nic_path, request.peer_nic_path);
    assert_eq!(reply.qp_num.len(), request.qp_num.len());
    assert!(!reply.is_rejection());
}

#[test]
fn the_recorded_request_passes_the_checks_at_its_target() {
    let request = parsed(&frames()[0]);
    let accepted = check_request(&request, "10.77.0.1:17777", &["rxe0"], 64).unwrap();
    assert_eq!(accepted.peer, NicPath::new("10.77.0.1:15671", "rxe0"));
    assert_eq!(accepted.local_nic, "rxe0");
    assert_eq!(accepted.peer_qps, vec![17, 18]);
    assert_eq!(accepted.peer_lid, 0);
    assert_eq!(accepted.peer_gid.to_string(), request.local_gid);
    assert_eq!(accepted.peer_mtu, None);
    assert!(accepted.wants_ready_ack);
}

#[test]
fn the_recorded_request_is_rejected_elsewhere() {
    let request = parsed(&frames()[0]);
    let reason = check_request(&request, "10.77.0.1:15077", &["rxe0"], 64).unwrap_err();
    assert!(reason.contains("10.77.0.1:15077"), "{reason}");
    assert!(reason.contains("10.77.0.1:17777@rxe0"), "{reason}");
}
