//! The address map: non-overlapping `[start, start + len)` ranges keyed by start address.
//!
//! Kept as one vector sorted by start: a lookup is a binary search over contiguous memory
//! (every transfer does one), while inserts and removals, which happen at registration
//! time, shift the tail.

/// Why a range could not be inserted into or found in a [`RegionMap`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MapError {
    /// The range had zero length; give a length of at least one byte.
    #[error("zero-length range at {start:#x}")]
    ZeroLength {
        /// Start address of the rejected range.
        start: usize,
    },
    /// `start + len` does not fit in the address space.
    #[error("range at {start:#x} with length {len} overflows the address space")]
    Overflow {
        /// Start address of the rejected range.
        start: usize,
        /// Length of the rejected range.
        len: usize,
    },
    /// The range overlaps a range already in the map; unregister that one first.
    #[error("range [{start:#x}, +{len}) overlaps the range starting at {existing:#x}")]
    Overlap {
        /// Start address of the rejected range.
        start: usize,
        /// Length of the rejected range.
        len: usize,
        /// Start address of the range it overlaps.
        existing: usize,
    },
}

/// Non-overlapping address ranges with a value each.
#[derive(Debug, Clone)]
pub struct RegionMap<V> {
    /// `(start, len, value)`, sorted by start, non-overlapping.
    ranges: Vec<(usize, usize, V)>,
}

impl<V> Default for RegionMap<V> {
    fn default() -> Self {
        Self { ranges: Vec::new() }
    }
}

impl<V> RegionMap<V> {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of ranges in the map.
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// Whether the map holds no range.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Inserts `[start, start + len)`; fails on zero length, overflow or overlap, and then
    /// leaves the map unchanged.
    pub fn insert(&mut self, start: usize, len: usize, value: V) -> Result<(), MapError> {
        if let Some(existing) = self.first_overlap(start, len)? {
            return Err(MapError::Overlap {
                start,
                len,
                existing,
            });
        }
        let at = self.ranges.partition_point(|r| r.0 < start);
        self.ranges.insert(at, (start, len, value));
        Ok(())
    }

    /// Start of the first range that overlaps `[start, start + len)`, if any.
    pub fn first_overlap(&self, start: usize, len: usize) -> Result<Option<usize>, MapError> {
        let end = checked_end(start, len)?;
        // The only candidate is the last range starting before `end`, and it overlaps iff it
        // ends after `start`; ranges are disjoint, so no earlier one can reach further.
        let before_end = self.ranges.partition_point(|r| r.0 < end);
        Ok(before_end
            .checked_sub(1)
            .map(|i| &self.ranges[i])
            .filter(|(s, l, _)| *s + *l > start)
            .map(|(s, _, _)| *s))
    }

    /// The range that wholly contains `[addr, addr + len)`: `(start, len, value)`.
    pub fn find_containing(&self, addr: usize, len: usize) -> Option<(usize, usize, &V)> {
        let end = checked_end(addr, len).ok()?;
        let at_or_before = self
            .ranges
            .partition_point(|r| r.0 <= addr)
            .checked_sub(1)?;
        let (start, region_len, value) = &self.ranges[at_or_before];
        (*start + *region_len >= end).then_some((*start, *region_len, value))
    }

    /// The range starting exactly at `start`.
    pub fn get(&self, start: usize) -> Option<(usize, &V)> {
        let at = self.ranges.binary_search_by_key(&start, |r| r.0).ok()?;
        let (_, len, value) = &self.ranges[at];
        Some((*len, value))
    }

    /// Removes and returns the range starting exactly at `start`.
    pub fn remove(&mut self, start: usize) -> Option<(usize, V)> {
        let at = self.ranges.binary_search_by_key(&start, |r| r.0).ok()?;
        let (_, len, value) = self.ranges.remove(at);
        Some((len, value))
    }

    /// All ranges in address order: `(start, len, value)`.
    pub fn iter(&self) -> impl Iterator<Item = (usize, usize, &V)> {
        self.ranges.iter().map(|(s, l, v)| (*s, *l, v))
    }
}

fn checked_end(start: usize, len: usize) -> Result<usize, MapError> {
    if len == 0 {
        return Err(MapError::ZeroLength { start });
    }
    start
        .checked_add(len)
        .ok_or(MapError::Overflow { start, len })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_rejects_zero_length_and_overflow() {
        let mut map = RegionMap::new();
        assert_eq!(
            map.insert(0x1000, 0, ()),
            Err(MapError::ZeroLength { start: 0x1000 })
        );
        assert!(matches!(
            map.insert(usize::MAX - 1, 4, ()),
            Err(MapError::Overflow { .. })
        ));
        assert!(map.is_empty());
    }

    #[test]
    fn overlap_is_detected_on_every_side() {
        let mut map = RegionMap::new();
        map.insert(1000, 100, 'a').unwrap();
        for (start, len) in [(900, 101), (1099, 1), (1050, 10), (950, 200), (1000, 100)] {
            assert_eq!(
                map.insert(start, len, 'x'),
                Err(MapError::Overlap {
                    start,
                    len,
                    existing: 1000
                }),
                "[{start}, +{len})"
            );
        }
        // Touching ranges do not overlap.
        map.insert(900, 100, 'b').unwrap();
        map.insert(1100, 5, 'c').unwrap();
        assert_eq!(map.len(), 3);
    }

    #[test]
    fn containing_lookup_needs_the_whole_range_inside_one_region() {
        let mut map = RegionMap::new();
        map.insert(1000, 100, 'a').unwrap();
        map.insert(1100, 100, 'b').unwrap();
        assert_eq!(map.find_containing(1000, 100).map(|r| *r.2), Some('a'));
        assert_eq!(map.find_containing(1099, 1).map(|r| *r.2), Some('a'));
        assert_eq!(map.find_containing(1100, 1).map(|r| *r.2), Some('b'));
        assert!(
            map.find_containing(1050, 100).is_none(),
            "spans two regions"
        );
        assert!(map.find_containing(999, 2).is_none());
        assert!(map.find_containing(1200, 1).is_none());
        assert!(map.find_containing(1000, 0).is_none());
        assert!(map.find_containing(usize::MAX, 2).is_none());
    }

    /// Every answer of the map agrees with a brute-force check over random ranges.
    #[test]
    fn agrees_with_brute_force() {
        let mut below = tern_testkit::random::below_from(0x9e37_79b9_7f4a_7c15);
        let mut next = move |bound: u64| below(bound) as usize;
        let mut map = RegionMap::new();
        let mut reference: Vec<(usize, usize)> = Vec::new();
        for _ in 0..2000 {
            let start = next(10_000);
            let len = next(64) + 1;
            let overlaps = reference
                .iter()
                .any(|&(s, l)| start < s + l && s < start + len);
            assert_eq!(map.insert(start, len, ()).is_err(), overlaps);
            if !overlaps {
                reference.push((start, len));
            }
            let (qa, ql) = (next(10_100), next(80) + 1);
            let expected = reference
                .iter()
                .find(|&&(s, l)| qa >= s && qa + ql <= s + l)
                .map(|&(s, _)| s);
            assert_eq!(map.find_containing(qa, ql).map(|r| r.0), expected);
            if next(4) == 0 && !reference.is_empty() {
                let (s, l) = reference.swap_remove(next(reference.len() as u64));
                assert_eq!(map.remove(s).map(|r| r.0), Some(l));
            }
        }
    }
}
