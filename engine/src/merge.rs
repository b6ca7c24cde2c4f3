//! Merging the neighbouring requests of one submit call into runs, so that the number of
//! requests stops mattering: a serving stack submits one request per (layer, page), and
//! consecutive pages of a layer are contiguous on both sides. A run is moved as one range,
//! cut into slices by the transport's slice size; each request stays its own task.
//!
//! The planner is pure: it sees requests already checked (each inside one local region and
//! one of the peer's buffers) as plain numbers, and decides which go together.

use crate::types::Opcode;

/// A checked request, as the planner sees it: 40 bytes, so that a submit's list of them
/// stays small to write and to sort.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Extent {
    pub local: usize,
    pub remote: u64,
    pub len: usize,
    /// The task (index in its batch).
    pub task: u32,
    /// The submission the request was checked with, an index the caller keeps: one pinned
    /// local region and one peer, as the very descriptor the request was checked against
    /// (requests checked against two versions of one peer's descriptor, a re-fetch between
    /// them, never share one). A run uses its first request's, which covers the whole run.
    pub submission: u32,
    /// The peer's buffer holding `[remote, remote + len)`, by its index in the descriptor.
    pub buffer: u32,
    pub opcode: Opcode,
}

impl Extent {
    /// The order in which neighbours sit next to each other; the task breaks ties, so that
    /// overlapping requests keep their submission order.
    fn order(&self) -> (u32, bool, usize, u32) {
        (
            self.submission,
            self.opcode == Opcode::Write,
            self.local,
            self.task,
        )
    }

    /// [`order`](Self::order) in one number, compared in one go: the submission, whether
    /// a write, the local address (below 2^63, as any a process can map) and the task.
    fn sort_key(&self) -> u128 {
        (u128::from(self.submission) << 96)
            | (u128::from(self.opcode == Opcode::Write) << 95)
            | ((self.local as u128 & (u64::MAX >> 1) as u128) << 32)
            | u128::from(self.task)
    }

    /// Whether `next` starts where `self` ends, on both sides, going the same way within
    /// one local region and one of the peer's buffers: the two can move as one range.
    fn neighbours(&self, next: &Extent) -> bool {
        self.submission == next.submission
            && self.buffer == next.buffer
            && self.opcode == next.opcode
            && self.local.checked_add(self.len) == Some(next.local)
            && self.remote.checked_add(self.len as u64) == Some(next.remote)
    }

    /// Whether `next` continues a run that ends with `self` and is `run_len` bytes long,
    /// without making it longer than `max_run`.
    fn continues_into(&self, next: &Extent, run_len: u64, max_run: u64) -> bool {
        self.neighbours(next) && run_len.saturating_add(next.len as u64) <= max_run
    }
}

/// Room the planner reorders in, kept by the caller between calls so that a plan
/// allocates nothing once it has grown.
#[derive(Debug, Default)]
pub(crate) struct PlanRoom {
    /// The runs of neighbours as submitted, each by where it sits among the requests.
    heads: Vec<Head>,
    /// The requests again, runs in address order.
    ordered: Vec<Extent>,
}

impl PlanRoom {
    pub(crate) const EMPTY: Self = Self {
        heads: Vec::new(),
        ordered: Vec::new(),
    };

    /// Lets go of room past `keep` entries (a batch of many thousand requests made it).
    pub(crate) fn trim(&mut self, keep: usize) {
        if self.ordered.capacity() > keep || self.heads.capacity() > keep {
            *self = Self::default();
        }
    }
}

/// A run of neighbours in submission order: where its requests sit among the extents, and
/// (once runs are to be put in order) its first request's [`Extent::sort_key`].
#[derive(Debug, Clone, Copy)]
struct Head {
    start: u32,
    end: u32,
    key: u128,
}

