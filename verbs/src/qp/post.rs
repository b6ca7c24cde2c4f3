//! Tracked posting: each request's guard goes into the queue's ledger, which keeps it until
//! the request is retired.

use rdma_sys as sys;

use super::chain::{
    Refused, link_and_post, post_recv_error, post_send_error, raw_sge, recv_wr, send_wr,
};
use super::{MemoryGuard, QueuePair, RecvWork, SendWork, Sge, WorkQueue};
use crate::error::VerbsError;
use crate::ledger::{Ledger, signalled};

impl<G: MemoryGuard, U: Send> QueuePair<G, U> {
    /// Posts `work` as one chain (one `ibv_post_send` call), signalling every
    /// [`QpCaps::signal_every`](super::QpCaps::signal_every)-th request and the last. What
    /// the device took is drained from the front of `work` and tracked until retired; on a
    /// refusal the rest stays in `work` and the error says how many were posted. When the
    /// library fails without naming the request it refused, all of `work` is tracked as
    /// possibly posted, the QP is moved to the error state so that each one's completion or
    /// flush retires it, and the error is [`VerbsError::PostUncertain`]. An SGE outside its
    /// guard's span is refused before anything is posted.
    pub fn post_send(&self, work: &mut Vec<SendWork<G, U>>) -> Result<(), VerbsError> {
        if work.is_empty() {
            return Ok(());
        }
        if work.iter().any(|w| !inside(&w.local, w.guard.span())) {
            return Err(VerbsError::InvalidRequest(
                "a work request's SGE lies outside the memory its guard keeps valid",
            ));
        }
        let mut queue = self.send.lock();
        let WorkQueue { ledger, wrs, sges } = &mut *queue;
        sges.clear();
        sges.extend(work.iter().map(|w| raw_sge(&w.local)));
        wrs.clear();
        for (i, w) in work.iter().enumerate() {
            let signaled = signalled(i, work.len(), self.signal_every);
            wrs.push(send_wr(ledger.upcoming_wr_id(i), w.op, signaled));
        }
        let posted = link_and_post(wrs, sges, |head, bad| {
            // SAFETY: the chain and its SGE array live until the call returns (the library
            // copies them into the send queue). Every SGE lies inside its guard's span
            // (checked above), and the guards go into the ledger, which keeps them until the
            // requests' completions have been retrieved (`ibv_post_send(3)`, NOTES) — every
            // request the device may hold, including all of them when the library does not
            // say which one it refused (see `track`). No request is inline, so the library
            // reads no SGE memory itself.
            unsafe { sys::ibv_post_send(self.qp.as_ptr(), head, bad) }
        });
        let outcome = track(ledger, work, posted, |w| (w.guard, w.user));
        drop(queue);
        outcome.map_err(|refused| self.post_error("ibv_post_send", refused, post_send_error))
    }

    /// Posts receive requests as [`post_send`](Self::post_send) does send requests; every
    /// receive completes with its own completion.
    pub fn post_recv(&self, work: &mut Vec<RecvWork<G, U>>) -> Result<(), VerbsError> {
        if work.is_empty() {
            return Ok(());
        }
        if work.iter().any(|w| !inside(&w.local, w.guard.span())) {
            return Err(VerbsError::InvalidRequest(
                "a receive request's SGE lies outside the memory its guard keeps valid",
            ));
        }
        let mut queue = self.recv.lock();
        let WorkQueue { ledger, wrs, sges } = &mut *queue;
        sges.clear();
        sges.extend(work.iter().map(|w| raw_sge(&w.local)));
        wrs.clear();
        wrs.extend((0..work.len()).map(|i| recv_wr(ledger.upcoming_wr_id(i))));
        let posted = link_and_post(wrs, sges, |head, bad| {
            // SAFETY: as in `post_send`: the chain lives for the call, every SGE lies inside
            // its guard's span, and the ledger keeps the guards until retirement.
            unsafe { sys::ibv_post_recv(self.qp.as_ptr(), head, bad) }
        });
        let outcome = track(ledger, work, posted, |w| (w.guard, w.user));
        drop(queue);
        outcome.map_err(|refused| self.post_error("ibv_post_recv", refused, post_recv_error))
    }
}

