//! The one check of a peer's range against a registry: the owner makes it before it answers
//! an Open or grants a lease, and an engine of this process makes it on the other engine's
//! registry before it copies there (`client::copy_in_registry`).

use tern_memreg::{MemoryRegistry, RegionPin};

/// Pins the registered, remote-accessible region of `registry` holding `[addr, addr + len)`;
/// why not, for a range that does not fit this address space, is empty, or is not inside
/// such a region.
pub(crate) fn pin_range(
    registry: &MemoryRegistry,
    addr: u64,
    len: u64,
) -> Result<RegionPin, String> {
    let (Ok(addr), Ok(len)) = (usize::try_from(addr), usize::try_from(len)) else {
        return Err("the range does not fit this address space".into());
    };
    if len == 0 {
        return Err("a range of zero bytes".into());
    }
    registry.pin_remote(addr, len).map_err(|e| e.to_string())
}
