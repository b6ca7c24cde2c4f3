//! The TCP data protocol's frames: `Header::decode` on the first 24 bytes and
//! `Status::decode` on every 8-byte window after them. Both must agree with their encoders:
//! a decoded header re-encodes to the same bytes with the padding zeroed, the version bits
//! (v2, and the aligned bit beside it) and the operation split the opcode byte, the framing's
//! lengths follow its version, and a status decodes only from its exact frame.
#![cfg_attr(fuzzing, no_main)]

use tern_transport_tcp::{
    FRAME_ALIGN, HEADER_LEN, Header, OP_ALIGNED, OP_V2, STATUS_LEN, STATUS_MAGIC, Status,
};

tern_fuzz::target!(|data| {
    if let Some(bytes) = data.get(..HEADER_LEN) {
        let bytes: &[u8; HEADER_LEN] = bytes.try_into().expect("24 bytes");
        let header = Header::decode(bytes);
        assert_eq!(Some(header.size), tern_fuzz::le_u64(bytes, 0));
        assert_eq!(Some(header.addr), tern_fuzz::le_u64(bytes, 8));
        assert_eq!(header.opcode, bytes[16]);
        let v2 = bytes[16] & OP_V2 != 0;
        let aligned = v2 && bytes[16] & OP_ALIGNED != 0;
        assert_eq!((header.is_v2(), header.is_aligned()), (v2, aligned));
        let version_bits = if aligned {
            OP_V2 | OP_ALIGNED
        } else {
            bytes[16] & OP_V2
        };
        assert_eq!(header.operation() | version_bits, bytes[16]);
        assert_eq!(header.operation() & version_bits, 0);
        let (frame_len, status_len, version) = match (v2, aligned) {
            (false, _) => (HEADER_LEN, 0, 1),
            (true, false) => (HEADER_LEN, STATUS_LEN, 2),
            (true, true) => (FRAME_ALIGN, FRAME_ALIGN, 3),
        };
        assert_eq!(
            (header.frame_len(), header.status_len(), header.version()),
            (frame_len, status_len, version)
        );
        let (framed, len) = header.encode_framed();
        assert_eq!(len, frame_len);
        assert_eq!(&framed[..HEADER_LEN], &header.encode());
        assert!(framed[HEADER_LEN..].iter().all(|&b| b == 0));
        let encoded = header.encode();
        assert_eq!(&encoded[..17], &bytes[..17]);
        assert_eq!(&encoded[17..], &[0u8; 7], "padding is zeroed");
        assert_eq!(Header::decode(&encoded), header);
    }
    for window in data.get(HEADER_LEN..).unwrap_or_default().chunks_exact(8) {
        let frame: [u8; 8] = window.try_into().expect("8 bytes");
        let raw = u64::from_le_bytes(frame);
        match Status::decode(frame) {
            Ok(status) => {
                assert_eq!(status.encode(), frame);
                let padded = status.encode_padded();
                assert_eq!(&padded[..STATUS_LEN], &frame);
                assert!(padded[STATUS_LEN..].iter().all(|&b| b == 0));
                assert_eq!(raw & !1, STATUS_MAGIC);
            }
            Err(value) => {
                assert_eq!(value, raw);
                assert!(raw != STATUS_MAGIC && raw != STATUS_MAGIC | 1);
            }
        }
    }
});
