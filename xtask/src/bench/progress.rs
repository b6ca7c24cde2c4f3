//! The line printed as each section of a run starts, and the total at the end.

/// Prints a line as each section of a run starts: where the run is, and how long it has
/// taken so far.
pub(super) struct Progress {
    sections: usize,
    done: usize,
    started: std::time::Instant,
}

impl Progress {
    pub(super) fn new(sections: usize) -> Self {
        Self {
            sections,
            done: 0,
            started: std::time::Instant::now(),
        }
    }

    pub(super) fn section(&mut self, name: &str) {
        use std::io::Write as _;
        self.done += 1;
        let secs = self.started.elapsed().as_secs();
        println!(
            "\n[{}/{}] {name} … ({}m{:02}s in)",
            self.done,
            self.sections,
            secs / 60,
            secs % 60
        );
        let _ = std::io::stdout().flush();
    }

    pub(super) fn finish(&self) {
        let secs = self.started.elapsed().as_secs();
        println!(
            "\nbench: {} sections in {}m{:02}s (after the build)",
            self.sections,
            secs / 60,
            secs % 60
        );
    }
}
