//! The engine's instructions per request, counted by callgrind.

use std::process::Command;

use crate::{cargo, root, run};

/// Instructions the engine spends per request (callgrind: the difference between two batch
/// counts, over the difference in requests), where valgrind is installed; a figure the
/// machine's load does not move. Batch 1, and batches of 128 contiguous requests (merged
/// into one run), of 128 with gaps (each its own) and of 128 contiguous ones submitted in
/// runs of 8 out of address order (put in order, then merged), and of 128 16 KiB pages so
/// submitted (four to a slice), and of 128 contiguous 16 KiB pages to a transport of 1 MiB
/// slices (the same-host transport's: 64 to a slice), with the transport
/// completing slices on another thread and, for the engine's bookkeeping alone, inside
/// `submit`.
pub(super) fn instructions_per_request() {
    let mut build = cargo();
    build.args([
        "build",
        "--release",
        "-p",
        "tern-bench",
        "--example",
        "slice_cost",
    ]);
    if run(build, "building slice_cost").is_err() {
        return;
    }
    let exe = root().join("target/release/examples/slice_cost");
    let count = |case: &[String], metrics: &str| -> Option<f64> {
        let out = root().join(format!("target/callgrind.slice_cost.{}", case.join(".")));
        let output = Command::new("valgrind")
            .arg("--tool=callgrind")
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(&exe)
            .args(case)
            .env("TERN_WAIT_SPIN_US", "0")
            .env("TERN_METRICS", metrics)
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&output.stderr);
        let line = text.lines().find(|l| l.contains("Collected :"))?;
        line.rsplit(':')
            .next()?
            .trim()
            .replace(',', "")
            .parse()
            .ok()
    };
    // (requests per batch, layout, batches in the short run and in the long one)
    let cases = [
        (1usize, "contiguous", 20usize, 220usize),
        (128, "contiguous", 20, 120),
        (128, "gaps", 20, 120),
        (128, "runs", 20, 120),
        (128, "pages", 20, 120),
        (128, "apart", 20, 120),
        (128, "long", 20, 120),
    ];
    println!(
        "\nEngine instructions per request, 64 KiB (`pages`, `apart`, `long`: 16 KiB) (callgrind, with metrics / without):\n\n| batch | layout | transport completing on another thread | transport completing in submit |\n|---|---|---|---|"
    );
    for (per_batch, layout, short, long) in cases {
        let per_request = |transport: &str, metrics: &str| {
            let case = |batches: usize| {
                [batches, per_batch]
                    .map(|n| n.to_string())
                    .into_iter()
                    .chain([layout.to_owned(), transport.to_owned()])
                    .collect::<Vec<_>>()
            };
            Some(
                (count(&case(long), metrics)? - count(&case(short), metrics)?)
                    / ((long - short) * per_batch) as f64,
            )
        };
        let cell =
            |transport: &str| match (per_request(transport, "1"), per_request(transport, "0")) {
                (Some(on), Some(off)) => format!("{on:.0} / {off:.0}"),
                _ => "no valgrind".to_owned(),
            };
        println!(
            "| {per_batch} | {layout} | {} | {} |",
            cell("threaded"),
            cell("instant")
        );
    }
}