/// Hands `each_run` the runs of `extents`: neighbours (same peer and opcode, contiguous both
/// locally and remotely, in one local region and one remote buffer) together, at most
/// `max_run` bytes each. With `merge` off, each request is a run of its own, in submission
/// order. With it on, neighbours submitted in any order meet: the requests are first
/// gathered into the runs they make as submitted (pages submitted a few consecutive ones at
/// a time, as serving stacks do), in one pass that also tells whether they came in address
/// order (the common case, handed on as they are); otherwise those runs — not each request —
/// are put in address order, so a submit of `n` requests in `r` such runs sorts `r`
/// entries, not `n`.
pub(crate) fn plan(
    extents: &[Extent],
    merge: bool,
    max_run: u64,
    room: &mut PlanRoom,
    mut each_run: impl FnMut(&[Extent]),
) {
    if !merge || extents.len() == 1 {
        for extent in extents.chunks(1) {
            each_run(extent);
        }
        return;
    }
    let PlanRoom { heads, ordered } = room;
    heads.clear();
    // Inside a run of neighbours the order ascends (each starts where the one before ends,
    // and a checked request is never empty): the requests are in address order when each
    // run's first comes after the run before's last.
    let mut in_order = true;
    let mut start = 0;
    for (i, pair) in extents.windows(2).enumerate() {
        if !pair[0].neighbours(&pair[1]) {
            in_order &= pair[0].order() < pair[1].order();
            heads.push(Head {
                start: start as u32,
                end: i as u32 + 1,
                key: 0,
            });
            start = i + 1;
        }
    }
    heads.push(Head {
        start: start as u32,
        end: extents.len() as u32,
        key: 0,
    });
    let run_of = |head: &Head| &extents[head.start as usize..head.end as usize];
    if in_order {
        for head in heads.iter() {
            capped(run_of(head), max_run, &mut each_run);
        }
        return;
    }
    // Orders are unique (the task breaks ties), so an unstable sort orders as a stable one.
    for head in heads.iter_mut() {
        head.key = extents[head.start as usize].sort_key();
    }
    heads.sort_unstable_by_key(|head| head.key);
    // In address order, a run may now continue the one put before it: those that join are
    // copied together into `ordered`; one that joins none is handed on where it is.
    let joins = |before: &Head, after: &Head| {
        let (before, after) = (run_of(before), run_of(after));
        before
            .last()
            .zip(after.first())
            .is_some_and(|(last, first)| last.neighbours(first))
    };
    let mut rest = heads.as_slice();
    while !rest.is_empty() {
        let joined = 1 + rest
            .windows(2)
            .take_while(|pair| joins(&pair[0], &pair[1]))
            .count();
        let group;
        (group, rest) = rest.split_at(joined);
        if let [alone] = group {
            capped(run_of(alone), max_run, &mut each_run);
        } else {
            ordered.clear();
            for head in group {
                ordered.extend_from_slice(run_of(head));
            }
            capped(ordered, max_run, &mut each_run);
        }
    }
}

/// Whether [`plan`] hands each of `extents` on as a run of its own, in submission order:
/// with `merge` off, and for requests that cannot merge coming in address order (as sorting
/// would leave them). Any pair of neighbours, or one out of order, ends the look at once,
/// so a submit that merges pays one comparison for it. A caller may then cut each request
/// on its own, in a loop of its own, without the planner (which, asked all the same, finds
/// the same runs the long way).
pub(crate) fn each_alone(extents: &[Extent], merge: bool) -> bool {
    !merge
        || extents
            .windows(2)
            .all(|pair| apart_in_order(&pair[0], &pair[1]))
}

/// Whether `next`, submitted after `extent`, neither continues it nor sits before it.
#[inline(always)]
fn apart_in_order(extent: &Extent, next: &Extent) -> bool {
    if extent.submission == next.submission && extent.opcode == next.opcode {
        // Most pairs: one region, one way. In order is after it (a later task at the same
        // address would be too, but the planner sorts those out); a neighbour starts where
        // it ends.
        return extent.local < next.local
            && !(extent.local.checked_add(extent.len) == Some(next.local)
                && extent.remote.checked_add(extent.len as u64) == Some(next.remote)
                && extent.buffer == next.buffer);
    }
    !extent.neighbours(next) && extent.order() < next.order()
}

