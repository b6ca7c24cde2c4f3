//! `tern-bench`: Tern's transfer benchmark, with the flags of Mooncake's
//! `transfer_engine_bench`, plus `--verify`, `--json` and `--mode loopback` (which starts a
//! target process itself, runs the initiator against it, and reports). A target serves until
//! SIGINT or SIGTERM (or its `--duration`), whatever its stdin is, and then shuts down cleanly:
//! its keys withdrawn, its connections closed, exit status 0.
//!
//! It must not contain transfer logic of its own: everything goes through `tern-engine`.
#![forbid(unsafe_code)]

mod cpu;
mod flags;
mod initiator;
mod loopback;
mod report;
mod service;
mod target;
mod transport;
mod watch;
mod workload;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;

use crate::flags::{Args, Mode, available_memory, check_flags, enough_memory};
use crate::initiator::run_initiator;
use crate::loopback::run_loopback;
use crate::report::report;
use crate::target::run_target;
use crate::watch::run_watch_latency;

fn main() -> ExitCode {
    let filter = match std::env::var("RUST_LOG").as_deref() {
        Ok("trace") => tracing::Level::TRACE,
        Ok("debug") => tracing::Level::DEBUG,
        Ok("info") => tracing::Level::INFO,
        Ok("error") => tracing::Level::ERROR,
        _ => tracing::Level::WARN,
    };
    tracing_subscriber::fmt()
        .with_max_level(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("tern-bench: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    check_flags(args)?;
    enough_memory(args, available_memory())?;
    match args.mode {
        Mode::Target => run_target(args),
        Mode::Initiator => {
            let segment = args
                .segment_id
                .clone()
                .ok_or("--segment_id names the target (it prints it at start)")?;
            report(args, &run_initiator(args, &segment, None)?)
        }
        Mode::Loopback => run_loopback(args),
        Mode::WatchLatency => run_watch_latency(args),
    }
}
