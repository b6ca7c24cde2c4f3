//! The metadata stores that keep descriptors under keys (etcd, HTTP): one codec and one
//! [`MetadataStore`] over a small key-value trait, so the key layout, the value formats and
//! their sealing exist once.

use std::sync::Arc;

use crate::desc::{DescriptorError, SegmentDesc};
use crate::error::MetadataError;
use crate::keys::{self, KeyKind};
use crate::seal;
use crate::store::{MetadataEvent, MetadataListener, MetadataStore, RpcMeta};

/// A store's keys and values: Mooncake's layout under an optional cluster ID, Mooncake's
/// JSON, and — with a cluster secret — an order and a MAC on every value written, demanded of
/// every value read, which must not be older than what was read of its key before ([`seal`]).
#[derive(Debug, Clone, Default)]
pub struct Codec {
    /// Scopes every key (`MC_METADATA_CLUSTER_ID`).
    pub cluster_id: Option<String>,
    /// Seals what is written and checks what is read (MAC and order).
    pub sealer: Option<Arc<seal::Sealer>>,
}

impl Codec {
    /// The key of a segment's descriptor.
    pub fn segment_key(&self, name: &str) -> String {
        keys::segment_key(self.cluster_id.as_deref(), name)
    }

    /// The key of a server's RPC meta.
    pub fn rpc_meta_key(&self, server: &str) -> String {
        keys::rpc_meta_key(self.cluster_id.as_deref(), server)
    }

    fn sealed(&self, key: &str, json: String) -> Result<String, MetadataError> {
        match &self.sealer {
            None => Ok(json),
            Some(sealer) => sealer
                .seal(key, &json)
                .map_err(|source| MetadataError::Seal {
                    key: key.to_owned(),
                    source,
                }),
        }
    }

    fn checked(&self, key: &str, value: &[u8]) -> Result<(), MetadataError> {
        match &self.sealer {
            None => Ok(()),
            Some(sealer) => {
                sealer
                    .admit(key, value)
                    .map(|_| ())
                    .map_err(|source| MetadataError::Seal {
                        key: key.to_owned(),
                        source,
                    })
            }
        }
    }

    /// The value a segment's descriptor is stored as at `key`.
    pub fn encode_segment(&self, key: &str, desc: &SegmentDesc) -> Result<String, MetadataError> {
        self.sealed(key, desc.to_json())
    }

    /// The descriptor stored at `key`.
    pub fn decode_segment(&self, key: &str, value: &[u8]) -> Result<SegmentDesc, MetadataError> {
        self.checked(key, value)?;
        SegmentDesc::from_json(value).map_err(|source| MetadataError::MalformedValue {
            key: key.to_owned(),
            source,
        })
    }

    /// The value RPC meta is stored as at `key`.
    pub fn encode_rpc_meta(&self, key: &str, meta: &RpcMeta) -> Result<String, MetadataError> {
        let mut json = serde_json::to_string(meta).unwrap_or_default();
        json.push('\n');
        self.sealed(key, json)
    }

    /// The RPC meta stored at `key`.
    pub fn decode_rpc_meta(&self, key: &str, value: &[u8]) -> Result<RpcMeta, MetadataError> {
        self.checked(key, value)?;
        serde_json::from_slice(value).map_err(|e| MetadataError::MalformedValue {
            key: key.to_owned(),
            source: DescriptorError::MalformedJson(e.to_string()),
        })
    }

    /// What a change of `key` to `value` (or its deletion) means to a cache; `None` for keys
    /// that are not metadata, and for values that fail to decode or to verify (logged).
    pub fn event(&self, key: &str, value: &[u8], deleted: bool) -> Option<MetadataEvent> {
        let ignored = |e: MetadataError| tracing::warn!("ignoring a change: {e}");
        match keys::classify(self.cluster_id.as_deref(), key)? {
            KeyKind::Segment(name) if deleted => Some(MetadataEvent::Segment { name, desc: None }),
            KeyKind::Segment(name) => {
                self.decode_segment(key, value)
                    .map_err(ignored)
                    .ok()
                    .map(|desc| MetadataEvent::Segment {
                        name,
                        desc: Some(desc),
                    })
            }
            KeyKind::RpcMeta(server) if deleted => {
                Some(MetadataEvent::RpcMeta { server, meta: None })
            }
            KeyKind::RpcMeta(server) => {
                self.decode_rpc_meta(key, value)
                    .map_err(ignored)
                    .ok()
                    .map(|meta| MetadataEvent::RpcMeta {
                        server,
                        meta: Some(meta),
                    })
            }
        }
    }
}

/// A key-value back end: what etcd and the HTTP protocol have in common.
pub trait KeyValue: Send + Sync {
    /// The store's kind, as `MetadataStore::kind` names it.
    fn kind(&self) -> &'static str;
    /// Stores `value` at `key` (as this node's: etcd keeps it alive under a lease).
    fn put(&self, key: String, value: String) -> Result<(), MetadataError>;
    /// Removes `key` (a missing key is no error).
    fn delete(&self, key: &str) -> Result<(), MetadataError>;
    /// The value at `key`, if any.
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, MetadataError>;
    /// Starts telling `listener` about changes, if the back end can watch.
    fn subscribe(&self, _listener: MetadataListener) {}
    /// Withdraws what this node put and stops.
    fn shutdown(&self) {}
}

/// A [`MetadataStore`] over a key-value back end and a [`Codec`].
#[derive(Debug)]
pub struct KeyedStore<K> {
    pub(crate) kv: K,
    pub(crate) codec: Arc<Codec>,
}

impl<K: KeyValue> MetadataStore for KeyedStore<K> {
    fn kind(&self) -> &'static str {
        self.kv.kind()
    }

    fn segment_name(&self, local_server_name: &str, _advertised: &RpcMeta) -> String {
        local_server_name.to_owned()
    }

    fn publish_segment(&self, name: &str, desc: &SegmentDesc) -> Result<(), MetadataError> {
        let key = self.codec.segment_key(name);
        let value = self.codec.encode_segment(&key, desc)?;
        self.kv.put(key, value)
    }

    fn remove_segment(&self, name: &str) -> Result<(), MetadataError> {
        self.kv.delete(&self.codec.segment_key(name))
    }

    fn fetch_segment(&self, name: &str) -> Result<SegmentDesc, MetadataError> {
        let key = self.codec.segment_key(name);
        let value = self
            .kv
            .get(&key)?
            .ok_or_else(|| MetadataError::SegmentNotFound(name.to_owned()))?;
        self.codec.decode_segment(&key, &value)
    }

    fn publish_rpc_meta(&self, server: &str, meta: &RpcMeta) -> Result<(), MetadataError> {
        let key = self.codec.rpc_meta_key(server);
        let value = self.codec.encode_rpc_meta(&key, meta)?;
        self.kv.put(key, value)
    }

    fn remove_rpc_meta(&self, server: &str) -> Result<(), MetadataError> {
        self.kv.delete(&self.codec.rpc_meta_key(server))
    }

    fn rpc_meta(&self, server: &str) -> Result<RpcMeta, MetadataError> {
        let key = self.codec.rpc_meta_key(server);
        let value = self
            .kv
            .get(&key)?
            .ok_or_else(|| MetadataError::RpcMetaNotFound(server.to_owned()))?;
        self.codec.decode_rpc_meta(&key, &value)
    }

    fn subscribe(&self, listener: MetadataListener) {
        self.kv.subscribe(listener);
    }

    fn shutdown(&self) {
        self.kv.shutdown();
    }
}
