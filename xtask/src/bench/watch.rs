//! How long a descriptor change takes to reach a node watching etcd.

use std::path::Path;
use std::process::Command;

use crate::{json_number, start_etcd};

pub(super) fn watch_latency(exe: &Path) {
    let etcd = match start_etcd(None) {
        Ok(etcd) => etcd,
        Err(e) => return eprintln!("xtask: skipping the etcd watch latency: {e}"),
    };
    let output = Command::new(exe)
        .args([
            "--mode=watch-latency",
            &format!("--metadata_server=etcd://{}", etcd.endpoint),
        ])
        .env("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        .output();
    let Ok(output) = output else {
        return eprintln!("xtask: watch latency could not start");
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    match json_number(&stdout, "median_ms") {
        Some(median) => println!(
            "\nA descriptor change reaches a watching node (etcd on loopback, 20 changes): median {median:.1} ms, p90 {:.1} ms, max {:.1} ms (goal: median < 100 ms)",
            json_number(&stdout, "p90_ms").unwrap_or(f64::NAN),
            json_number(&stdout, "max_ms").unwrap_or(f64::NAN)
        ),
        None => eprintln!(
            "xtask: watch latency failed: {}",
            String::from_utf8_lossy(&output.stderr)
        ),
    }
}
