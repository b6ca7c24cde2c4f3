//! A Notify RPC body (`{"name": ..., "notify_msg": ...}`), read as the engine reads it: into
//! a JSON value first (a body that is not JSON drops the connection), then into
//! `tern_engine::Notify`. Properties: when a direct read accepts the body too, both give the
//! same notification (neither read accepts a superset of the other: the value rejects bad
//! UTF-8 in strings the direct read skips, the direct read rejects repeated keys), and a
//! notification writes back to an equal value.
#![cfg_attr(fuzzing, no_main)]

use tern_engine::Notify;

tern_fuzz::target!(|data| {
    let Some(notify) = serde_json::from_slice::<serde_json::Value>(data)
        .ok()
        .and_then(|value| serde_json::from_value::<Notify>(value).ok())
    else {
        return;
    };
    if let Ok(direct) = serde_json::from_slice::<Notify>(data) {
        assert_eq!(direct, notify);
    }
    let json = serde_json::to_vec(&notify).expect("two strings serialise");
    assert_eq!(serde_json::from_slice::<Notify>(&json).ok(), Some(notify));
});
