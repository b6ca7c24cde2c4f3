//! A node killed with SIGKILL loses its etcd keys within the lease TTL; `tern-bench` runs
//! against etcd and against the HTTP metadata server.

#[path = "support/target.rs"]
mod support;

use std::time::{Duration, Instant};

use support::{Target, initiator_through, metadata_server};
use tern_testkit::etcd;
use tern_testkit::etcd::{eventually, get, unique};

fn target(metadata: &str, name: &str, ttl_secs: &str) -> Target {
    let metadata = format!("--metadata_server={metadata}");
    let name = format!("--local_server_name={name}");
    Target::start(
        &[&metadata, &name, "--buffer_size=16777216"],
        &[
            ("MC_TCP_BIND_ADDRESS", "127.0.0.1"),
            ("TERN_ETCD_TTL_SECS", ttl_secs),
        ],
    )
}

fn initiator(metadata: &str, segment: &str, operation: &str) -> serde_json::Value {
    initiator_through(
        metadata,
        &unique("bench-initiator"),
        segment,
        operation,
        "0.5",
    )
}

#[test]
fn sigkill_loses_the_keys_within_the_ttl() {
    let (endpoint, _own) = etcd::shared();
    let name = unique("doomed");
    let mut child = target(&format!("etcd://{endpoint}"), &name, "2");
    assert_eq!(child.segment, name, "etcd mode keeps the server name");
    let key = format!("mooncake/ram/{name}");
    assert!(get(&endpoint, &key).is_some());
    let result = initiator(&format!("etcd://{endpoint}"), &name, "write");
    assert!(result["bytes"].as_u64().unwrap() > 0);

    child.child.kill().unwrap();
    child.child.wait().unwrap();
    let killed = Instant::now();
    let gone = eventually(Duration::from_secs(15), || {
        get(&endpoint, &key).is_none()
            && get(&endpoint, &format!("mooncake/rpc_meta/{name}")).is_none()
    });
    let took = gone.expect("keys of a killed node survived");
    assert!(
        killed.elapsed() < Duration::from_secs(2 + 6),
        "took {took:?} for a 2 s TTL"
    );
}

#[test]
fn tern_bench_runs_against_the_http_metadata_server() {
    let (_server, addr) = metadata_server();
    let url = format!("http://{addr}/metadata");
    let name = unique("http-target");
    let mut child = target(&url, &name, "10");
    let result = initiator(&url, &name, "read");
    assert!(result["bytes"].as_u64().unwrap() > 0);
    let (status, stderr) = child.stop("TERM");
    assert!(status.success(), "{status}: {stderr}");
}
