//! KV-shaped pages beside the same bytes in 1 MiB requests, on TCP and same-host.

use std::path::Path;

use super::table::ratio_mark;
use super::tern::{tcp_lanes, tern};
use crate::{json_number, median, median_by};

/// Rounds of the KV-shaped rows: each round runs the baseline and then each row, and a
/// row's ratio is the median of its rounds' ratios to the baseline of the same round. On a
/// shared machine the baseline alone moves by a third between rounds; a ratio of two runs
/// seconds apart cancels most of that drift, where a ratio of medians taken at different
/// moments keeps it.
const PAGE_ROUNDS: usize = 5;

/// Pages per layer, layers and the page of the KV-shaped rows: 32 layers of 4 MiB.
const KV_PAGES: usize = 256;
const KV_LAYERS: usize = 32;
const KV_PAGE: usize = 16 << 10;
/// The baseline's request: one layer is four of them.
const KV_BIG: usize = 1 << 20;

/// The KV-shaped rows: 32 layers × 16 KiB pages, one request per page, submitted a layer's
/// bytes (4 MiB) at a time, in runs of 8 pages shuffled and fully shuffled, beside the same
/// layers moved as 1 MiB requests, 4 to a submit; TCP and same-host, [`PAGE_ROUNDS`] rounds
/// taken in turn: median throughput, and the median of each round's ratio to its baseline.
pub(super) fn pages(exe: &Path, duration: f64) -> Result<(), String> {
    let lanes_env = [("MC_TCP_LANES_PER_PEER", tcp_lanes().to_string())];
    // Half a second a run by default (some 600 layers each): a run also spends ~0.8 s
    // starting its target and buffers, and the section has to fit the headline minutes.
    let seconds = (duration / 2.0).max(0.5);
    // Room for the layers and the page gap after each, in either page size.
    let buffer = KV_LAYERS * (KV_PAGES * KV_PAGE / KV_BIG + 1) * KV_BIG;
    let shape = |page: usize, order: &str, extra: &[&str]| -> Vec<String> {
        let per_layer = KV_PAGES * KV_PAGE / page;
        [
            "--operation=write".to_owned(),
            format!("--pages={per_layer}"),
            format!("--layers={KV_LAYERS}"),
            format!("--page_size={page}"),
            format!("--page_order={order}"),
            format!("--batch_size={per_layer}"),
            "--threads=1".into(),
            format!("--duration={seconds}"),
            format!("--buffer_size={buffer}"),
        ]
        .into_iter()
        .chain(extra.iter().map(|e| (*e).to_owned()))
        .collect()
    };
    let rows = [
        (
            "1 MiB requests",
            KV_BIG,
            "contiguous",
            Some("--no_merge"),
            None,
        ),
        ("16 KiB pages", KV_PAGE, "runs:8", None, Some(0.9)),
        ("16 KiB pages", KV_PAGE, "shuffled", None, Some(0.5)),
    ];
    println!(
        "\nKV-shaped writes on loopback: {KV_LAYERS} layers of {} MiB, one thread, a layer's bytes per submit ({} pages of {} KiB, or 4 requests of 1 MiB without merging), {PAGE_ROUNDS} rounds in turn of {seconds} s; GB/s: the median round; ratio: the median of each round's ratio to the 1 MiB requests of the same round, with the lowest and highest:\n",
        (KV_PAGES * KV_PAGE) >> 20,
        KV_PAGES,
        KV_PAGE >> 10
    );
    println!(
        "| protocol | requests | order | GB/s | requests/s | submit ns/request | vs 1 MiB requests |"
    );
    println!("|---|---|---|---|---|---|---|");
    for protocol in ["tcp", "shm"] {
        let mut runs: Vec<Vec<String>> = vec![Vec::new(); rows.len()];
        for _ in 0..PAGE_ROUNDS {
            for (i, (_, page, order, extra, _)) in rows.iter().enumerate() {
                let mut args = shape(*page, order, extra.as_slice());
                args.push(format!("--protocol={protocol}"));
                runs[i].push(tern(exe, &args, &lanes_env)?);
            }
        }
        let gbps = |json: &String| json_number(json, "gbps").unwrap_or(f64::NAN);
        let baselines: Vec<f64> = runs[0].iter().map(gbps).collect();
        for ((what, _, order, _, goal), rounds) in rows.iter().zip(&runs) {
            let ratios: Vec<f64> = rounds
                .iter()
                .zip(&baselines)
                .map(|(json, base)| gbps(json) / base)
                .collect();
            let (low, high) = ratios
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &r| {
                    (lo.min(r), hi.max(r))
                });
            let json = median_by(rounds.clone(), gbps).ok_or("no pages rounds")?;
            let n = |k: &str| json_number(&json, k).unwrap_or(f64::NAN);
            println!(
                "| {protocol} | {what} | {order} | {:.2} | {:.0} | {:.0} | {} ({low:.2}–{high:.2}) |",
                n("gbps"),
                n("requests_per_s"),
                n("submit_ns_per_request"),
                ratio_mark(median(&ratios), *goal, true)
            );
        }
    }
    Ok(())
}
