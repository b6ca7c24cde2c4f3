//! A peer's device memory: mapped here chunk by chunk (CUDA IPC handles, or VMM
//! descriptors) and copied by the GPU, never the CPU; a slice that spans chunks maps and
//! copies each.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use parking_lot::RwLock;
use tern_engine::{Opcode, Slice, TransferError};

use super::Link;
use super::copy::COPY_PIECE;
use super::request::{Refusal, Reply, Way};
use crate::declines::DEVICE_UNMAPPED;
use crate::wire::{ChunkHandle, DeviceChunk};
use tern_cuda::PeerHandle;

/// A chunk of a peer's device buffer, mapped into this process.
#[derive(Debug)]
pub(super) struct DeviceMapped {
    /// Start of the registered buffer it belongs to in the peer (revocations name it).
    pub(super) buffer: u64,
    /// The chunk's start in the peer.
    base: u64,
    /// Its length.
    len: u64,
    /// The mapping until revoked or the peer left, then `None` (copies hold the read side,
    /// as for a memfd's `Mapped`).
    live: RwLock<Option<tern_cuda::PeerMemory>>,
}

impl DeviceMapped {
    fn holds(&self, addr: u64) -> bool {
        addr >= self.base && addr - self.base < self.len
    }

    pub(super) fn unmap(&self) {
        self.live.write().take();
    }
}

/// What a chunk of a peer's device buffer came with.
enum Shared {
    Ipc([u8; tern_cuda::IPC_HANDLE_LEN]),
    Fd(OwnedFd),
    Fabric([u8; tern_cuda::FABRIC_HANDLE_LEN]),
}

impl Link {
    /// Maps the chunks of the peer's device buffer `addr..addr + len` that this link does
    /// not hold yet, each with the IPC handle or descriptor it came with. A chunk that does
    /// not map here (another GPU this process cannot reach, a driver that refuses) makes the
    /// whole buffer declined to the next transport, remembered for its later slices.
    pub(super) fn map_device(
        &self,
        addr: u64,
        len: u64,
        bus_id: &str,
        chunks: Vec<DeviceChunk>,
        fds: Vec<OwnedFd>,
    ) -> Reply {
        let mut fds = fds.into_iter();
        let mut fresh = Vec::new();
        let mut failure = None;
        for chunk in chunks {
            let shared = match chunk.handle {
                ChunkHandle::Ipc(handle) => Shared::Ipc(handle),
                ChunkHandle::Fabric(handle) => Shared::Fabric(handle),
                ChunkHandle::Descriptor => match fds.next() {
                    Some(fd) => Shared::Fd(fd),
                    None => {
                        return Reply::Refused(
                            "the peer sent a device chunk without its descriptor".into(),
                        );
                    }
                },
            };
            if chunk.len == 0 || self.device_chunk(chunk.base).is_some() {
                continue;
            }
            let mapped = tern_cuda::Device::by_bus_id(bus_id).and_then(|device| match &shared {
                Shared::Ipc(handle) => device.open_ipc(handle, chunk.len),
                Shared::Fd(fd) => device.map_shared(PeerHandle::Fd(fd), chunk.len),
                Shared::Fabric(handle) => device.map_shared(PeerHandle::Fabric(handle), chunk.len),
            });
            match mapped {
                Ok(memory) => fresh.push(Arc::new(DeviceMapped {
                    buffer: addr,
                    base: chunk.base,
                    len: chunk.len,
                    live: RwLock::new(Some(memory)),
                })),
                Err(e) => {
                    failure = Some(e.to_string());
                    break;
                }
            }
        }
        if let Some(why) = failure {
            tracing::warn!("shm peer {}: {}: {why}", self.peer, DEVICE_UNMAPPED);
            self.declined.lock().push((addr, len, DEVICE_UNMAPPED));
            return Reply::Declined(why);
        }
        self.device_maps.write().extend(fresh);
        Reply::Device
    }

    /// The mapped chunk of a peer's device buffer holding `addr`.
    pub(super) fn device_chunk(&self, addr: u64) -> Option<Arc<DeviceMapped>> {
        let chunks = self.device_maps.read();
        chunks.iter().find(|c| c.holds(addr)).cloned()
    }

    /// Moves one slice to or from the peer's device memory, chunk by chunk, each piece by a
    /// GPU copy between the local range and the chunk mapped here; asks the peer for the
    /// chunks it has not mapped yet on the way. The task is checked between pieces, as for
    /// mappings.
    pub(super) fn copy_device(&self, slice: Slice) {
        if !slice.is_live() {
            slice.abandon();
            return;
        }
        let mut at = 0usize;
        let mut asked_at = None;
        while at < slice.len {
            if at > 0 && !slice.is_live_by_clock() {
                slice.cut_off(false);
                return;
            }
            let remote = slice.remote_addr + at as u64;
            let Some(chunk) = self.device_chunk(remote) else {
                if asked_at == Some(at) {
                    return slice.fail(TransferError::Protocol {
                        peer: self.peer.clone(),
                        message: format!("its answer did not map the device memory at {remote:#x}"),
                    });
                }
                asked_at = Some(at);
                match self.open(&slice, remote, (slice.len - at) as u64) {
                    Ok(Way::Device) => continue,
                    Ok(_) => {
                        return slice.fail(TransferError::Protocol {
                            peer: self.peer.clone(),
                            message: format!(
                                "part of a device buffer at {remote:#x} was answered as host \
                                 memory"
                            ),
                        });
                    }
                    // Part of it has moved already: the slice fails instead.
                    Err(Refusal::Device(_, why)) if at > 0 => {
                        return slice.fail(TransferError::Protocol {
                            peer: self.peer.clone(),
                            message: format!("device memory at {remote:#x}: {why}"),
                        });
                    }
                    Err(refusal) => return self.refused(slice, refusal),
                }
            };
            let live = chunk.live.read();
            let Some(memory) = live.as_ref() else {
                drop(live);
                return self.reject(slice);
            };
            let offset = remote - chunk.base;
            let piece = (slice.len - at)
                .min(usize::try_from(chunk.len - offset).unwrap_or(usize::MAX))
                .min(COPY_PIECE);
            let copied = slice.local().copy_with_peer_device(
                slice.local_addr + at,
                piece,
                memory,
                offset,
                slice.opcode() == Opcode::Write,
                slice.device_order(),
            );
            drop(live);
            if let Err(e) = copied {
                return slice.fail(TransferError::Protocol {
                    peer: self.peer.clone(),
                    message: format!("device copy: {e}"),
                });
            }
            at += piece;
        }
        self.completed(slice);
    }
}
