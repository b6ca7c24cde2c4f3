//! The stand-in's tables: the memory it handed out (device allocations and mappings, pinned
//! host memory, physical memory, reserved address space) and the handles of its streams and
//! events.

use std::collections::BTreeMap;
use std::ffi::c_int;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use parking_lot::{Mutex, MutexGuard};

use crate::event::EventState;
use crate::stream::StreamQueue;

pub(crate) struct Allocation {
    pub(crate) len: usize,
    pub(crate) ordinal: usize,
    /// The readable and writable mapping of the same memfd.
    pub(crate) alias: usize,
    pub(crate) origin: Origin,
}

/// Where a range of device memory came from.
pub(crate) enum Origin {
    /// `cuMemAlloc`: its memfd is kept, for IPC handles.
    Alloc(OwnedFd),
    /// Opened from another process's IPC handle.
    Ipc,
    /// `cuMemMap` of physical memory.
    Mapped(Arc<Physical>),
}

/// Physical memory of `cuMemCreate` (or imported from a descriptor).
pub(crate) struct Physical {
    pub(crate) fd: OwnedFd,
    pub(crate) len: usize,
    pub(crate) ordinal: usize,
    pub(crate) handle_types: c_int,
    /// Imported from another process's descriptor.
    pub(crate) imported: bool,
    /// Made with `gpuDirectRDMACapable` set in its allocation flags.
    pub(crate) gpu_direct: bool,
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) initialized: bool,
    /// Device allocations (and mappings) by the address handed out.
    pub(crate) device: BTreeMap<usize, Allocation>,
    /// Pinned host allocations: address → length.
    pub(crate) host: BTreeMap<usize, usize>,
    pub(crate) retained: Vec<u64>,
    /// Physical memory handles.
    pub(crate) handles: BTreeMap<u64, Arc<Physical>>,
    /// Reserved address ranges: start → length.
    pub(crate) reserved: BTreeMap<usize, usize>,
}

pub(crate) static STATE: Mutex<Option<State>> = Mutex::new(None);

pub(crate) fn with_state<R>(f: impl FnOnce(&mut State) -> R) -> R {
    let mut guard = STATE.lock();
    f(guard.get_or_insert_with(State::default))
}

pub(crate) fn devices() -> usize {
    std::env::var("TERN_STANDIN_DEVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
}

pub(crate) struct Handles {
    pub(crate) streams: BTreeMap<usize, (Arc<StreamQueue>, usize)>,
    pub(crate) events: BTreeMap<usize, Arc<EventState>>,
}

pub(crate) static HANDLE_TABLE: Mutex<Handles> = Mutex::new(Handles {
    streams: BTreeMap::new(),
    events: BTreeMap::new(),
});

pub(crate) fn handles() -> MutexGuard<'static, Handles> {
    HANDLE_TABLE.lock()
}

pub(crate) static HANDLES: AtomicU64 = AtomicU64::new(1);
