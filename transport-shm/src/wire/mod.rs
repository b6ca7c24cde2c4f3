//! The frames of the shared-memory socket. Tern-native (no Mooncake format binds it):
//! little-endian, each frame `u32 body length | u8 kind | body`, bodies of fixed fields and
//! `u16`-length-prefixed UTF-8 strings. The client (the initiator) speaks first, after the
//! cluster-secret exchange when there is a secret:
//!
//! ```text
//!  client                                                server (owner of the memory)
//!   Hello   { magic, version, nonce, client segment, wanted segment } ──▶
//!                                              ◀── Welcome { version, probe address, segment }
//!   (reads 16 bytes at the probe address by cross-memory attach: the nonce, if permitted)
//!   Open    { id, addr, len }                   ──▶
//!                                              ◀── Opened  { id, memfd region + 1 fd | plain region | rejected, reason
//!                                                            | declined, reason
//!                                                            | device region, bus ID, chunks (IPC handle or 1 fd each) }
//!   Lease   { id, [addr, len]… }                ──▶   pins each range (registered, remote-accessible)
//!                                              ◀── Leased  { id, [granted?]… }
//!   (cross-memory attach into the granted ranges)
//!   Release { id }                              ──▶   unpins
//!                                              ◀── Revoke  { id, addr }   (a mapped buffer is being unregistered)
//!   Revoked { id }                              ──▶   (no copy into it runs, none will)
//!                                              ◀── Refused { reason }     (bad input; the server closes)
//! ```
//!
//! [`decode()`] reads one frame's body and never panics, whatever the bytes (fuzzed through
//! its tests); [`FrameReader`] cuts frames out of a stream and keeps the descriptors that
//! came along.
//!
//! One idea per module: the frames and their kind bytes (`frame`), frames to bytes
//! (`encode`), bytes to frames (`decode`), the string fields both share (`text`), what can
//! be wrong with bytes read (`error`), and frames on the socket (`stream`).

mod decode;
mod encode;
mod error;
mod frame;
mod stream;
mod text;

pub use decode::decode;
pub use error::WireError;
pub use frame::{ChunkHandle, DeviceChunk, Frame, Opened};
pub use stream::{FrameReader, send};

/// First bytes of a Hello: a node that reads anything else closes.
pub const MAGIC: [u8; 8] = *b"TERNSHM\x01";
/// Bytes before a frame's body.
pub const HEADER_LEN: usize = 5;
/// Longest body accepted.
pub const MAX_BODY: usize = 64 << 10;
/// Longest string field.
pub const MAX_TEXT: usize = 1024;
/// Most ranges one Lease asks for.
pub const MAX_LEASE_RANGES: usize = 1024;
/// Bytes of the probe nonce.
pub const NONCE_LEN: usize = 16;
/// Most chunks of device memory one Opened hands out (each may carry a descriptor); a range
/// over more is asked for again from where the answer ended.
pub const MAX_DEVICE_CHUNKS: usize = 32;
/// Bytes of a CUDA IPC handle.
pub const IPC_HANDLE_LEN: usize = 64;
/// Bytes of a CUDA fabric handle (`CUmemFabricHandle`).
pub const FABRIC_HANDLE_LEN: usize = 64;
