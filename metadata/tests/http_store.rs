//! The HTTP store against the embedded HTTP metadata server, over real loopback sockets.

use std::io::{Read, Write};
use std::net::TcpStream;

use tern_metadata::http::{HttpMetadataServer, HttpStore};
use tern_metadata::{MetadataError, MetadataStore, RpcMeta, SegmentDesc};

const GOLDEN_TCP: &str = include_str!("golden/mooncake-tcp-segment.json");

fn raw(port: u16, request: &str) -> String {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    reply
}

#[test]
fn store_round_trips_through_the_server_with_mooncakes_keys() {
    let server = HttpMetadataServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = server.local_addr().port();
    let store = HttpStore::new(&format!("http://127.0.0.1:{port}/metadata")).unwrap();
    let desc = SegmentDesc::from_json(GOLDEN_TCP.as_bytes()).unwrap();
    store.publish_segment("mc-target", &desc).unwrap();
    assert_eq!(store.fetch_segment("mc-target").unwrap(), desc);
    let meta = RpcMeta {
        ip_or_host_name: "127.0.0.1".into(),
        rpc_port: 15123,
    };
    store.publish_rpc_meta("mc-target", &meta).unwrap();
    assert_eq!(store.rpc_meta("mc-target").unwrap(), meta);

    // What a Mooncake client sends: GET <path>?key=<escaped key>.
    let reply = raw(
        port,
        "GET /metadata?key=mooncake%2Fram%2Fmc-target HTTP/1.1\r\nHost: x\r\n\r\n",
    );
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.ends_with(&desc.to_json()), "{reply}");

    store.remove_segment("mc-target").unwrap();
    assert!(matches!(
        store.fetch_segment("mc-target"),
        Err(MetadataError::SegmentNotFound(_))
    ));
    let reply = raw(
        port,
        "GET /metadata?key=mooncake%2Fram%2Fmc-target HTTP/1.1\r\n\r\n",
    );
    assert!(reply.starts_with("HTTP/1.1 404"), "{reply}");
}

#[test]
fn bad_values_and_bad_requests_are_named_not_fatal() {
    let server = HttpMetadataServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = server.local_addr().port();
    let body = "{broken";
    let reply = raw(
        port,
        &format!(
            "PUT /metadata?key=mooncake%2Fram%2Fbad HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
    );
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let store = HttpStore::new(&format!("http://127.0.0.1:{port}/metadata")).unwrap();
    let error = store.fetch_segment("bad").unwrap_err();
    assert!(
        matches!(&error, MetadataError::MalformedValue { key, .. } if key == "mooncake/ram/bad"),
        "{error}"
    );
    for request in [
        "GET /metadata HTTP/1.1\r\n\r\n",
        "GET /metadata?key=%zz HTTP/1.1\r\n\r\n",
        "garbage\r\n\r\n",
        "PUT /metadata?key=k HTTP/1.1\r\nContent-Length: 999999999999\r\n\r\n",
    ] {
        let reply = raw(port, request);
        assert!(reply.starts_with("HTTP/1.1 400"), "{request:?}: {reply}");
    }
    let unreachable = HttpStore::new("http://127.0.0.1:1/metadata").unwrap();
    let error = unreachable.fetch_segment("x").unwrap_err().to_string();
    assert!(error.contains("127.0.0.1:1"), "{error}");
}
