//! Nodes that find each other through a real etcd server: Mooncake's key layout, leases that
//! outlive nothing, watches that keep caches fresh, and failures of etcd itself.

use std::time::{Duration, Instant};

use tern_engine::{
    EngineError, SegmentDesc, StoreOptions, TransferEngine, TransferError, TransferRequest,
    TransferStatus,
};
use tern_metadata::{MetadataError, RpcMeta};
use tern_testkit::etcd;
use tern_testkit::etcd::{Etcd, eventually, get, unique};
use tern_transport_tcp::TcpTransport;

const GOLDEN_TCP: &str = include_str!("../../metadata/tests/golden/mooncake-tcp-segment.json");
const GOLDEN_RDMA: &str = include_str!("../../metadata/tests/golden/mooncake-rdma-segment.json");

fn node(endpoint: &str, name: &str, options: StoreOptions) -> TransferEngine {
    node_on(&format!("etcd://{endpoint}"), name, options)
}

fn node_on(conn: &str, name: &str, options: StoreOptions) -> TransferEngine {
    TransferEngine::builder()
        .local_server_name(name)
        .advertise_address("127.0.0.1")
        .metadata(conn)
        .store_options(options)
        .transport(TcpTransport::default())
        .build()
        .unwrap()
}

fn status_of(engine: &TransferEngine, request: TransferRequest) -> TransferStatus {
    let batch = engine.allocate_batch(1).unwrap();
    engine.submit(&batch, &[request]).unwrap();
    batch.wait(Duration::from_secs(30));
    batch.task_status(0).unwrap().status
}

#[test]
fn nodes_publish_under_mooncakes_keys_with_a_lease_and_transfer() {
    let (endpoint, _own) = etcd::shared();
    let name = unique("tern-target");
    let target = node(&endpoint, &name, StoreOptions::default());
    let remote = target.allocate(1 << 20, "cpu:0").unwrap();
    let initiator = node(
        &endpoint,
        &unique("tern-initiator"),
        StoreOptions::default(),
    );

    let stored = get(&endpoint, &format!("mooncake/ram/{name}")).expect("descriptor key");
    assert!(stored.ends_with('\n'));
    let desc = SegmentDesc::from_json(stored.as_bytes()).unwrap();
    assert_eq!(desc.name, name);
    assert_eq!(desc.tcp_proto_version, 3);
    assert!(
        desc.buffers
            .iter()
            .any(|b| b.addr == remote.addr() as u64 && b.name == name)
    );
    let rpc: RpcMeta =
        serde_json::from_str(&get(&endpoint, &format!("mooncake/rpc_meta/{name}")).unwrap())
            .unwrap();
    assert_eq!(
        rpc,
        RpcMeta {
            ip_or_host_name: "127.0.0.1".into(),
            rpc_port: target.rpc_port()
        }
    );
    let listing = etcd::etcdctl(
        &endpoint,
        &["get", &format!("mooncake/ram/{name}"), "-w", "json"],
    );
    assert!(
        listing.contains("\"lease\":"),
        "descriptor is not under a lease: {listing}"
    );

    let peer = initiator.open_segment(&name).unwrap();
    let local = initiator.allocate(1 << 20, "cpu:0").unwrap();
    local.write_at(0, b"over etcd").unwrap();
    initiator
        .transfer_sync(TransferRequest::write(
            local.addr(),
            peer,
            remote.addr() as u64,
            9,
        ))
        .unwrap();
    let mut back = [0u8; 9];
    remote.read_at(0, &mut back).unwrap();
    assert_eq!(&back, b"over etcd");

    // A clean shutdown withdraws the keys at once.
    drop(remote);
    drop(target);
    assert!(get(&endpoint, &format!("mooncake/ram/{name}")).is_none());
    assert!(get(&endpoint, &format!("mooncake/rpc_meta/{name}")).is_none());
}

#[test]
fn cluster_ids_scope_the_keys() {
    let (endpoint, _own) = etcd::shared();
    let name = unique("scoped");
    let cluster = unique("cluster");
    let options = StoreOptions {
        cluster_id: Some(cluster.clone()),
        ..StoreOptions::default()
    };
    let target = node(&endpoint, &name, options.clone());
    assert!(get(&endpoint, &format!("mooncake/{cluster}/ram/{name}")).is_some());
    assert!(get(&endpoint, &format!("mooncake/ram/{name}")).is_none());
    let same_cluster = node(&endpoint, &unique("a"), options);
    assert!(same_cluster.open_segment(&name).is_ok());
    let other_cluster = node(&endpoint, &unique("b"), StoreOptions::default());
    assert!(matches!(
        other_cluster.open_segment(&name),
        Err(EngineError::Metadata(MetadataError::SegmentNotFound(_)))
    ));
    drop(target);
}

