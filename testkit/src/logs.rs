//! The log lines of the test process itself, for tests that assert what a refusal logged:
//! installs a `tracing` subscriber that keeps every line in memory.

use parking_lot::Mutex;
use std::io::Write;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

fn lines() -> &'static Mutex<Vec<u8>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let sink = logs.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .finish();
        let _ = tracing::subscriber::set_global_default(subscriber);
        logs
    })
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Starts keeping this process's log lines (from now on; call it before what should log).
pub fn capture() {
    lines();
}

/// Kept log lines that mention `needle`, once one has appeared (or after 3 s), with a moment
/// more for a second line that should not be there.
pub fn mentioning(needle: &str) -> Vec<String> {
    let collect = || {
        String::from_utf8_lossy(&lines().lock())
            .lines()
            .filter(|l| l.contains(needle))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let started = Instant::now();
    while collect().is_empty() && started.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    collect()
}
