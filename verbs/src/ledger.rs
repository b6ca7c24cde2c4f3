//! The in-flight bookkeeping of one work queue, without I/O: which work requests are on the
//! device, what each carries, and which completion retires them.
//!
//! It rests on three documented guarantees:
//!
//! - `ibv_post_send(3)`, NOTES: the memory a work request uses may be reused only once the
//!   request has executed and *a work completion has been retrieved from the CQ*. So what
//!   keeps a request's memory valid (its guard) is dropped only on retirement here.
//! - InfiniBand Architecture Specification, Vol. 1, ch. 10.8 (work request processing): the
//!   work requests of one queue of a reliable-connected QP complete in the order they were
//!   posted, and the completion of a request implies the completion of every request posted
//!   before it on that queue. So a completion retires its own request and every older one —
//!   which is what makes unsignalled requests safe to retire.
//! - The same chapter, QP state "Error": every request outstanding when a QP enters the error
//!   state completes with a flush error (each one produces a completion, signalled or not).
//!   So moving a QP to the error state and polling its CQ retires everything posted.
//!
//! A request posted and never retired keeps its guard forever: [`Ledger::abandon`] hands the
//! caller's data back (to fail the task) but leaks the guards, since nothing then says the
//! device is done with the memory.
//!
//! Work request IDs are the ledger's own: the top bit marks a tracked request, the next 31
//! bits name the ledger (one per queue, from a process-wide counter), the low 32 bits count
//! requests. A completion that names another ledger, or a request no longer in flight, is
//! ignored, so a stray or stale completion cannot retire anything.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

/// Set in every work request ID a ledger hands out.
pub const TRACKED_BIT: u64 = 1 << 63;

static NEXT_LEDGER: AtomicU32 = AtomicU32::new(1);
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
static LEAKED: AtomicUsize = AtomicUsize::new(0);

/// Tracked work requests posted in this process whose completion has not been retrieved
/// yet: what a test counts to see that nothing is in flight once a transport has stopped.
pub fn tracked_in_flight() -> usize {
    IN_FLIGHT.load(Ordering::Relaxed)
}

/// Guards this process has given up on (work requests abandoned or still posted when their
/// QP was destroyed): their memory stays pinned for good.
pub fn leaked_guards() -> usize {
    LEAKED.load(Ordering::Relaxed)
}

/// Whether request `index` of a chain of `len` posted together is signalled: every
/// `every`-th one and the last, so that every chain ends with a completion that retires all of
/// it, and a long chain frees its queue slots before it ends.
pub fn signalled(index: usize, len: usize, every: usize) -> bool {
    index + 1 == len || (index + 1).is_multiple_of(every.max(1))
}

#[derive(Debug)]
struct Entry<T> {
    seq: u32,
    item: T,
}

/// How a retired request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome<E> {
    /// It ran to completion (reported, or implied by a later request's completion).
    Done,
    /// Its own completion carried this error (a flush included).
    Failed(E),
}

/// The requests of one work queue that are on the device, oldest first.
#[derive(Debug)]
pub struct Ledger<T> {
    id: u32,
    next_seq: u32,
    in_flight: VecDeque<Entry<T>>,
}

impl<T> Default for Ledger<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Ledger<T> {
    /// An empty ledger with a process-unique ID.
    pub fn new() -> Self {
        let id = NEXT_LEDGER.fetch_add(1, Ordering::Relaxed) & 0x7FFF_FFFF;
        Self {
            id,
            next_seq: 0,
            in_flight: VecDeque::new(),
        }
    }

    fn wr_id(&self, seq: u32) -> u64 {
        TRACKED_BIT | u64::from(self.id) << 32 | u64::from(seq)
    }

    /// The work request ID the `n`-th next request (0-based) will carry once recorded.
    pub fn upcoming_wr_id(&self, n: usize) -> u64 {
        self.wr_id(self.next_seq.wrapping_add(n as u32))
    }

    /// Records that the next request is on the device, carrying `item`; returns its ID
    /// (the one [`upcoming_wr_id`](Self::upcoming_wr_id)`(0)` gave).
    pub fn record(&mut self, item: T) -> u64 {
        let seq = self.next_seq;
        self.next_seq = seq.wrapping_add(1);
        self.in_flight.push_back(Entry { seq, item });
        IN_FLIGHT.fetch_add(1, Ordering::Relaxed);
        self.wr_id(seq)
    }

