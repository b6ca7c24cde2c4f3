//! Speed, apart from the checks: moving several slices at once where the checks already
//! passed for each. A run of a submit's slices in one mapping is copied under one hold of it
//! and counted once; a lease's slices go by one system call (or a few). Every slice is
//! checked and settled as it would be alone.

use std::iter::Peekable;
use std::vec;

use tern_engine::{Opcode, ReportTogether, Slice};
use tern_memreg::shm::PeerProcess;

use super::Link;
use super::mapping::Mapped;

impl Link {
    /// Copies `first` and the slices after it that fall in the same mapping (a submit's
    /// slices usually do) under one hold of the mapping, then counts them for the peer once
    /// and completes them. What the mapping cannot take because it died meanwhile goes to
    /// `back`.
    pub(super) fn copy_mapped(
        &self,
        mapped: &Mapped,
        first: Slice,
        rest: &mut Peekable<vec::IntoIter<Slice>>,
        back: &mut Vec<Slice>,
    ) {
        let inside = |s: &Slice| mapped.contains(s.remote_addr, s.len as u64);
        let run = std::iter::once(first).chain(std::iter::from_fn(|| rest.next_if(inside)));
        let live = mapped.live.read();
        let Some(mapping) = live.as_ref() else {
            back.extend(run);
            return;
        };
        let done: Vec<Slice> = run
            .filter_map(|slice| self.copy_through(mapping, mapped.addr, slice))
            .collect();
        drop(live);
        self.count(done.iter().map(|s| s.len as u64).sum(), done.len() as u64);
        // Every copy is over: the slices ended together, and one clock reading times them.
        let _together = ReportTogether::begin();
        done.into_iter().for_each(Slice::complete);
    }

    /// A lease's slices, `granted` one each: where the peer granted every range, the leading
    /// slices that go one way move with one system call, and those that moved whole are
    /// counted and completed here. The rest come back with their grants, for one by one
    /// (which learns each slice's outcome).
    pub(super) fn attach_at_once(
        &self,
        process: PeerProcess,
        mut slices: Vec<Slice>,
        granted: Vec<bool>,
    ) -> impl Iterator<Item = (Slice, bool)> {
        let whole = if granted.iter().all(|&g| g) {
            attach_many(process, &slices)
        } else {
            0
        };
        let rest = slices.split_off(whole);
        if whole > 0 {
            self.count(slices.iter().map(|s| s.len as u64).sum(), whole as u64);
            let _together = ReportTogether::begin();
            slices.into_iter().for_each(Slice::complete);
        }
        rest.into_iter().zip(granted.into_iter().skip(whole))
    }
}

/// Moves the leading slices that go the same way as the first with one system call (or a
/// few: `IOV_MAX` ranges per call): how many of them moved whole.
fn attach_many(process: PeerProcess, slices: &[Slice]) -> usize {
    let Some(opcode) = slices.first().map(Slice::opcode) else {
        return 0;
    };
    let run = slices.iter().take_while(|s| s.opcode() == opcode);
    let pairs: Result<Vec<_>, tern_memreg::MemoryError> = run
        .clone()
        .map(|s| Ok((s.remote_addr, s.local().slice(s.local_addr, s.len)?)))
        .collect();
    let moved = match (pairs, opcode) {
        (Ok(pairs), Opcode::Write) => process.write_many(&pairs),
        (Ok(pairs), Opcode::Read) => process.read_many(&pairs),
        (Err(_), _) => 0,
    };
    // The slices wholly inside what moved.
    run.scan(0usize, |covered, s| {
        *covered += s.len;
        Some(*covered)
    })
    .take_while(|&covered| covered <= moved)
    .count()
}
