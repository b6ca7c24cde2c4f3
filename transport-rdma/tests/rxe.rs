//! The RDMA transport on one Soft-RoCE device: Mooncake's descriptor and handshake formats
//! against the golden recordings (with a stand-in peer that speaks exactly those frames),
//! bad handshake messages, the choice between RDMA and TCP, two processes, and endpoint
//! eviction under traffic. Ignored on hosts without RDMA; `cargo xtask test` runs them in
//! the Soft-RoCE guest.

mod support;

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use support::standin::{StandIn, Verbs, golden, keys, wire};
use support::{builder, device, holds, pattern, rdma_with, spawn_helper, until_stdin_closes};
use tern_engine::{
    EngineError, OwnedBuffer, SegmentDesc, SegmentId, TransferEngine, TransferError,
    TransferRequest, TransferStatus,
};
use tern_metadata::MetadataError;
use tern_metadata::rpc::{self, RpcClientConfig, RpcType};
use tern_transport_rdma::handshake::HandshakeDesc;
use tern_transport_tcp::TcpTransport;
use tern_verbs::{CompletionError, Gid, SendOp};

const GOLDEN_SEGMENT: &str = include_str!("golden/mooncake-rdma-segment.json");

/// A JSON value's shape: the same keys and the same kinds of values, recursively (an
/// array's shape is its first element's).
fn shape(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            Value::Object(map.iter().map(|(k, v)| (k.clone(), shape(v))).collect())
        }
        Value::Array(items) => Value::Array(items.iter().take(1).map(shape).collect()),
        Value::String(_) => json!("string"),
        Value::Number(_) => json!("number"),
        Value::Bool(_) => json!("bool"),
        Value::Null => json!("null"),
    }
}

fn call(endpoint: &str, body: &str) -> String {
    let reply = rpc::call(
        endpoint,
        RpcType::Connection,
        body.as_bytes(),
        &RpcClientConfig::default(),
    )
    .unwrap();
    String::from_utf8(reply).unwrap()
}

/// [`support::setup`] with the 300 s watchdog that most tests here run under.
fn setup(test: &'static str) {
    support::setup(test, Duration::from_secs(300));
}

/// An engine on the test device with the environment's RDMA settings.
fn rdma_engine() -> TransferEngine {
    builder(rdma_with(|_| {})).build().unwrap()
}

/// [`helper_target`] started as a child process: it, its segment's name and the address of
/// its 8 MiB buffer.
fn spawn_helper_target() -> (support::Helper, String, u64) {
    let (target, value) = spawn_helper("helper_target", "target", &[], "buffer");
    let (segment, addr) = value.split_once(' ').unwrap();
    (target, segment.to_owned(), addr.parse().unwrap())
}

