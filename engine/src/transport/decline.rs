//! Declining a slice: a transport that cannot carry it hands it to the next transport that
//! reaches the peer.

use super::slice::Slice;
use crate::error::TransferError;

impl Slice {
    /// This transport cannot carry the slice (memory it cannot reach, a peer it cannot
    /// connect to): the engine offers it to the next transport that reaches the peer (cut
    /// again to that transport's slice size if it is larger), and fails it with `why` if
    /// there is none. The slice's task goes on; the slices already moving are not touched.
    pub fn decline(self, why: &str) {
        let error = TransferError::Declined {
            segment: self.submission().peer.name.clone(),
            reason: why.to_owned(),
        };
        self.decline_with(error);
    }

    /// As [`decline`](Slice::decline), for a transport that tried and failed (no path to the
    /// peer's NICs, say): with no transport left to offer it to, the slice fails with `error`
    /// itself.
    pub fn decline_with(mut self, error: TransferError) {
        let submission = self.submission();
        let next = self.rank as usize + 1;
        let (Some(transport), Some(engine)) = (submission.routes.get(next), submission.engine())
        else {
            return self.fail(error);
        };
        tracing::debug!(
            "slice of {} declined ({error}); offered to {}",
            submission.peer.name,
            engine.transports[transport].protocol()
        );
        let next_transport = &engine.transports[transport];
        let Some(size) = engine.slice_sizes.get(transport) else {
            return self.fail(error);
        };
        let cuts = size.cuts(self.len);
        if cuts.count() <= 1 {
            self.rank = next as u8;
            return next_transport.submit(&mut vec![self]);
        }
        // Too large for the next transport: cut again to its slice size. The tasks count the
        // extra slices before any of them can report (this one has not).
        let Some(submission) = self.submission.take() else {
            return;
        };
        self.count_cuts(&submission, cuts.pieces().skip(1).map(|(offset, _)| offset));
        let mut slices = cuts
            .pieces()
            .map(|(offset, len)| self.piece(submission.clone(), offset, len, next as u8))
            .collect();
        drop(submission);
        next_transport.submit(&mut slices);
    }
}
