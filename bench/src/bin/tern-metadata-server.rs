//! `tern-metadata-server`: Mooncake's HTTP metadata protocol, in memory. Point any node at
//! `http://<addr>:<port>/metadata`, a Mooncake node included.

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
    match tern_metadata::http::HttpMetadataServer::start(addr) {
        Ok(server) => {
            println!("serving http://{}/metadata", server.local_addr());
            loop {
                std::thread::park();
            }
        }
        Err(e) => {
            eprintln!("tern-metadata-server: cannot bind {addr}: {e}");
            ExitCode::FAILURE
        }
    }
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
