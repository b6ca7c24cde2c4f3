//! `--mode target`: one buffer, filled with the pattern, served (with its metrics, if asked)
//! until a signal, the run time or stdin's end.

use std::io::Write;
use std::sync::Arc;

use tern_metadata::http::{METRICS_PATH, MetricsServer, RenderMetrics};

use crate::flags::{Args, run_time};
use crate::service;
use crate::transport::engine;
use crate::workload::fill_pattern;

/// Serves the buffer until a signal, `--duration` or (with `--stop_on_stdin_eof`) stdin's
/// end, then withdraws the segment and returns.
pub(crate) fn run_target(args: &Args) -> Result<(), String> {
    let limit = run_time(args)?;
    // Before the engine starts, so that a signal sent during start-up is not lost.
    let stop = service::Stop::install()?;
    if args.stop_on_stdin_eof {
        stop.on_stdin_eof()?;
    }
    let engine = Arc::new(engine(args, None)?);
    let buffer = engine
        .allocate(args.buffer_size, "cpu:0")
        .map_err(|e| format!("allocating the buffer: {e}"))?;
    fill_pattern(&buffer)?;
    let metrics = match args.metrics_addr {
        Some(addr) => {
            let engine = Arc::downgrade(&engine);
            let render: RenderMetrics = Arc::new(move || {
                engine
                    .upgrade()
                    .map(|engine| engine.stats().prometheus())
                    .unwrap_or_default()
            });
            let server = MetricsServer::start(addr, render)
                .map_err(|e| format!("--metrics_addr {addr}: {e}"))?;
            Some(server)
        }
        None => None,
    };
    // One write, so that a reader who takes only the first line still gets both.
    let mut said = format!("segment: {}\n", engine.segment_name());
    if let Some(server) = &metrics {
        said += &format!("metrics: http://{}{METRICS_PATH}\n", server.local_addr());
    }
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(said.as_bytes())
        .and_then(|()| stdout.flush())
        .map_err(|e| e.to_string())?;
    drop(stdout);
    eprintln!(
        "tern-bench target: segment {} ({} bytes at {:#x}); run the initiator with --segment_id={}; stop with Ctrl-C or SIGTERM",
        engine.segment_name(),
        buffer.len(),
        buffer.addr(),
        engine.segment_name()
    );
    let reason = stop.wait(limit);
    eprintln!(
        "tern-bench target: {reason}; withdrawing segment {} and exiting",
        engine.segment_name()
    );
    drop(metrics);
    // Dropping the engine closes its connections and deletes its keys (etcd, HTTP) at once.
    drop(engine);
    drop(buffer);
    Ok(())
}