/// Whether `sge` lies inside `(start, len)`.
fn inside(sge: &Sge, (start, len): (usize, usize)) -> bool {
    let (Ok(addr), Some(end)) = (usize::try_from(sge.addr), start.checked_add(len)) else {
        return false;
    };
    addr >= start && addr.checked_add(sge.len as usize).is_some_and(|e| e <= end)
}

/// Moves the requests the device may now hold from the front of `work` into `ledger`, each
/// split by `entry` into what the ledger keeps. `ibv_post_send(3)` and `ibv_post_recv(3)`
/// only say that the library "stops processing WRs from this list at the first failure ...
/// and returns this failing WR through bad_wr"; what was posted when it does not (a
/// provider that fails without setting `bad_wr`) is undocumented. So then every request of
/// the chain counts as posted: its guard stays in the ledger until a completion or a flush
/// retires it, and the caller moves the QP to the error state so that one comes (a request
/// that was in fact never posted is never retired, and its guard is leaked with the QP,
/// which is safe). Returns `Ok(())` when everything was posted.
fn track<T, E>(
    ledger: &mut Ledger<E>,
    work: &mut Vec<T>,
    posted: Result<usize, Refused>,
    mut entry: impl FnMut(T) -> E,
) -> Result<(), Refused> {
    let taken = match posted {
        Ok(all) => all,
        Err(Refused::At { posted, .. }) => posted,
        Err(Refused::Unknown { .. }) => work.len(),
    }
    .min(work.len());
    for w in work.drain(..taken) {
        ledger.record(entry(w));
    }
    posted.map(|_| ())
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use super::*;

    /// What the ledger keeps is what keeps a request's memory alive: counted here through
    /// `Rc`s standing in for guards.
    /// A request's ledger entry in these tests: its stand-in guard and its index.
    type Entry = (Rc<()>, usize);

    fn guards(n: usize) -> (Vec<Rc<()>>, Vec<Entry>) {
        let guards: Vec<Rc<()>> = (0..n).map(|_| Rc::new(())).collect();
        let work = guards.iter().cloned().zip(0..).collect();
        (guards, work)
    }

    fn alive(guards: &[Rc<()>]) -> usize {
        guards.iter().filter(|g| Rc::strong_count(g) > 1).count()
    }

    #[test]
    fn every_guard_stays_until_retired_when_the_library_does_not_say_what_it_took() {
        let (guards, mut work) = guards(5);
        let mut ledger: Ledger<Entry> = Ledger::new();
        let first = ledger.upcoming_wr_id(0);
        let unknown = Err(Refused::Unknown {
            chain: 5,
            errno: 22,
        });
        assert_eq!(
            track(&mut ledger, &mut work, unknown, |w| w),
            unknown.map(|_| ())
        );
        assert!(work.is_empty(), "nothing is handed back to post again");
        assert_eq!(ledger.len(), 5);
        assert_eq!(alive(&guards), 5, "every guard is kept");
        // The flush of the third request (the QP went to the error state) retires it and
        // the two before it; the rest stay until theirs.
        let mut retired = Vec::new();
        let third = first + 2;
        ledger.retire(third, Some("flushed"), |(guard, user), outcome| {
            drop(guard);
            retired.push((user, outcome));
        });
        assert_eq!(retired.len(), 3);
        assert_eq!(alive(&guards), 2);
    }

    #[test]
    fn a_named_refusal_keeps_the_guards_of_the_posted_ones_only() {
        let (guards, mut work) = guards(5);
        let mut ledger: Ledger<Entry> = Ledger::new();
        let at = Err(Refused::At {
            posted: 2,
            errno: 12,
        });
        assert!(track(&mut ledger, &mut work, at, |w| w).is_err());
        assert_eq!(ledger.len(), 2);
        let left: Vec<usize> = work.iter().map(|(_, i)| *i).collect();
        assert_eq!(
            left,
            [2, 3, 4],
            "the refused one and those after it come back"
        );
        drop(work);
        assert_eq!(alive(&guards), 2);
        let (_guards, mut work) = self::guards(3);
        assert_eq!(track(&mut ledger, &mut work, Ok(3), |w| w), Ok(()));
        assert!(work.is_empty());
        assert_eq!(ledger.len(), 5);
    }
}
