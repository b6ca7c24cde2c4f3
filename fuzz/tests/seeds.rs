//! The seed corpus, `corpus/<target>/seed-*`, is made from the golden files Mooncake produced
//! (`metadata/tests/golden`, `transport-rdma/tests/golden`) and a few frames written here.
//! This test rebuilds it and fails when the committed seeds differ; with `TERN_FUZZ_BLESS=1`
//! it writes them instead. It also checks that every target has its `[[bin]]` entry and
//! that every seed belongs to a target. Only files named `seed-*` are the test's: libFuzzer's additions sit beside them.

use std::collections::BTreeMap;
use std::path::PathBuf;

use tern_metadata::rpc::{RpcType, write_frame};
use tern_transport_shm::wire::{Frame, MAGIC, Opened};
use tern_transport_tcp::{Header, OP_READ, OP_V2, OP_WRITE, Status};

fn fuzz_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn golden(path: &str) -> String {
    let file = fuzz_dir().join("..").join(path);
    std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

/// `body=b'...'` and `payload b'...'` of the P2P RPC golden file, as bytes.
fn python_bytes(line: &str, marker: &str) -> Option<Vec<u8>> {
    let start = line.find(marker)? + marker.len();
    let end = line.rfind('\'')?;
    Some(line[start..end].replace("\\n", "\n").into_bytes())
}

/// `(direction, json)` of each `REQ 0 {...}` / `REP 0 {...}` line of the Connection golden.
fn connection_bodies() -> Vec<(String, Vec<u8>)> {
    golden("transport-rdma/tests/golden/mooncake-rdma-connection-rpc.txt")
        .lines()
        .filter_map(|line| {
            let (direction, rest) = line.split_once(" 0 ")?;
            matches!(direction, "REQ" | "REP").then(|| {
                let mut body = rest.as_bytes().to_vec();
                body.push(b'\n');
                (direction.to_owned(), body)
            })
        })
        .collect()
}

fn frame(ty: RpcType, body: &[u8]) -> Vec<u8> {
    let mut wire = Vec::new();
    write_frame(&mut wire, ty, body).unwrap();
    wire
}

fn header(size: u64, addr: u64, opcode: u8) -> Vec<u8> {
    Header { size, addr, opcode }.encode().to_vec()
}

/// Every seed: target → (name → bytes).
fn seeds() -> BTreeMap<&'static str, BTreeMap<String, Vec<u8>>> {
    let mut all: BTreeMap<&'static str, BTreeMap<String, Vec<u8>>> = BTreeMap::new();
    let mut add = |target: &'static str, name: &str, bytes: Vec<u8>| {
        all.entry(target)
            .or_default()
            .insert(format!("seed-{name}"), bytes);
    };

    let tcp_segment = golden("metadata/tests/golden/mooncake-tcp-segment.json");
    let rdma_segment = golden("metadata/tests/golden/mooncake-rdma-segment.json");
    let rpc_meta = golden("metadata/tests/golden/mooncake-rpc-meta.json");
    let p2p = golden("metadata/tests/golden/mooncake-p2p-metadata-rpc.txt");
    let connection = connection_bodies();
    assert!(
        connection.len() >= 5,
        "the Connection golden has changed shape"
    );

    // The same-host socket's frames, each as its kind byte and its body.
    let shm_frames = [
        (
            "hello",
            Frame::Hello {
                magic: MAGIC,
                version: 1,
                nonce: [0x11; 16],
                client_segment: "127.0.0.1:15001".into(),
                server_segment: "127.0.0.1:15002".into(),
            },
        ),
        (
            "welcome",
            Frame::Welcome {
                version: 1,
                probe_addr: 0x7ffd_0000_1000,
                segment: "127.0.0.1:15002".into(),
            },
        ),
        (
            "open",
            Frame::Open {
                id: 1,
                addr: 0x7f00_0000_0000,
                len: 65536,
            },
        ),
        (
            "opened-memfd",
            Frame::Opened {
                id: 1,
                outcome: Opened::Memfd {
                    addr: 0x7f00_0000_0000,
                    len: 1 << 20,
                    map_len: 1 << 20,
                },
            },
        ),
        (
            "opened-rejected",
            Frame::Opened {
                id: 2,
                outcome: Opened::Rejected("not registered".into()),
            },
        ),
        (
            "lease",
            Frame::Lease {
                id: 3,
                ranges: vec![(0x1000, 4096), (0x3000, 8)],
            },
        ),
        (
            "leased",
            Frame::Leased {
                id: 3,
                granted: vec![true, false],
            },
        ),
        (
            "revoke",
            Frame::Revoke {
                id: 4,
                addr: 0x1000,
            },
        ),
    ];
    for (name, frame) in shm_frames {
        let bytes = frame.encode();
        add("shm_frames", name, [&bytes[4..5], &bytes[5..]].concat());
    }

    // TCP data protocol: requests of each kind, then status frames.
    let status_ok = Status::Ok.encode();
    let rejected = Status::AddressRejected.encode();
    add(
        "tcp_frames",
        "read-v2-ok",
        [
            &header(65536, 0x7f00_0000_1000, OP_READ | OP_V2)[..],
            &status_ok,
        ]
        .concat(),
    );
    add(
        "tcp_frames",
        "write-v2-rejected",
        [&header(1 << 20, 0x1000, OP_WRITE | OP_V2)[..], &rejected].concat(),
    );
    add("tcp_frames", "read-v1", header(24, 8, OP_READ));

    // The admission check (an 8 KiB open region, a private one): offsets 0 and 8 of the open
    // region, the private region (top bit), a write with its body, a rejected write with its
    // body, the open region's edges, and v1.
    let private = 1u64 << 63;
    let mut stream = vec![0x2a];
    stream.extend(header(16, 0, OP_READ | OP_V2));
    stream.extend(header(4, 8, OP_WRITE | OP_V2));
    stream.extend(b"tern");
    stream.extend(header(8, 4, OP_READ | OP_V2));
    add("tcp_admission", "read-write-read", stream);
    let mut stream = vec![0x01];
    stream.extend(header(16, private, OP_READ | OP_V2));
    stream.extend(header(3, private | 16, OP_WRITE | OP_V2));
    stream.extend(b"abc");
    stream.extend(header(8192, 0, OP_READ | OP_V2));
    stream.extend(header(1, 8192, OP_READ | OP_V2));
    add("tcp_admission", "private-and-edges", stream);
    let mut stream = vec![0x00];
    stream.extend(header(2, 100, OP_WRITE));
    stream.extend(b"v1");
    stream.extend(header(2, 100, OP_READ));
    add("tcp_admission", "v1", stream);

    // RPC framing: the frames of both golden files, behind a selector byte (max 1021).
    let mut stream = vec![0xff];
    for line in p2p.lines() {
        if let Some(body) = python_bytes(line, "body=b'") {
            let ty = line
                .split("type byte=")
                .nth(1)
                .and_then(|rest| rest.split(',').next())
                .and_then(|b| b.trim().parse::<u8>().ok())
                .and_then(RpcType::from_byte)
                .expect("a reply frame names its type byte");
            stream.extend(frame(ty, &body));
        }
    }
    add("rpc_frame", "p2p-replies", stream);
    let mut stream = vec![0xff];
    for (_, body) in &connection {
        stream.extend(frame(RpcType::Connection, body));
    }
    add("rpc_frame", "connection", stream);
    let (_, first) = &connection[0];
    let mut legacy = vec![0xff];
    legacy.extend((first.len() as u64).to_le_bytes());
    legacy.extend(first);
    add("rpc_frame", "connection-legacy", legacy);
    add(
        "rpc_frame",
        "small-max",
        [&[0x02][..], &frame(RpcType::Probe, b"{}")].concat(),
    );

    // Handshake bodies: every Connection message of the golden file.
    for (i, (direction, body)) in connection.iter().enumerate() {
        add(
            "handshake",
            &format!("{}-{i}", direction.to_lowercase()),
            body.clone(),
        );
    }

    // Descriptors: both golden ones and the Metadata RPC's reply.
    add("segment_desc", "tcp", tcp_segment.clone().into_bytes());
    add("segment_desc", "rdma", rdma_segment.clone().into_bytes());
    let metadata_reply = p2p
        .lines()
        .filter(|l| l.contains("type byte=1"))
        .find_map(|l| python_bytes(l, "body=b'"))
        .expect("the Metadata reply");
    add("segment_desc", "p2p-metadata-reply", metadata_reply);

    // The priority matrix of the RDMA descriptor.
    let desc: serde_json::Value = serde_json::from_str(&rdma_segment).unwrap();
    add(
        "topology_matrix",
        "rdma-segment",
        desc["priority_matrix"].to_string().into_bytes(),
    );
    add(
        "topology_matrix",
        "two-nics",
        br#"{"cpu:0":[["rxe0"],["rxe1"]],"cpu:1":[["rxe1"],["rxe0"]],"cuda:0":[[],["mlx5_0","rxe0"]]}"#.to_vec(),
    );

    add("rpc_meta", "golden", rpc_meta.clone().into_bytes());
    add(
        "rpc_meta",
        "ipv6",
        br#"{"ip_or_host_name":"::1","rpc_port":15123}"#.to_vec(),
    );

    for line in p2p.lines() {
        if line.contains("(Notify)") {
            add(
                "notify",
                "request",
                python_bytes(line, "payload b'").expect("the Notify payload"),
            );
        } else if line.contains("type byte=2") {
            add(
                "notify",
                "reply",
                python_bytes(line, "body=b'").expect("the Notify reply"),
            );
        }
    }

    // Found by fuzzing (the target's own property was wrong): bad UTF-8 in a string the
    // direct read skips, which the engine's read through a JSON value refuses.
    add(
        "notify",
        "regression-bad-utf8-in-unknown-key",
        b"{\"name\":\"\",\"notify_msg\":\"iysu\",\"n4otify_msg\":\"\x92\x98\"}\n".to_vec(),
    );

    // Store keys: a selector byte (cluster none / c1 / given before `|`), then the key.
    add(
        "store_keys",
        "segment",
        b"\x00mooncake/ram/mc-target".to_vec(),
    );
    add(
        "store_keys",
        "rpc-meta-c1",
        b"\x01mooncake/c1/rpc_meta/10.0.0.1:15123".to_vec(),
    );
    add(
        "store_keys",
        "nvmeof-cluster",
        b"\x02c1|mooncake/c1/nvmeof/disk".to_vec(),
    );

    // HTTP metadata protocol, as HttpStore writes requests and the server writes replies.
    let request = |method: &str, key: &str, body: &str| {
        format!(
            "{method} /metadata?key={} HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            tern_metadata::http::escape(key),
            body.len()
        )
        .into_bytes()
    };
    add(
        "http_request",
        "put-segment",
        request("PUT", "mooncake/ram/mc-target", &tcp_segment),
    );
    add(
        "http_request",
        "put-rpc-meta",
        request("PUT", "mooncake/c1/rpc_meta/mc-target", &rpc_meta),
    );
    add(
        "http_request",
        "get",
        request("GET", "mooncake/ram/mc-target", ""),
    );
    add(
        "http_request",
        "delete",
        request("DELETE", "mooncake/ram/10.0.0.1:1234", ""),
    );
    let reply = |status: u16, reason: &str, body: &str| {
        format!(
            "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    };
    add(
        "http_response",
        "200-segment",
        reply(200, "OK", &rdma_segment),
    );
    add(
        "http_response",
        "404",
        reply(404, "Not Found", "metadata not found"),
    );
    add(
        "http_response",
        "to-eof",
        format!("HTTP/1.0 200 OK\r\n\r\n{rpc_meta}").into_bytes(),
    );
    all
}

/// The `seed-*` files of `corpus/<target>`.
fn committed(target: &str) -> BTreeMap<String, Vec<u8>> {
    let dir = fuzz_dir().join("corpus").join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return BTreeMap::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            name.starts_with("seed-")
                .then(|| (name, std::fs::read(e.path()).unwrap()))
        })
        .collect()
}

