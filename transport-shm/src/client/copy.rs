//! The copies themselves: one slice through a mapping of the peer's memfd, in pieces with its
//! task checked before each; and one slice between two registries of this process (another
//! engine of it, or this engine's own segment), its remote range pinned there first.

use tern_engine::{Opcode, Slice, TransferError};
use tern_memreg::MemoryRegistry;
use tern_memreg::shm::SharedMapping;

use super::Link;
use crate::pin::pin_range;

/// Most bytes one copy through a mapping moves before it checks that its task is still live.
pub(super) const COPY_PIECE: usize = 4 << 20;

impl Link {
    /// Copies `slice` through `mapping`, the peer's buffer that starts at `base`: the slice
    /// back when all of it moved (for the caller to count and complete), `None` when it was
    /// settled here (abandoned, cut off, or failed). A long slice goes in pieces, its task
    /// checked before each: a canceled or timed out transfer stops touching memory within
    /// one piece.
    pub(super) fn copy_through(
        &self,
        mapping: &SharedMapping,
        base: u64,
        slice: Slice,
    ) -> Option<Slice> {
        if !slice.is_live() {
            slice.abandon();
            return None;
        }
        let offset = (slice.remote_addr - base) as usize;
        let mut at = 0;
        let mut outcome = Ok(());
        while at < slice.len && outcome.is_ok() {
            if at > 0 && !slice.is_live_by_clock() {
                break;
            }
            let piece = (slice.len - at).min(COPY_PIECE);
            outcome = if slice.local().is_device() {
                // Device memory here, the peer's memfd mapped here: a GPU copy.
                mapping.copy_with_device(
                    offset + at,
                    slice.local(),
                    slice.local_addr + at,
                    piece,
                    slice.opcode() == Opcode::Write,
                    slice.device_order(),
                )
            } else {
                slice
                    .local()
                    .slice(slice.local_addr + at, piece)
                    .and_then(|local| match slice.opcode() {
                        Opcode::Write => mapping.write_from(offset + at, local),
                        Opcode::Read => mapping.read_into(offset + at, local),
                    })
            };
            at += piece;
        }
        match outcome {
            // Nothing more of it lands anywhere: the copy was this thread's.
            Ok(()) if at < slice.len => {
                slice.cut_off(false);
                None
            }
            Ok(()) => Some(slice),
            Err(e) => {
                slice.fail(TransferError::Protocol {
                    peer: self.peer.clone(),
                    message: format!("copy through the mapping: {e}"),
                });
                None
            }
        }
    }

    /// Slices to another engine of this process.
    pub(super) fn in_process(&self, registry: &MemoryRegistry, slices: Vec<Slice>) {
        for slice in slices {
            copy_in_registry(registry, slice, |moved| self.completed(moved));
        }
    }
}

/// Moves one slice between its local region and a remote range of `registry` (an engine of
/// this process, or this engine): the range is pinned there first ([`pin_range`], the check
/// the owner makes for a lease), then the bytes are copied between the two regions (by the
/// GPU when either is device memory), and the slice goes to `moved` (which completes it).
pub(crate) fn copy_in_registry(registry: &MemoryRegistry, slice: Slice, moved: impl FnOnce(Slice)) {
    let peer = slice.peer().name.clone();
    let Ok(pin) = pin_range(registry, slice.remote_addr, slice.len as u64) else {
        let error = TransferError::RemoteRejected {
            peer,
            addr: slice.remote_addr,
            len: slice.len,
        };
        slice.fail(error);
        return;
    };
    // `pin_range` took the address: it fits.
    let addr = slice.remote_addr as usize;
    let copied = if pin.is_device() || slice.local().is_device() {
        match slice.opcode() {
            Opcode::Write => slice.local().copy_to_with_device(
                slice.local_addr,
                &pin,
                addr,
                slice.len,
                slice.device_order(),
            ),
            Opcode::Read => pin.copy_to_with_device(
                addr,
                slice.local(),
                slice.local_addr,
                slice.len,
                slice.device_order(),
            ),
        }
        .map_err(|e| e.to_string())
    } else {
        pin.slice(addr, slice.len)
            .and_then(|remote| {
                let local = slice.local().slice(slice.local_addr, slice.len)?;
                match slice.opcode() {
                    Opcode::Write => remote.copy_from_region(local),
                    Opcode::Read => local.copy_from_region(remote),
                };
                Ok(())
            })
            .map_err(|e| e.to_string())
    };
    drop(pin);
    match copied {
        Ok(()) => moved(slice),
        Err(message) => slice.fail(TransferError::Protocol { peer, message }),
    }
}
