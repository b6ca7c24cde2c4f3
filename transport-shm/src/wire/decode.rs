//! Bytes to frames: [`decode()`] reads one frame's body and never panics, whatever the bytes.

use super::error::WireError;
use super::frame::{self, ChunkHandle, DeviceChunk, Frame, Opened};
use super::{MAX_BODY, MAX_DEVICE_CHUNKS, MAX_LEASE_RANGES};

/// Reads fields off a body, failing (never panicking) when it runs short.
pub(super) struct Body<'a> {
    bytes: &'a [u8],
    kind: &'static str,
}

impl<'a> Body<'a> {
    pub(super) fn bad(&self, why: impl Into<String>) -> WireError {
        WireError::Malformed {
            kind: self.kind,
            why: why.into(),
        }
    }

    pub(super) fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.bytes.len() < n {
            return Err(self.bad(format!("{} bytes short", n - self.bytes.len())));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }

    pub(super) fn u16(&mut self) -> Result<u16, WireError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, WireError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }

    fn u64(&mut self) -> Result<u64, WireError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    /// A count of ranges, at most [`MAX_LEASE_RANGES`].
    fn count(&mut self) -> Result<usize, WireError> {
        let count = self.u32()? as usize;
        if count > MAX_LEASE_RANGES {
            return Err(self.bad(format!("{count} ranges")));
        }
        Ok(count)
    }

    fn end(self) -> Result<(), WireError> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(self.bad(format!("{} bytes after its end", self.bytes.len())))
        }
    }
}

/// Decodes one frame from its kind byte and body. Total: any input gives a frame or an
/// error.
pub fn decode(kind: u8, body: &[u8]) -> Result<Frame, WireError> {
    if body.len() > MAX_BODY {
        return Err(WireError::TooLong(body.len()));
    }
    let name = frame::name(kind).ok_or(WireError::UnknownKind(kind))?;
    let mut b = Body {
        bytes: body,
        kind: name,
    };
    let frame = match kind {
        frame::HELLO => Frame::Hello {
            magic: b.array()?,
            version: b.u16()?,
            nonce: b.array()?,
            client_segment: b.text()?,
            server_segment: b.text()?,
        },
        frame::WELCOME => Frame::Welcome {
            version: b.u16()?,
            probe_addr: b.u64()?,
            segment: b.text()?,
        },
        frame::OPEN => Frame::Open {
            id: b.u64()?,
            addr: b.u64()?,
            len: b.u64()?,
        },
        frame::OPENED => {
            let id = b.u64()?;
            let outcome = match b.u8()? {
                0 => Opened::Memfd {
                    addr: b.u64()?,
                    len: b.u64()?,
                    map_len: b.u64()?,
                },
                1 => Opened::Plain {
                    addr: b.u64()?,
                    len: b.u64()?,
                },
                2 => Opened::Rejected(b.text()?),
                3 => Opened::Declined {
                    addr: b.u64()?,
                    len: b.u64()?,
                    reason: b.text()?,
                },
                4 => {
                    let (addr, len, bus_id) = (b.u64()?, b.u64()?, b.text()?);
                    let count = usize::from(b.u8()?);
                    if count > MAX_DEVICE_CHUNKS {
                        return Err(b.bad(format!("{count} device chunks")));
                    }
                    let mut chunks = Vec::with_capacity(count);
                    for _ in 0..count {
                        let (base, len) = (b.u64()?, b.u64()?);
                        let handle = match b.u8()? {
                            0 => ChunkHandle::Descriptor,
                            1 => ChunkHandle::Ipc(b.array()?),
                            2 => ChunkHandle::Fabric(b.array()?),
                            other => return Err(b.bad(format!("device chunk kind {other}"))),
                        };
                        chunks.push(DeviceChunk { base, len, handle });
                    }
                    Opened::Device {
                        addr,
                        len,
                        bus_id,
                        chunks,
                    }
                }
                other => return Err(b.bad(format!("outcome {other}"))),
            };
            Frame::Opened { id, outcome }
        }
        frame::LEASE => {
            let id = b.u64()?;
            let count = b.count()?;
            let mut ranges = Vec::with_capacity(count);
            for _ in 0..count {
                ranges.push((b.u64()?, b.u64()?));
            }
            Frame::Lease { id, ranges }
        }
        frame::LEASED => {
            let id = b.u64()?;
            let count = b.count()?;
            let mut granted = Vec::with_capacity(count);
            for _ in 0..count {
                granted.push(match b.u8()? {
                    0 => false,
                    1 => true,
                    other => return Err(b.bad(format!("grant {other}"))),
                });
            }
            Frame::Leased { id, granted }
        }
        frame::RELEASE => Frame::Release { id: b.u64()? },
        frame::REVOKED => Frame::Revoked { id: b.u64()? },
        frame::REVOKE => Frame::Revoke {
            id: b.u64()?,
            addr: b.u64()?,
        },
        _ => Frame::Refused { reason: b.text()? },
    };
    b.end()?;
    Ok(frame)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::HEADER_LEN;
    use crate::wire::frame::{KINDS, LEASE, samples};

    #[test]
    fn every_frame_round_trips_and_every_cut_is_an_error() {
        for frame in samples() {
            let bytes = frame.encode();
            let len = u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize;
            assert_eq!(len + HEADER_LEN, bytes.len());
            assert_eq!(
                decode(bytes[4], &bytes[HEADER_LEN..]).as_ref(),
                Ok(&frame),
                "{frame:?}"
            );
            for cut in HEADER_LEN..bytes.len() {
                assert!(
                    decode(bytes[4], &bytes[HEADER_LEN..cut]).is_err(),
                    "{frame:?} cut at {cut}"
                );
            }
            let mut longer = bytes[HEADER_LEN..].to_vec();
            longer.push(0);
            assert!(decode(bytes[4], &longer).is_err());
        }
        assert_eq!(decode(0x42, &[]), Err(WireError::UnknownKind(0x42)));
    }

    #[test]
    fn pseudo_random_bytes_never_panic_the_decoder() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for round in 0..20_000 {
            let len = round % 80;
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            for kind in KINDS {
                let _ = decode(kind, &bytes);
            }
        }
        // A huge count in a short body is refused, not allocated.
        let mut lease = vec![0u8; 8];
        lease.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(LEASE, &lease).is_err());
    }
}
