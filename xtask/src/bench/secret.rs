//! What a cluster secret costs on the 64 KiB TCP rows.

use std::path::Path;

use super::tern::{row, tcp_args, tcp_lanes, tern};

/// The 64 KiB TCP rows with and without a cluster secret, alternating, three times each.
pub(super) fn secret_cost(exe: &Path, duration: f64) -> Result<(), String> {
    let lanes_env = [("MC_TCP_LANES_PER_PEER", tcp_lanes().to_string())];
    println!("\nThe cost of a cluster secret (64 KiB, batch 128, TCP, alternating runs):\n");
    for op in ["read", "write"] {
        let mut plain = Vec::new();
        let mut secured = Vec::new();
        for _ in 0..3 {
            let args = tcp_args(op, 64 << 10, 128, duration.min(3.0));
            plain.push(row(&tern(exe, &args, &lanes_env)?).3);
            let mut with = args.clone();
            with.push("--cluster_secret=bench-secret".into());
            secured.push(row(&tern(exe, &with, &lanes_env)?).3);
        }
        let show = |v: &[f64]| {
            v.iter()
                .map(|g| format!("{g:.2}"))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        println!(
            "{op}: without {} GB/s, with {} GB/s (means {:.2} and {:.2}: ratio {:.2})",
            show(&plain),
            show(&secured),
            mean(&plain),
            mean(&secured),
            mean(&secured) / mean(&plain)
        );
    }
    Ok(())
}
