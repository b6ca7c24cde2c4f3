//! The atomics of a batch's bookkeeping: the standard library's, or with the `loom` feature
//! loom's, so that the model ([`super::model`]) checks every order in which threads can
//! interleave their steps on them (`cargo xtask test` runs it).

#[cfg(feature = "loom")]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize};
#[cfg(not(feature = "loom"))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize};

pub(crate) use std::sync::atomic::Ordering;
