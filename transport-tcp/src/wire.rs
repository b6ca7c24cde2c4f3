//! The bytes on the wire: request headers and v2 status frames, and the aligned framing
//! (v3) that pads both to [`FRAME_ALIGN`] bytes.
//!
//! v1 and v2 are Mooncake's. The kernel copies a socket's bytes into its buffers one after
//! another, so a frame of 8 or 24 bytes shifts every block behind it off the cache-line grid,
//! and both sides then copy the block out of line (the README's TCP section has what that
//! costs). v3, spoken only to a peer whose descriptor says `tcp_proto_version` 3 or more,
//! pads the header and the status frames to [`FRAME_ALIGN`] bytes, so a block whose length
//! is a multiple of it keeps the alignment of the block before it.

/// Length of a request header.
pub const HEADER_LEN: usize = 24;
/// Opcode of a READ (remote → initiator).
pub const OP_READ: u8 = 0;
/// Opcode of a WRITE (initiator → remote).
pub const OP_WRITE: u8 = 1;
/// Opcode bit that marks protocol v2.
pub const OP_V2: u8 = 0x80;
/// Opcode bit, beside [`OP_V2`], that marks the aligned framing (v3): the header is padded
/// to [`FRAME_ALIGN`] bytes, and so is every status frame sent back.
pub const OP_ALIGNED: u8 = 0x40;
/// What the aligned framing pads headers and status frames to: a cache line.
pub const FRAME_ALIGN: usize = 64;
/// Length of a v2 status frame.
pub const STATUS_LEN: usize = 8;
/// High 32 bits of every v2 status frame: "MCTV".
pub const STATUS_MAGIC: u64 = 0x4D43_5456_0000_0000;

/// A request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Bytes to move.
    pub size: u64,
    /// Remote virtual address.
    pub addr: u64,
    /// Opcode byte, v2 bit included.
    pub opcode: u8,
}

impl Header {
    /// Encodes the header (padding zeroed).
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut bytes = [0u8; HEADER_LEN];
        bytes[..8].copy_from_slice(&self.size.to_le_bytes());
        bytes[8..16].copy_from_slice(&self.addr.to_le_bytes());
        bytes[16] = self.opcode;
        bytes
    }

    /// Decodes a header; padding is ignored, as Mooncake does.
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Self {
        let mut word = [0u8; 8];
        word.copy_from_slice(&bytes[..8]);
        let size = u64::from_le_bytes(word);
        word.copy_from_slice(&bytes[8..16]);
        let addr = u64::from_le_bytes(word);
        Self {
            size,
            addr,
            opcode: bytes[16],
        }
    }

    /// Encodes the header as its framing sends it: [`HEADER_LEN`] bytes, or (aligned)
    /// [`FRAME_ALIGN`] with the padding zeroed. Returns the buffer and the length used.
    pub fn encode_framed(&self) -> ([u8; FRAME_ALIGN], usize) {
        let mut bytes = [0u8; FRAME_ALIGN];
        bytes[..HEADER_LEN].copy_from_slice(&self.encode());
        (bytes, self.frame_len())
    }

    /// Whether the v2 bit is set.
    pub fn is_v2(&self) -> bool {
        self.opcode & OP_V2 != 0
    }

    /// Whether the request uses the aligned framing (v3): the v2 bit and [`OP_ALIGNED`].
    pub fn is_aligned(&self) -> bool {
        self.is_v2() && self.opcode & OP_ALIGNED != 0
    }

    /// The framing the request uses: 1, 2 or 3 (aligned).
    pub fn version(&self) -> u32 {
        match (self.is_v2(), self.is_aligned()) {
            (false, _) => 1,
            (true, false) => 2,
            (true, true) => 3,
        }
    }

    /// Bytes of the request's header on the wire, padding included.
    pub fn frame_len(&self) -> usize {
        match self.version() {
            3 => FRAME_ALIGN,
            _ => HEADER_LEN,
        }
    }

    /// Bytes of each status frame sent back for the request (0 under v1).
    pub fn status_len(&self) -> usize {
        match self.version() {
            1 => 0,
            2 => STATUS_LEN,
            _ => FRAME_ALIGN,
        }
    }

    /// The operation without the version bits ([`OP_ALIGNED`] counts as one only beside
    /// [`OP_V2`]; without it the opcode is unknown).
    pub fn operation(&self) -> u8 {
        self.opcode & !version_bits(self.version())
    }
}