#[test]
fn descriptors_written_by_mooncake_are_read_and_bad_ones_are_named() {
    let (endpoint, _own) = etcd::shared();
    let initiator = node(&endpoint, &unique("reader"), StoreOptions::default());
    let good = unique("mc-golden");
    let golden = GOLDEN_TCP.replace("\"mc-target\"", &format!("\"{good}\""));
    etcd::etcdctl(
        &endpoint,
        &["put", &format!("mooncake/ram/{good}"), &golden],
    );
    etcd::etcdctl(
        &endpoint,
        &[
            "put",
            &format!("mooncake/rpc_meta/{good}"),
            r#"{"ip_or_host_name":"127.0.0.1","rpc_port":1}"#,
        ],
    );
    let id = initiator.open_segment(&good).unwrap();
    let seen = initiator.segment(id).unwrap();
    assert!(
        seen.desc
            .same_content(&SegmentDesc::from_json(golden.as_bytes()).unwrap())
    );

    let bad = unique("mc-malformed");
    let key = format!("mooncake/ram/{bad}");
    etcd::etcdctl(&endpoint, &["put", &key, "{\"name\": not json"]);
    let error = initiator.open_segment(&bad).unwrap_err().to_string();
    assert!(error.contains(&key), "error does not name the key: {error}");

    let broken = unique("mc-rkeys");
    let key = format!("mooncake/ram/{broken}");
    let two_keys = GOLDEN_RDMA.replace("[712]", "[712,713]");
    etcd::etcdctl(&endpoint, &["put", &key, &two_keys]);
    etcd::etcdctl(
        &endpoint,
        &[
            "put",
            &format!("mooncake/rpc_meta/{broken}"),
            r#"{"ip_or_host_name":"127.0.0.1","rpc_port":1}"#,
        ],
    );
    let error = initiator.open_segment(&broken).unwrap_err().to_string();
    assert!(error.contains("rkeys") && error.contains(&key), "{error}");

    // The good one is unaffected.
    assert!(initiator.segment(id).is_some());
    assert!(initiator.open_segment(&good).is_ok());
    for name in [good, bad, broken] {
        etcd::etcdctl(
            &endpoint,
            &["del", "--prefix", &format!("mooncake/ram/{name}")],
        );
    }
}

#[test]
fn watches_refresh_evict_and_revive_cached_segments() {
    let (endpoint, _own) = etcd::shared();
    let name = unique("watched");
    let initiator = node(&endpoint, &unique("watcher"), StoreOptions::default());
    let local = initiator.allocate(1 << 20, "cpu:0").unwrap();
    let target = node(&endpoint, &name, StoreOptions::default());
    let first = target.allocate(4096, "cpu:0").unwrap();
    let peer = initiator.open_segment(&name).unwrap();

    // New memory on the target reaches the initiator's cache without a refresh call.
    let second = target.allocate(1 << 20, "cpu:0").unwrap();
    let seen = eventually(Duration::from_secs(10), || {
        initiator.segment(peer).is_some_and(|p| {
            p.desc
                .buffers
                .iter()
                .any(|b| b.addr == second.addr() as u64)
        })
    });
    assert!(seen.is_some(), "the new buffer never reached the cache");
    assert!(
        initiator
            .segment(peer)
            .unwrap()
            .desc
            .buffers
            .iter()
            .any(|b| b.addr == first.addr() as u64)
    );

    // The target leaves: transfers to it fail fast with a typed error, not a hang.
    drop((first, second));
    drop(target);
    let gone = eventually(Duration::from_secs(10), || {
        initiator.segment(peer).is_none()
    });
    assert!(gone.is_some(), "the vanished segment stayed cached");
    let started = Instant::now();
    let status = status_of(
        &initiator,
        TransferRequest::read(local.addr(), peer, 4096, 16),
    );
    assert_eq!(
        status,
        TransferStatus::Failed(TransferError::SegmentVanished(name.clone()))
    );
    // No connection is tried for a vanished segment: the bound only tells a fast failure from
    // a transfer that waited out its 30 s, with room for a loaded machine.
    assert!(started.elapsed() < Duration::from_secs(10));

    // It comes back (a restart, new buffers, a new port): usable without reopening.
    let reborn = node(&endpoint, &name, StoreOptions::default());
    let memory = reborn.allocate(1 << 20, "cpu:0").unwrap();
    let back = eventually(Duration::from_secs(10), || {
        initiator.segment(peer).is_some_and(|p| {
            p.desc
                .buffers
                .iter()
                .any(|b| b.addr == memory.addr() as u64)
                && p.rpc.rpc_port == reborn.rpc_port()
        })
    });
    assert!(back.is_some(), "the restarted peer was not picked up");
    local.write_at(0, b"again").unwrap();
    initiator
        .transfer_sync(TransferRequest::write(
            local.addr(),
            peer,
            memory.addr() as u64,
            5,
        ))
        .unwrap();
    let mut word = [0u8; 5];
    memory.read_at(0, &mut word).unwrap();
    assert_eq!(&word, b"again");
}

