//! The soak's randomness, seeded so that a run repeats, and the bytes every served buffer
//! holds before anyone writes to it.

/// The bytes peer `process`'s buffer holds from `offset` on before anyone writes to it:
/// eight at a time, a hash of the process and the offset's word.
pub(crate) fn initial_bytes(process: usize, offset: usize, out: &mut [u8]) {
    let mut i = 0;
    while i < out.len() {
        let at = offset + i;
        let word = splitmix((at as u64 / 8) ^ ((process as u64 + 1) << 48)).to_le_bytes();
        let from = at % 8;
        let n = (8 - from).min(out.len() - i);
        out[i..i + n].copy_from_slice(&word[from..from + n]);
        i += n;
    }
}

pub(crate) fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// xorshift64*: fast, and good enough to pick sizes, offsets and payloads.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(splitmix(seed) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub(crate) fn below(&mut self, n: usize) -> usize {
        ((self.next() >> 11) % n as u64) as usize
    }

    /// Log-uniform in `1..=max`: as many transfers of 1–10 B as of 100 KiB–1 MiB.
    pub(crate) fn size(&mut self, max: usize) -> usize {
        let unit = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        let size = ((max as f64 + 1.0).ln() * unit).exp() as usize;
        size.clamp(1, max)
    }

    pub(crate) fn fill(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for chunk in &mut chunks {
            chunk.copy_from_slice(&self.next().to_le_bytes());
        }
        let tail = chunks.into_remainder();
        let last = self.next().to_le_bytes();
        tail.copy_from_slice(&last[..tail.len()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initial_bytes_agree_at_any_offset() {
        let mut whole = vec![0u8; 100];
        initial_bytes(2, 0, &mut whole);
        for start in 0..20 {
            for len in [0, 1, 7, 8, 9, 33] {
                let mut part = vec![0u8; len];
                initial_bytes(2, start, &mut part);
                assert_eq!(part, whole[start..start + len]);
            }
        }
        let mut other = vec![0u8; 100];
        initial_bytes(3, 0, &mut other);
        assert_ne!(whole, other);
    }

    #[test]
    fn sizes_stay_in_range_and_span_it() {
        let mut rng = Rng::new(7);
        let sizes: Vec<usize> = (0..10_000).map(|_| rng.size(4 << 20)).collect();
        assert!(sizes.iter().all(|&s| (1..=4 << 20).contains(&s)));
        assert!(sizes.iter().any(|&s| s < 16));
        assert!(sizes.iter().any(|&s| s > 1 << 20));
        assert!((0..1000).all(|_| rng.size(1) == 1));
    }
}
