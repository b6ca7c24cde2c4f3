//! The handshake RPC framing: `tern_metadata::rpc::read_frame` over a stream of arbitrary
//! bytes, frame after frame, with a small size limit chosen by the first byte. A frame that
//! reads must have consumed exactly its announced length, respect the limit, carry the type
//! byte it announced (or be a legacy Connection frame starting with `{`), and survive
//! `write_frame` → `read_frame` unchanged; every error must be the one the bytes call for.
#![cfg_attr(fuzzing, no_main)]

use tern_metadata::rpc::{FrameError, RpcType, read_frame, write_frame};

tern_fuzz::target!(|data| {
    let (selector, mut stream) = tern_fuzz::split_selector(data);
    // Limits of 1..=1021 bytes: small enough that announced lengths hit them.
    let max = 1 + usize::from(selector) * 4;
    loop {
        let before = stream;
        let announced = tern_fuzz::le_u64(before, 0);
        match read_frame(&mut stream, max) {
            Ok((ty, body)) => {
                let len = announced.expect("a frame read has a length word");
                assert!(
                    len >= 1 && len <= max as u64,
                    "length {len} against max {max}"
                );
                let len = len as usize;
                assert_eq!(before.len() - stream.len(), 8 + len, "consumed");
                let content = &before[8..8 + len];
                if content[0] == b'{' {
                    assert_eq!(ty, RpcType::Connection);
                    assert_eq!(body, content, "a legacy frame keeps its first byte");
                } else {
                    assert_eq!(ty as u8, content[0]);
                    assert_eq!(body, &content[1..]);
                }
                let mut wire = Vec::new();
                write_frame(&mut wire, ty, &body).expect("writing to a Vec");
                let (again_ty, again) =
                    read_frame(&mut &wire[..], max.max(wire.len())).expect("re-read");
                assert_eq!((again_ty, again), (ty, body));
            }
            Err(FrameError::ZeroLength) => {
                assert_eq!(announced, Some(0));
                break;
            }
            Err(FrameError::TooLong { len, max: limit }) => {
                assert_eq!(limit, max);
                assert_eq!(Some(len), announced);
                assert!(len > max as u64);
                break;
            }
            Err(FrameError::UnknownType(byte)) => {
                let len = announced.expect("a typed frame has a length word") as usize;
                assert_eq!(before.get(8).copied(), Some(byte));
                assert!(RpcType::from_byte(byte).is_none() && byte != b'{');
                assert_eq!(
                    before.len() - stream.len(),
                    8 + len,
                    "the frame was read whole"
                );
                break;
            }
            Err(FrameError::Io(_)) => {
                let complete = announced.is_some_and(|len| (before.len() - 8) as u64 >= len);
                assert!(!complete, "an I/O error on a complete frame");
                break;
            }
            // `FrameError` is non-exhaustive: a new variant needs its property here.
            Err(other) => panic!("a FrameError this target does not know: {other:?}"),
        }
    }
});
