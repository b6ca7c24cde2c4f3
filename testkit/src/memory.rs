//! Memory a test hands to an engine and then watches: after a transfer call returned (timed
//! out, canceled), nothing may write it any more. The memory is atomics, so reading it while a
//! buggy transport, the kernel or a NIC still writes it is a defined read of a changing value,
//! not a data race; and it is leaked, so that even a failing test never frees memory that a
//! device may still write.

use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Every [`Watched`] memory made: leaked on purpose, and kept reachable here, so that a leak
/// checker (valgrind's memcheck, which `cargo xtask memcheck` runs) does not count it lost.
static KEPT: Mutex<Vec<&'static [AtomicU64]>> = Mutex::new(Vec::new());

/// Zeroed memory, 8-byte aligned, that lives as long as the process.
#[derive(Debug, Clone, Copy)]
pub struct Watched {
    words: &'static [AtomicU64],
}

impl Watched {
    /// `len` bytes (rounded up to 8), zeroed.
    pub fn zeroed(len: usize) -> Self {
        let words: Vec<AtomicU64> = (0..len.div_ceil(8)).map(|_| AtomicU64::new(0)).collect();
        let words: &'static [AtomicU64] = Box::leak(words.into_boxed_slice());
        KEPT.lock().push(words);
        Self { words }
    }

    /// The start, for registering with an engine. Writing through it is allowed: atomics
    /// are interior-mutable (`AtomicU64::as_ptr`).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.words
            .first()
            .map_or(std::ptr::null_mut(), |w| w.as_ptr().cast())
    }

    /// The start address.
    pub fn addr(&self) -> usize {
        self.as_mut_ptr() as usize
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.words.len() * 8
    }

    /// Whether it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// A checksum of what it holds now.
    pub fn checksum(&self) -> u64 {
        self.words.iter().fold(0u64, |sum, word| {
            sum.rotate_left(5)
                ^ word
                    .load(Ordering::Relaxed)
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        })
    }

    /// Fails the test if, within `watch` from now, its checksum ever differs from `before`.
    pub fn assert_unchanged(&self, before: u64, watch: Duration, what: &str) {
        let until = Instant::now() + watch;
        loop {
            assert_eq!(
                self.checksum(),
                before,
                "{what}: the local buffer changed after the call returned"
            );
            if Instant::now() >= until {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_while_watched_fails_the_watch() {
        let memory = Watched::zeroed(1 << 16);
        let before = memory.checksum();
        memory.assert_unchanged(before, Duration::from_millis(50), "quiet");
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            memory.words[4000].store(1, Ordering::Relaxed);
        });
        let watched = std::panic::catch_unwind(|| {
            memory.assert_unchanged(before, Duration::from_secs(5), "written")
        });
        writer.join().unwrap();
        assert!(watched.is_err(), "the write went unseen");
        assert_eq!((memory.len(), memory.addr() % 8), (1 << 16, 0));
    }
}
