//! Cutting a slice into pieces: for a transport that moves one slice with several threads,
//! and for a declined slice too large for the next transport. Every piece is counted by its
//! task, or its run, before any piece can report.

use super::slice::Slice;
use super::submission::Submission;

impl Slice {
    /// Counts, before any piece reports, the pieces this slice is about to be cut into, at
    /// offsets `cuts` (inside the slice): one more slice for its task each, or for its run.
    pub(super) fn count_cuts(&self, submission: &Submission, cuts: impl Iterator<Item = usize>) {
        let more = cuts.count();
        if more == 0 {
            return;
        }
        match self.run.as_deref() {
            Some(run) => run.add_slices(more),
            None => submission.batch.add_slices(self.task as usize, more as u32),
        }
    }

    /// Cuts the slice into up to `pieces` slices of about equal length, in order, each handed
    /// to `place` with its index; the task counts every piece before any can report. Cuts
    /// fall on multiples of `align` bytes from the slice's start (no two pieces share a
    /// cache line, say), so a slice shorter than `2 × align` stays whole. For a transport
    /// that moves one slice with several threads at once.
    pub fn cut(self, pieces: usize, align: usize, mut place: impl FnMut(usize, Slice)) {
        let align = align.max(1);
        let pieces = pieces.min(self.len / align).max(1);
        if pieces == 1 {
            return place(0, self);
        }
        // Aligned bounds: piece k starts at k × len / pieces rounded down to `align`.
        let len = self.len;
        let bound = move |k: usize| {
            if k == pieces {
                len
            } else {
                (len / pieces * k + len % pieces * k / pieces) / align * align
            }
        };
        let Some(submission) = self.submission.clone() else {
            return;
        };
        self.count_cuts(&submission, (1..pieces).map(bound));
        for k in 1..pieces {
            let (start, end) = (bound(k), bound(k + 1));
            place(
                k,
                self.piece(submission.clone(), start, end - start, self.rank),
            );
        }
        let mut first = self;
        first.len = bound(1);
        place(0, first);
    }
}
