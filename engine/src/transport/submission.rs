//! [`Submission`]: what the slices of one submit call from one region to one peer share.

use std::sync::Arc;

use tern_memreg::{HoldsPin, RegionPin};

use super::routes::Routes;
use super::segment::PeerSegment;
use crate::batch::BatchInner;
use crate::engine::EngineInner;

/// What the slices of one submit call share when they come from one local region and go to
/// one peer: the pin on that region (one for all of them), the peer, the batch their
/// outcomes go to, and the transports that may carry them. Transports see it through
/// [`Slice`](super::Slice), and hand it to a device as the keeper of a slice's memory
/// ([`Slice::pinned`](super::Slice::pinned)).
#[derive(Debug)]
pub struct Submission {
    pub(super) local: RegionPin,
    pub(super) peer: Arc<PeerSegment>,
    pub(super) batch: Arc<BatchInner>,
    /// The installed transports that reach the peer, best first (indices into the
    /// engine's list).
    pub(super) routes: Routes,
}

impl HoldsPin for Submission {
    fn pin(&self) -> &RegionPin {
        &self.local
    }
}

impl Submission {
    pub(crate) fn new(
        local: RegionPin,
        peer: Arc<PeerSegment>,
        batch: Arc<BatchInner>,
        routes: Routes,
    ) -> Self {
        Self {
            local,
            peer,
            batch,
            routes,
        }
    }

    /// The engine, to offer a declined slice to the next transport: reached through the
    /// batch, which every submission holds anyway.
    pub(super) fn engine(&self) -> Option<Arc<EngineInner>> {
        self.batch.engine.upgrade()
    }

    /// Whether `[addr, addr + len)` lies in this submission's pinned region.
    pub(crate) fn covers(&self, addr: usize, len: usize) -> bool {
        let info = self.local.info();
        addr >= info.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= info.addr + info.len)
    }

    /// Whether requests to `peer` (the very descriptor they were checked against) from
    /// `[addr, addr + len)` may share this submission.
    pub(crate) fn serves(&self, peer: &Arc<PeerSegment>, addr: usize, len: usize) -> bool {
        Arc::ptr_eq(&self.peer, peer) && self.covers(addr, len)
    }

    pub(crate) fn peer(&self) -> &Arc<PeerSegment> {
        &self.peer
    }

    /// The pinned region's start and length.
    pub(crate) fn region(&self) -> (usize, usize) {
        let info = self.local.info();
        (info.addr, info.len)
    }

    /// The transport that carries this submission's slices first.
    pub(crate) fn first_route(&self) -> Option<usize> {
        self.routes.first()
    }
}
