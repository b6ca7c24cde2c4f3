//! The endpoint a worker uses for a path: the store's, or a new one whose handshake starts
//! on a thread of its own; endpoints displaced from a store are decommissioned.

use std::sync::Arc;

use tern_engine::Slice;

use super::{NicSlot, Shared};
use crate::endpoint::{Endpoint, State};
use crate::worker::Msg;

impl Shared {
    /// Removes a decommissioned endpoint from its NIC's store (if it is still there).
    pub fn forget_endpoint(&self, ep: &Arc<Endpoint>) {
        if let Some(slot) = self.nics.get(ep.nic) {
            slot.store.lock().remove(ep);
        }
    }

    /// Decommissions endpoints another thread displaced and tells their workers.
    pub(super) fn decommission_displaced(&self, displaced: Vec<Arc<Endpoint>>) {
        for ep in displaced {
            if ep.decommission()
                && let Some(handle) = self.nics.get(ep.nic).and_then(|n| n.workers.get(ep.worker))
            {
                let _ = handle.send(Msg::Changed(ep));
            }
        }
    }

    /// The endpoint a worker should use for `key`: the store's, or a new one whose
    /// handshake starts on a thread of its own (the worker goes on with other endpoints).
    pub fn endpoint_for(
        self: &Arc<Self>,
        nic: usize,
        worker: usize,
        key: &Arc<str>,
        slice: &Slice,
    ) -> Result<Arc<Endpoint>, String> {
        let slot = self.nics.get(nic).ok_or_else(|| format!("no NIC #{nic}"))?;
        let mut store = slot.store.lock();
        if let Some(ep) = store.get(key) {
            return Ok(ep);
        }
        let ep = self.new_endpoint(
            slot,
            key,
            worker,
            self.config.qps_per_endpoint,
            State::Connecting,
        )?;
        let displaced = store.insert(ep.clone());
        drop(store);
        self.decommission_displaced(displaced);
        let shared = self.clone();
        let connecting = ep.clone();
        let peer = slice.peer().clone();
        let spawned = std::thread::Builder::new()
            .name("tern-rdma-connect".into())
            .spawn(move || {
                let result = shared.handshake(&connecting, &peer);
                if result.is_ok() && !connecting.set_state(State::Ready) {
                    return;
                }
                if let Some(handle) = shared
                    .nics
                    .get(connecting.nic)
                    .and_then(|n| n.workers.get(connecting.worker))
                {
                    let _ = handle.send(Msg::Connected {
                        ep: connecting,
                        result,
                    });
                }
            });
        if let Err(e) = spawned {
            slot.store.lock().remove(&ep);
            return Err(format!("cannot start a handshake thread: {e}"));
        }
        Ok(ep)
    }

    /// A new endpoint of `count` QPs on `slot`'s NIC, reporting to `worker`'s CQ.
    pub(super) fn new_endpoint(
        &self,
        slot: &NicSlot,
        key: &Arc<str>,
        worker: usize,
        count: usize,
        state: State,
    ) -> Result<Arc<Endpoint>, String> {
        let cq = &slot
            .workers
            .get(worker)
            .ok_or_else(|| format!("no worker #{worker}"))?
            .cq;
        Endpoint::create(key.clone(), &slot.nic, worker, cq, count, self.caps, state)
            .map(Arc::new)
            .map_err(|e| format!("cannot create QPs on {}: {e}", slot.nic.name))
    }
}
