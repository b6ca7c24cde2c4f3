//! Keys of a metadata store as a watch reports them: `keys::classify`, which tells segment
//! descriptors from RPC locations before their values are decoded. The first byte chooses the
//! cluster id (none, `c1`, or the rest of the input up to a `|`). Properties: a key outside
//! the cluster's prefix is never classified; a key made by `segment_key` or `rpc_meta_key`
//! classifies back to its name, except where Mooncake's layout itself is ambiguous (a
//! segment name with a `/` that starts with `ram/` or `rpc_meta/`, or a cluster id with a
//! `/`).
#![cfg_attr(fuzzing, no_main)]

use tern_metadata::keys::{KeyKind, classify, common_prefix, rpc_meta_key, segment_key};

tern_fuzz::target!(|data| {
    let (selector, rest) = tern_fuzz::split_selector(data);
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let (cluster, name) = match selector % 3 {
        0 => (None, text),
        1 => (Some("c1"), text),
        _ => match text.split_once('|') {
            Some((cluster, name)) => (Some(cluster), name),
            None => (None, text),
        },
    };
    let prefix = common_prefix(cluster);
    let kind = classify(cluster, name);
    if !name.starts_with(&prefix) {
        assert_eq!(kind, None);
    }
    let plain_cluster = cluster.is_none_or(|c| !c.contains('/'));
    let ambiguous =
        name.contains('/') && (name.starts_with("ram/") || name.starts_with("rpc_meta/"));
    if plain_cluster && !ambiguous {
        assert_eq!(
            classify(cluster, &segment_key(cluster, name)),
            Some(KeyKind::Segment(name.to_owned()))
        );
    }
    if plain_cluster {
        assert_eq!(
            classify(cluster, &rpc_meta_key(cluster, name)),
            Some(KeyKind::RpcMeta(name.to_owned()))
        );
    }
});
