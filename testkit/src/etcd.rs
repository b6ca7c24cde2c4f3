//! A real etcd server: `etcd` on free ports with a data directory of its own, killed (and
//! its directory removed) on drop. `cargo xtask test` starts one and hands its address over
//! in `TERN_TEST_ETCD`; tests that must kill or restart etcd start their own.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running etcd.
#[derive(Debug)]
pub struct Etcd {
    child: Option<Child>,
    /// `host:port` of its client API.
    pub endpoint: String,
    ip: IpAddr,
    client_port: u16,
    peer_port: u16,
    /// Plain-HTTP port of `/health` when the client API speaks TLS.
    metrics_port: Option<u16>,
    dir: PathBuf,
    log: Option<PathBuf>,
    options: LaunchOptions,
}

/// The client API over TLS: etcd's certificate and key, and the CA whose client certificates
/// it demands (`--client-cert-auth`), if any.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// PEM certificate etcd serves (its names must include the address it listens on).
    pub cert: PathBuf,
    /// Its PEM key.
    pub key: PathBuf,
    /// When set, etcd refuses clients without a certificate signed by this PEM CA.
    pub client_ca: Option<PathBuf>,
}

/// What [`Etcd::launch_with`] adds to a plain etcd.
#[derive(Debug, Clone, Default)]
pub struct LaunchOptions {
    /// Serve the client API over TLS.
    pub tls: Option<TlsFiles>,
    /// More `etcd` flags, e.g. `--auth-token-ttl=1`.
    pub extra_args: Vec<String>,
}

/// A port nothing listens on at `ip` right now.
pub fn free_port(ip: IpAddr) -> Result<u16, String> {
    TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port on {ip}: {e}"))
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

/// A name no other test of this process uses.
pub fn unique(prefix: &str) -> String {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{prefix}-{}-{n}", std::process::id())
}

impl Etcd {
    /// Starts etcd with its client API on `ip:client_port` (a free port when `None`), its
    /// data in `dir` (emptied first) and its log in `log` (discarded when `None`), and waits
    /// until it is healthy.
    pub fn launch(
        ip: IpAddr,
        client_port: Option<u16>,
        dir: PathBuf,
        log: Option<PathBuf>,
    ) -> Result<Self, String> {
        Self::launch_with(ip, client_port, dir, log, LaunchOptions::default())
    }

    /// As [`Etcd::launch`], with TLS or more flags. With TLS, health is checked on a
    /// plain-HTTP metrics port of its own.
    pub fn launch_with(
        ip: IpAddr,
        client_port: Option<u16>,
        dir: PathBuf,
        log: Option<PathBuf>,
        options: LaunchOptions,
    ) -> Result<Self, String> {
        let client_port = match client_port {
            Some(port) => port,
            None => free_port(ip)?,
        };
        let _ = std::fs::remove_dir_all(&dir);
        let mut etcd = Self {
            child: None,
            endpoint: format!("{ip}:{client_port}"),
            ip,
            client_port,
            peer_port: free_port(IpAddr::V4(Ipv4Addr::LOCALHOST))?,
            metrics_port: match options.tls {
                Some(_) => Some(free_port(IpAddr::V4(Ipv4Addr::LOCALHOST))?),
                None => None,
            },
            dir,
            log,
            options,
        };
        etcd.run()?;
        Ok(etcd)
    }

    /// On loopback with free ports and a temporary directory; panics if etcd cannot start.
    pub fn start() -> Self {
        Self::start_on(IpAddr::V4(Ipv4Addr::LOCALHOST))
    }

    /// On `ip` with free ports and a temporary directory; panics if etcd cannot start.
    pub fn start_on(ip: IpAddr) -> Self {
        let dir = std::env::temp_dir().join(unique("tern-etcd"));
        Self::launch(ip, None, dir, None).unwrap_or_else(|e| panic!("{e}"))
    }

    fn run(&mut self) -> Result<(), String> {
        let scheme = if self.options.tls.is_some() {
            "https"
        } else {
            "http"
        };
        let client = format!("{scheme}://{}:{}", self.ip, self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let stderr = match &self.log {
            Some(path) => Stdio::from(
                std::fs::File::create(path).map_err(|e| format!("etcd log {path:?}: {e}"))?,
            ),
            None => Stdio::null(),
        };
        let mut command = Command::new(binary());
        if let Some(tls) = &self.options.tls {
            command.arg("--cert-file").arg(&tls.cert);
            command.arg("--key-file").arg(&tls.key);
            if let Some(ca) = &tls.client_ca {
                command
                    .arg("--client-cert-auth")
                    .arg("--trusted-ca-file")
                    .arg(ca);
            }
        }
        if let Some(port) = self.metrics_port {
            command.arg(format!("--listen-metrics-urls=http://127.0.0.1:{port}"));
        }
        command.args(&self.options.extra_args);
        let child = command
            .args(["--name", "tern", "--data-dir"])
            .arg(&self.dir)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("tern={peer}")])
            .args(["--heartbeat-interval=10", "--election-timeout=100"])
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .map_err(|e| {
                format!("cannot start etcd ({e}); install it with `cargo xtask deps` (package etcd-server)")
            })?;
        self.child = Some(child);
        // Under software emulation (the Soft-RoCE guests) etcd takes seconds to come up.
        let started = Instant::now();
        let health_endpoint = match self.metrics_port {
            Some(port) => format!("127.0.0.1:{port}"),
            None => self.endpoint.clone(),
        };
        while started.elapsed() < Duration::from_secs(90) {
            if health(&health_endpoint) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let log = self
            .log
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .unwrap_or_default();
        self.kill();
        Err(format!(
            "etcd at {} did not become healthy {log}",
            self.endpoint
        ))
    }

    /// Kills it (its data stays, for [`Etcd::restart`]).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills it and starts it again on the same ports and data; panics if it cannot start.
    pub fn restart(&mut self) {
        self.kill();
        self.run().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Blocks until etcd exits by itself (someone else stops it).
    pub fn wait(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.wait();
        }
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
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let request = format!("GET /health HTTP/1.1\r\nHost: {endpoint}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut reply = String::new();
    let _ = stream.read_to_string(&mut reply);
    reply.contains("\"health\":\"true\"")
}

/// `etcdctl` (API v3) against `endpoint`; returns stdout. Panics when it fails.
pub fn etcdctl(endpoint: &str, args: &[&str]) -> String {
    etcdctl_with(endpoint, &[], args)
}

/// `etcdctl` with global flags (`--user=root:pw`, `--cacert=..`, `--cert=..`, `--key=..`)
/// before `args`; returns stdout. Panics when it fails.
pub fn etcdctl_with(endpoint: &str, global: &[&str], args: &[&str]) -> String {
    let output = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={endpoint}"))
        .args(global)
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
