//! The transport's report: each link's state, the peers cut off for not confirming a
//! revocation, and the device memory declined to the next transport.

use tern_engine::{DeclinedStats, PeerState, PeerStats, TransportReport};

use crate::transport::Running;

impl Running {
    pub(crate) fn report(&self) -> TransportReport {
        let mut peers: Vec<PeerStats> = self
            .links
            .report()
            .into_iter()
            .map(|link| PeerStats {
                peer: link.peer,
                state: PeerState::of(usize::from(link.up), 0, link.error.is_some()),
                endpoints: link.mapped,
                bytes: link.bytes,
                slices: link.slices,
                last_error: link.error,
            })
            .collect();
        // Peers that did not confirm a revocation: the owner cut them off, yet they may still
        // map the buffer's pages; said here, not passed off as confirmed.
        peers.extend(
            self.owner
                .unconfirmed()
                .into_iter()
                .map(|unconfirmed| PeerStats {
                    peer: unconfirmed.peer,
                    state: PeerState::Failed,
                    endpoints: 0,
                    bytes: 0,
                    slices: 0,
                    last_error: Some(unconfirmed.message),
                }),
        );
        peers.sort_by(|a, b| a.peer.cmp(&b.peer));
        let declined = self
            .links
            .device_declines
            .get()
            .into_iter()
            .map(|(reason, slices, bytes)| DeclinedStats {
                reason: reason.into(),
                slices,
                bytes,
            })
            .collect();
        TransportReport {
            retries: 0,
            peers,
            declined,
            ..TransportReport::default()
        }
    }
}
