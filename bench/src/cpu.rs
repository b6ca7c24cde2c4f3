//! The CPU the initiator and the target use, from `/proc`: during the run and while idle.

use std::time::{Duration, Instant};

/// User plus system CPU time of a process so far, from `/proc/<pid>/stat` (in clock ticks
/// of 1/100 s: USER_HZ is 100 for `/proc` on Linux).
pub(crate) fn cpu_seconds(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces; the fields after it are plain numbers.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i)?.parse::<f64>().ok();
    Some((ticks(11)? + ticks(12)?) / 100.0)
}

/// Percent of a core each process uses over `seconds` of doing nothing.
pub(crate) fn idle_cpu(seconds: f64, target: Option<u32>) -> (f64, Option<f64>) {
    let target = target.map(|pid| pid.to_string());
    let before = (cpu_seconds("self"), target.as_deref().and_then(cpu_seconds));
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let wall = started.elapsed().as_secs_f64();
    let after = (cpu_seconds("self"), target.as_deref().and_then(cpu_seconds));
    let percent = |a: Option<f64>, b: Option<f64>| Some((b? - a?) / wall * 100.0);
    (
        percent(before.0, after.0).unwrap_or(f64::NAN),
        percent(before.1, after.1),
    )
}