/// The opcode bits that mark framing `version` (1, 2, 3; higher speaks 3): what
/// [`Header::version`] reads back.
pub fn version_bits(version: u32) -> u8 {
    match version {
        0 | 1 => 0,
        2 => OP_V2,
        _ => OP_V2 | OP_ALIGNED,
    }
}

/// A v2 status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// The range was accepted (and, for a write, the data applied).
    Ok,
    /// The range is not inside one registered, remote-accessible buffer.
    AddressRejected,
}

impl Status {
    /// The 8-byte frame.
    pub fn encode(self) -> [u8; 8] {
        let code = match self {
            Self::Ok => 0,
            Self::AddressRejected => 1,
        };
        (STATUS_MAGIC | code).to_le_bytes()
    }

    /// The frame followed by zeros up to [`FRAME_ALIGN`] bytes; a framing sends the first
    /// [`Header::status_len`] of them.
    pub fn encode_padded(self) -> [u8; FRAME_ALIGN] {
        let mut bytes = [0u8; FRAME_ALIGN];
        bytes[..STATUS_LEN].copy_from_slice(&self.encode());
        bytes
    }

    /// Reads a frame; `Err` carries the raw value when it is not a known status.
    pub fn decode(bytes: [u8; 8]) -> Result<Self, u64> {
        match u64::from_le_bytes(bytes) {
            v if v == STATUS_MAGIC => Ok(Self::Ok),
            v if v == STATUS_MAGIC | 1 => Ok(Self::AddressRejected),
            other => Err(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_layout_is_mooncakes() {
        let header = Header {
            size: 0x0102,
            addr: 0x1122_3344_5566_7788,
            opcode: OP_WRITE | OP_V2,
        };
        let bytes = header.encode();
        assert_eq!(&bytes[..8], &[2, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            &bytes[8..16],
            &[0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11]
        );
        assert_eq!(bytes[16], 0x81);
        assert_eq!(&bytes[17..], &[0; 7]);
        assert_eq!(Header::decode(&bytes), header);
        assert!(header.is_v2());
        assert_eq!(header.operation(), OP_WRITE);
    }

    #[test]
    fn aligned_frames_pad_header_and_status_to_a_cache_line() {
        let header = Header {
            size: 4096,
            addr: 0x1000,
            opcode: OP_READ | OP_V2 | OP_ALIGNED,
        };
        assert!(header.is_aligned());
        assert_eq!((header.operation(), header.version()), (OP_READ, 3));
        assert_eq!((header.frame_len(), header.status_len()), (64, 64));
        let (bytes, len) = header.encode_framed();
        assert_eq!(len, 64);
        assert_eq!(&bytes[..HEADER_LEN], &header.encode());
        assert!(bytes[HEADER_LEN..].iter().all(|&b| b == 0));
        let padded = Status::AddressRejected.encode_padded();
        assert_eq!(&padded[..8], &Status::AddressRejected.encode());
        assert!(padded[8..].iter().all(|&b| b == 0));

        // v2 and v1 keep their lengths; the aligned bit without v2 is no known operation.
        let v2 = Header {
            opcode: OP_WRITE | OP_V2,
            ..header
        };
        assert_eq!(
            (v2.frame_len(), v2.status_len(), v2.operation()),
            (24, 8, OP_WRITE)
        );
        let v1 = Header {
            opcode: OP_READ,
            ..header
        };
        assert_eq!((v1.frame_len(), v1.status_len(), v1.version()), (24, 0, 1));
        let stray = Header {
            opcode: OP_WRITE | OP_ALIGNED,
            ..header
        };
        assert!(!stray.is_aligned());
        assert_eq!(stray.operation(), OP_WRITE | OP_ALIGNED);
        assert_eq!(stray.frame_len(), HEADER_LEN);
    }

    #[test]
    fn status_frames_spell_mctv() {
        let ok = Status::Ok.encode();
        assert_eq!(&ok[4..], b"VTCM");
        assert_eq!(&ok[..4], &[0, 0, 0, 0]);
        assert_eq!(
            Status::decode(Status::AddressRejected.encode()),
            Ok(Status::AddressRejected)
        );
        assert_eq!(Status::decode([1, 0, 0, 0, 0, 0, 0, 0]), Err(1));
    }
}
