//! The HTTP store against the embedded HTTP metadata server, over real loopback sockets.

use std::io::{Read, Write};
use std::net::TcpStream;

use tern_metadata::http::{HttpMetadataServer, HttpStore};
use tern_metadata::seal::SealError;
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

const SECRET: &str = "tern-http-replay-secret";

fn secret() -> tern_metadata::auth::ClusterSecret {
    tern_metadata::auth::ClusterSecret::new(SECRET.as_bytes()).unwrap()
}

/// A node's store with the cluster secret: one life of the node.
fn sealed_store(port: u16) -> HttpStore {
    let mut store = HttpStore::new(&format!("http://127.0.0.1:{port}/metadata")).unwrap();
    store.set_secret(Some(secret()));
    store
}

fn request(port: u16, method: &str, key: &str, headers: &str, body: &str) -> String {
    raw(
        port,
        &format!(
            "{method} /metadata?key={} HTTP/1.1\r\n{headers}Content-Length: {}\r\n\r\n{body}",
            tern_metadata::http::escape(key),
            body.len()
        ),
    )
}

fn body_of(reply: &str) -> &str {
    reply.split_once("\r\n\r\n").map_or("", |(_, body)| body)
}

/// A relay between a node and the server that keeps every request it passes on: what an
/// eavesdropper on the path sees.
struct Recorder {
    port: u16,
    seen: std::sync::Arc<parking_lot::Mutex<Vec<String>>>,
}

impl Recorder {
    fn start(server_port: u16) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
        let record = seen.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(mut client) = client else { return };
                // One request per connection (`Connection: close`): its head, then its body.
                let mut request = Vec::new();
                let mut byte = [0u8; 1];
                while !request.ends_with(b"\r\n\r\n") {
                    if client.read(&mut byte).unwrap_or(0) == 0 {
                        break;
                    }
                    request.push(byte[0]);
                }
                let head = String::from_utf8_lossy(&request).into_owned();
                let length = head
                    .lines()
                    .find_map(|l| l.strip_prefix("Content-Length: "))
                    .and_then(|n| n.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                let mut body = vec![0u8; length];
                client.read_exact(&mut body).unwrap();
                request.extend_from_slice(&body);
                record
                    .lock()
                    .push(String::from_utf8_lossy(&request).into_owned());
                let mut server = TcpStream::connect(("127.0.0.1", server_port)).unwrap();
                server.write_all(&request).unwrap();
                let mut reply = Vec::new();
                server.read_to_end(&mut reply).unwrap();
                client.write_all(&reply).unwrap();
            }
        });
        Self { port, seen }
    }

    /// The header `name` of the last request that carried it.
    fn last_header(&self, name: &str) -> Option<String> {
        let prefix = format!("{name}: ");
        self.seen.lock().iter().rev().find_map(|request| {
            request
                .lines()
                .find_map(|l| l.strip_prefix(&prefix).map(|v| v.trim().to_owned()))
        })
    }
}

/// The descriptor a node publishes after its restart: new ports, new buffers.
fn restarted(desc: &SegmentDesc) -> SegmentDesc {
    let mut desc = desc.clone();
    desc.tcp_data_port = desc.tcp_data_port.wrapping_add(1000);
    desc.buffers[0].addr += 1 << 30;
    desc
}

