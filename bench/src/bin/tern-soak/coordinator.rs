//! The coordinator: starts the peers, hands them each other's names, collects their reports,
//! tells them to close, and prints one `SOAK {json}` line per peer with its verdict.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::args::{Args, check_args, warmup};
use crate::verdict::Report;

/// A line a peer printed on stdout (`None`: its stdout closed).
type PeerLine = (usize, Option<String>);

pub(crate) fn coordinate(args: &Args) -> Result<(), String> {
    check_args(args)?;
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    eprintln!(
        "tern-soak: {} peers over {}, {} s (warm-up {} s), {} threads each, slots of {} bytes, seed {seed}",
        args.processes,
        args.protocol,
        args.seconds,
        warmup(args).as_secs_f64(),
        args.threads,
        args.slot_size
    );
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let (lines_tx, lines) = mpsc::channel::<PeerLine>();
    let mut children: Vec<Child> = Vec::new();
    let mut stdins: Vec<Option<ChildStdin>> = Vec::new();
    let mut spawn_all = || -> Result<(), String> {
        for index in 0..args.processes {
            let mut command = Command::new(&exe);
            command
                .args(["--role=peer", &format!("--index={index}")])
                .arg(format!("--processes={}", args.processes))
                .arg(format!("--seconds={}", args.seconds))
                .arg(format!("--warmup={}", warmup(args).as_secs_f64()))
                .arg(format!("--protocol={}", args.protocol))
                .arg(format!("--threads={}", args.threads))
                .arg(format!("--slot_size={}", args.slot_size))
                .arg(format!("--max_batch={}", args.max_batch))
                .arg(format!(
                    "--seed={}",
                    seed.wrapping_add(index as u64 * 0x9E37_79B9)
                ))
                .args(
                    args.device_name
                        .iter()
                        .map(|d| format!("--device_name={d}")),
                )
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit());
            let mut child = command
                .spawn()
                .map_err(|e| format!("starting peer {index}: {e}"))?;
            stdins.push(child.stdin.take());
            if let Some(stdout) = child.stdout.take() {
                let tx = lines_tx.clone();
                std::thread::spawn(move || {
                    for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                        if tx.send((index, Some(line))).is_err() {
                            return;
                        }
                    }
                    let _ = tx.send((index, None));
                });
            }
            children.push(child);
        }
        Ok(())
    };
    let started = spawn_all();
    drop(lines_tx);
    let outcome = started.and_then(|()| drive(args, &lines, &mut stdins));
    // Whatever happened: closing their stdin stops the peers (a peer also stops on "exit").
    drop(stdins);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut statuses = Vec::new();
    for (index, child) in children.iter_mut().enumerate() {
        statuses.push(wait_child(index, child, deadline));
    }
    let mut reports = outcome?;
    for (index, status) in statuses.into_iter().enumerate() {
        if let Some(report) = reports.get_mut(index) {
            report.exit = status;
        }
    }
    let mut failures = Vec::new();
    for report in &reports {
        let verdict = report.verdict();
        let mut line = report.json.clone();
        line["process"] = json!(report.index);
        line["exit"] = json!(report.exit.clone());
        line["verdict"] = json!(if verdict.is_empty() {
            "ok".to_owned()
        } else {
            verdict.join("; ")
        });
        println!("SOAK {line}");
        if !verdict.is_empty() {
            failures.push(format!("peer {}: {}", report.index, verdict.join("; ")));
        }
    }
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    if failures.is_empty() {
        eprintln!("tern-soak: passed");
        Ok(())
    } else {
        Err(format!("FAILED: {}", failures.join("; ")))
    }
}

/// Waits for a peer to exit, killing it at `deadline`; its exit as text ("0" when clean).
pub(crate) fn wait_child(index: usize, child: &mut Child, deadline: Instant) -> String {
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                return status
                    .code()
                    .map_or_else(|| status.to_string(), |c| c.to_string());
            }
            Ok(None) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(None) => {
                eprintln!("tern-soak: peer {index} did not exit; killing it");
                let _ = child.kill();
                let _ = child.wait();
                return "killed".into();
            }
            Err(e) => return format!("unknown ({e})"),
        }
    }
}

