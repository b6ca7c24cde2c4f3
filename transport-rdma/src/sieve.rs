//! A SIEVE cache: the eviction policy of Mooncake's endpoint store, used here to bound the
//! endpoints (queue pairs) each NIC keeps open.
//!
//! A lookup sets an entry's visited bit; new entries go to the head; to make room, a hand
//! sweeps from the oldest entry towards newer ones, clearing visited bits, and evicts the first
//! entry it finds unvisited. Every operation is O(1) amortized: the entries live in a slab
//! (`Vec`) linked newest-to-oldest by index, with a `HashMap` from key to slot.
//!
//! This module must not know what it stores: it does not tear down endpoints (the caller gets
//! evicted entries back and decides), does no I/O and takes no locks.

use std::collections::HashMap;
use std::hash::Hash;

/// One cache entry in the slab, linked to its neighbours by slot index.
#[derive(Debug)]
struct Node<K, V> {
    key: K,
    value: V,
    visited: bool,
    /// The next entry towards the head (inserted later); `None` at the head.
    newer: Option<usize>,
    /// The next entry towards the tail (inserted earlier); `None` at the tail.
    older: Option<usize>,
}

/// A fixed-capacity map that evicts with SIEVE.
#[derive(Debug)]
pub struct Sieve<K, V> {
    capacity: usize,
    /// Dense storage; removal swaps the last slot into the hole so no free list is needed.
    nodes: Vec<Node<K, V>>,
    slot_of: HashMap<K, usize>,
    /// Newest entry.
    head: Option<usize>,
    /// Oldest entry.
    tail: Option<usize>,
    /// Where the next eviction sweep starts; `None` means at the tail.
    hand: Option<usize>,
}

/// What [`Sieve::insert`] displaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inserted<K, V> {
    /// The value previously stored under the same key (the entry kept its place and is now
    /// marked visited).
    pub replaced: Option<V>,
    /// The entry evicted to stay within capacity.
    pub evicted: Option<(K, V)>,
}

/// Preallocating the full capacity up front would reserve memory for endpoints that may never
/// exist (Mooncake's default capacity is 65 536), so growth beyond this is left to `Vec`.
const MAX_PREALLOCATED: usize = 1024;

