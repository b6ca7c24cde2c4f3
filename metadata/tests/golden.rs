//! Descriptors recorded from a running Mooncake node: Tern reads them, and writes them back
//! byte for byte (apart from nothing: keys sorted, compact, one trailing newline).

use tern_metadata::{DescriptorError, RpcMeta, SegmentDesc};

const TCP: &str = include_str!("golden/mooncake-tcp-segment.json");
const RDMA: &str = include_str!("golden/mooncake-rdma-segment.json");
const RPC_META: &str = include_str!("golden/mooncake-rpc-meta.json");

#[test]
fn tcp_segment_round_trips_byte_for_byte() {
    let desc = SegmentDesc::from_json(TCP.as_bytes()).unwrap();
    assert_eq!(desc.name, "mc-target");
    assert_eq!(desc.protocols(), ["tcp"]);
    assert_eq!(desc.tcp_proto_version, 2);
    assert!(desc.devices.is_empty());
    assert_eq!(desc.buffers[0].name, "mc-target");
    assert!(desc.buffers[0].rkey.is_none());
    assert_eq!(desc.to_json(), format!("{}\n", TCP.trim_end()));
}

#[test]
fn rdma_segment_round_trips_byte_for_byte() {
    let desc = SegmentDesc::from_json(RDMA.as_bytes()).unwrap();
    assert_eq!(desc.devices.len(), 1);
    assert_eq!(desc.devices[0].name, "rxe0");
    assert_eq!(desc.buffers[0].rkey.as_deref(), Some(&[712][..]));
    assert_eq!(desc.tcp_data_port, 0);
    assert_eq!(desc.tcp_proto_version, 1);
    let matrix = desc.priority_matrix.as_ref().unwrap();
    assert_eq!(matrix["cpu:0"][0], ["rxe0"]);
    assert!(matrix["cpu:0"][1].is_empty());
    assert_eq!(desc.to_json(), format!("{}\n", RDMA.trim_end()));
}

#[test]
fn rpc_meta_round_trips() {
    let meta: RpcMeta = serde_json::from_str(RPC_META).unwrap();
    assert_eq!(meta.ip_or_host_name, "127.0.0.1");
    assert_eq!(serde_json::to_string(&meta).unwrap(), RPC_META.trim_end());
}

#[test]
fn reader_tolerates_what_mooncake_tolerates() {
    let with_newline = format!("{TCP}\n\n");
    assert!(SegmentDesc::from_json(with_newline.as_bytes()).is_ok());
    // Absent tcp_proto_version means 1, absent timestamp is fine, unknown fields are ignored.
    let old = r#"{"name":"n","protocol":"tcp","tcp_data_port":5,"buffers":[{"name":"n","addr":4096,"length":10,"shm_name":"x"}]}"#;
    let desc = SegmentDesc::from_json(old.as_bytes()).unwrap();
    assert_eq!(desc.tcp_proto_version, 1);
    // Multi-protocol builds write an array.
    let multi = r#"{"name":"n","protocol":["rdma","hip"],"buffers":[]}"#;
    let desc = SegmentDesc::from_json(multi.as_bytes()).unwrap();
    assert!(desc.speaks("hip"));
    assert!(desc.to_json().contains(r#""protocol":["rdma","hip"]"#));
}

#[test]
fn reader_rejects_what_breaks_the_rules() {
    let cases = [
        // rkey count differs from device count
        RDMA.replace(r#""lkey":[712]"#, r#""lkey":[712,713]"#)
            .replace(r#""rkey":[712]"#, r#""rkey":[712,713]"#),
        // rkey and lkey counts differ
        RDMA.replace(r#""lkey":[712]"#, r#""lkey":[]"#),
        // zero address
        TCP.replace(r#""addr":140324754161664"#, r#""addr":0"#),
        // zero length
        TCP.replace(r#""length":1073741824"#, r#""length":0"#),
        // wraps around
        TCP.replace(
            r#""addr":140324754161664"#,
            r#""addr":18446744073709551615"#,
        ),
        // empty buffer name
        TCP.replace(r#""name":"mc-target"}"#, r#""name":""}"#),
        // device without a gid
        RDMA.replace(
            r#""gid":"00:00:00:00:00:00:00:00:00:00:ff:ff:0a:4d:00:01""#,
            r#""gid":"""#,
        ),
        // empty segment name
        TCP.replace(
            r#""name":"mc-target","protocol""#,
            r#""name":"","protocol""#,
        ),
    ];
    for (i, case) in cases.iter().enumerate() {
        assert!(
            matches!(
                SegmentDesc::from_json(case.as_bytes()),
                Err(DescriptorError::Invalid(_))
            ),
            "case {i} accepted: {case}"
        );
    }
    for garbage in [
        "",
        "{",
        "[]",
        "{\"name\":5}",
        "not json",
        "{\"buffers\":[]}",
    ] {
        assert!(
            matches!(
                SegmentDesc::from_json(garbage.as_bytes()),
                Err(DescriptorError::MalformedJson(_))
            ),
            "{garbage:?}"
        );
    }
}

#[test]
fn written_descriptors_are_readable_and_equal_but_for_the_timestamp() {
    let mut desc = SegmentDesc::from_json(TCP.as_bytes()).unwrap();
    desc.stamp_now();
    let again = SegmentDesc::from_json(desc.to_json().as_bytes()).unwrap();
    assert_eq!(again, desc);
    let original = SegmentDesc::from_json(TCP.as_bytes()).unwrap();
    assert!(again.same_content(&original));
    assert_ne!(again.timestamp, original.timestamp);
}
