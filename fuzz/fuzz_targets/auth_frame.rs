//! The cluster-secret exchange's frames (`tern_metadata::auth::decode_frame`), and a
//! server's acceptance of an arbitrary hello and proof. A frame that decodes re-encodes to
//! the same bytes; a server never accepts a proof it did not compute itself.
#![cfg_attr(fuzzing, no_main)]

use tern_metadata::auth::{
    AuthFrame, Channel, ClusterSecret, HELLO_FIXED_LEN, Identity, ServerExchange, decode_frame,
    hello_len,
};

tern_fuzz::target!(|data| {
    if let Ok(frame) = decode_frame(data) {
        assert_eq!(
            frame.encode(),
            data,
            "a decoded frame re-encodes to its bytes"
        );
        assert_eq!(decode_frame(&frame.encode()).ok(), Some(frame.clone()));
        let len = match frame.kind() {
            tern_metadata::auth::FrameKind::Hello => hello_len(data).unwrap_or(HELLO_FIXED_LEN),
            kind => kind.frame_len(),
        };
        assert_eq!(frame.encode().len(), len);
    }
    // The first bytes as a client's hello, the rest as its proof: random bytes never pass.
    let secret = ClusterSecret::new(b"fuzz").expect("a non-empty secret");
    let split = hello_len(data).unwrap_or(HELLO_FIXED_LEN).min(data.len());
    let me = Identity::default();
    if let Ok((server, challenge)) =
        ServerExchange::accept(&secret, Channel::Rpc, &me, &data[..split])
    {
        assert!(matches!(
            decode_frame(&challenge),
            Ok(AuthFrame::Challenge { .. })
        ));
        assert!(
            server.finish(&data[split..]).is_err(),
            "a proof made without the server's nonce was accepted"
        );
    }
});