/// Writes `len` bytes of pattern `seed` from the start of `local` to the start of `remote`
/// and checks they landed.
fn write_pattern_and_check(
    engine: &TransferEngine,
    peer: SegmentId,
    local: &OwnedBuffer,
    remote: &OwnedBuffer,
    seed: u64,
    len: usize,
) {
    local.write_at(0, &pattern(seed, len)).unwrap();
    engine
        .transfer_sync(TransferRequest::write(
            local.addr(),
            peer,
            remote.addr() as u64,
            len,
        ))
        .unwrap();
    assert!(holds(remote, 0, seed, len));
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn the_descriptor_has_mooncakes_rdma_schema() {
    setup("the_descriptor_has_mooncakes_rdma_schema");
    let engine = rdma_engine();
    let _buffer = engine.allocate(1 << 20, "cpu:0").unwrap();
    let ours = engine.local_descriptor().to_json();
    let mut mine: Value = serde_json::from_str(&ours).unwrap();
    let mut theirs: Value = serde_json::from_str(GOLDEN_SEGMENT).unwrap();
    // The matrix lists this host's storage types; each entry has the golden entry's shape.
    let entry = shape(&theirs["priority_matrix"]["cpu:0"]);
    for (location, value) in mine["priority_matrix"].as_object().unwrap() {
        assert_eq!(shape(value), entry, "matrix entry {location}");
    }
    mine["priority_matrix"] = json!({});
    theirs["priority_matrix"] = json!({});
    assert_eq!(shape(&mine), shape(&theirs), "{ours}");
    let desc = SegmentDesc::from_json(ours.as_bytes()).unwrap();
    assert_eq!(desc.protocols(), ["rdma"]);
    assert_eq!((desc.tcp_data_port, desc.tcp_proto_version), (0, 1));
    assert_eq!(desc.devices.len(), 1);
    assert_eq!(desc.devices[0].name, device());
    assert!(Gid::parse(&desc.devices[0].gid).is_some_and(|g| g.is_ipv4_mapped()));
    let buffer = &desc.buffers[0];
    assert_eq!(buffer.name, "cpu:0");
    assert_eq!(buffer.rkey.as_ref().map(Vec::len), Some(1));
    assert_eq!(buffer.lkey.as_ref().map(Vec::len), Some(1));
    let matrix = desc.priority_matrix.as_ref().unwrap();
    assert_eq!(matrix["cpu:0"][0], [device()]);
    assert!(ours.ends_with("}\n"));
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn tern_connects_to_a_peer_that_answers_the_golden_frames() {
    setup("tern_connects_to_a_peer_that_answers_the_golden_frames");
    let golden = golden();
    let standin = StandIn::start(&device(), 1 << 20);
    let engine = rdma_engine();
    let peer = engine.open_segment(&standin.name).unwrap();
    let local = engine.allocate(1 << 20, "cpu:0").unwrap();
    local.write_at(0, &pattern(1, 256 << 10)).unwrap();
    let remote = standin.verbs.addr() as u64;
    engine
        .transfer_sync(TransferRequest::write(
            local.addr(),
            peer,
            remote,
            256 << 10,
        ))
        .unwrap();
    assert_eq!(standin.verbs.read_at(0, 256 << 10), pattern(1, 256 << 10));
    standin.verbs.write_at(512 << 10, &pattern(2, 100_000));
    engine
        .transfer_sync(TransferRequest::read(
            local.addr() + 4096,
            peer,
            remote + (512 << 10),
            100_000,
        ))
        .unwrap();
    assert!(holds(&local, 4096, 2, 100_000));

    // Tern's frames carry the recorded keys (plus its MTU and PSN, which Mooncake ignores),
    // in the recorded order of events: the request, then the ready ACK with the same QPs.
    let exchanges = standin.exchanges.lock().clone();
    assert_eq!(
        exchanges.len(),
        2,
        "one request and one ready ACK: {exchanges:?}"
    );
    let mut expected = keys(&golden.req);
    expected.push("mtu".into());
    expected.push("psn".into());
    expected.sort();
    for (request, _) in &exchanges {
        assert_eq!(keys(request), expected, "{request}");
        assert!(
            request.ends_with("}\n"),
            "one trailing newline: {request:?}"
        );
    }
    let first: Value = serde_json::from_str(&exchanges[0].0).unwrap();
    let ack: Value = serde_json::from_str(&exchanges[1].0).unwrap();
    assert_eq!(
        (first["ready_ack"].clone(), ack["ready_ack"].clone()),
        (json!(false), json!(true))
    );
    assert_eq!(first["qp_num"], ack["qp_num"]);
    // Tern offers its random PSN; the stand-in answers as Mooncake (none), so both ends ran
    // at PSN 0 — had Tern started its QPs at its own PSN, the transfers above would not
    // have completed.
    let psn = first["psn"].as_u64().expect("Tern sends a PSN");
    assert!(psn <= 0x00ff_ffff, "psn {psn} fits 24 bits");
    assert_eq!(first["psn"], ack["psn"]);
    assert_eq!(
        first["qp_num"].as_array().unwrap().len(),
        2,
        "MC_NUM_QP_PER_EP default"
    );
    assert_eq!(
        first["peer_nic_path"],
        json!(format!("{}@{}", standin.name, device()))
    );
    assert_eq!(
        first["local_nic_path"],
        json!(format!("{}@{}", engine.segment_name(), device()))
    );
    assert_eq!(exchanges[1].1, format!("{}\n", golden.rep_ack));
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn tern_answers_the_golden_frames_of_an_active_peer() {
    setup("tern_answers_the_golden_frames_of_an_active_peer");
    let golden = golden();
    let engine = rdma_engine();
    let buffer = engine.allocate(1 << 20, "cpu:0").unwrap();
    let desc = engine.local_descriptor();
    let rkey = desc.buffers[0].rkey.as_ref().unwrap()[0];
    let endpoint = format!("127.0.0.1:{}", engine.rpc_port());
    let verbs = Verbs::open(&device(), 1 << 20);
    let qps = verbs.qps(2);

    let mut request: Value = serde_json::from_str(&golden.req).unwrap();
    request["local_gid"] = json!(verbs.gid.to_string());
    request["local_nic_path"] = json!(format!("10.77.0.1:15671@{}", device()));
    request["peer_nic_path"] = json!(format!("{}@{}", engine.segment_name(), device()));
    request["qp_num"] = json!(qps.iter().map(|q| q.qp_num()).collect::<Vec<_>>());
    let reply = call(&endpoint, &wire(&request));
    let mut expected = keys(&golden.rep);
    expected.push("mtu".into());
    expected.sort();
    assert_eq!(keys(&reply), expected, "{reply}");
    let reply: Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(reply["reply_msg"], json!(""));
    assert_eq!(reply["ready_ack"], json!(false));
    assert_eq!(reply["peer_nic_path"], request["local_nic_path"]);
    let tern_qps: Vec<u32> = serde_json::from_value(reply["qp_num"].clone()).unwrap();
    let tern_gid = Gid::parse(reply["local_gid"].as_str().unwrap()).unwrap();
    verbs.connect(&qps, tern_gid, &tern_qps);

    let mut ack = request.clone();
    ack["ready_ack"] = json!(true);
    assert_eq!(
        keys(&wire(&ack)),
        keys(&golden.req_ack),
        "the ACK frame is the recorded one"
    );
    assert_eq!(
        call(&endpoint, &wire(&ack)),
        format!("{}\n", golden.rep_ack)
    );

    // The passive endpoint carries one-sided traffic both ways, on both QPs.
    verbs.write_at(0, &pattern(3, 64 << 10));
    let write = SendOp::Write {
        remote_addr: buffer.addr() as u64 + 8192,
        rkey,
    };
    assert_eq!(verbs.run(&qps[0], write, 0, 64 << 10), Ok(()));
    assert!(holds(&buffer, 8192, 3, 64 << 10));
    buffer.write_at(300_000, &pattern(4, 5000)).unwrap();
    let read = SendOp::Read {
        remote_addr: buffer.addr() as u64 + 300_000,
        rkey,
    };
    assert_eq!(verbs.run(&qps[1], read, 100_000, 5000), Ok(()));
    assert_eq!(verbs.read_at(100_000, 5000), pattern(4, 5000));

    // The recorded rejection: a request for another node gets a reply of the recorded shape.
    let mut stray = request.clone();
    stray["peer_nic_path"] = json!(format!("10.77.0.1:15077@{}", device()));
    stray["qp_num"] = json!([5, 6]);
    let rejection = call(&endpoint, &wire(&stray));
    assert_eq!(keys(&rejection), keys(&golden.rejection), "{rejection}");
    let rejection = HandshakeDesc::parse(rejection.as_bytes()).unwrap();
    assert!(
        rejection.reply_msg.contains("10.77.0.1:15077"),
        "{}",
        rejection.reply_msg
    );
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn bad_connection_messages_are_rejected_and_touch_nothing() {
    setup("bad_connection_messages_are_rejected_and_touch_nothing");
    let target = rdma_with(|_| {});
    let probe = target.clone();
    let engine = builder(target).build().unwrap();
    let buffer = engine.allocate(1 << 20, "cpu:0").unwrap();
    let endpoint = format!("127.0.0.1:{}", engine.rpc_port());
    let verbs = Verbs::open(&device(), 4096);
    let me = format!("{}@{}", engine.segment_name(), device());
    let good = HandshakeDesc {
        local_gid: verbs.gid.to_string(),
        local_nic_path: format!("10.77.0.9:15000@{}", device()),
        peer_nic_path: me.clone(),
        qp_num: vec![101, 102],
        ready_ack: Some(false),
        ..HandshakeDesc::default()
    };
    let body = |desc: HandshakeDesc| String::from_utf8(desc.to_body()).unwrap();
    let qps_before = tern_verbs::live_queue_pairs();
    let cases: Vec<(String, &str)> = vec![
        ("{\"local_gid\": ".into(), "malformed"),
        ("[1, 2, 3]\n".into(), "malformed"),
        (
            body(HandshakeDesc {
                peer_nic_path: format!("{}@mlx5_9", engine.segment_name()),
                ..good.clone()
            }),
            "mlx5_9",
        ),
        (
            body(HandshakeDesc {
                peer_nic_path: format!("10.1.1.1:1@{}", device()),
                ..good.clone()
            }),
            "10.1.1.1:1",
        ),
        (
            body(HandshakeDesc {
                qp_num: vec![],
                ..good.clone()
            }),
            "QP",
        ),
        (
            body(HandshakeDesc {
                qp_num: (1..=65).collect(),
                ..good.clone()
            }),
            "QP",
        ),
        (
            body(HandshakeDesc {
                local_gid: "not a gid".into(),
                ..good.clone()
            }),
            "GID",
        ),
        (
            body(HandshakeDesc {
                ready_ack: Some(true),
                ..good.clone()
            }),
            "ready ACK",
        ),
    ];
    for (body, why) in &cases {
        let reply = call(&endpoint, body);
        let reply = HandshakeDesc::parse(reply.as_bytes()).unwrap();
        assert!(
            reply.is_rejection() && reply.reply_msg.to_lowercase().contains(&why.to_lowercase()),
            "{body:?} got {reply:?}"
        );
        assert!(reply.qp_num.is_empty());
    }
    assert_eq!(probe.endpoints(), 0, "a rejected message made an endpoint");
    assert_eq!(
        tern_verbs::live_queue_pairs(),
        qps_before,
        "a rejected message made QPs"
    );
    // The node still serves a real peer.
    let initiator = rdma_engine();
    let peer = initiator.open_segment(engine.segment_name()).unwrap();
    let local = initiator.allocate(1 << 20, "cpu:0").unwrap();
    write_pattern_and_check(&initiator, peer, &local, &buffer, 5, 4096);
}

/// A peer whose descriptor has more rkeys than devices is refused with the reason, before
/// any transfer (Mooncake indexes out of bounds there).
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn a_descriptor_with_more_rkeys_than_devices_is_refused() {
    setup("a_descriptor_with_more_rkeys_than_devices_is_refused");
    let verbs = Arc::new(Verbs::open(&device(), 4096));
    let served = verbs.clone();
    let server = rpc::RpcServer::start(
        "127.0.0.1".parse().unwrap(),
        rpc::RpcServerConfig::default(),
        Arc::new(
            move |_ty: RpcType, _body: &[u8]| -> Result<Vec<u8>, String> {
                let mut desc: Value =
                    serde_json::from_str(&served.descriptor("bad-peer", &device())).unwrap();
                desc["buffers"][0]["rkey"] = json!([1, 2]);
                desc["buffers"][0]["lkey"] = json!([1, 2]);
                Ok(wire(&desc).into_bytes())
            },
        ),
    )
    .unwrap();
    let engine = rdma_engine();
    let name = format!("127.0.0.1:{}", server.local_addr().port());
    let error = engine.open_segment(&name).unwrap_err();
    assert!(
        matches!(
            error,
            EngineError::Metadata(MetadataError::Descriptor { .. })
        ) && error.to_string().contains("2 rkeys for 1 devices"),
        "{error}"
    );
}

/// With TCP and RDMA both installed, a peer that speaks both is reached over RDMA, one that
/// speaks only TCP over TCP.
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn rdma_is_chosen_over_tcp_when_the_peer_speaks_both() {
    setup("rdma_is_chosen_over_tcp_when_the_peer_speaks_both");
    let rdma = rdma_with(|_| {});
    let stats = rdma.clone();
    let initiator = builder(rdma)
        .transport(TcpTransport::default())
        .build()
        .unwrap();
    let both = builder(rdma_with(|_| {}))
        .transport(TcpTransport::default())
        .build()
        .unwrap();
    let tcp_only = TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .transport(TcpTransport::default())
        .build()
        .unwrap();
    assert_eq!(
        both.local_descriptor().protocols(),
        ["rdma", "tcp"],
        "a node with both publishes both"
    );
    let local = initiator.allocate(1 << 20, "cpu:0").unwrap();
    let rdma_bytes = || stats.nic_stats().iter().map(|s| s.bytes).sum::<u64>();
    for (target, over_rdma) in [(&both, true), (&tcp_only, false)] {
        let remote = target.allocate(1 << 20, "cpu:0").unwrap();
        let peer = initiator.open_segment(target.segment_name()).unwrap();
        let before = rdma_bytes();
        write_pattern_and_check(&initiator, peer, &local, &remote, 6, 1 << 20);
        assert_eq!(rdma_bytes() - before, if over_rdma { 1 << 20 } else { 0 });
    }
}

/// Helper process for the two-process test: an RDMA target with an 8 MiB buffer holding
/// pattern 7, until its stdin closes.
#[test]
#[ignore = "helper process of two_processes_share_one_device"]
fn helper_target() {
    if std::env::var(support::HELPER_ENV).as_deref() != Ok("target") {
        return;
    }
    setup("helper_target");
    let engine = rdma_engine();
    let buffer = engine.allocate(8 << 20, "cpu:0").unwrap();
    buffer.write_at(0, &pattern(7, 8 << 20)).unwrap();
    println!("buffer: {} {}", engine.segment_name(), buffer.addr());
    until_stdin_closes();
    assert!(
        holds(&buffer, 4 << 20, 8, 1 << 20),
        "the initiator's write landed"
    );
}

/// Reads the helper target's 8 MiB (pattern 7) and writes pattern 8 into its fifth MiB,
/// which the helper checks when it finishes.
fn read_the_helper_then_write_to_it(
    engine: &TransferEngine,
    peer: tern_engine::SegmentId,
    local: &tern_engine::OwnedBuffer,
    remote: u64,
) {
    engine
        .transfer_sync(TransferRequest::read(local.addr(), peer, remote, 8 << 20))
        .unwrap();
    assert!(holds(local, 0, 7, 8 << 20), "read from the other process");
    local.write_at(0, &pattern(8, 1 << 20)).unwrap();
    engine
        .transfer_sync(TransferRequest::write(
            local.addr(),
            peer,
            remote + (4 << 20),
            1 << 20,
        ))
        .unwrap();
}

#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn two_processes_share_one_device() {
    setup("two_processes_share_one_device");
    let (mut target, segment, remote) = spawn_helper_target();
    let engine = rdma_engine();
    let peer = engine.open_segment(&segment).unwrap();
    let local = engine.allocate(8 << 20, "cpu:0").unwrap();
    read_the_helper_then_write_to_it(&engine, peer, &local, remote);
    assert!(target.finish().success(), "the target saw the write");
}

/// With room for one endpoint per NIC, alternating between three peers evicts on every
/// switch; every transfer still lands and the QPs stay bounded.
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn evicted_endpoints_are_remade_and_qps_stay_bounded() {
    setup("evicted_endpoints_are_remade_and_qps_stay_bounded");
    let rdma = rdma_with(|c| c.max_endpoints = 1);
    let stats = rdma.clone();
    let initiator = builder(rdma).build().unwrap();
    let targets: Vec<TransferEngine> = (0..3)
        .map(|_| builder(rdma_with(|c| c.max_endpoints = 4)).build().unwrap())
        .collect();
    let buffers: Vec<_> = targets
        .iter()
        .map(|t| t.allocate(1 << 20, "cpu:0").unwrap())
        .collect();
    let peers: Vec<_> = targets
        .iter()
        .map(|t| initiator.open_segment(t.segment_name()).unwrap())
        .collect();
    let local = initiator.allocate(1 << 20, "cpu:0").unwrap();
    let mut qps_after_warmup = 0;
    for round in 0..30 {
        let i = round % 3;
        local.write_at(0, &pattern(round as u64, 64 << 10)).unwrap();
        initiator
            .transfer_sync(TransferRequest::write(
                local.addr(),
                peers[i],
                buffers[i].addr() as u64,
                64 << 10,
            ))
            .unwrap();
        assert!(
            holds(&buffers[i], 0, round as u64, 64 << 10),
            "round {round}"
        );
        assert!(
            stats.endpoints() <= 1,
            "{} endpoints cached",
            stats.endpoints()
        );
        if round == 5 {
            // Retired endpoints go once their flushes are polled; give the worker a moment.
            std::thread::sleep(Duration::from_millis(500));
            qps_after_warmup = tern_verbs::live_queue_pairs();
        }
    }
    std::thread::sleep(Duration::from_millis(500));
    let now = tern_verbs::live_queue_pairs();
    assert!(
        now <= qps_after_warmup,
        "QPs grew from {qps_after_warmup} to {now}"
    );
}

/// A remote access error (the peer unregistered the memory) fails the task with a typed
/// error and the path keeps working.
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn a_remote_access_error_fails_the_task_and_the_path_recovers() {
    setup("a_remote_access_error_fails_the_task_and_the_path_recovers");
    let target = rdma_engine();
    let initiator = rdma_engine();
    let kept = target.allocate(1 << 20, "cpu:0").unwrap();
    let gone = target.allocate(1 << 20, "cpu:0").unwrap();
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    let gone_addr = gone.addr() as u64;
    drop(gone);
    let local = initiator.allocate(1 << 20, "cpu:0").unwrap();
    let batch = submit_alone(
        &initiator,
        TransferRequest::write(local.addr(), peer, gone_addr, 1 << 20),
    );
    batch.wait(Duration::from_secs(60));
    let status = batch.task_status(0).unwrap().status;
    assert!(
        matches!(
            status,
            TransferStatus::Failed(TransferError::RemoteRejected { .. })
        ),
        "{status}"
    );
    let _ = CompletionError::REMOTE_ACCESS;
    write_pattern_and_check(&initiator, peer, &local, &kept, 9, 4096);
    // The engine's statistics tell the story: the failed slices (each QP's first refused
    // write fails; the flushed ones behind them are skipped), the bytes that moved, and the
    // peer connected again with its last error kept.
    let stats = initiator.stats();
    let rdma = &stats.transports[0];
    assert_eq!(rdma.protocol, "rdma");
    assert!((1..=2).contains(&rdma.failures), "{rdma:?}");
    assert_eq!((rdma.bytes, rdma.slices), (4096, 1), "{rdma:?}");
    let peer_stats = rdma
        .peers
        .iter()
        .find(|p| p.peer == target.segment_name())
        .unwrap_or_else(|| panic!("no stats for the target: {rdma:?}"));
    assert_eq!(
        peer_stats.state,
        tern_engine::PeerState::Connected,
        "{peer_stats:?}"
    );
    assert!(peer_stats.endpoints >= 1);
    assert!(
        peer_stats
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("remote access")),
        "{peer_stats:?}"
    );
}

/// `MC_GID_INDEX` and `MC_IB_PORT` are honoured: the published GID is the one at the index
/// asked for, and a port the device lacks is an error naming it.
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn the_gid_index_and_port_asked_for_are_used() {
    setup("the_gid_index_and_port_asked_for_are_used");
    let table = |index: u32| {
        let path = format!("/sys/class/infiniband/{}/ports/1/gids/{index}", device());
        Gid::parse(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    for index in [0u32, 1] {
        let engine = builder(rdma_with(|c| c.gid_index = Some(index)))
            .build()
            .unwrap();
        let published = engine.local_descriptor().devices[0].gid.clone();
        assert_eq!(Gid::parse(&published), Some(table(index)), "index {index}");
    }
    let error = tern_transport_rdma::RdmaTransport::discover(tern_transport_rdma::RdmaConfig {
        devices: vec![device()],
        ib_port: 2,
        ..tern_transport_rdma::RdmaConfig::default()
    })
    .unwrap_err()
    .to_string();
    assert!(error.contains("port 2"), "{error}");
}

/// A priority matrix given in the configuration (as `MC_CUSTOM_TOPO_JSON` or
/// `--nic_priority_matrix` would give it) is the one published, restricted to the NICs in
/// use; a malformed one is an error naming the problem.
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn a_given_priority_matrix_is_published() {
    setup("a_given_priority_matrix_is_published");
    let json = format!(
        r#"{{"cpu:0": [["{0}"], []], "cuda:3": [[], ["{0}", "mlx5_9"]]}}"#,
        device()
    );
    let file = std::env::temp_dir().join(format!("tern-topo-{}.json", std::process::id()));
    std::fs::write(&file, &json).unwrap();
    for config in [
        tern_transport_rdma::RdmaConfig {
            priority_matrix: Some(json.clone()),
            ..Default::default()
        },
        tern_transport_rdma::RdmaConfig {
            topology_file: Some(file.clone()),
            ..Default::default()
        },
    ] {
        let engine = builder(rdma_with(|c| {
            c.priority_matrix = config.priority_matrix.clone();
            c.topology_file = config.topology_file.clone();
        }))
        .build()
        .unwrap();
        let matrix = engine.local_descriptor().priority_matrix.unwrap();
        assert_eq!(matrix["cpu:0"], [vec![device()], vec![]]);
        assert_eq!(
            matrix["cuda:3"],
            [vec![], vec![device()]],
            "mlx5_9 is not here"
        );
    }
    std::fs::write(&file, r#"{"cpu:0": [["rxe0"]]}"#).unwrap();
    let error = tern_transport_rdma::RdmaTransport::discover(tern_transport_rdma::RdmaConfig {
        devices: vec![device()],
        topology_file: Some(file.clone()),
        ..Default::default()
    })
    .unwrap_err()
    .to_string();
    assert!(error.contains("cpu:0"), "{error}");
    let _ = std::fs::remove_file(&file);
}

/// A target process stopped (SIGSTOP) mid-run: its NIC still serves the memory it
/// registered, so transfers on open endpoints complete with the right bytes; a new
/// initiator, whose handshake the stopped process cannot answer, times out at its deadline
/// with a typed status; once the target continues, that initiator is served too.
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn a_stopped_target_is_still_served_by_its_nic_and_new_handshakes_time_out() {
    setup("a_stopped_target_is_still_served_by_its_nic_and_new_handshakes_time_out");
    let (mut target, segment, remote) = spawn_helper_target();
    let first = rdma_engine();
    let peer = first.open_segment(&segment).unwrap();
    let local = first.allocate(8 << 20, "cpu:0").unwrap();
    first
        .transfer_sync(TransferRequest::read(local.addr(), peer, remote, 4096))
        .unwrap();
    // Opened before the stop, but no endpoint yet: its first transfer needs a handshake.
    let second = rdma_engine();
    let peer2 = second.open_segment(&segment).unwrap();
    target.stop();
    read_the_helper_then_write_to_it(&first, peer, &local, remote);

    let local2 = second.allocate(1 << 20, "cpu:0").unwrap();
    let batch = second.allocate_batch(1).unwrap();
    batch.set_deadline(Some(std::time::Instant::now() + Duration::from_secs(5)));
    second
        .submit(
            &batch,
            &[TransferRequest::read(local2.addr(), peer2, remote, 4096)],
        )
        .unwrap();
    let started = std::time::Instant::now();
    batch.wait(Duration::from_secs(30));
    assert_eq!(
        batch.task_status(0).unwrap().status,
        TransferStatus::Timeout
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    target.resume();
    second
        .transfer_sync(TransferRequest::read(local2.addr(), peer2, remote, 1 << 20))
        .unwrap();
    assert!(holds(&local2, 0, 7, 1 << 20));
    assert!(target.finish().success(), "the target saw the write");
}

/// An initiator shut down while 64 MiB of reads are on the wire: its workers move every QP
/// to the error state and retire each request as it flushes, so by the time shutdown returns
/// no work request naming local memory is outstanding and no pin was given up for one.
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn shutdown_mid_transfer_retires_every_request_before_its_pin_goes() {
    setup("shutdown_mid_transfer_retires_every_request_before_its_pin_goes");
    const BLOCK: usize = 64 << 10;
    const COUNT: usize = 1024;
    let target = rdma_engine();
    let remote = target.allocate(COUNT * BLOCK, "cpu:0").unwrap();
    let initiator = rdma_engine();
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    let local = initiator.allocate(COUNT * BLOCK, "cpu:0").unwrap();
    let leaked_before = tern_verbs::leaked_guards();
    let batch = initiator.allocate_batch(COUNT).unwrap();
    let requests: Vec<TransferRequest> = (0..COUNT)
        .map(|i| {
            TransferRequest::read(
                local.addr() + i * BLOCK,
                peer,
                remote.addr() as u64 + (i * BLOCK) as u64,
                BLOCK,
            )
        })
        .collect();
    initiator.submit(&batch, &requests).unwrap();
    // Wait until the NIC is busy with them.
    let started = std::time::Instant::now();
    while tern_verbs::tracked_in_flight() == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "nothing was posted"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(initiator);
    assert_eq!(
        tern_verbs::tracked_in_flight(),
        0,
        "requests still on the device after shutdown"
    );
    assert_eq!(
        tern_verbs::leaked_guards(),
        leaked_before,
        "the device flushed everything, so no pin had to be given up"
    );
    let statuses: Vec<TransferStatus> = (0..COUNT)
        .map(|i| batch.task_status(i).unwrap().status)
        .collect();
    assert!(
        statuses.iter().all(|s| *s != TransferStatus::Pending),
        "a task was left pending: {:?}",
        statuses.iter().find(|s| **s == TransferStatus::Pending)
    );
    assert!(
        statuses
            .iter()
            .any(|s| matches!(s, TransferStatus::Failed(_))),
        "every read finished before the shutdown: nothing was in flight"
    );
    drop(local);
}

/// A peer whose published NIC cannot be reached (its GID is the link-local one, index 0, which
/// an IPv4 RoCE path cannot route to): RDMA tries its paths, gives the slices back to the
/// engine, and TCP — installed beside it on both nodes — carries them; every task completes
/// with the right bytes, and the RDMA counters show nothing moved.
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn slices_rdma_cannot_carry_move_over_tcp() {
    support::setup(
        "slices_rdma_cannot_carry_move_over_tcp",
        Duration::from_secs(600),
    );
    let target = builder(rdma_with(|c| c.gid_index = Some(0)))
        .transport(TcpTransport::default())
        .build()
        .unwrap();
    let initiator = builder(rdma_with(|_| {}))
        .transport(TcpTransport::default())
        .transfer_timeout(Some(Duration::from_secs(300)))
        .build()
        .unwrap();
    let remote = target.allocate(4 << 20, "cpu:0").unwrap();
    let local = initiator.allocate(8 << 20, "cpu:0").unwrap();
    local.write_at(0, &pattern(21, 4 << 20)).unwrap();
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    let remote_addr = remote.addr() as u64;
    initiator
        .transfer_sync(TransferRequest::write(
            local.addr(),
            peer,
            remote_addr,
            4 << 20,
        ))
        .unwrap();
    assert!(
        holds(&remote, 0, 21, 4 << 20),
        "the write landed the wrong bytes"
    );
    initiator
        .transfer_sync(TransferRequest::read(
            local.addr() + (4 << 20),
            peer,
            remote_addr,
            4 << 20,
        ))
        .unwrap();
    assert!(
        holds(&local, 4 << 20, 21, 4 << 20),
        "the read brought the wrong bytes"
    );
    let stats = initiator.stats();
    let of = |protocol: &str| {
        stats
            .transports
            .iter()
            .find(|t| t.protocol == protocol)
            .unwrap_or_else(|| panic!("no {protocol} stats: {stats:?}"))
    };
    assert_eq!(of("rdma").bytes, 0, "{stats:?}");
    assert_eq!(of("tcp").bytes, 8 << 20, "{stats:?}");
}

/// A slice size that would make slices longer than one work request carries is refused
/// when the transport is set up, with an error that names the limit: beyond `u32` (an SGE's
/// length), and beyond the port's `max_msg_sz` as the device reports it.
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn a_slice_size_beyond_one_work_request_is_refused_at_discover() {
    use tern_transport_rdma::config::ConfigError;
    use tern_transport_rdma::{RdmaConfig, RdmaError, RdmaTransport};
    support::setup(
        "a_slice_size_beyond_one_work_request_is_refused_at_discover",
        Duration::from_secs(120),
    );
    let discover = |slice_size: usize| {
        RdmaTransport::discover(RdmaConfig {
            devices: vec![device()],
            slice_size,
            ..RdmaConfig::from_env()
        })
    };
    match discover(4 << 30) {
        Err(RdmaError::Config(ConfigError::SliceTooLarge { limit, .. })) => {
            assert_eq!(limit, u64::from(u32::MAX));
        }
        other => panic!("a 4 GiB slice size: {other:?}"),
    }
    let max_msg = tern_verbs::Context::open(&device())
        .unwrap()
        .port(1)
        .unwrap()
        .max_msg_sz;
    eprintln!("{} port 1: max_msg_sz {max_msg}", device());
    assert!(max_msg > 0);
    // A slice of max_msg_sz fits, but the tail merged into it (a quarter of a slice at the
    // default fragment ratio) does not.
    match discover(max_msg as usize) {
        Err(RdmaError::Config(ConfigError::SliceTooLarge {
            limit, limited_by, ..
        })) => {
            assert_eq!(limit, u64::from(max_msg));
            if u64::from(max_msg) < u64::from(u32::MAX) {
                assert!(limited_by.contains(&device()), "{limited_by}");
            }
        }
        other => panic!("a slice size of max_msg_sz: {other:?}"),
    }
    // Half of max_msg_sz, with its quarter-slice tail, fits.
    discover(max_msg as usize / 2).expect("a slice size well inside max_msg_sz");
}

#[path = "../../testkit/include/local.rs"]
mod local;
use local::Local;
#[path = "../../testkit/include/deadline.rs"]
mod deadline;
use deadline::{assert_read_timed_out, assert_write_timed_out, submit_alone, wait_past_deadline};

/// An engine whose endpoint to [`helper_target`] was open (a 4 KiB read went through) when
/// the target was killed: its QPs are destroyed with it, so the device drops what arrives for
/// them, unanswered. At 4.096 µs × 2^24 ≈ 69 s per try, 7 tries, the engine's QP alone would
/// give up only minutes after a test's wait.
fn an_endpoint_to_a_killed_target() -> (TransferEngine, SegmentId, Local, u64) {
    let (mut target, segment, remote) = spawn_helper_target();
    let engine = builder(rdma_with(|c| c.ack_timeout = 24)).build().unwrap();
    let peer = engine.open_segment(&segment).unwrap();
    let local = Local::register(&engine, 1 << 20);
    engine
        .transfer_sync(TransferRequest::read(local.addr(), peer, remote, 4096))
        .unwrap();
    target.kill();
    (engine, peer, local, remote)
}

/// A 1 MiB read that waits for a handshake the target process cannot answer (stopped with
/// SIGSTOP before the initiator's first transfer) ends as `Timeout` at its deadline; at
/// once its buffer can be unregistered, and it stays untouched for the next two seconds
/// while the target runs again (and could now answer the handshake). The path then serves
/// the initiator normally.
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn a_read_waiting_on_a_handshake_to_a_stopped_peer_gives_its_memory_back_at_the_timeout() {
    setup("a_read_waiting_on_a_handshake_to_a_stopped_peer_gives_its_memory_back_at_the_timeout");
    let (mut target, segment, remote) = spawn_helper_target();
    let engine = rdma_engine();
    let peer = engine.open_segment(&segment).unwrap();
    let local = Local::register(&engine, 1 << 20);
    target.stop();
    let batch = submit_alone(
        &engine,
        TransferRequest::read(local.addr(), peer, remote, 1 << 20),
    );
    let (status, _) = wait_past_deadline(&batch, Duration::from_millis(500));
    assert_read_timed_out(&status);
    engine
        .unregister_memory(local.addr())
        .expect("unregistering the timed-out read's buffer succeeds at once");
    target.resume();
    local.assert_untouched("a read waiting on a handshake", || ());
    engine.free_batch(&batch).unwrap();
    let owned = engine.allocate(8 << 20, "cpu:0").unwrap();
    read_the_helper_then_write_to_it(&engine, peer, &owned, remote);
    assert!(target.finish().success(), "the target saw the write");
}

/// A 1 MiB read posted on an open endpoint to a target process that was then killed:
/// nothing answers its packets, and with a long ACK timeout its QP would retry for
/// minutes. At the deadline it ends as `Timeout`: its endpoint's QPs go to the error state,
/// the flushed request is reaped, and at once its buffer can be unregistered and stays
/// untouched.
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn a_read_on_the_wire_to_a_vanished_peer_is_flushed_at_the_timeout() {
    setup("a_read_on_the_wire_to_a_vanished_peer_is_flushed_at_the_timeout");
    let (engine, peer, local, remote) = an_endpoint_to_a_killed_target();
    let posted_before = tern_verbs::tracked_in_flight();
    let batch = submit_alone(
        &engine,
        TransferRequest::read(local.addr(), peer, remote, 1 << 20),
    );
    let started = std::time::Instant::now();
    while tern_verbs::tracked_in_flight() == posted_before {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the read was never posted"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let (status, late) = wait_past_deadline(&batch, Duration::from_millis(500));
    eprintln!("a read on the wire to a vanished peer: back {late:?} after its deadline");
    assert_read_timed_out(&status);
    engine
        .unregister_memory(local.addr())
        .expect("unregistering the flushed read's buffer succeeds at once");
    assert_eq!(
        tern_verbs::tracked_in_flight(),
        posted_before,
        "a request is still on the device"
    );
    local.assert_untouched("a read flushed at its deadline", || ());
    engine.free_batch(&batch).unwrap();
}

/// A write posted to a killed target, like the read above: it ends as `Timeout`, its
/// buffer is free at once, and the status says the peer's memory may still change (bytes of
/// it may have left before the QP was cut off).
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn a_write_on_the_wire_cut_off_at_the_timeout_says_the_peer_may_still_change() {
    setup("a_write_on_the_wire_cut_off_at_the_timeout_says_the_peer_may_still_change");
    let (engine, peer, local, remote) = an_endpoint_to_a_killed_target();
    let batch = submit_alone(
        &engine,
        TransferRequest::write(local.addr(), peer, remote, 1 << 20),
    );
    let (status, _) = wait_past_deadline(&batch, Duration::from_millis(500));
    assert_write_timed_out(&status);
    engine
        .unregister_memory(local.addr())
        .expect("unregistering the cut-off write's buffer succeeds at once");
    engine.free_batch(&batch).unwrap();
}

/// How long reads stuck behind a handshake to a stopped target take to come back after
/// their deadline, over 100 stalls (printed: p50, p99, max).
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn timed_out_reads_come_back_soon_after_their_deadline() {
    setup("timed_out_reads_come_back_soon_after_their_deadline");
    const STALLS: usize = 100;
    let (mut target, segment, remote) = spawn_helper_target();
    // The handshake outlasts every stall.
    let engine = builder(rdma_with(|c| {
        c.handshake_timeout = Duration::from_secs(120)
    }))
    .build()
    .unwrap();
    let peer = engine.open_segment(&segment).unwrap();
    let local = Local::register(&engine, 1 << 20);
    target.stop();
    let mut took = Vec::with_capacity(STALLS);
    for _ in 0..STALLS {
        let batch = submit_alone(
            &engine,
            TransferRequest::read(local.addr(), peer, remote, 1 << 20),
        );
        let (status, late) = wait_past_deadline(&batch, Duration::from_millis(50));
        took.push(late);
        assert_eq!(status.status, TransferStatus::Timeout);
        engine.free_batch(&batch).unwrap();
    }
    engine.unregister_memory(local.addr()).unwrap();
    target.resume();
    took.sort();
    println!(
        "rdma: timed-out read back after its deadline over {STALLS} stalls: p50 {:?}, p99 {:?}, \
         max {:?}",
        took[STALLS / 2],
        took[(STALLS * 99).div_ceil(100) - 1],
        took[STALLS - 1]
    );
    target.kill();
}

/// Helper process for `a_flushed_write_whose_path_cannot_be_fenced_fails_and_never_moves_to_tcp`:
/// an RDMA and TCP target with an 8 MiB buffer, until its stdin closes (or it is killed).
#[test]
#[ignore = "helper process of a_flushed_write_whose_path_cannot_be_fenced_fails_and_never_moves_to_tcp"]
fn helper_target_with_tcp() {
    if std::env::var(support::HELPER_ENV).as_deref() != Ok("target-with-tcp") {
        return;
    }
    setup("helper_target_with_tcp");
    let engine = builder(rdma_with(|_| {}))
        .transport(TcpTransport::default())
        .build()
        .unwrap();
    let buffer = engine.allocate(8 << 20, "cpu:0").unwrap();
    println!("buffer: {} {}", engine.segment_name(), buffer.addr());
    until_stdin_closes();
}

/// Submits `request` alone in a batch and waits until the RDMA transport has posted more
/// work requests than `posted_before`, or the request is over (60 s at most); the batch.
fn posted_alone(
    engine: &TransferEngine,
    request: TransferRequest,
    posted_before: usize,
) -> tern_engine::Batch {
    let batch = submit_alone(engine, request);
    let started = std::time::Instant::now();
    while tern_verbs::tracked_in_flight() <= posted_before && batch.status().pending > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the request was never posted"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    batch
}

/// A write on the wire to a target that was killed, flushed when another task's deadline
/// cuts its endpoint off: bytes of it may have left, and only a handshake on its path (the
/// peer replacing the QPs they went through) would make sending it again safe. The killed
/// peer cannot answer one, so the write fails saying the peer's memory may still change —
/// it is not handed to TCP, whose copy could be overtaken by the first.
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn a_flushed_write_whose_path_cannot_be_fenced_fails_and_never_moves_to_tcp() {
    setup("a_flushed_write_whose_path_cannot_be_fenced_fails_and_never_moves_to_tcp");
    let (mut target, value) =
        spawn_helper("helper_target_with_tcp", "target-with-tcp", &[], "buffer");
    let (segment, remote) = value.split_once(' ').unwrap();
    let remote: u64 = remote.parse().unwrap();
    // A long ACK timeout: the QP retries for minutes, so only a cut-off ends its requests.
    let engine = builder(rdma_with(|c| c.ack_timeout = 24))
        .transport(TcpTransport::default())
        .merge_requests(false)
        .build()
        .unwrap();
    let peer = engine.open_segment(segment).unwrap();
    let local = Local::register(&engine, 2 << 20);
    engine
        .transfer_sync(TransferRequest::read(local.addr(), peer, remote, 4096))
        .unwrap();
    target.kill();
    let posted = tern_verbs::tracked_in_flight();
    let first = posted_alone(
        &engine,
        TransferRequest::write(local.addr(), peer, remote, 1 << 20),
        posted,
    );
    let posted = tern_verbs::tracked_in_flight();
    let second = posted_alone(
        &engine,
        TransferRequest::write(local.addr() + (1 << 20), peer, remote + (1 << 20), 1 << 20),
        posted,
    );
    // The second write's deadline cuts the endpoint off, flushing the first too.
    let (status, _) = wait_past_deadline(&second, Duration::from_millis(200));
    assert_write_timed_out(&status);
    first.wait(Duration::from_secs(120));
    let status = first.task_status(0).unwrap();
    assert!(
        matches!(
            status.status,
            TransferStatus::Failed(TransferError::Connection { .. })
        ),
        "{status:?}"
    );
    assert!(
        status.remote_may_change,
        "the first attempt may still land: {status:?}"
    );
    let stats = engine.stats();
    let tcp = stats
        .transports
        .iter()
        .find(|t| t.protocol == "tcp")
        .expect("tcp stats");
    assert!(
        tcp.declined.is_empty() && tcp.bytes == 0 && tcp.failures == 0,
        "the write was handed to TCP: {stats:?}"
    );
    let rdma = &stats.transports[0];
    assert!(rdma.declined.is_empty(), "the write was declined: {rdma:?}");
}

/// Two writes on one QP of a live target: a large one, then a small one queued behind it.
/// The large one is canceled while on the wire, which takes the endpoint down and flushes the
/// small one if it was posted (RC runs a QP's requests in order, so it cannot have finished),
/// or moves it off the endpoint if not. The small one goes out again behind a new handshake
/// on the same path and completes whole, shown final (nothing of a first attempt lands later:
/// the target's QPs of that path were replaced before it went again). A round counts when the
/// small write went again; six rounds, so that the race of the cancel against the large
/// write's end leaves at least one.
#[test]
#[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma"]
fn a_write_flushed_by_another_tasks_cut_off_goes_again_behind_a_handshake_and_completes() {
    support::setup(
        "a_write_flushed_by_another_tasks_cut_off_goes_again_behind_a_handshake_and_completes",
        Duration::from_secs(600),
    );
    const BLOCKER: usize = 32 << 20;
    const SMALL: usize = 1 << 20;
    const ROUNDS: u64 = 6;
    // Slices of 64 KiB: both writes' requests fit the one QP at once.
    const REQUESTS: usize = (BLOCKER + SMALL) / (64 << 10);
    let target = rdma_engine();
    let remote = target.allocate(BLOCKER + SMALL, "cpu:0").unwrap();
    let engine = builder(rdma_with(|c| {
        c.qps_per_endpoint = 1;
        c.slice_size = 64 << 10;
        c.max_wr = (2 * REQUESTS) as u32;
    }))
    .merge_requests(false)
    .build()
    .unwrap();
    let peer = engine.open_segment(target.segment_name()).unwrap();
    let local = engine.allocate(BLOCKER + SMALL, "cpu:0").unwrap();
    let mut flushed_rounds = 0;
    for round in 0..ROUNDS {
        local
            .write_at(BLOCKER, &pattern(40 + round, SMALL))
            .unwrap();
        let retries_before = engine.stats().transports[0].retries;
        let posted = tern_verbs::tracked_in_flight();
        let blocker = posted_alone(
            &engine,
            TransferRequest::write(local.addr(), peer, (remote.addr() + SMALL) as u64, BLOCKER),
            posted,
        );
        let posted = tern_verbs::tracked_in_flight();
        let small = posted_alone(
            &engine,
            TransferRequest::write(local.addr() + BLOCKER, peer, remote.addr() as u64, SMALL),
            posted,
        );
        blocker.cancel();
        small.wait(Duration::from_secs(300));
        let status = small.task_status(0).unwrap();
        assert_eq!(status.status, TransferStatus::Completed, "{status:?}");
        assert!(!status.remote_may_change, "{status:?}");
        assert!(holds(&remote, 0, 40 + round, SMALL), "round {round}");
        if engine.stats().transports[0].retries > retries_before {
            flushed_rounds += 1;
        }
    }
    eprintln!("{flushed_rounds} of {ROUNDS} rounds flushed the small write and sent it again");
    assert!(
        flushed_rounds > 0,
        "no round flushed the small write: the test proved nothing"
    );
}
