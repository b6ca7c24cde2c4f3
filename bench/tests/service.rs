//! `tern-bench --mode target` and `tern-metadata-server` as services, with the real binaries:
//! they serve whatever their stdin is (here `/dev/null`, as for a job started with `&` from a
//! script), and SIGINT or SIGTERM ends them cleanly: exit status 0, one line saying why, and
//! the target's keys deleted at once (etcd, HTTP store). Also: `--mode loopback` shows the
//! target's own error when the target cannot start; both serve their metrics.

#[path = "support/target.rs"]
mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use support::{Reaped, Target, drain, initiator_through, metadata_server, send_signal};
use tern_testkit::etcd;
use tern_testkit::etcd::{get, unique};

const BENCH: &str = env!("CARGO_BIN_EXE_tern-bench");

/// The real initiator binary against `segment` for `seconds`, verifying every block.
fn initiator(metadata: &str, segment: &str, seconds: &str) -> serde_json::Value {
    initiator_through(
        metadata,
        &unique("service-initiator"),
        segment,
        "read",
        seconds,
    )
}

/// Asserts a clean stop: exit status 0 and exactly one line saying which signal stopped it.
fn assert_clean_stop(status: std::process::ExitStatus, stderr: &str, signal: &str) {
    assert_eq!(status.code(), Some(0), "{status}: {stderr}");
    let said = format!("{signal} received");
    let lines = stderr.lines().filter(|line| line.contains(&said)).count();
    assert_eq!(lines, 1, "one line saying `{said}`: {stderr}");
}

/// One raw HTTP/1.1 request to Mooncake's HTTP metadata protocol; returns status and body.
fn http(addr: &str, method: &str, key: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let request = format!(
        "{method} /metadata?key={key} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    let status = reply
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP reply: {reply:?}"));
    let body = reply
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// `GET /metrics` at `addr`; returns status and the text.
fn metrics(addr: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    let (head, text) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text.to_owned())
}

/// The value of the series `series` (name and labels as rendered) in Prometheus text.
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}

#[test]
fn a_target_serves_its_metrics_at_metrics_addr() {
    let mut target = Target::start(
        &[
            "--local_server_name=127.0.0.1",
            "--buffer_size=16777216",
            "--metrics_addr=127.0.0.1:0",
        ],
        &[],
    );
    let line = target.line();
    let addr = line
        .strip_prefix("metrics: http://")
        .and_then(|rest| rest.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("no metrics line: {line:?}"))
        .to_owned();
    let (status, before) = metrics(&addr);
    assert_eq!(status, 200, "{before}");
    let served = "tern_served_read_bytes_total{transport=\"tcp\"}";
    assert_eq!(metric(&before, served), Some(0.0), "{before}");
    let result = initiator("P2PHANDSHAKE", &target.segment.clone(), "1");
    let (_, after) = metrics(&addr);
    let moved = result["bytes"].as_u64().unwrap() as f64;
    assert!(moved > 0.0, "{result}");
    // Every block the initiator counted, the target served (and perhaps a few more that
    // were under way when it stopped counting).
    assert!(
        metric(&after, served).unwrap() >= moved,
        "{after}\n{result}"
    );
    let (status, stderr) = target.stop("TERM");
    assert_clean_stop(status, &stderr, "SIGTERM");
}

#[test]
fn tern_metadata_server_serves_its_metrics() {
    let (_server, addr) = metadata_server();
    assert_eq!(http(&addr, "PUT", "a", "{\"a\":1}").0, 200);
    assert_eq!(http(&addr, "GET", "b", "").0, 404);
    let (status, text) = metrics(&addr);
    assert_eq!(status, 200, "{text}");
    let requests = |method: &str, status: &str| {
        let series =
            format!("tern_metadata_requests_total{{method=\"{method}\",status=\"{status}\"}}");
        metric(&text, &series)
    };
    assert_eq!(requests("PUT", "200"), Some(1.0), "{text}");
    assert_eq!(requests("GET", "404"), Some(1.0), "{text}");
    assert_eq!(metric(&text, "tern_metadata_entries"), Some(1.0), "{text}");
}

#[test]
fn a_target_with_stdin_dev_null_serves_for_seconds_and_sigterm_exits_0() {
    let mut target = Target::start(
        &["--local_server_name=127.0.0.1", "--buffer_size=16777216"],
        &[],
    );
    let result = initiator("P2PHANDSHAKE", &target.segment.clone(), "3");
    assert!(result["bytes"].as_u64().unwrap() > 0, "{result}");
    assert!(result["duration_s"].as_f64().unwrap() >= 3.0, "{result}");
    assert!(target.running(), "the target stopped on its own");
    let (status, stderr) = target.stop("TERM");
    assert_clean_stop(status, &stderr, "SIGTERM");
}

#[test]
fn sigint_ends_a_target_cleanly_too() {
    let mut target = Target::start(
        &["--local_server_name=127.0.0.1", "--buffer_size=1048576"],
        &[],
    );
    let (status, stderr) = target.stop("INT");
    assert_clean_stop(status, &stderr, "SIGINT");
}

#[test]
fn a_target_given_a_duration_stops_by_itself_with_status_0() {
    let mut target = Target::start(
        &[
            "--local_server_name=127.0.0.1",
            "--buffer_size=1048576",
            "--duration=0.5",
        ],
        &[],
    );
    let status = target.child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{status}");
}

