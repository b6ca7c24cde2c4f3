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

/// The first latency, in ns, above each bucket's bound: the first whose whole µs is above it.
const ABOVE_NS: [u64; LATENCY_BUCKETS_US.len()] = {
    let mut above = [0; LATENCY_BUCKETS_US.len()];
    let mut i = 0;
    while i < above.len() {
        above[i] = (LATENCY_BUCKETS_US[i] + 1) * 1_000;
        i += 1;
    }
    above
};

/// The bucket a latency of `ns` falls in (the first bound not below its whole µs; past the
/// last, the overflow), and the latencies that bucket holds, `[from, below)` in ns: a run of
/// tasks that took alike is told by two comparisons, not a search each.
pub(crate) fn bucket_of(ns: u64) -> (usize, u64, u64) {
    let bucket = ABOVE_NS.partition_point(|&above| above <= ns);
    let from = bucket.checked_sub(1).map_or(0, |below| ABOVE_NS[below]);
    let below = ABOVE_NS.get(bucket).copied().unwrap_or(u64::MAX);
    (bucket, from, below)
}

impl Histogram {
    /// `tasks` tasks took `ns` each.
    #[cfg(test)]
    pub(super) fn record(&mut self, ns: u64, tasks: u64) {
        let (bucket, _, _) = bucket_of(ns);
        self.add(bucket, tasks, ns.saturating_mul(tasks));
    }

    /// Adds all of `other`.
    pub(super) fn absorb(&mut self, other: &Histogram) {
        for (mine, theirs) in self.buckets.iter_mut().zip(&other.buckets) {
            *mine += theirs;
        }
        self.sum_ns = self.sum_ns.saturating_add(other.sum_ns);
    }

    /// `tasks` tasks in `bucket` (as [`bucket_of`] finds it), which took `sum_ns` together.
    pub(super) fn add(&mut self, bucket: usize, tasks: u64, sum_ns: u64) {
        if let Some(count) = self.buckets.get_mut(bucket) {
            *count += tasks;
            self.sum_ns = self.sum_ns.saturating_add(sum_ns);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_holds_exactly_the_latencies_it_says() {
        for ns in [
            0,
            4_999,
            5_999,
            6_000,
            10_999,
            11_000,
            10_000_000_999,
            10_000_001_000,
        ] {
            let (bucket, from, below) = bucket_of(ns);
            assert!(from <= ns && ns < below, "{ns} in [{from}, {below})");
            assert_eq!(
                bucket_of(from).0,
                bucket,
                "{from}, the first of {ns}'s bucket"
            );
            assert_eq!(bucket_of(below - 1).0, bucket, "{}, its last", below - 1);
            if below != u64::MAX {
                assert_eq!(bucket_of(below).0, bucket + 1, "{below}, past it");
            }
        }
        assert_eq!(bucket_of(u64::MAX - 1).0, LATENCY_BUCKETS_US.len());
    }

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
