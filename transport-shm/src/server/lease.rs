//! Leases: the ranges a peer moves by cross-memory attach, pinned while its lease lasts, so
//! that unregistering them fails as in use meanwhile.

use std::collections::HashMap;

use tern_memreg::{MemoryRegistry, RegionPin};

use crate::pin::pin_range;

/// The pins of one peer's leases, by lease ID.
pub(super) struct Leases {
    held: HashMap<u64, Vec<RegionPin>>,
    /// Most leases held at once.
    max: usize,
}

impl Leases {
    pub(super) fn new(max: usize) -> Self {
        Self {
            held: HashMap::new(),
            max,
        }
    }

    /// Pins for lease `id` each range that is inside registered, remote-accessible memory;
    /// which were. A lease past the most held, or one already held, is the peer's mistake.
    pub(super) fn grant(
        &mut self,
        registry: &MemoryRegistry,
        id: u64,
        ranges: &[(u64, u64)],
    ) -> Result<Vec<bool>, String> {
        if self.held.len() >= self.max || self.held.contains_key(&id) {
            return Err(format!(
                "lease {id}: {} leases held already, or this one twice",
                self.held.len()
            ));
        }
        let mut pins = Vec::with_capacity(ranges.len());
        let granted = ranges
            .iter()
            .map(|&(addr, len)| match pin_range(registry, addr, len) {
                Ok(pin) => {
                    pins.push(pin);
                    true
                }
                Err(_) => false,
            })
            .collect();
        self.held.insert(id, pins);
        Ok(granted)
    }

    /// Lets lease `id` go (one never granted is nothing).
    pub(super) fn release(&mut self, id: u64) {
        self.held.remove(&id);
    }
}