#[test]
fn a_lost_lease_is_regranted_and_everything_republished() {
    let (endpoint, _own) = etcd::shared();
    let name = unique("lease");
    let options = StoreOptions {
        ttl: Some(Duration::from_secs(3)),
        ..StoreOptions::default()
    };
    let target = node(&endpoint, &name, options);
    let key = format!("mooncake/ram/{name}");
    let listing = etcd::etcdctl(&endpoint, &["get", &key, "-w", "json"]);
    let lease: i64 = listing
        .split("\"lease\":")
        .nth(1)
        .and_then(|rest| rest.split([',', '}']).next())
        .and_then(|n| n.trim().parse().ok())
        .expect("a lease id");
    etcd::etcdctl(&endpoint, &["lease", "revoke", &format!("{lease:x}")]);
    assert!(
        get(&endpoint, &key).is_none(),
        "revoking the lease did not drop the key"
    );
    let back = eventually(Duration::from_secs(15), || {
        get(&endpoint, &key).is_some()
            && get(&endpoint, &format!("mooncake/rpc_meta/{name}")).is_some()
    });
    assert!(
        back.is_some(),
        "keys were not re-published after the lease was lost"
    );
    drop(target);
}

#[test]
fn etcd_down_at_start_is_an_error_naming_the_endpoint() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let endpoint = format!("127.0.0.1:{port}");
    let started = Instant::now();
    let error = TransferEngine::builder()
        .local_server_name("nobody")
        .advertise_address("127.0.0.1")
        .metadata(format!("etcd://{endpoint}"))
        .store_options(StoreOptions {
            start_retry: Some(Duration::from_millis(800)),
            ..StoreOptions::default()
        })
        .transport(TcpTransport::default())
        .build()
        .unwrap_err();
    let elapsed = started.elapsed();
    assert!(error.to_string().contains(&endpoint), "{error}");
    assert!(
        elapsed >= Duration::from_millis(500),
        "did not retry: {elapsed:?}"
    );
    assert!(elapsed < Duration::from_secs(20), "took {elapsed:?}");
}

#[test]
fn transfers_go_on_while_etcd_is_down_and_publishing_resumes_after() {
    let mut etcd = Etcd::start();
    let endpoint = etcd.endpoint.clone();
    let name = unique("outage");
    let target = node(&endpoint, &name, StoreOptions::default());
    let remote = target.allocate(1 << 20, "cpu:0").unwrap();
    let initiator = node(
        &endpoint,
        &unique("outage-initiator"),
        StoreOptions::default(),
    );
    let peer = initiator.open_segment(&name).unwrap();
    let local = initiator.allocate(1 << 20, "cpu:0").unwrap();

    etcd.kill();
    for round in 0..3u8 {
        local.write_at(0, &[round; 64]).unwrap();
        initiator
            .transfer_sync(TransferRequest::write(
                local.addr(),
                peer,
                remote.addr() as u64,
                64,
            ))
            .unwrap();
    }
    // Registration works while etcd is away; the descriptor reaches etcd when it is back.
    let during = target.allocate(1 << 20, "cpu:0").unwrap();
    etcd.restart();
    let published = eventually(Duration::from_secs(20), || {
        get(&endpoint, &format!("mooncake/ram/{name}"))
            .is_some_and(|v| v.contains(&during.addr().to_string()))
    });
    assert!(
        published.is_some(),
        "publishing did not resume after etcd came back"
    );
    let cached = eventually(Duration::from_secs(20), || {
        initiator.segment(peer).is_some_and(|p| {
            p.desc
                .buffers
                .iter()
                .any(|b| b.addr == during.addr() as u64)
        })
    });
    assert!(
        cached.is_some(),
        "the watch did not resume after etcd came back"
    );
}
