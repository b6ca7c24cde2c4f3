//! Repeatable numbers for tests that try many random cases: the same seed gives the same
//! cases on every run, so a failure can be replayed.

/// A stream of numbers below the bound each call names (xorshift64), from `seed` (not 0).
pub fn below_from(mut seed: u64) -> impl FnMut(u64) -> u64 {
    move |below: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % below
    }
}