/// Hands the peers each other's names, collects their reports, then tells them to close.
fn drive(
    args: &Args,
    lines: &Receiver<PeerLine>,
    stdins: &mut [Option<ChildStdin>],
) -> Result<Vec<Report>, String> {
    let k = args.processes;
    // Engines start in well under a minute even in an emulated guest; the run itself gets
    // its length plus as much again (and two minutes) for stragglers.
    let start_by = Instant::now() + Duration::from_secs(120);
    let names = gather(
        lines,
        k,
        (start_by, "every peer to print its segment"),
        "segment: ",
        |_, name| Ok(name.to_owned()),
        |index, _| Err(format!("peer {index} exited at start")),
    )?;
    let peers_line = format!("peers: {}\n", names.join(" "));
    for (index, stdin) in stdins.iter_mut().enumerate() {
        let stdin = stdin.as_mut().ok_or("a peer's stdin is missing")?;
        stdin
            .write_all(peers_line.as_bytes())
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("telling peer {index} the names: {e}"))?;
    }
    let report_by =
        Instant::now() + Duration::from_secs_f64(args.seconds * 2.0) + Duration::from_secs(120);
    let reports = gather(
        lines,
        k,
        (report_by, "every peer's report"),
        "report: ",
        |index, text| json_of(index, "report", text),
        |index, _| Err(format!("peer {index} exited before its report")),
    )?;
    // Everyone is done moving bytes: now they may close their engines.
    for stdin in stdins.iter_mut().flatten() {
        let _ = stdin.write_all(b"exit\n").and_then(|()| stdin.flush());
    }
    let close_by = Instant::now() + Duration::from_secs(60);
    let closed = gather(
        lines,
        k,
        (close_by, "every peer to close"),
        "closed: ",
        |index, text| json_of(index, "close report", text),
        // Its stdout closed without a word (it failed while closing, and says so).
        |_, said| {
            said.get_or_insert_with(|| json!({}));
            Ok(())
        },
    )?;
    Ok(reports
        .into_iter()
        .zip(closed)
        .enumerate()
        .map(|(index, (mut json, closed))| {
            if let (Some(object), serde_json::Value::Object(extra)) = (json.as_object_mut(), closed)
            {
                object.extend(extra);
            }
            Report {
                index,
                json,
                exit: "unknown".into(),
            }
        })
        .collect())
}

/// Reads the peers' lines until each of the `count` peers has printed one that starts with
/// `prefix` (a later one replaces an earlier), by the deadline `by` (waiting for `by.1`), and
/// returns what follows the prefix, parsed by `parse`, in index order. A peer whose stdout
/// closes meanwhile is handed to `closed` with what it has said so far.
fn gather<T>(
    lines: &Receiver<PeerLine>,
    count: usize,
    by: (Instant, &str),
    prefix: &str,
    mut parse: impl FnMut(usize, &str) -> Result<T, String>,
    mut closed: impl FnMut(usize, &mut Option<T>) -> Result<(), String>,
) -> Result<Vec<T>, String> {
    let mut said: Vec<Option<T>> = std::iter::repeat_with(|| None).take(count).collect();
    while said.iter().any(Option::is_none) {
        match next_line(lines, by.0, by.1)? {
            (index, None) => closed(index, &mut said[index])?,
            (index, Some(line)) => {
                if let Some(text) = line.strip_prefix(prefix) {
                    said[index] = Some(parse(index, text)?);
                }
            }
        }
    }
    Ok(said.into_iter().flatten().collect())
}

/// A peer's JSON object (its `what`).
fn json_of(index: usize, what: &str, text: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(text).map_err(|e| format!("peer {index}'s {what} {text:?}: {e}"))
}

fn next_line(lines: &Receiver<PeerLine>, by: Instant, what: &str) -> Result<PeerLine, String> {
    match lines.recv_timeout(by.saturating_duration_since(Instant::now())) {
        Ok(line) => Ok(line),
        Err(RecvTimeoutError::Timeout) => Err(format!("timed out waiting for {what}")),
        Err(RecvTimeoutError::Disconnected) => Err(format!("every peer exited before {what}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(said: &[(usize, Option<&str>)]) -> Receiver<PeerLine> {
        let (tx, rx) = mpsc::channel();
        for (index, line) in said {
            tx.send((*index, line.map(str::to_owned))).unwrap();
        }
        rx
    }

    fn by() -> (Instant, &'static str) {
        (Instant::now() + Duration::from_secs(5), "the test's lines")
    }

    #[test]
    fn gather_takes_each_peers_last_prefixed_line_in_index_order() {
        let said = lines(&[
            (1, Some("noise")),
            (1, Some("segment: b0")),
            (1, Some("segment: b")),
            (0, Some("segment: a")),
        ]);
        let refuse = |index, _: &mut Option<String>| Err(format!("peer {index} closed"));
        let names = gather(&said, 2, by(), "segment: ", |_, t| Ok(t.to_owned()), refuse);
        assert_eq!(names.unwrap(), ["a", "b"]);
    }

    #[test]
    fn a_closed_stdout_goes_to_the_callers_choice() {
        let said = lines(&[
            (0, Some("closed: {\"qps_closed\": 0}")),
            (1, None),
            (0, None),
        ]);
        let closed = gather(
            &said,
            2,
            by(),
            "closed: ",
            |index, text| json_of(index, "close report", text),
            |_, said| {
                said.get_or_insert_with(|| json!({}));
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(closed, [json!({"qps_closed": 0}), json!({})]);
        let said = lines(&[(1, None)]);
        let refuse = |index, _: &mut Option<String>| Err(format!("peer {index} exited"));
        let error = gather(&said, 2, by(), "report: ", |_, t| Ok(t.to_owned()), refuse);
        assert_eq!(error.unwrap_err(), "peer 1 exited");
        let said = lines(&[(0, Some("report: {"))]);
        let error = gather(
            &said,
            1,
            by(),
            "report: ",
            |i, t| json_of(i, "report", t),
            |_, _| Ok(()),
        );
        assert!(error.unwrap_err().starts_with("peer 0's report \"{\": "));
    }
}
