//! What a peer's report must show: no error, transfers, and resources that did not grow
//! between the sample after the warm-up and the one at the end.

/// The limits a peer's resources must keep between the sample after the warm-up and the one
/// at the end, while every worker is still moving bytes.
///
/// - File descriptors, threads and queue pairs: equal. After the warm-up every peer has
///   reached every other over every connection (or endpoint) it will ever use, and a steady
///   workload has no reason to open, spawn or create one more; any difference is a leak or a
///   reconnection, both worth a look.
/// - RSS: at most [`RSS_SLACK_KIB`] more. Every buffer (served, local, shadow, scratch) is
///   allocated and touched before the warm-up ends, but malloc keeps freed blocks in its
///   per-thread arenas and trims them when it likes, and transparent huge pages back heaps
///   2 MiB at a time, so a steady process moves by a step or two of 2 MiB. A leak per
///   batch, however small, grows with every batch and passes the limit in a long enough run.
const RSS_SLACK_KIB: u64 = 8 * 1024;

/// What one peer reported, and how it ended.
pub(crate) struct Report {
    pub(crate) index: usize,
    /// The peer's `report:` object merged with its `closed:` object.
    pub(crate) json: serde_json::Value,
    pub(crate) exit: String,
}

impl Report {
    fn number(&self, key: &str) -> Option<u64> {
        self.json.get(key).and_then(serde_json::Value::as_u64)
    }

    /// What is wrong with this peer's run; empty when nothing is.
    pub(crate) fn verdict(&self) -> Vec<String> {
        let mut wrong = Vec::new();
        if self.exit != "0" {
            wrong.push(format!("exit status {}", self.exit));
        }
        match self.number("errors") {
            Some(0) => {}
            Some(n) => wrong.push(format!("{n} errors")),
            None => wrong.push("no error count".into()),
        }
        if self.number("transfers").unwrap_or(0) == 0 {
            wrong.push("no transfers".into());
        }
        for key in ["fds", "threads", "qps"] {
            match (
                self.number(&format!("{key}_start")),
                self.number(&format!("{key}_end")),
            ) {
                (Some(start), Some(end)) if start == end => {}
                (Some(start), Some(end)) => wrong.push(format!("{key} {start} -> {end}")),
                _ => wrong.push(format!("no {key} samples")),
            }
        }
        match (self.number("rss_kib_start"), self.number("rss_kib_end")) {
            (Some(start), Some(end)) if end <= start + RSS_SLACK_KIB => {}
            (Some(start), Some(end)) => wrong.push(format!(
                "RSS grew {start} -> {end} KiB (limit +{RSS_SLACK_KIB} KiB)"
            )),
            _ => wrong.push("no RSS samples".into()),
        }
        match self.number("qps_closed") {
            Some(0) => {}
            Some(n) => wrong.push(format!("{n} queue pairs left after the engine closed")),
            None => wrong.push("no count of queue pairs after closing".into()),
        }
        wrong
    }
}
