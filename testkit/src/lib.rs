//! What Tern's tests and `cargo xtask` share: one way to start a real etcd server (Debian's
//! `etcd`, on a given address with free ports and its own data directory), to check it is
//! healthy, and to poke at it with `etcdctl`; a way to read what the test process logged;
//! stopping a peer process so that it is stopped when the call returns; and memory to watch
//! for writes after a transfer call gave it back; the stand-in CUDA driver for device-memory
//! tests; what this process has mapped; repeatable random numbers; a relay that holds a
//! connection's bytes back, as a lagging path would.
//!
//! It must not be a dependency of any library crate: it is for tests (as a dev-dependency)
//! and for xtask, and it depends only on pure-Rust crates, so xtask builds before any system
//! package is installed.
#![forbid(unsafe_code)]

pub mod cuda;
pub mod etcd;
pub mod logs;
pub mod maps;
pub mod memory;
pub mod process;
pub mod random;
pub mod relay;
pub mod wire;