/// Hands `each_run` a run of neighbours, cut where it would pass `max_run` bytes (a request
/// longer than that on its own goes alone).
#[inline(always)]
fn capped(run: &[Extent], max_run: u64, each_run: &mut impl FnMut(&[Extent])) {
    match run {
        [] => {}
        [_] => each_run(run),
        // Neighbours are contiguous: the run ends where its last request does.
        [first, .., last]
            if last
                .local
                .saturating_add(last.len)
                .saturating_sub(first.local) as u64
                <= max_run =>
        {
            each_run(run)
        }
        _ => runs_in_order(run, max_run, each_run),
    }
}

/// Hands `each_run` the runs of `extents`, taken in the order they are: neighbours meet only
/// where they sit side by side.
fn runs_in_order(extents: &[Extent], max_run: u64, each_run: &mut impl FnMut(&[Extent])) {
    let mut start = 0;
    let mut run_len = 0u64;
    for i in 0..extents.len() {
        if i > start && !extents[i - 1].continues_into(&extents[i], run_len, max_run) {
            each_run(&extents[start..i]);
            (start, run_len) = (i, 0);
        }
        run_len = run_len.saturating_add(extents[i].len as u64);
    }
    if start < extents.len() {
        each_run(&extents[start..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 16 << 10;
    /// Where the test's local region and remote buffer start.
    const LOCAL: usize = 1 << 30;
    const REMOTE: u64 = 1 << 40;

    /// Page `page` read from peer 1: local and remote both at `page × PAGE` from their base.
    fn page(task: u32, page: usize) -> Extent {
        Extent {
            local: LOCAL + page * PAGE,
            remote: REMOTE + (page * PAGE) as u64,
            len: PAGE,
            task,
            submission: 0,
            buffer: 0,
            opcode: Opcode::Read,
        }
    }

    /// The runs, as the tasks of each.
    fn runs(extents: &[Extent], merge: bool, max_run: u64) -> Vec<Vec<u32>> {
        let mut runs = Vec::new();
        plan(extents, merge, max_run, &mut PlanRoom::default(), |run| {
            runs.push(run.iter().map(|e| e.task).collect())
        });
        runs
    }

    /// A repeatable stream of numbers below a bound, from `seed`.
    fn below_from(seed: u64) -> impl FnMut(usize) -> usize {
        let mut next = tern_testkit::random::below_from(seed);
        move |below: usize| next(below as u64) as usize
    }

    fn tasks(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    #[test]
    fn contiguous_pages_make_one_run_and_merging_off_makes_one_per_request() {
        let extents: Vec<_> = (0..64).map(|i| page(i, i as usize)).collect();
        assert_eq!(runs(&extents, true, u64::MAX), [tasks(0..64)]);
        let alone: Vec<Vec<u32>> = (0..64).map(|i| vec![i]).collect();
        assert_eq!(runs(&extents, false, u64::MAX), alone);
    }

    #[test]
    fn neighbours_submitted_out_of_order_are_merged_in_address_order() {
        // Pages 0..16 submitted as 8..16 then 0..8 reversed: one run, in address order.
        let order: Vec<usize> = (8..16).chain((0..8).rev()).collect();
        let extents: Vec<_> = order
            .iter()
            .enumerate()
            .map(|(task, &p)| page(task as u32, p))
            .collect();
        let by_address: Vec<u32> = (0..16)
            .map(|p| order.iter().position(|&o| o == p).unwrap() as u32)
            .collect();
        assert_eq!(runs(&extents, true, u64::MAX), [by_address]);
    }

    #[test]
    fn a_gap_or_an_overlap_ends_a_run() {
        // Pages 0, 1, then 3 (a gap), then page 3 again shifted by one byte (an overlap).
        let mut overlap = page(3, 3);
        overlap.local += 1;
        overlap.remote += 1;
        let extents = [page(0, 0), page(1, 1), page(2, 3), overlap];
        assert_eq!(
            runs(&extents, true, u64::MAX),
            [vec![0, 1], vec![2], vec![3]]
        );
        // Contiguous locally, not remotely: no run.
        let mut remote_gap = page(1, 1);
        remote_gap.remote += PAGE as u64;
        let extents = [page(0, 0), remote_gap];
        assert_eq!(runs(&extents, true, u64::MAX), [vec![0], vec![1]]);
    }

    #[test]
    fn different_peers_or_opcodes_never_merge() {
        // Another peer is another submission.
        let mut other_peer = page(1, 1);
        other_peer.submission = 2;
        let mut write = page(2, 2);
        write.opcode = Opcode::Write;
        let extents = [page(0, 0), other_peer, write, page(3, 3)];
        let mut found = runs(&extents, true, u64::MAX);
        found.sort();
        assert_eq!(found, [vec![0], vec![1], vec![2], vec![3]]);
    }

    #[test]
    fn a_huge_request_beside_small_ones_joins_their_run() {
        // Pages 0..4, then one request of 1 GiB right after them, then page 4 + 1 GiB/PAGE.
        let huge_pages = (1 << 30) / PAGE;
        let mut huge = page(4, 4);
        huge.len = 1 << 30;
        let after = page(5, 4 + huge_pages);
        let mut extents: Vec<_> = (0..4).map(|i| page(i, i as usize)).collect();
        extents.extend([huge, after]);
        assert_eq!(runs(&extents, true, u64::MAX), [tasks(0..6)]);
        // A cap on a run's bytes cuts it where the next request would pass it.
        assert_eq!(
            runs(&extents, true, (4 * PAGE) as u64 + (1 << 30)),
            [tasks(0..5), vec![5]]
        );
    }

    #[test]
    fn a_run_never_crosses_a_local_region_or_a_remote_buffer() {
        // Page 2 is the first of another local region that starts right where the first
        // ends (so of another submission); page 4 the first of another remote buffer
        // likewise.
        let mut extents: Vec<_> = (0..6).map(|i| page(i, i as usize)).collect();
        for extent in &mut extents[2..] {
            extent.submission = 1;
        }
        for extent in &mut extents[4..] {
            extent.buffer = 1;
        }
        assert_eq!(
            runs(&extents, true, u64::MAX),
            [vec![0, 1], vec![2, 3], vec![4, 5]]
        );
    }

    #[test]
    fn interleaved_layers_sort_into_one_run_per_layer() {
        // Two layers 1 MiB apart, their pages submitted alternately.
        let layer_pages = (1 << 20) / PAGE;
        let extents: Vec<_> = (0..8)
            .map(|i| page(i, (i as usize % 2) * layer_pages + i as usize / 2))
            .collect();
        assert_eq!(
            runs(&extents, true, u64::MAX),
            [vec![0, 2, 4, 6], vec![1, 3, 5, 7]]
        );
    }

    /// The runs a full sort of the requests by address would make: what gathering the runs
    /// as submitted and sorting those must come to.
    fn runs_of_a_full_sort(extents: &[Extent], max_run: u64) -> Vec<Vec<u32>> {
        let mut sorted = extents.to_vec();
        sorted.sort_by_key(Extent::order);
        let mut runs = Vec::new();
        runs_in_order(&sorted, max_run, &mut |run: &[Extent]| {
            runs.push(run.iter().map(|e| e.task).collect())
        });
        runs
    }

    #[test]
    fn requests_each_alone_in_address_order_are_told_apart_from_those_the_planner_must_order() {
        // A gap after each page, in address order: each is its own run, in submission order.
        let apart: Vec<_> = (0..32).map(|i| page(i, 2 * i as usize)).collect();
        assert!(each_alone(&apart, true));
        let alone: Vec<Vec<u32>> = (0..32).map(|i| vec![i]).collect();
        assert_eq!(runs(&apart, true, u64::MAX), alone);
        // One pair of neighbours (task 20 moved right behind task 19's page), or one pair out
        // of order (tasks 5 and 6 swap pages): not each alone, and the planner merges or
        // orders them.
        let mut neighbours = apart.clone();
        neighbours[20] = page(20, 39);
        assert!(!each_alone(&neighbours, true));
        assert!(runs(&neighbours, true, u64::MAX).contains(&vec![19, 20]));
        let mut swapped = apart.clone();
        (swapped[5], swapped[6]) = (page(5, 12), page(6, 10));
        assert!(!each_alone(&swapped, true));
        assert_eq!(runs(&swapped, true, u64::MAX)[5..7], [vec![6], vec![5]]);
        // With merging off, every submit is each alone.
        assert!(each_alone(&swapped, false) && each_alone(&neighbours, false));

        // Random sets of distinct pages, in address order or not, and in half the rounds
        // from two regions and going two ways: whenever `each_alone` says so, the planner's
        // runs are one request each in submission order, and they are what a full sort of
        // the requests gives.
        let mut next = below_from(0x9E37_79B9_7F4A_7C15);
        let (mut seen_alone, mut seen_mixed_alone) = (0, 0);
        for round in 0..800 {
            let mut pages: Vec<usize> = (0..64).filter(|_| next(3) == 0).collect();
            if round % 2 == 1 && pages.len() > 1 {
                let (a, b) = (next(pages.len()), next(pages.len()));
                pages.swap(a, b);
            }
            let mixed = round % 4 >= 2;
            let extents: Vec<Extent> = pages
                .iter()
                .enumerate()
                .map(|(task, &p)| {
                    let mut extent = page(task as u32, p);
                    if mixed {
                        // Pages 0..32 from one region, 32..64 from another; in each, the
                        // first 16 read, the others write: in address order, also in the
                        // planner's order.
                        extent.submission = u32::from(p >= 32);
                        if p % 32 >= 16 {
                            extent.opcode = Opcode::Write;
                        }
                    }
                    extent
                })
                .collect();
            let found = runs(&extents, true, u64::MAX);
            assert_eq!(found, runs_of_a_full_sort(&extents, u64::MAX), "{pages:?}");
            if each_alone(&extents, true) {
                seen_alone += 1;
                seen_mixed_alone += usize::from(mixed);
                let one_each: Vec<Vec<u32>> = (0..extents.len() as u32).map(|t| vec![t]).collect();
                assert_eq!(found, one_each, "{pages:?}");
            }
        }
        assert!(seen_alone > 0, "no random set came out each alone");
        assert!(
            seen_mixed_alone > 0,
            "no set from two regions came out each alone"
        );
    }

    #[test]
    fn runs_submitted_out_of_order_merge_as_a_full_sort_of_the_requests_would() {
        // Three layers of 40 pages, cut into runs of 1 to 9 pages, the runs shuffled: each
        // layer comes out one run. With some pages submitted twice (overlaps), every task
        // still comes out once, and every run holds neighbours only.
        let layer_pages = 64;
        let mut next = below_from(0x2545_F491_4F6C_DD1D);
        for round in 0..50 {
            let mut runs_of_pages: Vec<Vec<usize>> = Vec::new();
            for layer in 0..3 {
                let mut first = 0;
                while first < 40 {
                    let len = (1 + next(9)).min(40 - first);
                    let base = layer * layer_pages + first;
                    runs_of_pages.push((base..base + len).collect());
                    first += len;
                }
            }
            let repeats = round % 2 == 1;
            if repeats {
                for _ in 0..5 {
                    let again = runs_of_pages[next(runs_of_pages.len())].clone();
                    runs_of_pages.push(again);
                }
            }
            for i in (1..runs_of_pages.len()).rev() {
                runs_of_pages.swap(i, next(i + 1));
            }
            let extents: Vec<Extent> = runs_of_pages
                .iter()
                .flatten()
                .enumerate()
                .map(|(task, &p)| page(task as u32, p))
                .collect();
            for max_run in [u64::MAX, 5 * PAGE as u64] {
                let found = runs(&extents, true, max_run);
                let mut tasks: Vec<u32> = found.iter().flatten().copied().collect();
                tasks.sort_unstable();
                assert_eq!(tasks, (0..extents.len() as u32).collect::<Vec<_>>());
                for run in &found {
                    let bytes: u64 = run.iter().map(|&t| extents[t as usize].len as u64).sum();
                    assert!(bytes <= max_run || run.len() == 1, "{run:?}");
                    for pair in run.windows(2) {
                        let (a, b) = (&extents[pair[0] as usize], &extents[pair[1] as usize]);
                        assert!(a.continues_into(b, 0, u64::MAX), "{pair:?} in {run:?}");
                    }
                }
                if !repeats {
                    assert_eq!(found, runs_of_a_full_sort(&extents, max_run));
                    if max_run == u64::MAX {
                        assert_eq!(found.len(), 3, "one run per layer: {found:?}");
                    }
                }
            }
        }
    }
}