    /// Requests in flight.
    pub fn len(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether nothing is in flight.
    pub fn is_empty(&self) -> bool {
        self.in_flight.is_empty()
    }

    /// Whether any request in flight carries an item for which `test` holds.
    pub fn any(&self, mut test: impl FnMut(&T) -> bool) -> bool {
        self.in_flight.iter().any(|entry| test(&entry.item))
    }

    /// The sequence number of a completion's request if it names this ledger and a request
    /// still in flight.
    fn in_window(&self, wr_id: u64) -> Option<u32> {
        if wr_id & TRACKED_BIT == 0 || (wr_id >> 32) as u32 & 0x7FFF_FFFF != self.id {
            return None;
        }
        let seq = wr_id as u32;
        let oldest = self.in_flight.front()?.seq;
        // In flight are `oldest .. next_seq` (wrapping); anything else is stale.
        (seq.wrapping_sub(oldest) < self.next_seq.wrapping_sub(oldest)).then_some(seq)
    }

    /// Retires the request a completion names and every older one, handing each item to
    /// `retired` in posting order: older ones ran ([`Outcome::Done`]); the named one ends
    /// with `error` if there is one. Returns how many were retired. A completion for another
    /// ledger or for a request not in flight retires nothing.
    pub fn retire<E>(
        &mut self,
        wr_id: u64,
        error: Option<E>,
        mut retired: impl FnMut(T, Outcome<E>),
    ) -> usize {
        let Some(seq) = self.in_window(wr_id) else {
            return 0;
        };
        let mut error = error;
        let mut count = 0;
        while let Some(front) = self.in_flight.pop_front() {
            count += 1;
            if front.seq == seq {
                retired(
                    front.item,
                    error.take().map_or(Outcome::Done, Outcome::Failed),
                );
                break;
            }
            retired(front.item, Outcome::Done);
        }
        IN_FLIGHT.fetch_sub(count, Ordering::Relaxed);
        count
    }

    /// Gives up on everything in flight: `keep` splits each item into what must live on (its
    /// guard, leaked here) and what goes back to the caller.
    pub fn abandon<G, U>(&mut self, mut keep: impl FnMut(T) -> (G, U)) -> Vec<U> {
        let abandoned: Vec<U> = self
            .in_flight
            .drain(..)
            .map(|entry| {
                let (guard, user) = keep(entry.item);
                std::mem::forget(guard);
                user
            })
            .collect();
        IN_FLIGHT.fetch_sub(abandoned.len(), Ordering::Relaxed);
        LEAKED.fetch_add(abandoned.len(), Ordering::Relaxed);
        abandoned
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::rc::Rc;

    /// Records `n` requests carrying their index; returns their IDs.
    fn post(ledger: &mut Ledger<usize>, first: usize, n: usize) -> Vec<u64> {
        (first..first + n).map(|i| ledger.record(i)).collect()
    }

    fn retire(
        ledger: &mut Ledger<usize>,
        wr_id: u64,
        error: Option<&'static str>,
    ) -> Vec<(usize, Outcome<&'static str>)> {
        let mut out = Vec::new();
        let count = ledger.retire(wr_id, error, |item, outcome| out.push((item, outcome)));
        assert_eq!(count, out.len());
        out
    }

    #[test]
    fn ids_are_announced_before_recording_and_carry_the_tracked_bit() {
        let mut ledger = Ledger::new();
        let announced = [ledger.upcoming_wr_id(0), ledger.upcoming_wr_id(1)];
        let ids = post(&mut ledger, 0, 2);
        assert_eq!(ids, announced);
        assert!(ids.iter().all(|id| id & TRACKED_BIT != 0));
        assert_ne!(
            Ledger::<()>::new().upcoming_wr_id(0),
            ids[0],
            "ledgers have their own IDs"
        );
    }

    #[test]
    fn a_chain_signals_every_32nd_request_and_its_last() {
        let signalled_in = |len: usize, every: usize| -> Vec<usize> {
            (0..len).filter(|&i| signalled(i, len, every)).collect()
        };
        assert_eq!(signalled_in(70, 32), vec![31, 63, 69]);
        assert_eq!(signalled_in(64, 32), vec![31, 63]);
        assert_eq!(signalled_in(1, 32), vec![0]);
        assert_eq!(signalled_in(3, 1), vec![0, 1, 2]);
        assert_eq!(signalled_in(3, 0), vec![0, 1, 2], "0 means every one");
    }

    #[test]
    fn one_signalled_completion_every_32_retires_the_unsignalled_ones_before_it() {
        let mut ledger = Ledger::new();
        let ids = post(&mut ledger, 0, 70);
        // A chain of 70 signalled at 31, 63 and its last (69).
        let first = retire(&mut ledger, ids[31], None);
        assert_eq!(first.len(), 32);
        assert!(
            first
                .iter()
                .enumerate()
                .all(|(i, (item, o))| *item == i && *o == Outcome::Done)
        );
        assert_eq!(ledger.len(), 38);
        assert_eq!(retire(&mut ledger, ids[63], None).len(), 32);
        let last = retire(&mut ledger, ids[69], None);
        assert_eq!(
            last.iter().map(|r| r.0).collect::<Vec<_>>(),
            (64..70).collect::<Vec<_>>()
        );
        assert!(ledger.is_empty());
    }

    #[test]
    fn an_error_fails_its_own_request_and_flushes_fail_the_rest_one_by_one() {
        let mut ledger = Ledger::new();
        let ids = post(&mut ledger, 0, 5);
        // Request 2 fails: 0 and 1 ran before it.
        let failed = retire(&mut ledger, ids[2], Some("remote access"));
        assert_eq!(
            failed,
            vec![
                (0, Outcome::Done),
                (1, Outcome::Done),
                (2, Outcome::Failed("remote access"))
            ]
        );
        // The QP is now in the error state: 3 and 4 come back flushed, each on its own.
        assert_eq!(
            retire(&mut ledger, ids[3], Some("flushed")),
            vec![(3, Outcome::Failed("flushed"))]
        );
        assert_eq!(
            retire(&mut ledger, ids[4], Some("flushed")),
            vec![(4, Outcome::Failed("flushed"))]
        );
        assert!(ledger.is_empty());
    }

    #[test]
    fn a_partial_post_records_only_what_the_device_took() {
        let mut ledger = Ledger::new();
        // Five were prepared with the IDs announced; the device took three.
        let announced: Vec<u64> = (0..5).map(|n| ledger.upcoming_wr_id(n)).collect();
        let posted = post(&mut ledger, 0, 3);
        assert_eq!(posted, announced[..3]);
        // A completion naming a request that was never posted retires nothing.
        assert!(retire(&mut ledger, announced[4], None).is_empty());
        assert_eq!(ledger.len(), 3);
        // The next post reuses the IDs of the refused ones, so their old completions cannot
        // exist; the flush after the failed post retires the posted three.
        assert_eq!(retire(&mut ledger, posted[2], Some("flushed")).len(), 3);
    }

    #[test]
    fn stale_foreign_and_untracked_completions_retire_nothing() {
        let mut ledger = Ledger::new();
        let ids = post(&mut ledger, 0, 4);
        assert_eq!(retire(&mut ledger, ids[1], None).len(), 2);
        // Replayed: already retired.
        assert!(retire(&mut ledger, ids[1], None).is_empty());
        assert!(retire(&mut ledger, ids[0], None).is_empty());
        // Another ledger's ID, an untracked ID, a request not yet posted.
        let mut other = Ledger::new();
        let foreign = post(&mut other, 0, 4);
        assert!(retire(&mut ledger, foreign[3], None).is_empty());
        assert!(retire(&mut ledger, ids[3] & !TRACKED_BIT, None).is_empty());
        let unposted = ledger.upcoming_wr_id(0);
        assert!(retire(&mut ledger, unposted, None).is_empty());
        assert_eq!(ledger.len(), 2);
    }

    #[test]
    fn sequence_numbers_wrap_without_losing_order() {
        let mut ledger: Ledger<usize> = Ledger::new();
        ledger.next_seq = u32::MAX - 1;
        let ids = post(&mut ledger, 0, 4);
        assert_eq!(ids[2] as u32, 0, "wrapped");
        assert!(retire(&mut ledger, ids[3].wrapping_add(1), None).is_empty());
        assert_eq!(retire(&mut ledger, ids[2], None).len(), 3);
        assert_eq!(retire(&mut ledger, ids[3], None).len(), 1);
    }

    #[test]
    fn abandoning_hands_back_the_callers_part_and_keeps_the_guards_alive() {
        let guard = Rc::new(());
        let mut ledger = Ledger::new();
        for task in 0..3 {
            ledger.record((guard.clone(), task));
        }
        let leaked_before = leaked_guards();
        let tasks = ledger.abandon(|item| item);
        assert_eq!(tasks, vec![0, 1, 2]);
        assert!(ledger.is_empty());
        // The three guards were never dropped: the memory they keep stays valid for good.
        assert_eq!(Rc::strong_count(&guard), 4);
        assert!(leaked_guards() >= leaked_before + 3);
    }
}
