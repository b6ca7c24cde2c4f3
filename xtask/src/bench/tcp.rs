//! The TCP profile on loopback beside xtask's own streams and round trips.

use std::path::Path;

use super::table::{kib, ratio_mark};
use super::tern::{TCP_BUFFER, row, tcp_args, tcp_lanes, tern};
use crate::{ROUNDS, baseline, median_by};

/// Block sizes of the profile.
pub(super) const SIZES: [usize; 4] = [4 << 10, 16 << 10, 64 << 10, 1 << 20];

/// The TCP profile; returns the raw JSON lines.
pub(super) fn tcp_profile(exe: &Path, duration: f64) -> Result<Vec<String>, String> {
    let lanes = tcp_lanes();
    let lanes_env = [("MC_TCP_LANES_PER_PEER", lanes.to_string())];
    println!(
        "\nTCP on loopback, one initiator thread, {lanes} lanes, {} MiB buffers, {duration} s per run. \
         Throughput baseline: {lanes} TCP streams between two processes, the same block size and buffers; \
         latency baseline: one connection's request-reply round trip of the same block, two processes. \
         At batch 128 Tern and the streams take turns, {ROUNDS} rounds each, and each shows its median round.\n",
        TCP_BUFFER >> 20
    );
    println!(
        "| op | block | batch | msgs/s | p50 us | p99 us | GB/s | CPU us/GB | baseline | ratio |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut raw = Vec::new();
    for block in SIZES {
        for op in ["read", "write"] {
            let (p50_base, p99_base) =
                baseline::round_trip(op == "read", TCP_BUFFER, block, duration.min(2.0))?;
            let json = tern(exe, &tcp_args(op, block, 1, duration), &lanes_env)?;
            let (rate, p50, p99, gbps, cpu) = row(&json);
            println!(
                "| {op} | {} | 1 | {rate:.0} | {p50:.1} | {p99:.1} | {gbps:.2} | {cpu:.0} | RTT p50 {p50_base:.1} us, p99 {p99_base:.1} us | {} |",
                kib(block),
                ratio_mark(p50 / p50_base, None, false),
            );
            raw.push(json);
            // Throughput: the streams and Tern take turns, and each shows its median round.
            let round = (duration / ROUNDS as f64).max(1.0);
            let mut streams = Vec::new();
            let mut terns = Vec::new();
            for _ in 0..ROUNDS {
                streams.push(baseline::stream(lanes, TCP_BUFFER, block, round)?);
                let json = tern(exe, &tcp_args(op, block, 128, round), &lanes_env)?;
                terns.push((row(&json), json));
            }
            let (Some(stream), Some(((rate, p50, p99, gbps, cpu), json))) =
                (median_by(streams, |s| s.gbps), median_by(terns, |t| t.0.3))
            else {
                return Err("no throughput rounds".into());
            };
            let goal = match block {
                b if b >= 1 << 20 => Some(1.0),
                b if b >= 64 << 10 => Some(0.9),
                _ => None,
            };
            println!(
                "| {op} | {} | 128 | {rate:.0} | {p50:.1} | {p99:.1} | {gbps:.2} | {cpu:.0} | {lanes} streams {:.2} GB/s, {:.0} CPU us/GB | {} |",
                kib(block),
                stream.gbps,
                stream.cpu_us_per_gb,
                ratio_mark(gbps / stream.gbps, goal, true),
            );
            raw.push(json);
        }
    }
    Ok(raw)
}
