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
}
