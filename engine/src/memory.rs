//! Registered memory: allocation, raw registration on every transport (all or none),
//! unregistration, and the descriptor that publishes it.

use std::sync::{Arc, Weak};

use tern_memreg::{AlignedBuffer, MemoryError, Region, RegionInfo, RegionPin, RegisterRaw};
use tern_metadata::SegmentDesc;

use crate::engine::{EngineInner, TransferEngine};
use crate::error::EngineError;
use crate::transport::{PeerSegment, Transport, keyless_buffer};
use crate::types::SegmentId;

impl TransferEngine {
    /// Allocates `len` bytes owned by the engine, registers them remote-accessible with
    /// `location` (e.g. `cpu:0`, or `*`), and returns the buffer. Dropping it unregisters.
    pub fn allocate(&self, len: usize, location: &str) -> Result<OwnedBuffer, EngineError> {
        if len == 0 {
            return Err(EngineError::InvalidArgument(
                "allocate of zero bytes".into(),
            ));
        }
        let mut buffer = self.inner.allocate_buffer(len)?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = self
            .inner
            .pretouch
            .threads_for(len, cores, self.inner.transports.len());
        if threads > 0 {
            buffer.pretouch(threads);
        }
        let region = self
            .inner
            .register(vec![Region::owned(buffer, location, true)])?
            .pop()
            .ok_or_else(|| EngineError::InvalidArgument("registration returned nothing".into()))?;
        let pin = region
            .pin_owned()
            .ok_or_else(|| EngineError::InvalidArgument("owned region cannot be pinned".into()))?;
        Ok(OwnedBuffer {
            pin,
            engine: self.inner.weak.clone(),
        })
    }

    /// Unregisters the region starting at `addr`. Fails with `RegionInUse` while a submitted
    /// task still uses it, and with `AddressNotRegistered` for an unknown address.
    pub fn unregister_memory(&self, addr: usize) -> Result<(), EngineError> {
        self.unregister_memory_batch(&[addr])
    }

    /// Unregisters several regions: all or none.
    pub fn unregister_memory_batch(&self, addrs: &[usize]) -> Result<(), EngineError> {
        self.inner.unregister(addrs)
    }

    /// Pins the registered region (raw or owned) that holds all of `[addr, addr + len)`, for
    /// copies into or out of it by address. While the pin lives, unregistering the region
    /// fails with `RegionInUse`, so the memory stays valid for the pin's
    /// [`RegionPin::copy_from_slice`] and [`RegionPin::copy_to_slice`]. Fails with
    /// `AddressNotRegistered` when no one region holds the range.
    pub fn pin_local(&self, addr: usize, len: usize) -> Result<RegionPin, EngineError> {
        Ok(self.inner.registry.pin(addr, len)?)
    }

    /// The facts of every registered region.
    pub fn registered_regions(&self) -> Vec<RegionInfo> {
        self.inner.registry.snapshot()
    }
}

impl RegisterRaw for TransferEngine {
    type Error = EngineError;

    fn register_region(&self, region: Region) -> Result<(), EngineError> {
        self.inner.register(vec![region]).map(|_| ())
    }

    fn register_regions(&self, regions: Vec<Region>) -> Result<(), EngineError> {
        self.inner.register(regions).map(|_| ())
    }
}

impl EngineInner {
    /// Memory for `allocate`: what the highest-priority transport that wants buffers of its
    /// own kind gives, else ordinary aligned memory.
    fn allocate_buffer(&self, len: usize) -> Result<AlignedBuffer, EngineError> {
        let mut by_priority: Vec<&Arc<dyn Transport>> = self.transports.iter().collect();
        by_priority.sort_by_key(|t| std::cmp::Reverse(t.priority()));
        for transport in by_priority {
            if let Some(offered) = transport.allocate(len) {
                return offered.map_err(|source| EngineError::Transport {
                    protocol: transport.protocol(),
                    source,
                });
            }
        }
        AlignedBuffer::new(len)
            .ok_or_else(|| EngineError::InvalidArgument(format!("cannot allocate {len} bytes")))
    }