fn write(target: &str, seeds: &BTreeMap<String, Vec<u8>>) {
    let dir = fuzz_dir().join("corpus").join(target);
    for stale in committed(target).keys().filter(|k| !seeds.contains_key(*k)) {
        std::fs::remove_file(dir.join(stale)).unwrap();
    }
    std::fs::create_dir_all(&dir).unwrap();
    for (name, bytes) in seeds {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

#[test]
fn seed_corpus_matches_the_golden_files() {
    let bless = std::env::var_os("TERN_FUZZ_BLESS").is_some_and(|v| v == "1");
    let mut stale = Vec::new();
    for (target, seeds) in seeds() {
        if bless {
            write(target, &seeds);
        } else if committed(target) != seeds {
            stale.push(target);
        }
    }
    assert!(
        stale.is_empty(),
        "the seeds of {stale:?} differ from what the golden files give; rerun with TERN_FUZZ_BLESS=1 and commit"
    );
}

/// The targets: `fuzz_targets/*.rs`.
fn targets() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(fuzz_dir().join("fuzz_targets"))
        .unwrap()
        .filter_map(Result::ok)
        .filter_map(|e| {
            e.file_name()
                .into_string()
                .ok()?
                .strip_suffix(".rs")
                .map(str::to_owned)
        })
        .collect();
    names.sort();
    names
}

#[test]
fn every_target_has_a_bin_entry_and_every_seed_a_target() {
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).unwrap();
    let seeded = seeds();
    let targets = targets();
    assert!(targets.len() >= 11, "{targets:?}");
    for target in &targets {
        let entry = format!("[[bin]]\nname = \"{target}\"\npath = \"fuzz_targets/{target}.rs\"\n");
        assert!(
            manifest.contains(&entry),
            "fuzz/Cargo.toml lacks the [[bin]] entry of {target} (cargo xtask fuzz adds it)"
        );
    }
    for target in seeded.keys() {
        assert!(
            targets.iter().any(|t| t == target),
            "seeds for no target {target}"
        );
    }
}
