//! The owners in this process: a peer found to be this very process (two engines in one
//! process) is served from its registry directly, since cross-memory attach into oneself is
//! refused.

use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use tern_memreg::MemoryRegistry;

use super::Owner;

/// The owners in this process, by socket name.
static IN_PROCESS: Mutex<Vec<(String, Weak<Owner>)>> = Mutex::new(Vec::new());

/// The registry behind `socket` when its owner lives in this process.
pub(crate) fn in_process(socket: &str) -> Option<Arc<MemoryRegistry>> {
    IN_PROCESS
        .lock()
        .iter()
        .find(|(name, _)| name == socket)
        .and_then(|(_, owner)| owner.upgrade())
        .map(|owner| owner.registry.clone())
}

/// Makes `owner` findable by its socket name.
pub(super) fn enter(owner: &Arc<Owner>) {
    let mut here = IN_PROCESS.lock();
    here.retain(|(_, o)| o.strong_count() > 0);
    here.push((owner.socket.clone(), Arc::downgrade(owner)));
}

/// Forgets the owner of `socket`.
pub(super) fn leave(socket: &str) {
    IN_PROCESS.lock().retain(|(name, _)| name != socket);
}
