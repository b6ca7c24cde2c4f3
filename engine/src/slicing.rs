//! Cutting a request into slices.

use crate::transport::Transport;

/// Splits `len` bytes into pieces of `slice` bytes; a tail shorter than `min_tail` is merged
/// into the piece before it (Mooncake: 64 KiB slices, 16 KiB tail merge). Yields
/// `(offset, length)` pairs that cover `[0, len)` exactly.
pub fn split(
    len: usize,
    slice: usize,
    min_tail: usize,
) -> impl Iterator<Item = (usize, usize)> + Clone {
    Cuts::new(len, slice, min_tail).pieces()
}

/// How a transport's slices are cut: its largest slice, and the tail below which a last
/// piece joins the one before ([`Transport::max_slice_size`],
/// [`Transport::merge_tail_below`]), asked once when the engine is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SliceSize {
    pub(crate) max: usize,
    pub(crate) merge_tail_below: usize,
}

impl SliceSize {
    pub(crate) fn of(transport: &dyn Transport) -> Self {
        Self {
            max: transport.max_slice_size().max(1),
            merge_tail_below: transport.merge_tail_below(),
        }
    }

    /// The cuts of `len` bytes.
    pub(crate) fn cuts(self, len: usize) -> Cuts {
        Cuts::new(len, self.max, self.merge_tail_below)
    }
}

/// How [`split`] cuts a range, asked without walking it: how many pieces there are (a merged
/// run counts its slices before any exists), and where each lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cuts {
    len: usize,
    slice: usize,
    count: usize,
}

impl Cuts {
    /// The cuts of `len` bytes into `slice`-byte pieces, a tail shorter than `min_tail`
    /// joined to the piece before it.
    pub fn new(len: usize, slice: usize, min_tail: usize) -> Self {
        let slice = slice.max(1);
        let mut count = len.div_ceil(slice);
        let tail = len % slice;
        if count > 1 && tail != 0 && tail < min_tail {
            count -= 1;
        }
        Self { len, slice, count }
    }

    /// How many pieces.
    pub fn count(&self) -> usize {
        self.count
    }

    /// `(offset, length)` of piece `i` (below [`count`](Self::count)).
    pub fn piece(&self, i: usize) -> (usize, usize) {
        let offset = i * self.slice;
        let this = if i + 1 == self.count {
            self.len - offset
        } else {
            self.slice
        };
        (offset, this)
    }

    /// `(offset, length)` of each piece, in order.
    pub fn pieces(self) -> impl Iterator<Item = (usize, usize)> + Clone {
        (0..self.count).map(move |i| self.piece(i))
    }
}

#[cfg(test)]
mod tests {
    use super::split;

    fn pieces(len: usize, slice: usize, tail: usize) -> Vec<(usize, usize)> {
        split(len, slice, tail).collect()
    }

    #[test]
    fn covers_exactly_and_merges_short_tails() {
        assert_eq!(pieces(10, 4, 0), [(0, 4), (4, 4), (8, 2)]);
        assert_eq!(pieces(10, 4, 3), [(0, 4), (4, 6)]);
        assert_eq!(pieces(8, 4, 3), [(0, 4), (4, 4)]);
        assert_eq!(pieces(3, 4, 3), [(0, 3)]);
        assert_eq!(pieces(0, 4, 3), []);
        for len in 1..300 {
            let ps = pieces(len, 64, 16);
            assert_eq!(ps.iter().map(|p| p.1).sum::<usize>(), len);
            assert!(ps.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
            assert!(ps.iter().all(|p| p.1 > 0 && p.1 < 64 + 16));
        }
    }
}
