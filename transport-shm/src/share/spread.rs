//! How one submit is shared among the hands: whole, in runs of whole slices, or each slice
//! cut into stripes, decided from the submit's shape alone.

/// Smallest piece a slice is cut into for several hands, and the alignment of the cuts
/// (whole pages, so no two hands write one cache line or pin one page).
pub(super) const STRIPE_PIECE: usize = 16 << 10;

/// Slices this long (on average) are cut into a piece per hand even when the submit has
/// enough slices to give each hand a run of its own: copies this long run from memory,
/// where two hands on the halves of each slice move more than two on runs of whole ones.
const STRIPE_FROM: u64 = 1 << 20;

/// Where a slice's bytes go, for [`Shape`].
#[derive(Debug, Clone, Copy)]
pub(super) struct Extent {
    pub(super) writes: bool,
    pub(super) local: u64,
    pub(super) remote: u64,
    pub(super) len: u64,
}

/// What [`spread`] needs to know of a submit.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Shape {
    slices: usize,
    bytes: u64,
    /// Whether two slices write the same bytes (the same block again, as a benchmark that
    /// reuses one block does): seen when the slices' destinations span fewer bytes than
    /// they hold.
    reuse: bool,
}

impl Shape {
    pub(super) fn of(extents: impl Iterator<Item = Extent>) -> Self {
        // Destinations: the peer's memory for writes, this node's for reads.
        #[derive(Clone, Copy)]
        struct Span {
            low: u64,
            high: u64,
            bytes: u64,
        }
        let empty = Span {
            low: u64::MAX,
            high: 0,
            bytes: 0,
        };
        let mut spans = [empty; 2];
        let mut shape = Shape::default();
        for extent in extents {
            let start = if extent.writes {
                extent.remote
            } else {
                extent.local
            };
            let span = &mut spans[usize::from(extent.writes)];
            span.low = span.low.min(start);
            span.high = span.high.max(start.saturating_add(extent.len));
            span.bytes = span.bytes.saturating_add(extent.len);
            shape.slices += 1;
            shape.bytes = shape.bytes.saturating_add(extent.len);
        }
        shape.reuse = spans
            .iter()
            .any(|s| s.bytes > 0 && s.high.saturating_sub(s.low) < s.bytes);
        shape
    }
}

/// How one submit is shared among the hands.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Spread {
    /// One hand takes it all: too little to share.
    Whole,
    /// Runs of whole slices, one per hand: distinct memory streams best this way.
    Runs(usize),
    /// Each slice cut into a piece per hand, so that the hands never write the same bytes:
    /// for memory reused within the submit (two hands on one block fight over its cache
    /// lines), for long slices, and for a submit of too few slices to share out whole.
    Stripes,
}

/// Memory reused within the submit is striped on both paths: cross-memory attach moves all
/// of a hand's pieces in one system call (`write_many`), and two hands on runs of the same
/// block (alternating runs) fight over its cache lines, which stripes keep apart. Long
/// slices and too few slices are cut only through a mapping (`mapped`: asked only when it
/// matters): over distinct memory, stripes gained cross-memory attach nothing measurable.
pub(super) fn spread(shape: &Shape, hands: usize, mapped: impl FnOnce() -> bool) -> Spread {
    let enough_for_runs = shape.slices >= 2 * hands;
    if hands < 2 || shape.bytes < 2 * STRIPE_PIECE as u64 {
        return Spread::Whole;
    }
    let long = shape.bytes / shape.slices as u64 >= STRIPE_FROM;
    if shape.reuse || ((long || !enough_for_runs) && mapped()) {
        return Spread::Stripes;
    }
    if enough_for_runs {
        Spread::Runs(hands)
    } else {
        Spread::Whole
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1 << 10;

    fn writes(blocks: &[(u64, u64)]) -> Shape {
        Shape::of(blocks.iter().map(|&(remote, len)| Extent {
            writes: true,
            local: 0,
            remote,
            len,
        }))
    }

    fn distinct(count: u64, len: u64) -> Shape {
        writes(&(0..count).map(|i| (i * len, len)).collect::<Vec<_>>())
    }

    #[test]
    fn reuse_is_slices_writing_the_same_bytes() {
        assert!(!distinct(128, 64 * KIB).reuse);
        assert!(writes(&[(0, 64 * KIB); 128]).reuse);
        assert!(writes(&[(0, 64 * KIB), (32 * KIB, 64 * KIB)]).reuse);
        // Reads land in local memory: the same remote block read into distinct local ones
        // is no reuse; read into one local block, it is.
        let reads = |locals: &[u64]| {
            Shape::of(locals.iter().map(|&local| Extent {
                writes: false,
                local,
                remote: 0,
                len: 64 * KIB,
            }))
        };
        assert!(!reads(&[0, 64 * KIB, 128 * KIB]).reuse);
        assert!(reads(&[0, 0]).reuse);
        let shape = distinct(3, 64 * KIB);
        assert_eq!((shape.slices, shape.bytes), (3, 192 * KIB));
    }

    #[test]
    fn a_submit_is_shared_out_by_what_it_moves_and_how() {
        let asked = std::cell::Cell::new(0);
        let mapped = |answer: bool| {
            let asked = &asked;
            move || {
                asked.set(asked.get() + 1);
                answer
            }
        };
        // Too little to share, or one hand: whole, without looking up the mapping.
        assert_eq!(
            spread(&distinct(1, 4 * KIB), 2, mapped(true)),
            Spread::Whole
        );
        assert_eq!(
            spread(&distinct(128, 64 * KIB), 1, mapped(true)),
            Spread::Whole
        );
        assert_eq!(asked.get(), 0);
        // Distinct 64 KiB blocks stream best in runs, mapped or not.
        assert_eq!(
            spread(&distinct(128, 64 * KIB), 2, mapped(true)),
            Spread::Runs(2)
        );
        assert_eq!(
            spread(&distinct(128, 64 * KIB), 2, mapped(false)),
            Spread::Runs(2)
        );
        // One block again and again: cut on both paths, without asking. Long slices, or
        // too few slices: cut through a mapping only.
        let again = writes(&[(0, 64 * KIB); 128]);
        let before = asked.get();
        assert_eq!(spread(&again, 2, mapped(true)), Spread::Stripes);
        assert_eq!(spread(&again, 2, mapped(false)), Spread::Stripes);
        assert_eq!(asked.get(), before);
        assert_eq!(
            spread(&distinct(128, 1 << 20), 2, mapped(false)),
            Spread::Runs(2)
        );
        assert_eq!(
            spread(&distinct(128, 1 << 20), 2, mapped(true)),
            Spread::Stripes
        );
        assert_eq!(
            spread(&distinct(1, 1 << 20), 2, mapped(true)),
            Spread::Stripes
        );
        assert_eq!(
            spread(&distinct(1, 1 << 20), 2, mapped(false)),
            Spread::Whole
        );
    }
}