#[test]
fn sigterm_deletes_a_targets_etcd_keys_at_once() {
    let (endpoint, _own) = etcd::shared();
    let metadata = format!("etcd://{endpoint}");
    let name = unique("service-target");
    // A lease far longer than this test: keys that vanish did not expire, they were deleted.
    let mut target = Target::start(
        &[
            &format!("--metadata_server={metadata}"),
            &format!("--local_server_name={name}"),
            "--buffer_size=16777216",
        ],
        &[
            ("MC_TCP_BIND_ADDRESS", "127.0.0.1"),
            ("TERN_ETCD_TTL_SECS", "60"),
        ],
    );
    let ram = format!("mooncake/ram/{name}");
    let rpc_meta = format!("mooncake/rpc_meta/{name}");
    assert!(get(&endpoint, &ram).is_some());
    assert!(get(&endpoint, &rpc_meta).is_some());
    let result = initiator(&metadata, &name, "3");
    assert!(result["bytes"].as_u64().unwrap() > 0, "{result}");
    assert!(target.running(), "the target stopped on its own");

    let (status, stderr) = target.stop("TERM");
    assert_clean_stop(status, &stderr, "SIGTERM");
    // The process has exited: its keys must be gone now, not after the TTL.
    assert_eq!(get(&endpoint, &ram), None, "{ram} outlived a clean stop");
    assert_eq!(
        get(&endpoint, &rpc_meta),
        None,
        "{rpc_meta} outlived a clean stop"
    );
}

#[test]
fn sigterm_removes_a_targets_http_store_entries() {
    let (mut server, addr) = metadata_server();
    let name = unique("service-http-target");
    let mut target = Target::start(
        &[
            &format!("--metadata_server=http://{addr}/metadata"),
            &format!("--local_server_name={name}"),
            "--buffer_size=1048576",
        ],
        &[("MC_TCP_BIND_ADDRESS", "127.0.0.1")],
    );
    let key = format!("mooncake/ram/{name}");
    let (code, body) = http(&addr, "GET", &key, "");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("buffers"), "not a segment descriptor: {body}");

    let (status, stderr) = target.stop("TERM");
    assert_clean_stop(status, &stderr, "SIGTERM");
    assert_eq!(
        http(&addr, "GET", &key, "").0,
        404,
        "{key} outlived a clean stop"
    );

    send_signal(server.0.id(), "TERM");
    assert_eq!(server.0.wait().unwrap().code(), Some(0));
}

#[test]
fn tern_metadata_server_exits_0_on_sigterm() {
    let (mut server, addr) = metadata_server();
    let stderr = drain(server.0.stderr.take().unwrap());
    let key = "mooncake/ram/service-probe";
    assert_eq!(http(&addr, "PUT", key, "{\"a\":1}").0, 200);
    assert_eq!(http(&addr, "GET", key, ""), (200, "{\"a\":1}".to_owned()));

    send_signal(server.0.id(), "TERM");
    let status = server.0.wait().unwrap();
    assert_clean_stop(status, &stderr.join().unwrap(), "SIGTERM");
    assert!(
        TcpStream::connect(&addr).is_err(),
        "{addr} still accepts after the server exited"
    );
}

#[test]
fn a_second_signal_exits_at_once_while_the_first_waits() {
    // A target stuck in start-up: etcd unreachable, retried for a minute. The first SIGTERM
    // waits for start-up to end; the second must end the process at once, with 128 + 15.
    let mut child = Reaped(
        Command::new(BENCH)
            .args([
                "--mode=target",
                "--metadata_server=etcd://127.0.0.1:1",
                "--local_server_name=service-stuck",
                "--buffer_size=1048576",
            ])
            .env("TERN_ETCD_START_RETRY_SECS", "60")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // The retry warning comes after the handlers are installed.
    let (lines, retrying) = mpsc::channel();
    let stderr = child.0.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("retrying") {
                let _ = lines.send(());
            }
            text.push_str(&line);
            text.push('\n');
        }
        text
    });
    retrying
        .recv_timeout(Duration::from_secs(30))
        .expect("the target logs its etcd retries");

    send_signal(child.0.id(), "TERM");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "the first SIGTERM did not wait for start-up to end"
    );
    send_signal(child.0.id(), "TERM");
    let status = child.0.wait().unwrap();
    let stderr = reader.join().unwrap();
    assert_eq!(status.code(), Some(128 + 15), "{status}: {stderr}");
}

#[test]
fn loopback_shows_the_targets_own_error_when_it_cannot_start() {
    for (metadata, says) in [
        ("etcd://127.0.0.1:1", "127.0.0.1:1"),
        ("carrier-pigeon://coop", "carrier-pigeon://coop"),
    ] {
        let output = Command::new(BENCH)
            .args([
                "--mode=loopback",
                &format!("--metadata_server={metadata}"),
                "--buffer_size=1048576",
                "--duration=1",
            ])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{metadata}: {stderr}");
        assert!(
            stderr.contains("the target process did not start"),
            "{metadata}: {stderr}"
        );
        // The child's own words: the engine's error naming the store it could not use.
        assert!(
            stderr.contains("starting the engine"),
            "{metadata}: {stderr}"
        );
        assert!(stderr.contains(says), "{metadata}: {stderr}");
    }
}
