//! Cutting a request into slices.

/// Splits `len` bytes into pieces of `slice` bytes; a tail shorter than `min_tail` is merged
/// into the piece before it (Mooncake: 64 KiB slices, 16 KiB tail merge). Yields
/// `(offset, length)` pairs that cover `[0, len)` exactly.
pub fn split(
    len: usize,
    slice: usize,
    min_tail: usize,
) -> impl Iterator<Item = (usize, usize)> + Clone {
    let slice = slice.max(1);
    let mut count = len.div_ceil(slice);
    let tail = len % slice;
    if count > 1 && tail != 0 && tail < min_tail {
        count -= 1;
    }
    (0..count).map(move |i| {
        let offset = i * slice;
        let this = if i + 1 == count { len - offset } else { slice };
        (offset, this)
    })
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
