//! Speed, apart from the checks: how the slices of a submit are shared among the hands that
//! copy them (the copy threads, and the thread that waits for the batch). Nothing here
//! decides whether a slice may move or how: every job goes through the same path
//! (`route::run`: the peer identified, its ranges admitted, the bytes copied), whichever hand
//! takes it.

mod hands;
mod spread;

use tern_engine::{Opcode, Slice};

use crate::client::Links;
use spread::{Extent, STRIPE_PIECE, Shape, Spread, spread};

pub(crate) use hands::Hands;

impl Hands {
    /// Shares out one submit's slices among the hands as [`spread()`] decides from its shape:
    /// one job, a run of whole slices per hand, or a piece of every slice per hand.
    pub(crate) fn share_out(&self, slices: Vec<Slice>, links: &Links) {
        let hands = self.count();
        let mapped = || {
            slices
                .first()
                .is_some_and(|first| links.maps(first.peer(), first.remote_addr, first.len as u64))
        };
        let shape = Shape::of(slices.iter().map(|s| Extent {
            writes: s.opcode() == Opcode::Write,
            local: s.local_addr as u64,
            remote: s.remote_addr,
            len: s.len as u64,
        }));
        match spread(&shape, hands, mapped) {
            Spread::Whole => self.send(slices),
            Spread::Runs(parts) => {
                let per = slices.len().div_ceil(parts);
                let mut slices = slices;
                while slices.len() > per {
                    let rest = slices.split_off(per);
                    self.send(std::mem::replace(&mut slices, rest));
                }
                self.send(slices);
            }
            Spread::Stripes => {
                let mut parts: Vec<Vec<Slice>> = (0..hands)
                    .map(|_| Vec::with_capacity(slices.len()))
                    .collect();
                for (i, slice) in slices.into_iter().enumerate() {
                    // Piece k of every slice to hand k (the same bytes always to the same
                    // hand); a slice too short to cut goes whole, to the hands in turn.
                    if slice.len < 2 * STRIPE_PIECE {
                        parts[i % hands].push(slice);
                        continue;
                    }
                    slice.cut(hands, STRIPE_PIECE, |k, piece| parts[k].push(piece));
                }
                for part in parts.into_iter().filter(|p| !p.is_empty()) {
                    self.send(part);
                }
            }
        }
    }
}
