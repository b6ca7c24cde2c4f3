//! Frames to bytes.

use super::frame::{ChunkHandle, Frame, Opened};
use super::text::put_text;
use super::{HEADER_LEN, MAX_DEVICE_CHUNKS, MAX_LEASE_RANGES};

impl Frame {
    /// The frame's bytes, header included.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![0u8; HEADER_LEN];
        out[4] = self.kind();
        let u64s = |out: &mut Vec<u8>, values: &[u64]| {
            for v in values {
                out.extend_from_slice(&v.to_le_bytes());
            }
        };
        match self {
            Self::Hello {
                magic,
                version,
                nonce,
                client_segment,
                server_segment,
            } => {
                out.extend_from_slice(magic);
                out.extend_from_slice(&version.to_le_bytes());
                out.extend_from_slice(nonce);
                put_text(&mut out, client_segment);
                put_text(&mut out, server_segment);
            }
            Self::Welcome {
                version,
                probe_addr,
                segment,
            } => {
                out.extend_from_slice(&version.to_le_bytes());
                u64s(&mut out, &[*probe_addr]);
                put_text(&mut out, segment);
            }
            Self::Open { id, addr, len } => u64s(&mut out, &[*id, *addr, *len]),
            Self::Opened { id, outcome } => {
                u64s(&mut out, &[*id]);
                match outcome {
                    Opened::Memfd { addr, len, map_len } => {
                        out.push(0);
                        u64s(&mut out, &[*addr, *len, *map_len]);
                    }
                    Opened::Plain { addr, len } => {
                        out.push(1);
                        u64s(&mut out, &[*addr, *len]);
                    }
                    Opened::Rejected(reason) => {
                        out.push(2);
                        put_text(&mut out, reason);
                    }
                    Opened::Declined { addr, len, reason } => {
                        out.push(3);
                        u64s(&mut out, &[*addr, *len]);
                        put_text(&mut out, reason);
                    }
                    Opened::Device {
                        addr,
                        len,
                        bus_id,
                        chunks,
                    } => {
                        out.push(4);
                        u64s(&mut out, &[*addr, *len]);
                        put_text(&mut out, bus_id);
                        let chunks = &chunks[..chunks.len().min(MAX_DEVICE_CHUNKS)];
                        out.push(chunks.len() as u8);
                        for chunk in chunks {
                            u64s(&mut out, &[chunk.base, chunk.len]);
                            match &chunk.handle {
                                ChunkHandle::Descriptor => out.push(0),
                                ChunkHandle::Ipc(handle) => {
                                    out.push(1);
                                    out.extend_from_slice(handle);
                                }
                                ChunkHandle::Fabric(handle) => {
                                    out.push(2);
                                    out.extend_from_slice(handle);
                                }
                            }
                        }
                    }
                }
            }
            Self::Lease { id, ranges } => {
                u64s(&mut out, &[*id]);
                let ranges = &ranges[..ranges.len().min(MAX_LEASE_RANGES)];
                out.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
                for (addr, len) in ranges {
                    u64s(&mut out, &[*addr, *len]);
                }
            }
            Self::Leased { id, granted } => {
                u64s(&mut out, &[*id]);
                let granted = &granted[..granted.len().min(MAX_LEASE_RANGES)];
                out.extend_from_slice(&(granted.len() as u32).to_le_bytes());
                out.extend(granted.iter().map(|&g| u8::from(g)));
            }
            Self::Release { id } | Self::Revoked { id } => u64s(&mut out, &[*id]),
            Self::Revoke { id, addr } => u64s(&mut out, &[*id, *addr]),
            Self::Refused { reason } => put_text(&mut out, reason),
        }
        let body = (out.len() - HEADER_LEN) as u32;
        out[..4].copy_from_slice(&body.to_le_bytes());
        out
    }
}
