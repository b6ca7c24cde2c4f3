//! Copies between pinned regions and device memory, by the GPU's copy engine: the CPU
//! touches neither side.

use tern_cuda::DeviceOrder;

use super::{MemoryError, RegionPin};

impl RegionPin {
    /// Copies `[addr, addr + len)` of this pinned region to `[offset, offset + len)` of a
    /// same-host peer's device memory mapped here (`to_peer`), or back, with the GPU's copy
    /// engine, after what `order` asks of the device's earlier work; both ranges are checked
    /// first. The CPU touches neither side.
    pub fn copy_with_peer_device(
        &self,
        addr: usize,
        len: usize,
        peer: &tern_cuda::PeerMemory,
        offset: u64,
        to_peer: bool,
        order: DeviceOrder,
    ) -> Result<(), MemoryError> {
        let local = match self.device_range(addr, len)? {
            Some(range) => range.addr,
            None => self.slice(addr, len)?.as_ptr() as u64,
        };
        let inside = offset
            .checked_add(len as u64)
            .is_some_and(|end| end <= peer.len());
        if !inside {
            return Err(MemoryError::OutOfRange {
                addr: offset as usize,
                len,
                region_addr: 0,
                region_len: peer.len() as usize,
            });
        }
        let remote = peer.addr() + offset;
        let (dst, src) = if to_peer {
            (remote, local)
        } else {
            (local, remote)
        };
        // SAFETY: the local range lies in this pinned region (checked above), which stays
        // registered, allocated and writable by Tern while pinned; the peer's range lies in
        // memory this process mapped or opened and holds through the borrow of `peer`
        // (checked above). The peer's bytes change only by copies like this one, and what
        // the local side holds meanwhile is the caller's to order, as for every transfer.
        unsafe { peer.device().copy_any(dst, src, len, order) }
            .map_err(|reason| MemoryError::Device { addr, reason })
    }

    /// Copies `[src_addr, src_addr + len)` of this pinned region to `[dst_addr, dst_addr +
    /// len)` of `dst` when either is device memory, with the GPU's copy engine (two regions
    /// of one process: unified addressing reaches both), after what `order` asks of the
    /// device's earlier work. Both ranges are checked first.
    pub fn copy_to_with_device(
        &self,
        src_addr: usize,
        dst: &RegionPin,
        dst_addr: usize,
        len: usize,
        order: DeviceOrder,
    ) -> Result<(), MemoryError> {
        let address = |pin: &RegionPin,
                       addr: usize|
         -> Result<(u64, Option<&'static tern_cuda::Device>), MemoryError> {
            Ok(match pin.device_range(addr, len)? {
                Some(range) => (range.addr, Some(range.device)),
                None => (pin.slice(addr, len)?.as_ptr() as u64, None),
            })
        };
        let (from, from_device) = address(self, src_addr)?;
        let (to, to_device) = address(dst, dst_addr)?;
        let Some(device) = to_device.or(from_device) else {
            return Err(MemoryError::DeviceMemory {
                addr: src_addr,
                len,
            });
        };
        // SAFETY: both ranges lie in pinned regions (checked above), which stay registered,
        // allocated and writable by Tern while pinned; what else touches them meanwhile is
        // the caller's to order, as for every transfer.
        unsafe { device.copy_any(to, from, len, order) }.map_err(|reason| MemoryError::Device {
            addr: dst_addr,
            reason,
        })
    }
}
