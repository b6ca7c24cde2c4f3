//! The key layout of metadata stores, exactly as Mooncake uses it.
//!
//! `mooncake/[<cluster_id>/]ram/<segment>` holds a descriptor; a segment name containing `/`
//! is appended verbatim instead (`mooncake/[<cluster_id>/]nvmeof/x`);
//! `mooncake/[<cluster_id>/]rpc_meta/<server>` holds `{"ip_or_host_name", "rpc_port"}`.

/// Environment variable naming the cluster, which scopes every key.
pub const CLUSTER_ID_ENV: &str = "MC_METADATA_CLUSTER_ID";

/// `mooncake/` or `mooncake/<cluster_id>/`.
pub fn common_prefix(cluster_id: Option<&str>) -> String {
    match cluster_id.filter(|c| !c.is_empty()) {
        Some(id) => format!("mooncake/{id}/"),
        None => "mooncake/".to_owned(),
    }
}

/// The key under which `segment`'s descriptor lives.
pub fn segment_key(cluster_id: Option<&str>, segment: &str) -> String {
    let prefix = common_prefix(cluster_id);
    if segment.contains('/') {
        format!("{prefix}{segment}")
    } else {
        format!("{prefix}ram/{segment}")
    }
}

/// The key under which `server`'s RPC location lives.
pub fn rpc_meta_key(cluster_id: Option<&str>, server: &str) -> String {
    format!("{}rpc_meta/{server}", common_prefix(cluster_id))
}

/// What a key under the common prefix names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyKind {
    /// A segment descriptor, with the segment's name.
    Segment(String),
    /// An RPC location, with the server's name.
    RpcMeta(String),
}

/// Classifies `key` (full key, prefix included); `None` when it is outside the layout.
pub fn classify(cluster_id: Option<&str>, key: &str) -> Option<KeyKind> {
    let rest = key.strip_prefix(&common_prefix(cluster_id))?;
    if let Some(name) = rest.strip_prefix("ram/") {
        Some(KeyKind::Segment(name.to_owned()))
    } else if let Some(server) = rest.strip_prefix("rpc_meta/") {
        Some(KeyKind::RpcMeta(server.to_owned()))
    } else if rest.contains('/') {
        Some(KeyKind::Segment(rest.to_owned()))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_mooncakes_layout() {
        assert_eq!(segment_key(None, "node01"), "mooncake/ram/node01");
        assert_eq!(segment_key(Some("c1"), "node01"), "mooncake/c1/ram/node01");
        assert_eq!(segment_key(Some(""), "node01"), "mooncake/ram/node01");
        assert_eq!(segment_key(None, "nvmeof/disk"), "mooncake/nvmeof/disk");
        assert_eq!(
            rpc_meta_key(None, "10.0.0.1:1234"),
            "mooncake/rpc_meta/10.0.0.1:1234"
        );
        assert_eq!(rpc_meta_key(Some("c"), "n"), "mooncake/c/rpc_meta/n");
    }

    #[test]
    fn keys_classify_back_to_names() {
        for (cluster, name) in [
            (None, "node01"),
            (Some("c1"), "10.0.0.1:5"),
            (None, "nvmeof/disk"),
        ] {
            assert_eq!(
                classify(cluster, &segment_key(cluster, name)),
                Some(KeyKind::Segment(name.to_owned()))
            );
            assert_eq!(
                classify(cluster, &rpc_meta_key(cluster, name)),
                Some(KeyKind::RpcMeta(name.to_owned()))
            );
        }
        assert_eq!(classify(Some("c1"), "mooncake/ram/x"), None);
        assert_eq!(classify(None, "other/ram/x"), None);
        assert_eq!(classify(None, "mooncake/plain"), None);
    }
}
