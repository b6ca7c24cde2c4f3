//! A real etcd server for tests: Debian's `etcd` on free loopback ports with a temporary
//! data directory, killed and removed on drop. `cargo xtask test` starts one and hands its
//! address over in `TERN_TEST_ETCD`; tests that must kill or restart etcd start their own.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Etcd {
    child: Option<Child>,
    pub endpoint: String,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn binary() -> String {
    std::env::var("TERN_ETCD_BIN").unwrap_or_else(|_| "etcd".into())
}

/// The shared etcd from `cargo xtask test`, or a private one when run another way.
pub fn shared() -> (String, Option<Etcd>) {
    match std::env::var("TERN_TEST_ETCD") {
        Ok(endpoint) if !endpoint.is_empty() => (endpoint, None),
        _ => {
            let etcd = Etcd::start();
            (etcd.endpoint.clone(), Some(etcd))
        }
    }
}

/// A name no other test uses.
pub fn unique(prefix: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{prefix}-{}-{n}", std::process::id())
}

impl Etcd {
    pub fn start() -> Self {
        let dir = std::env::temp_dir().join(unique("tern-etcd"));
        let mut etcd = Self {
            child: None,
            endpoint: String::new(),
            dir,
            client_port: free_port(),
            peer_port: free_port(),
        };
        etcd.endpoint = format!("127.0.0.1:{}", etcd.client_port);
        etcd.launch();
        etcd
    }

    fn launch(&mut self) {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new(binary())
            .args([
                "--name",
                "tern-test",
                "--data-dir",
                &self.dir.to_string_lossy(),
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
                "--initial-cluster",
                &format!("tern-test={peer}"),
                "--heartbeat-interval=10",
                "--election-timeout=100",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start etcd ({e}); install it with `cargo xtask deps` (package etcd-server)")
            });
        self.child = Some(child);
        self.wait_healthy();
    }

    fn wait_healthy(&self) {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(30) {
            if health(&self.endpoint) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("etcd at {} did not become healthy", self.endpoint);
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// etcd's `/health` answers `{"health":"true"}` once it has a leader.
pub fn health(endpoint: &str) -> bool {
    let Ok(mut stream) = TcpStream::connect(endpoint) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request = format!("GET /health HTTP/1.1\r\nHost: {endpoint}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut reply = String::new();
    let _ = stream.read_to_string(&mut reply);
    reply.contains("\"health\":\"true\"")
}

/// `etcdctl` (API v3) against `endpoint`; returns stdout.
pub fn etcdctl(endpoint: &str, args: &[&str]) -> String {
    let output = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={endpoint}"))
        .args(args)
        .output()
        .expect("etcdctl (package etcd-client)");
    assert!(
        output.status.success(),
        "etcdctl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The value under `key`, or `None`.
pub fn get(endpoint: &str, key: &str) -> Option<String> {
    let out = etcdctl(endpoint, &["get", key, "--print-value-only"]);
    (!out.is_empty()).then_some(out)
}

/// Polls `check` every 20 ms until it is true or `limit` passes; returns the time it took.
pub fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < limit {
        if check() {
            return Some(started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}