impl<K: Eq + Hash + Clone, V> Sieve<K, V> {
    /// An empty cache holding at most `capacity` entries (0 is treated as 1).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        let preallocated = capacity.min(MAX_PREALLOCATED);
        Self {
            capacity,
            nodes: Vec::with_capacity(preallocated),
            slot_of: HashMap::with_capacity(preallocated),
            head: None,
            tail: None,
            hand: None,
        }
    }

    /// The most entries the cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// How many entries the cache holds now.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the cache holds no entries.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The value under `key`, marking the entry visited so the next sweep spares it.
    pub fn get(&mut self, key: &K) -> Option<&V> {
        let slot = *self.slot_of.get(key)?;
        let node = self.nodes.get_mut(slot)?;
        node.visited = true;
        Some(&node.value)
    }

    /// The value under `key`, without marking the entry visited.
    pub fn peek(&self, key: &K) -> Option<&V> {
        let slot = *self.slot_of.get(key)?;
        self.nodes.get(slot).map(|node| &node.value)
    }

    /// Whether an entry is stored under `key` (does not mark it visited).
    pub fn contains(&self, key: &K) -> bool {
        self.slot_of.contains_key(key)
    }

    /// Inserts `value` under `key`.
    ///
    /// An existing entry under the same key keeps its place, is marked visited and has its
    /// value replaced; the old value is returned in [`Inserted::replaced`]. A new key goes to
    /// the head, first evicting one entry if the cache is full; that entry is returned in
    /// [`Inserted::evicted`].
    pub fn insert(&mut self, key: K, value: V) -> Inserted<K, V> {
        if let Some(&slot) = self.slot_of.get(&key)
            && let Some(node) = self.nodes.get_mut(slot)
        {
            node.visited = true;
            let old = std::mem::replace(&mut node.value, value);
            return Inserted {
                replaced: Some(old),
                evicted: None,
            };
        }
        let evicted = if self.nodes.len() >= self.capacity {
            self.evict()
        } else {
            None
        };
        self.push_head(key, value);
        Inserted {
            replaced: None,
            evicted,
        }
    }

    /// Removes the entry under `key` and returns its value.
    pub fn remove(&mut self, key: &K) -> Option<V> {
        let slot = *self.slot_of.get(key)?;
        self.take_slot(slot).map(|(_, value)| value)
    }

    /// Removes every entry, returning them newest first.
    pub fn drain(&mut self) -> Vec<(K, V)> {
        let order: Vec<usize> = self.slots_newest_first().collect();
        let mut taken: Vec<Option<(K, V)>> = std::mem::take(&mut self.nodes)
            .into_iter()
            .map(|node| Some((node.key, node.value)))
            .collect();
        self.slot_of.clear();
        self.head = None;
        self.tail = None;
        self.hand = None;
        order
            .into_iter()
            .filter_map(|slot| taken.get_mut(slot).and_then(Option::take))
            .collect()
    }

    /// Every entry, newest first. Does not mark anything visited.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.slots_newest_first()
            .filter_map(|slot| self.nodes.get(slot))
            .map(|node| (&node.key, &node.value))
    }

    fn slots_newest_first(&self) -> impl Iterator<Item = usize> + '_ {
        // Bounded by len() so that a broken link could only shorten the walk, never loop.
        std::iter::successors(self.head, |&slot| self.nodes.get(slot)?.older).take(self.len())
    }

    fn push_head(&mut self, key: K, value: V) {
        let slot = self.nodes.len();
        self.nodes.push(Node {
            key: key.clone(),
            value,
            visited: false,
            newer: None,
            older: self.head,
        });
        if let Some(old_head) = self.head.and_then(|h| self.nodes.get_mut(h)) {
            old_head.newer = Some(slot);
        }
        self.head = Some(slot);
        if self.tail.is_none() {
            self.tail = Some(slot);
        }
        self.slot_of.insert(key, slot);
    }

    /// The SIEVE sweep: starting at the hand (or the tail), clear visited bits moving towards
    /// the head, wrapping to the tail, and evict the first unvisited entry. At most one full
    /// lap clears every bit, so the second lap always finds a victim.
    fn evict(&mut self) -> Option<(K, V)> {
        let mut slot = self.hand.or(self.tail)?;
        for _ in 0..=2 * self.nodes.len() {
            let node = self.nodes.get_mut(slot)?;
            if !node.visited {
                // Removing the entry under the hand moves the hand to its newer neighbour.
                self.hand = Some(slot);
                return self.take_slot(slot);
            }
            node.visited = false;
            slot = node.newer.or(self.tail)?;
        }
        None
    }

    /// Unlinks and removes the entry in `slot`, keeping the slab dense.
    fn take_slot(&mut self, slot: usize) -> Option<(K, V)> {
        let (newer, older) = {
            let node = self.nodes.get(slot)?;
            (node.newer, node.older)
        };
        // The sweep continues where it would have gone next: towards the head.
        if self.hand == Some(slot) {
            self.hand = newer;
        }
        match newer.and_then(|s| self.nodes.get_mut(s)) {
            Some(node) => node.older = older,
            None => self.head = older,
        }
        match older.and_then(|s| self.nodes.get_mut(s)) {
            Some(node) => node.newer = newer,
            None => self.tail = newer,
        }

        let last = self.nodes.len().checked_sub(1)?;
        let removed = self.nodes.swap_remove(slot);
        self.slot_of.remove(&removed.key);
        if slot != last {
            self.relocated(last, slot);
        }
        Some((removed.key, removed.value))
    }

    /// Points whatever referred to the entry at `from` (now moved to `to` by `swap_remove`)
    /// at its new slot.
    fn relocated(&mut self, from: usize, to: usize) {
        let Some(moved) = self.nodes.get(to) else {
            return;
        };
        let (newer, older) = (moved.newer, moved.older);
        if let Some(index) = self.slot_of.get_mut(&moved.key) {
            *index = to;
        }
        if let Some(n) = newer.and_then(|s| self.nodes.get_mut(s)) {
            n.older = Some(to);
        }
        if let Some(n) = older.and_then(|s| self.nodes.get_mut(s)) {
            n.newer = Some(to);
        }
        for end in [&mut self.head, &mut self.tail, &mut self.hand] {
            if *end == Some(from) {
                *end = Some(to);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny deterministic PRNG so the random sequences are reproducible without a crate.
    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, bound: u64) -> u64 {
            self.next() % bound
        }
    }

    /// SIEVE written the obvious way: a Vec ordered oldest to newest, the hand an index.
    struct ReferenceSieve {
        capacity: usize,
        /// (key, value, visited), oldest first.
        entries: Vec<(u32, u32, bool)>,
        hand: Option<usize>,
    }

    impl ReferenceSieve {
        fn new(capacity: usize) -> Self {
            Self {
                capacity: capacity.max(1),
                entries: Vec::new(),
                hand: None,
            }
        }

        fn position(&self, key: u32) -> Option<usize> {
            self.entries.iter().position(|e| e.0 == key)
        }

        fn get(&mut self, key: u32) -> Option<u32> {
            let i = self.position(key)?;
            self.entries[i].2 = true;
            Some(self.entries[i].1)
        }

        fn remove_at(&mut self, i: usize) -> (u32, u32) {
            let (k, v, _) = self.entries.remove(i);
            // Entries after `i` shift down by one, so the entry that was newer is now at `i`.
            self.hand = match self.hand {
                Some(h) if h == i => (i < self.entries.len()).then_some(i),
                Some(h) if h > i => Some(h - 1),
                other => other,
            };
            (k, v)
        }

        fn remove(&mut self, key: u32) -> Option<u32> {
            let i = self.position(key)?;
            Some(self.remove_at(i).1)
        }

        fn insert(&mut self, key: u32, value: u32) -> (Option<u32>, Option<(u32, u32)>) {
            if let Some(i) = self.position(key) {
                let old = self.entries[i].1;
                self.entries[i].1 = value;
                self.entries[i].2 = true;
                return (Some(old), None);
            }
            let mut evicted = None;
            if self.entries.len() >= self.capacity {
                let mut i = self.hand.unwrap_or(0);
                while self.entries[i].2 {
                    self.entries[i].2 = false;
                    i = (i + 1) % self.entries.len();
                }
                self.hand = Some(i);
                evicted = Some(self.remove_at(i));
            }
            self.entries.push((key, value, false));
            (None, evicted)
        }

        fn newest_first(&self) -> Vec<(u32, u32)> {
            self.entries.iter().rev().map(|e| (e.0, e.1)).collect()
        }
    }

    fn contents<K: Eq + Hash + Clone + Copy, V: Copy>(cache: &Sieve<K, V>) -> Vec<(K, V)> {
        cache.iter().map(|(k, v)| (*k, *v)).collect()
    }

    /// Checks the links, the index and the hand against each other.
    fn assert_consistent<K: Eq + Hash + Clone + std::fmt::Debug, V>(cache: &Sieve<K, V>) {
        assert!(cache.len() <= cache.capacity());
        assert_eq!(cache.slot_of.len(), cache.nodes.len());
        let mut walked = 0;
        let mut previous: Option<usize> = None;
        let mut slot = cache.head;
        while let Some(s) = slot {
            let node = &cache.nodes[s];
            assert_eq!(node.newer, previous, "newer link of slot {s}");
            assert_eq!(cache.slot_of.get(&node.key), Some(&s));
            walked += 1;
            assert!(walked <= cache.nodes.len(), "cycle in the list");
            previous = Some(s);
            slot = node.older;
        }
        assert_eq!(walked, cache.nodes.len());
        assert_eq!(cache.tail, previous);
        if let Some(hand) = cache.hand {
            assert!(hand < cache.nodes.len());
        }
    }

    #[test]
    fn matches_the_reference_model_on_random_sequences() {
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        for round in 0..300 {
            let capacity = 1 + rng.below(12) as usize;
            let key_space = 1 + rng.below(3 * capacity as u64 + 2) as u32;
            let mut cache = Sieve::new(capacity);
            let mut model = ReferenceSieve::new(capacity);
            for step in 0..400 {
                let key = rng.below(u64::from(key_space)) as u32;
                let value = rng.next() as u32;
                let what = format!("round {round} step {step} key {key}");
                match rng.below(10) {
                    0..=3 => {
                        let got = cache.insert(key, value);
                        let (replaced, evicted) = model.insert(key, value);
                        assert_eq!(got.replaced, replaced, "{what}");
                        assert_eq!(got.evicted, evicted, "{what}");
                    }
                    4..=6 => assert_eq!(cache.get(&key).copied(), model.get(key), "{what}"),
                    7 => assert_eq!(cache.remove(&key), model.remove(key), "{what}"),
                    8 => assert_eq!(
                        cache.peek(&key).copied(),
                        model.position(key).map(|i| model.entries[i].1),
                        "{what}"
                    ),
                    _ => assert_eq!(cache.contains(&key), model.position(key).is_some()),
                }
                assert_eq!(contents(&cache), model.newest_first(), "{what}");
                assert_consistent(&cache);
            }
        }
    }

    #[test]
    fn capacity_zero_is_one() {
        let mut cache = Sieve::new(0);
        assert_eq!(cache.capacity(), 1);
        assert!(cache.insert("a", 1).evicted.is_none());
        assert_eq!(cache.insert("b", 2).evicted, Some(("a", 1)));
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn ten_thousand_inserts_leave_capacity_entries() {
        let mut cache = Sieve::new(8);
        let mut evictions = 0;
        for i in 0..10_000u32 {
            if cache.insert(i, i).evicted.is_some() {
                evictions += 1;
            }
            assert!(cache.len() <= 8);
        }
        assert_eq!(cache.len(), 8);
        assert_eq!(evictions, 10_000 - 8);
        // Nothing was visited, so SIEVE degenerates to FIFO: the newest eight remain.
        let keys: Vec<u32> = cache.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, (9_992..10_000).rev().collect::<Vec<_>>());
        assert_consistent(&cache);
    }

    #[test]
    fn hot_key_survives_a_scan_of_cold_keys() {
        let mut cache = Sieve::new(4);
        cache.insert(0u32, "hot");
        for cold in 1..1_000u32 {
            assert_eq!(
                cache.get(&0),
                Some(&"hot"),
                "hot key lost before cold key {cold}"
            );
            let inserted = cache.insert(cold, "cold");
            assert_ne!(inserted.evicted.map(|(k, _)| k), Some(0));
        }
        assert!(cache.contains(&0));
    }

    #[test]
    fn unvisited_hot_key_is_evicted_like_any_other() {
        // The counterpart of the test above: without lookups the oldest entry goes first, so
        // that test's survival is due to the visited bit.
        let mut cache = Sieve::new(4);
        cache.insert(0u32, ());
        for cold in 1..=4u32 {
            cache.insert(cold, ());
        }
        assert!(!cache.contains(&0));
    }

    #[test]
    fn peek_does_not_mark_visited_but_get_does() {
        let mut cache = Sieve::new(2);
        cache.insert("a", 1);
        cache.insert("b", 2);
        assert_eq!(cache.peek(&"a"), Some(&1));
        assert_eq!(cache.insert("c", 3).evicted, Some(("a", 1)));

        let mut cache = Sieve::new(2);
        cache.insert("a", 1);
        cache.insert("b", 2);
        assert_eq!(cache.get(&"a"), Some(&1));
        assert_eq!(cache.insert("c", 3).evicted, Some(("b", 2)));
    }

    #[test]
    fn replacing_keeps_position_and_marks_visited() {
        let mut cache = Sieve::new(3);
        cache.insert("a", 1);
        cache.insert("b", 2);
        cache.insert("c", 3);
        let inserted = cache.insert("a", 10);
        assert_eq!(inserted.replaced, Some(1));
        assert_eq!(inserted.evicted, None);
        assert_eq!(contents(&cache), vec![("c", 3), ("b", 2), ("a", 10)]);
        // "a" is the oldest but visited, so the sweep passes it and takes "b".
        assert_eq!(cache.insert("d", 4).evicted, Some(("b", 2)));
        assert_eq!(cache.len(), 3);
    }

    #[test]
    fn the_hand_resumes_after_the_last_victim() {
        // Written out by hand rather than checked against the model, so that a mistake
        // shared by both cannot hide.
        let mut cache = Sieve::new(3);
        cache.insert("a", ());
        cache.insert("b", ());
        cache.insert("c", ());
        cache.get(&"a");
        // The sweep clears "a" and evicts "b"; the hand moves on to "c".
        assert_eq!(cache.insert("d", ()).evicted, Some(("b", ())));
        // From the tail this would be "a"; SIEVE resumes at the hand and takes "c".
        assert_eq!(cache.insert("e", ()).evicted, Some(("c", ())));
        // The hand stands at "d"; with "d" and "e" visited it clears both, passes the head
        // and wraps to the tail.
        cache.get(&"d");
        cache.get(&"e");
        assert_eq!(cache.insert("f", ()).evicted, Some(("a", ())));
        // It resumes at "d", whose bit that lap cleared.
        assert_eq!(cache.insert("g", ()).evicted, Some(("d", ())));
        assert_consistent(&cache);
    }

    #[test]
    fn sweep_wraps_when_everything_is_visited() {
        let mut cache = Sieve::new(3);
        for key in ["a", "b", "c"] {
            cache.insert(key, ());
            cache.get(&key);
        }
        // One lap clears every bit; the oldest is then the first unvisited entry.
        assert_eq!(cache.insert("d", ()).evicted, Some(("a", ())));
        // The hand now stands at "b" (unvisited since the lap).
        assert_eq!(cache.insert("e", ()).evicted, Some(("b", ())));
        assert_consistent(&cache);
    }

    #[test]
    fn remove_and_drain() {
        let mut cache = Sieve::new(4);
        for i in 0..4u32 {
            cache.insert(i, i * 10);
        }
        assert_eq!(cache.remove(&2), Some(20));
        assert_eq!(cache.remove(&2), None);
        assert_eq!(cache.len(), 3);
        assert_consistent(&cache);
        assert!(cache.insert(7, 70).evicted.is_none());
        assert_eq!(cache.drain(), vec![(7, 70), (3, 30), (1, 10), (0, 0)]);
        assert!(cache.is_empty());
        assert_eq!(cache.iter().count(), 0);
        assert_eq!(cache.get(&3), None);
        // Still usable after draining.
        cache.insert(9, 90);
        assert_eq!(contents(&cache), vec![(9, 90)]);
        assert_consistent(&cache);
    }

    #[test]
    fn huge_capacity_does_not_preallocate() {
        let mut cache: Sieve<u32, u32> = Sieve::new(usize::MAX);
        assert_eq!(cache.capacity(), usize::MAX);
        assert!(cache.insert(1, 1).evicted.is_none());
        assert_eq!(cache.len(), 1);
    }
}
