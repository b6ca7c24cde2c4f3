//! Handing a peer device memory: the chunks of the allocation it asks for, each with its
//! CUDA IPC handle or a descriptor of its physical memory.

use std::os::fd::OwnedFd;

use tern_cuda::ChunkReach;
use tern_memreg::RegionPin;

use crate::declines::DEVICE_UNSHARED;
use crate::wire::{ChunkHandle, DeviceChunk, MAX_DEVICE_CHUNKS, Opened};

/// The answer that hands a peer the device memory holding `[addr, addr + len)`, with the
/// descriptors to send along; why not, when the driver cannot share it (the peer then
/// declines the slice to the next transport, with this reason in its stats).
pub(super) fn share_device(
    pin: &RegionPin,
    addr: u64,
    len: u64,
) -> Result<(Opened, Vec<OwnedFd>), String> {
    let device = pin
        .device()
        .ok_or_else(|| "device memory without a device".to_owned())?;
    let why = |e: tern_cuda::CudaError| format!("{}: {e}", DEVICE_UNSHARED);
    let bus_id = device.bus_id().map_err(why)?;
    let shared = device.share(addr, len, MAX_DEVICE_CHUNKS).map_err(why)?;
    let mut fds = Vec::new();
    let chunks = shared
        .into_iter()
        .map(|chunk| DeviceChunk {
            base: chunk.base,
            len: chunk.len,
            handle: match chunk.reach {
                ChunkReach::Ipc(handle) => ChunkHandle::Ipc(handle),
                ChunkReach::Fabric(handle) => ChunkHandle::Fabric(handle),
                ChunkReach::Fd(fd) => {
                    fds.push(fd);
                    ChunkHandle::Descriptor
                }
            },
        })
        .collect();
    let info = pin.info();
    Ok((
        Opened::Device {
            addr: info.addr as u64,
            len: info.len as u64,
            bus_id,
            chunks,
        },
        fds,
    ))
}
