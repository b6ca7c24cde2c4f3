//! The same-host transport's socket frames: `wire::decode` on a kind byte (the selector) and
//! a body. Whatever the bytes, it gives a frame or an error; a frame it gives re-encodes to
//! exactly the bytes it came from (so no field is lost, widened or defaulted).
#![cfg_attr(fuzzing, no_main)]

use tern_transport_shm::wire::{HEADER_LEN, decode};

tern_fuzz::target!(|data| {
    let (kind, body) = tern_fuzz::split_selector(data);
    if let Ok(frame) = decode(kind, body) {
        let bytes = frame.encode();
        assert_eq!(bytes[4], kind, "{frame:?}");
        assert_eq!(
            u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as usize,
            body.len()
        );
        assert_eq!(
            &bytes[HEADER_LEN..],
            body,
            "{frame:?} re-encodes differently"
        );
    }
});
