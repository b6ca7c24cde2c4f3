//! `tern-metadata-server`: Mooncake's HTTP metadata protocol, in memory. Point any node at
//! `http://<addr>:<port>/metadata`, a Mooncake node included; its own metrics (Prometheus
//! text) are at `http://<addr>:<port>/metrics`. It serves until SIGINT or SIGTERM, whatever
//! its stdin is, then stops listening and exits 0 (a second signal exits at once).
//!
//! Given the cluster secret (`TERN_CLUSTER_SECRET` or `TERN_CLUSTER_SECRET_FILE`), it takes
//! only sealed values no older than the one it holds for their key, and deletes only with a
//! token for the very value held (`tern_metadata::seal`).
#![forbid(unsafe_code)]

// Shared with `tern-bench`, which uses all of it.
#[allow(dead_code)]
#[path = "../service.rs"]
mod service;

use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut bind = "127.0.0.1".to_owned();
    let mut port = 8080u16;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f.to_owned(), Some(v.to_owned())),
            None => (arg.clone(), None),
        };
        let mut value = || inline.clone().or_else(|| args.next());
        match flag.as_str() {
            "--port" => match value().and_then(|v| v.parse().ok()) {
                Some(p) => port = p,
                None => return usage("--port takes a number"),
            },
            "--bind" => match value() {
                Some(b) => bind = b,
                None => return usage("--bind takes an address"),
            },
            "--help" | "-h" => return usage(""),
            other => return usage(&format!("unknown flag {other}")),
        }
    }
    let addr: SocketAddr = match format!("{bind}:{port}").parse() {
        Ok(addr) => addr,
        Err(_) => return usage("--bind takes an IP address"),
    };
    let stop = match service::Stop::install() {
        Ok(stop) => stop,
        Err(e) => {
            eprintln!("tern-metadata-server: {e}");
            return ExitCode::FAILURE;
        }
    };
    let secret = match tern_metadata::auth::ClusterSecret::from_env() {
        Ok(secret) => secret,
        Err(e) => {
            eprintln!("tern-metadata-server: {e}");
            return ExitCode::FAILURE;
        }
    };
    let sealed = secret.is_some();
    let config = tern_metadata::http::HttpServerConfig {
        secret,
        ..tern_metadata::http::HttpServerConfig::default()
    };
    let server = match tern_metadata::http::HttpMetadataServer::start_with(addr, config) {
        Ok(server) => server,
        Err(e) => {
            eprintln!("tern-metadata-server: cannot bind {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    if sealed {
        eprintln!("tern-metadata-server: with the cluster secret: sealed values only");
    }
    println!("serving http://{}/metadata", server.local_addr());
    if let Err(e) = std::io::stdout().flush() {
        eprintln!("tern-metadata-server: writing to stdout: {e}");
        return ExitCode::FAILURE;
    }
    let reason = stop.wait(None);
    eprintln!(
        "tern-metadata-server: {reason}; stopping http://{}/metadata",
        server.local_addr()
    );
    drop(server);
    ExitCode::SUCCESS
}

fn usage(problem: &str) -> ExitCode {
    if !problem.is_empty() {
        eprintln!("tern-metadata-server: {problem}");
    }
    eprintln!("usage: tern-metadata-server [--bind IP] [--port PORT]   (defaults 127.0.0.1, 8080)");
    if problem.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    }
}
