//! How the sections' tables spell a block size and a ratio beside its goal.

pub(super) fn kib(block: usize) -> String {
    if block >= 1 << 20 {
        format!("{} MiB", block >> 20)
    } else {
        format!("{} KiB", block >> 10)
    }
}

pub(super) fn ratio_mark(ratio: f64, goal: Option<f64>, higher_is_better: bool) -> String {
    match goal {
        None => format!("{ratio:.2}"),
        Some(goal) => {
            let met = if higher_is_better {
                ratio >= goal
            } else {
                ratio <= goal
            };
            format!(
                "{ratio:.2} ({} {goal} {})",
                if higher_is_better { ">=" } else { "<=" },
                if met { "met" } else { "MISSED" }
            )
        }
    }
}
