//! What Tern's tests and `cargo xtask` share: one way to start a real etcd server (Debian's
//! `etcd`, on a given address with free ports and its own data directory), to check it is
//! healthy, and to poke at it with `etcdctl`; and a way to read what the test process
//! logged.
//!
//! It must not be a dependency of any library crate: it is for tests (as a dev-dependency)
//! and for xtask, and it depends only on pure-Rust crates, so xtask builds before any system
//! package is installed.
#![forbid(unsafe_code)]

pub mod etcd;
pub mod logs;
pub mod wire;
