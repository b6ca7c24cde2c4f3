//! Memory a test owns and registers with an engine, to watch for writes after a transfer call
//! gave it back. Included by path (`#[path]`) into the transports' tests, which depend on
//! `tern-engine`; `tern-testkit` itself does not, so this file is not part of its library.

use std::time::Duration;

use tern_engine::TransferEngine;
use tern_testkit::memory::Watched;

/// Registered raw and never freed ([`Watched`]): it stays readable after it is unregistered,
/// so the test can see whether anything still writes it.
pub struct Local(pub Watched);

impl Local {
    /// `len` zeroed bytes, registered as `cpu:0` memory of `engine`.
    pub fn register(engine: &TransferEngine, len: usize) -> Self {
        let memory = Watched::zeroed(len);
        // SAFETY: `Watched` memory is leaked, so it stays allocated and in place for as long
        // as the process lives, registered or not; it is atomics, so writes through the
        // pointer are allowed.
        unsafe {
            tern_engine::RegisterRaw::register_memory(
                engine,
                memory.as_mut_ptr(),
                memory.len(),
                "cpu:0",
                true,
            )
            .unwrap();
        }
        Self(memory)
    }

    pub fn addr(&self) -> usize {
        self.0.addr()
    }

    /// For two seconds from now the buffer does not change, `meanwhile` done first (waking
    /// a stopped peer, say).
    pub fn assert_untouched(&self, what: &str, meanwhile: impl FnOnce()) {
        let before = self.0.checksum();
        meanwhile();
        self.0
            .assert_unchanged(before, Duration::from_secs(2), what);
    }
}
