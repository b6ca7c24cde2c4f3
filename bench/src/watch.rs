//! `--mode watch-latency`: two nodes in this process on a watching metadata store (etcd), and
//! how long a descriptor change takes to reach the other node's cache.

use std::time::{Duration, Instant};

use crate::flags::Args;
use crate::report::percentile;
use crate::transport::engine;

/// Times descriptor changes from one node's registration to the other node's cache and
/// prints their median, p90 and maximum as one JSON object.
pub(crate) fn run_watch_latency(args: &Args) -> Result<(), String> {
    const CHANGES: usize = 20;
    let tag = std::process::id();
    let mut target_args = args.clone();
    target_args.local_server_name = Some(format!("watch-target-{tag}"));
    let target = engine(&target_args, None)?;
    let mut initiator_args = args.clone();
    initiator_args.local_server_name = Some(format!("watch-initiator-{tag}"));
    let initiator = engine(&initiator_args, None)?;
    let peer = initiator
        .open_segment(target.segment_name())
        .map_err(|e| format!("opening the target: {e}"))?;
    let mut samples = Vec::with_capacity(CHANGES);
    for _ in 0..CHANGES {
        let started = Instant::now();
        let buffer = target.allocate(4096, "cpu:0").map_err(|e| e.to_string())?;
        let addr = buffer.addr() as u64;
        loop {
            let seen = initiator
                .segment(peer)
                .is_some_and(|p| p.desc.buffers.iter().any(|b| b.addr == addr));
            if seen {
                break;
            }
            if started.elapsed() > Duration::from_secs(10) {
                return Err("a descriptor change did not arrive within 10 s".into());
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        samples.push(started.elapsed().as_secs_f64() * 1e3);
        drop(buffer);
        std::thread::sleep(Duration::from_millis(20));
    }
    samples.sort_by(f64::total_cmp);
    let json = serde_json::json!({
        "samples": samples.len(),
        "median_ms": percentile(&samples, 50.0),
        "p90_ms": percentile(&samples, 90.0),
        "max_ms": samples.last().copied().unwrap_or(0.0),
    });
    println!("{json}");
    Ok(())
}
