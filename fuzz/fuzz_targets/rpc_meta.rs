//! An RPC location as stores hold it under `rpc_meta/<server>`:
//! `{"ip_or_host_name": ..., "rpc_port": ...}`, read with `serde_json` into `RpcMeta` exactly
//! as the stores' decoder does. Properties: it writes back to an equal value, and its
//! `endpoint()` splits back into the same host and port unless the host itself carries
//! brackets at its ends.
#![cfg_attr(fuzzing, no_main)]

use tern_metadata::RpcMeta;
use tern_metadata::net::split_host_port;

tern_fuzz::target!(|data| {
    let Ok(meta) = serde_json::from_slice::<RpcMeta>(data) else {
        return;
    };
    let json = serde_json::to_vec(&meta).expect("strings and integers serialise");
    let again: RpcMeta = serde_json::from_slice(&json).expect("its own JSON reads back");
    assert_eq!(again, meta);
    let endpoint = meta.endpoint();
    let host = meta.ip_or_host_name.as_str();
    if !host.is_empty() && !host.starts_with('[') && !host.ends_with(']') {
        assert_eq!(
            split_host_port(&endpoint),
            Some((host, meta.rpc_port)),
            "{endpoint:?}"
        );
    }
});
