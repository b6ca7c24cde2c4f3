//! `tern-soak`: a long run of random, verified transfers among 2 to 4 processes on one host,
//! which reports per process the transfers, bytes and errors, and the RSS, open file
//! descriptors, threads and live queue pairs after a warm-up and at the end, so that leaks and
//! stale state show up as growth.
//!
//! Run as `tern-soak --processes K --seconds S [--protocol rdma --device_name rxe0]`: this
//! process (the coordinator) starts K peer processes of itself on 127.0.0.1 (P2P metadata).
//! Every peer serves one buffer and is an initiator towards every other peer. Each of its
//! worker threads owns one slot of every other peer's buffer — nobody else writes there — and
//! keeps a shadow copy of what that slot must hold, so every byte is checked: a read must
//! return the shadow, a write is read back and must return what was written. The coordinator
//! prints one `SOAK {json}` line per peer on stdout, judges them against the limits below and
//! exits non-zero when a peer saw an error or grew.
//!
//! It must not contain transfer logic of its own (everything goes through `tern-engine`'s
//! public API), and it sends traffic only to 127.0.0.1 (and, over RDMA, to the local NIC).
#![forbid(unsafe_code)]

mod args;
mod coordinator;
mod peer;
mod random;
mod sample;
mod verdict;
mod worker;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;

use crate::args::{Args, Role};
use crate::coordinator::coordinate;
use crate::peer::peer;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let args = Args::parse();
    let result = match args.role {
        Role::Coordinator => coordinate(&args),
        Role::Peer => peer(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("tern-soak: {message}");
            ExitCode::FAILURE
        }
    }
}
