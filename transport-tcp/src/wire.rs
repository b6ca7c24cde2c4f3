//! The bytes on the wire: request headers and v2 status frames.

/// Length of a request header.
pub const HEADER_LEN: usize = 24;
/// Opcode of a READ (remote → initiator).
pub const OP_READ: u8 = 0;
/// Opcode of a WRITE (initiator → remote).
pub const OP_WRITE: u8 = 1;
/// Opcode bit that marks protocol v2.
pub const OP_V2: u8 = 0x80;
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

    /// Whether the v2 bit is set.
    pub fn is_v2(&self) -> bool {
        self.opcode & OP_V2 != 0
    }

    /// The operation without the version bit.
    pub fn operation(&self) -> u8 {
        self.opcode & !OP_V2
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
