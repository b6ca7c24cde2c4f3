//! Sorting a submit's slices to one peer by how each moves: through a memfd mapping (asking
//! the peer for it first where it is not mapped yet), by the GPU where the peer's buffer is
//! device memory, else by cross-memory attach under a lease. Local device memory moves only
//! to memory the GPU reaches here (the peer's device memory, or a memfd mapped here); to the
//! peer's plain host memory it goes to the next transport.

use std::iter::Peekable;
use std::vec;

use tern_engine::Slice;
use tern_memreg::MemoryRegistry;

use super::Link;
use super::attach::Attach;
use super::request::Way;
use crate::declines::DEVICE_TO_HOST_DECLINED;
use crate::pin::pin_range;

/// Slices that move after the mapped ones: by the GPU, and by cross-memory attach.
#[derive(Default)]
struct Later {
    device: Vec<Slice>,
    plain: Vec<Slice>,
}

impl Link {
    /// Moves slices to this peer, each the way its buffer is reached.
    pub(crate) fn carry(&self, slices: Vec<Slice>) {
        let slices = self.device_in_process(slices);
        let mut later = Later::default();
        // First what this link knows how to reach already; the rest is asked about below.
        let mut unknown = Vec::new();
        let mut rest = slices.into_iter().peekable();
        while let Some(slice) = rest.next() {
            if !slice.is_live() {
                slice.abandon();
                continue;
            }
            match self.known_way(&slice) {
                Some(way) => self.take(way, slice, &mut rest, &mut unknown, &mut later),
                None => unknown.push(slice),
            }
        }
        // What comes back now was revoked between the lookup and the copy: the buffer is
        // going.
        let mut revoked = Vec::new();
        let mut unknown = unknown.into_iter().peekable();
        while let Some(slice) = unknown.next() {
            let (addr, len) = (slice.remote_addr, slice.len as u64);
            let way = match self.known_way(&slice) {
                Some(way) => way,
                None => {
                    if let Some(why) = self.declined_why(addr, len) {
                        self.device_declines.decline(slice, why, None);
                        continue;
                    }
                    match self.open(&slice, addr, len) {
                        Ok(way) => way,
                        Err(refusal) => {
                            self.refused(slice, refusal);
                            continue;
                        }
                    }
                }
            };
            self.take(way, slice, &mut unknown, &mut revoked, &mut later);
        }
        revoked.into_iter().for_each(|slice| self.reject(slice));
        later
            .device
            .into_iter()
            .for_each(|slice| self.copy_device(slice));
        if !later.plain.is_empty() {
            self.attach(later.plain);
        }
    }

    /// How the peer's buffer under `slice` is reached, if this link knows already: a device
    /// chunk mapped here, a memfd mapped here, or plain memory.
    fn known_way(&self, slice: &Slice) -> Option<Way> {
        let (addr, len) = (slice.remote_addr, slice.len as u64);
        if self.device_chunk(addr).is_some() {
            return Some(Way::Device);
        }
        if let Some(mapped) = self.mapping(addr, len) {
            return Some(Way::Mapped(mapped));
        }
        self.is_plain(addr, len).then_some(Way::Plain)
    }

    /// Sends `slice` its way: a mapped one is copied now (with the slices after it in `rest`
    /// that fall in the same mapping; those the mapping no longer takes go to `back`), the
    /// others wait in `later`.
    fn take(
        &self,
        way: Way,
        slice: Slice,
        rest: &mut Peekable<vec::IntoIter<Slice>>,
        back: &mut Vec<Slice>,
        later: &mut Later,
    ) {
        match way {
            Way::Mapped(mapped) => self.copy_mapped(&mapped, slice, rest, back),
            Way::Device => later.device.push(slice),
            // Cross-memory attach is a CPU copy, which never touches device memory.
            Way::Plain if slice.local().is_device() => {
                self.device_declines
                    .decline(slice, DEVICE_TO_HOST_DECLINED, None);
            }
            Way::Plain => later.plain.push(slice),
        }
    }

    /// Another engine of this process: its device memory is this process's too, and the GPU
    /// copies between the two registries directly (IPC handles do not open in the process
    /// that made them). Those slices move now; the others come back.
    fn device_in_process(&self, slices: Vec<Slice>) -> Vec<Slice> {
        let Attach::SameProcess(registry) = &self.attach else {
            return slices;
        };
        let (device, host): (Vec<Slice>, Vec<Slice>) = slices
            .into_iter()
            .partition(|s| s.local().is_device() || is_device(registry, s));
        if !device.is_empty() {
            self.in_process(registry, device);
        }
        host
    }
}

/// Whether the slice's remote range is device memory of `registry`.
fn is_device(registry: &MemoryRegistry, slice: &Slice) -> bool {
    pin_range(registry, slice.remote_addr, slice.len as u64).is_ok_and(|pin| pin.is_device())
}