#[test]
fn a_secured_server_refuses_a_restarted_nodes_old_descriptor_and_spent_delete_tokens() {
    let config = tern_metadata::http::HttpServerConfig {
        secret: Some(secret()),
        ..tern_metadata::http::HttpServerConfig::default()
    };
    let server = HttpMetadataServer::start_with("127.0.0.1:0".parse().unwrap(), config).unwrap();
    let port = server.local_addr().port();
    let recorder = Recorder::start(port);
    let key = "mooncake/ram/node-a";
    let old = SegmentDesc::from_json(GOLDEN_TCP.as_bytes()).unwrap();
    let new = restarted(&old);

    // The node's first life publishes; anyone can GET what it wrote, and save it.
    let first = sealed_store(recorder.port);
    first.publish_segment("node-a", &old).unwrap();
    let saved = body_of(&request(port, "GET", key, "", "")).to_owned();
    assert!(saved.contains("tern_mac"), "{saved}");
    // It shuts down: its DELETE passes the eavesdropper.
    first.remove_segment("node-a").unwrap();
    let spent = recorder
        .last_header("X-Tern-Auth")
        .expect("the DELETE carried a token");
    drop(first);

    // While the node is down, its deleted descriptor cannot come back.
    let reply = request(port, "PUT", key, "", &saved);
    assert!(
        reply.starts_with("HTTP/1.1 403"),
        "replay after delete: {reply}"
    );
    assert!(reply.contains("older"), "{reply}");

    // The node restarts (a new store, the same name and secret) and publishes again.
    let second = sealed_store(recorder.port);
    second.publish_segment("node-a", &new).unwrap();
    assert_eq!(second.fetch_segment("node-a").unwrap(), new);

    // The saved descriptor of its first life, put back: refused, and nothing changes.
    let reply = request(port, "PUT", key, "", &saved);
    assert!(
        reply.starts_with("HTTP/1.1 403"),
        "replay after restart: {reply}"
    );
    let reader = sealed_store(port);
    assert_eq!(reader.fetch_segment("node-a").unwrap(), new);

    // The first life's delete token, used again: refused, and the new value stays.
    let token = format!("X-Tern-Auth: {spent}\r\n");
    let reply = request(port, "DELETE", key, &token, "");
    assert!(reply.starts_with("HTTP/1.1 403"), "token reused: {reply}");
    assert_eq!(reader.fetch_segment("node-a").unwrap(), new);

    // The second life's own token deletes its value once; used again, it is refused, and
    // the value it deleted cannot be put back either.
    let current = body_of(&request(port, "GET", key, "", "")).to_owned();
    second
        .publish_rpc_meta(
            "node-a",
            &RpcMeta {
                ip_or_host_name: "127.0.0.1".into(),
                rpc_port: 15999,
            },
        )
        .unwrap();
    second.remove_segment("node-a").unwrap();
    let token = recorder.last_header("X-Tern-Auth").unwrap();
    assert_ne!(token, spent);
    let header = format!("X-Tern-Auth: {token}\r\n");
    let reply = request(port, "DELETE", key, &header, "");
    assert!(
        reply.starts_with("HTTP/1.1 403"),
        "token used twice: {reply}"
    );
    let reply = request(port, "PUT", key, "", &current);
    assert!(reply.starts_with("HTTP/1.1 403"), "{reply}");
    // A token for one key deletes nothing under another.
    let rpc_key = "mooncake/rpc_meta/node-a";
    let reply = request(port, "DELETE", rpc_key, &header, "");
    assert!(
        reply.starts_with("HTTP/1.1 403"),
        "token moved to another key: {reply}"
    );
    assert!(reader.rpc_meta("node-a").is_ok());

    // The node itself can still delete and publish anew.
    second.remove_rpc_meta("node-a").unwrap();
    second.publish_segment("node-a", &old).unwrap();
    assert_eq!(reader.fetch_segment("node-a").unwrap(), old);
}

#[test]
fn a_node_refuses_a_descriptor_older_than_the_one_it_read_even_from_a_plain_server() {
    // A server without the secret keeps whatever it is sent; the nodes' own check remains.
    let server = HttpMetadataServer::start("127.0.0.1:0".parse().unwrap()).unwrap();
    let port = server.local_addr().port();
    let key = "mooncake/ram/node-a";
    let old = SegmentDesc::from_json(GOLDEN_TCP.as_bytes()).unwrap();
    let new = restarted(&old);
    let first = sealed_store(port);
    first.publish_segment("node-a", &old).unwrap();
    let saved = body_of(&request(port, "GET", key, "", "")).to_owned();
    let reader = sealed_store(port);
    assert_eq!(reader.fetch_segment("node-a").unwrap(), old);
    drop(first);

    let second = sealed_store(port);
    second.publish_segment("node-a", &new).unwrap();
    assert_eq!(reader.fetch_segment("node-a").unwrap(), new);
    let reply = request(port, "PUT", key, "", &saved);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    match reader.fetch_segment("node-a") {
        Err(MetadataError::Seal {
            key: refused,
            source: SealError::Stale { .. },
        }) => assert_eq!(refused, key),
        other => panic!("the replayed descriptor was taken: {other:?}"),
    }
    // Once its writer publishes again, the node follows.
    second.publish_segment("node-a", &new).unwrap();
    assert_eq!(reader.fetch_segment("node-a").unwrap(), new);
}
