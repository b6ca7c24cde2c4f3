//! The results: Mooncake's `Test completed` line and Tern's table lines on stdout, or one JSON
//! object there (the line on stderr) with `--json`.

use tern_engine::TransportStats;

use crate::flags::{Args, Operation};
use crate::initiator::Outcome;
use crate::workload::PageLayout;

/// Bytes per `--report_unit`.
pub(crate) fn unit_scale(unit: &str) -> Result<f64, String> {
    Ok(match unit {
        "GB" => 1e9,
        "GiB" => (1u64 << 30) as f64,
        "Gb" => 1e9 / 8.0,
        "MB" => 1e6,
        "MiB" => (1u64 << 20) as f64,
        "Mb" => 1e6 / 8.0,
        "KB" => 1e3,
        "KiB" => 1024.0,
        "Kb" => 1e3 / 8.0,
        other => {
            return Err(format!(
                "--report_unit {other:?} is not one of GB GiB Gb MB MiB Mb KB KiB Kb"
            ));
        }
    })
}

/// The `p`th percentile of sorted samples (0 for none).
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// One line per transport: what it moved, and how each peer stands.
fn describe_transport(stats: &TransportStats) -> String {
    let peers: Vec<String> = stats
        .peers
        .iter()
        .map(|p| {
            let error = p
                .last_error
                .as_ref()
                .map_or_else(String::new, |e| format!(", last error: {e}"));
            format!("{} {:?} ({} open{error})", p.peer, p.state, p.endpoints)
        })
        .collect();
    format!(
        "{}: {} bytes in {} slices, {} retries, {} failures; peers: {}",
        stats.protocol,
        stats.bytes,
        stats.slices,
        stats.retries,
        stats.failures,
        if peers.is_empty() {
            "none".to_owned()
        } else {
            peers.join("; ")
        }
    )
}

/// Prints a run's results: the lines, or with `--json` one object (the first line going to
/// stderr).
pub(crate) fn report(args: &Args, outcome: &Outcome) -> Result<(), String> {
    let secs = outcome.duration.as_secs_f64().max(1e-9);
    let scale = unit_scale(&args.report_unit)?;
    let mut latencies = outcome.latencies_us.clone();
    latencies.sort_by(f64::total_cmp);
    let avg = latencies.iter().sum::<f64>() / latencies.len().max(1) as f64;
    let line = format!(
        "Test completed: duration {secs:.2}, batch count {}, throughput {:.prec$} {}/s",
        outcome.batches,
        outcome.bytes as f64 / secs / scale,
        args.report_unit,
        prec = args.report_precision
    );
    let requests = outcome.requests.max(1) as f64;
    let submit_ns_per_request = outcome.submit_time.as_secs_f64() * 1e9 / requests;
    let batch_ns_per_request = latencies.iter().sum::<f64>() * 1e3 / requests;
    let workload = PageLayout::of(args).map_or_else(
        || "blocks".to_owned(),
        |l| {
            format!(
                "{} layers × {} pages of {} bytes, {}",
                l.layers,
                l.pages,
                l.page_size,
                args.page_order.name()
            )
        },
    );
    if !args.json {
        println!("{line}");
        println!(
            "{workload}: {:.0} requests/s; per request: {submit_ns_per_request:.0} ns in \
             submit, {batch_ns_per_request:.0} ns from submit to done (merging {})",
            outcome.requests as f64 / secs,
            if args.no_merge { "off" } else { "on" }
        );
        println!(
            "latency per batch of {}: avg {avg:.1} us, p50 {:.1} us, p99 {:.1} us",
            args.batch_size,
            percentile(&latencies, 50.0),
            percentile(&latencies, 99.0)
        );
        for transport in outcome.stats.iter().flat_map(|s| &s.transports) {
            println!("{}", describe_transport(transport));
        }
        if let Some((initiator, target)) = outcome.idle_cpu {
            let target = target.map_or_else(|| "not measured".to_owned(), |t| format!("{t:.2}%"));
            println!(
                "idle with endpoints open: initiator {initiator:.2}% of a core, target {target}"
            );
        }
        return Ok(());
    }
    eprintln!("{line}");
    let json = serde_json::json!({
        "protocol": args.protocol,
        "operation": match args.operation { Operation::Read => "read", Operation::Write => "write" },
        "block_size": args.block_size,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "duration_s": secs,
        "bytes": outcome.bytes,
        "gbps": outcome.bytes as f64 / secs / 1e9,
        "avg_latency_us": avg,
        "p50_latency_us": percentile(&latencies, 50.0),
        "p99_latency_us": percentile(&latencies, 99.0),
        "messages_per_s": outcome.batches as f64 * args.batch_size as f64 / secs,
        "workload": workload,
        "pages": PageLayout::of(args).map(|l| serde_json::json!({
            "layers": l.layers,
            "pages": l.pages,
            "page_size": l.page_size,
            "page_order": args.page_order.name(),
        })),
        "merge_requests": !args.no_merge,
        "requests": outcome.requests,
        "requests_per_s": outcome.requests as f64 / secs,
        "submit_ns_per_request": submit_ns_per_request,
        "batch_ns_per_request": batch_ns_per_request,
        "cpu_initiator_s": outcome.run_cpu.0,
        "cpu_target_s": outcome.run_cpu.1,
        "cpu_us_per_gb": match outcome.run_cpu {
            (Some(i), Some(t)) if outcome.bytes > 0 => Some((i + t) * 1e6 / (outcome.bytes as f64 / 1e9)),
            _ => None,
        },
        "idle_cpu_initiator_pct": outcome.idle_cpu.map(|c| c.0),
        "idle_cpu_target_pct": outcome.idle_cpu.and_then(|c| c.1),
        "stats": outcome.stats,
    });
    println!("{json}");
    Ok(())
}
