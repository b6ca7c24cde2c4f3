//! Fuzz targets for every decoder of bytes Tern reads from the network or a metadata store:
//! the TCP data protocol's header and status frames (and the check a header gets against
//! registered memory), the handshake RPC framing, RDMA Connection handshake bodies, segment
//! descriptors, the NIC priority matrix, the HTTP metadata protocol, RPC locations, notify
//! bodies, and the frames of the same-host transport's socket.
//!
//! Each target is one file, `fuzz_targets/<name>.rs`, whose body is written once inside
//! [`target!`]: built by `cargo +nightly fuzz` (which sets `--cfg fuzzing`) it is a libFuzzer
//! target with coverage feedback and AddressSanitizer; built by plain `cargo` on any toolchain
//! it is a program that feeds the same body random and mutated seed inputs for a while
//! ([`stable`]). `cargo xtask fuzz` drives both. Seeds live in `corpus/<name>/seed-*`, made
//! from the golden files of `metadata/tests/golden` and `transport-rdma/tests/golden`.
//!
//! This crate must not hold product logic or fixes: a crash found here is fixed in the crate
//! that owns the decoder, with a regression test there. It is outside the workspace (nightly,
//! sanitizers) and nothing depends on it.

pub mod stable;

#[cfg(fuzzing)]
#[doc(hidden)]
pub use libfuzzer_sys as __libfuzzer;

/// Declares a fuzz target: `tern_fuzz::target!(|data| { ... });` in `fuzz_targets/<name>.rs`
/// (which starts with `#![cfg_attr(fuzzing, no_main)]`). The body receives `data: &[u8]` and
/// panics when a property it checks does not hold.
#[macro_export]
macro_rules! target {
    (|$data:ident| $body:block) => {
        #[cfg(fuzzing)]
        $crate::__libfuzzer::fuzz_target!(|$data: &[u8]| $body);

        #[cfg(not(fuzzing))]
        fn main() -> ::std::process::ExitCode {
            $crate::stable::main(env!("CARGO_BIN_NAME"), |$data: &[u8]| $body)
        }
    };
}

/// Reads a little-endian `u64` at `at`, or `None` past the end.
pub fn le_u64(data: &[u8], at: usize) -> Option<u64> {
    let bytes: [u8; 8] = data.get(at..at.checked_add(8)?)?.try_into().ok()?;
    Some(u64::from_le_bytes(bytes))
}

/// Splits the input at its first byte: `(selector, rest)`; `(0, [])` for an empty input.
/// Targets use the selector to pick limits or modes without wasting structure on them.
pub fn split_selector(data: &[u8]) -> (u8, &[u8]) {
    match data.split_first() {
        Some((first, rest)) => (*first, rest),
        None => (0, &[]),
    }
}
