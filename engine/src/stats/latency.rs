//! Latency histograms: the size classes transfers are told apart by, the bucket bounds, and
//! one histogram.

/// Transfer sizes the latency histograms tell apart: up to 4 KiB, 64 KiB, 1 MiB, and more.
pub const SIZE_CLASSES: [(&str, usize); 4] = [
    ("4KiB", 4 << 10),
    ("64KiB", 64 << 10),
    ("1MiB", 1 << 20),
    ("larger", usize::MAX),
];

/// Upper bounds of the latency buckets, in microseconds (the last is everything above).
pub const LATENCY_BUCKETS_US: [u64; 16] = [
    5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 1_000_000,
    10_000_000,
];

pub(super) fn size_class(len: usize) -> usize {
    SIZE_CLASSES
        .iter()
        .position(|&(_, max)| len <= max)
        .unwrap_or(SIZE_CLASSES.len() - 1)
}

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Histogram {
    /// Per bucket (not cumulative); the last counts what is above every bound.
    pub(super) buckets: [u64; LATENCY_BUCKETS_US.len() + 1],
    pub(super) sum_ns: u64,
}

impl Histogram {
    /// `tasks` tasks took `ns` each.
    pub(super) fn record(&mut self, ns: u64, tasks: u64) {
        // The first bound not below the whole µs of `ns` (the bounds ascend) — the first
        // whose next µs starts above `ns`; past the last, the overflow.
        const ABOVE_NS: [u64; LATENCY_BUCKETS_US.len()] = {
            let mut above = [0; LATENCY_BUCKETS_US.len()];
            let mut i = 0;
            while i < above.len() {
                above[i] = (LATENCY_BUCKETS_US[i] + 1) * 1_000;
                i += 1;
            }
            above
        };
        let bucket = ABOVE_NS.partition_point(|&above| above <= ns);
        self.buckets[bucket] += tasks;
        self.sum_ns += ns * tasks;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_buckets_take_the_first_bound_not_below() {
        let mut histogram = Histogram::default();
        for us in [0, 5, 6, 10, 11, 10_000_000, 10_000_001] {
            histogram.record(us * 1_000, 1);
        }
        let counts = histogram.buckets;
        assert_eq!(counts[0], 2, "0 and 5 µs are in the first bucket (≤ 5)");
        assert_eq!(counts[1], 2, "6 and 10 µs in ≤ 10");
        assert_eq!(counts[2], 1, "11 µs in ≤ 20");
        assert_eq!(
            counts[LATENCY_BUCKETS_US.len() - 1],
            1,
            "10 s in the last bound"
        );
        assert_eq!(
            counts[LATENCY_BUCKETS_US.len()],
            1,
            "above it, the overflow"
        );
    }
}