    /// Registers regions on the registry and every transport, all or none, then publishes.
    pub(crate) fn register(&self, regions: Vec<Region>) -> Result<Vec<Arc<Region>>, EngineError> {
        let _change = self.change.lock();
        let mut done: Vec<Arc<Region>> = Vec::with_capacity(regions.len());
        let mut failure = None;
        'regions: for region in regions {
            let region = match self.registry.register(region) {
                Ok(region) => region,
                Err(e) => {
                    failure = Some(EngineError::from(e));
                    break;
                }
            };
            for (i, transport) in self.transports.iter().enumerate() {
                if let Err(e) = transport.register_memory(region.info()) {
                    for earlier in &self.transports[..i] {
                        earlier.unregister_memory(region.info());
                    }
                    self.forget(region.addr());
                    failure = Some(EngineError::Transport {
                        protocol: transport.protocol(),
                        source: e,
                    });
                    break 'regions;
                }
            }
            done.push(region);
        }
        if let Some(error) = failure {
            for region in &done {
                for transport in &self.transports {
                    transport.unregister_memory(region.info());
                }
                self.forget(region.addr());
            }
            return Err(error);
        }
        self.republish()?;
        Ok(done)
    }

    /// Removes a region that was registered a moment ago and never handed out.
    pub(crate) fn forget(&self, addr: usize) {
        if self.registry.unregister(addr).is_err() {
            self.registry.remove_owned(addr);
        }
    }

    pub(crate) fn unregister(&self, addrs: &[usize]) -> Result<(), EngineError> {
        let _change = self.change.lock();
        let removed = self.registry.unregister_all(addrs)?;
        for region in &removed {
            for transport in &self.transports {
                transport.unregister_memory(region.info());
            }
        }
        self.republish()
    }

    pub(crate) fn release_owned(&self, addr: usize) {
        let _change = self.change.lock();
        if let Some(region) = self.registry.remove_owned(addr) {
            for transport in &self.transports {
                transport.unregister_memory(region.info());
            }
            if let Err(e) = self.republish() {
                tracing::warn!("republishing after freeing {addr:#x}: {e}");
            }
        }
    }

    /// Rebuilds the local descriptor from the registry and the transports and publishes it.
    pub(crate) fn republish(&self) -> Result<(), EngineError> {
        let name = &self.segment_name;
        let mut desc = SegmentDesc::new(name.clone(), "");
        desc.protocol = self
            .transports
            .iter()
            .map(|t| t.protocol().to_owned())
            .collect();
        let regions: Vec<RegionInfo> = self
            .registry
            .snapshot()
            .into_iter()
            .filter(|r| r.remote_accessible)
            .collect();
        desc.buffers = regions.iter().map(|r| keyless_buffer(r, name)).collect();
        let mut by_priority: Vec<&Arc<dyn Transport>> = self.transports.iter().collect();
        by_priority.sort_by_key(|t| t.priority());
        for transport in by_priority {
            // Only the transport that owns them may change the buffers' keys.
            let buffers = (!transport.owns_buffer_keys()).then(|| desc.buffers.clone());
            transport.describe(&mut desc, &regions);
            if let Some(buffers) = buffers {
                desc.buffers = buffers;
            }
            if let Some(extension) = transport.extension(&regions) {
                desc.tern.insert(transport.protocol().to_owned(), extension);
            }
        }
        desc.stamp_now();
        let json = desc.to_json();
        *self.local.write() = Arc::new(PeerSegment {
            id: SegmentId::LOCAL,
            name: name.clone(),
            desc: desc.clone(),
            rpc: self.rpc_meta.clone(),
            routes: Default::default(),
        });
        *self.local_json.write() = Arc::new(json);
        self.store.publish_segment(name, &desc)?;
        Ok(())
    }
}

/// Memory allocated and registered by the engine. Dropping it unregisters it; transfers
/// still in flight keep the memory alive until they finish.
#[derive(Debug)]
pub struct OwnedBuffer {
    pin: RegionPin,
    engine: Weak<EngineInner>,
}

impl OwnedBuffer {
    /// Start address, for [`TransferRequest::source`](crate::TransferRequest::source) and for peers.
    pub fn addr(&self) -> usize {
        self.pin.info().addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.pin.info().len
    }

    /// Always false.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Copies `data` into the buffer at `offset`.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> Result<(), EngineError> {
        self.pin
            .copy_from_slice(self.at(offset)?, data)
            .map_err(range_error)
    }

    /// Copies bytes at `offset` out into `out`.
    pub fn read_at(&self, offset: usize, out: &mut [u8]) -> Result<(), EngineError> {
        self.pin
            .copy_to_slice(self.at(offset)?, out)
            .map_err(range_error)
    }

    fn at(&self, offset: usize) -> Result<usize, EngineError> {
        self.addr()
            .checked_add(offset)
            .ok_or_else(|| EngineError::InvalidArgument(format!("offset {offset} overflows")))
    }
}

fn range_error(error: MemoryError) -> EngineError {
    EngineError::InvalidArgument(error.to_string())
}

impl Drop for OwnedBuffer {
    fn drop(&mut self) {
        if let Some(engine) = self.engine.upgrade() {
            engine.release_owned(self.addr());
        }
    }
}
