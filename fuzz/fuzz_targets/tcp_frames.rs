//! The TCP data protocol's frames: `Header::decode` on the first 24 bytes and
//! `Status::decode` on every 8-byte window after them. Both must agree with their encoders:
//! a decoded header re-encodes to the same bytes with the padding zeroed, the v2 bit and the
//! operation split the opcode byte, and a status decodes only from its exact frame.
#![cfg_attr(fuzzing, no_main)]

use tern_transport_tcp::{HEADER_LEN, Header, OP_V2, STATUS_MAGIC, Status};

tern_fuzz::target!(|data| {
    if let Some(bytes) = data.get(..HEADER_LEN) {
        let bytes: &[u8; HEADER_LEN] = bytes.try_into().expect("24 bytes");
        let header = Header::decode(bytes);
        assert_eq!(Some(header.size), tern_fuzz::le_u64(bytes, 0));
        assert_eq!(Some(header.addr), tern_fuzz::le_u64(bytes, 8));
        assert_eq!(header.opcode, bytes[16]);
        assert_eq!(header.is_v2(), bytes[16] & OP_V2 != 0);
        assert_eq!(header.operation() | (bytes[16] & OP_V2), bytes[16]);
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
                assert_eq!(raw & !1, STATUS_MAGIC);
            }
            Err(value) => {
                assert_eq!(value, raw);
                assert!(raw != STATUS_MAGIC && raw != STATUS_MAGIC | 1);
            }
        }
    }
});
