//! This process's resources at one moment: RSS, open file descriptors, threads and live
//! queue pairs.

/// Resource counts of this process at one moment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    pub(crate) rss_kib: u64,
    pub(crate) fds: u64,
    pub(crate) threads: u64,
    pub(crate) qps: u64,
}

/// Samples this process now, from `/proc/self` and the verbs layer's count.
pub(crate) fn sample() -> Result<Sample, String> {
    let status = std::fs::read_to_string("/proc/self/status").map_err(|e| e.to_string())?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse::<u64>().ok())
            .ok_or_else(|| format!("/proc/self/status has no {name}"))
    };
    // The directory listing holds the descriptor that reads it: one less.
    let fds = std::fs::read_dir("/proc/self/fd")
        .map_err(|e| e.to_string())?
        .count()
        .saturating_sub(1) as u64;
    Ok(Sample {
        rss_kib: field("VmRSS:")?,
        fds,
        threads: field("Threads:")?,
        qps: tern_verbs::live_queue_pairs() as u64,
    })
}
