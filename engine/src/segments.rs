//! The segment table: opening, refreshing and closing segments, and following the metadata
//! store's watch.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use rustc_hash::FxHashMap;
use tern_metadata::{MetadataError, MetadataEvent};

use crate::engine::{EngineInner, TransferEngine};
use crate::error::{EngineError, TransferError};
use crate::transport::PeerSegment;
use crate::types::SegmentId;

/// Looked up on every submit (by ID) and on every `open_segment` (by name), which callers of
/// Mooncake's API make before each transfer: hashed with Fx, not SipHash, since the keys are
/// the engine's own IDs and the names its caller opens (nothing a peer chooses to collide),
/// and SipHash cost 150 and 300 instructions per look-up.
#[derive(Debug, Default)]
pub(crate) struct SegmentTable {
    pub(crate) by_name: FxHashMap<String, SegmentId>,
    pub(crate) by_id: FxHashMap<SegmentId, Arc<PeerSegment>>,
    /// Open segments whose descriptor was withdrawn (the node died or left); they come back
    /// if it is published again.
    pub(crate) vanished: FxHashMap<SegmentId, String>,
}

impl TransferEngine {
    /// Opens a segment by name and returns its ID; the local segment is
    /// [`SegmentId::LOCAL`]. Opening an open segment returns the same ID.
    pub fn open_segment(&self, name: &str) -> Result<SegmentId, EngineError> {
        let name = name.trim_start_matches('/');
        if name.is_empty() {
            return Err(EngineError::InvalidArgument("empty segment name".into()));
        }
        if name == self.inner.segment_name {
            return Ok(SegmentId::LOCAL);
        }
        if let Some(id) = self.inner.segments.read().by_name.get(name) {
            return Ok(*id);
        }
        let peer = self.inner.fetch_segment(name, None)?;
        let mut table = self.inner.segments.write();
        if let Some(id) = table.by_name.get(name) {
            return Ok(*id);
        }
        let id = peer.id;
        table.by_name.insert(name.to_owned(), id);
        table.by_id.insert(id, Arc::new(peer));
        Ok(id)
    }

    /// Re-fetches an open segment's descriptor (after the peer re-registered or restarted).
    pub fn refresh_segment(&self, id: SegmentId) -> Result<(), EngineError> {
        if id == SegmentId::LOCAL {
            return Ok(());
        }
        let name = self
            .inner
            .segment_name_of(id)
            .ok_or(EngineError::UnknownSegment(id))?;
        self.inner.refresh(id, &name)
    }

    /// Closes a segment: later submissions to it fail with `UnknownSegment`. Transfers in
    /// flight finish.
    pub fn close_segment(&self, id: SegmentId) -> Result<(), EngineError> {
        if id == SegmentId::LOCAL {
            return Ok(());
        }
        let mut table = self.inner.segments.write();
        let peer = table
            .by_id
            .remove(&id)
            .ok_or(EngineError::UnknownSegment(id))?;
        table.by_name.remove(&peer.name);
        Ok(())
    }

    /// The descriptor and address of an open segment.
    pub fn segment(&self, id: SegmentId) -> Option<Arc<PeerSegment>> {
        self.inner.segment(id)
    }
}

impl EngineInner {
    pub(crate) fn segment(&self, id: SegmentId) -> Option<Arc<PeerSegment>> {
        if id == SegmentId::LOCAL {
            return Some(self.local.read().clone());
        }
        self.segments.read().by_id.get(&id).cloned()
    }

    pub(crate) fn segment_name_of(&self, id: SegmentId) -> Option<String> {
        let table = self.segments.read();
        table
            .by_id
            .get(&id)
            .map(|p| p.name.clone())
            .or_else(|| table.vanished.get(&id).cloned())
    }

    /// Why an open-looking segment ID has no descriptor.
    pub(crate) fn missing_segment(&self, id: SegmentId) -> TransferError {
        match self.segments.read().vanished.get(&id) {
            Some(name) => TransferError::SegmentVanished(name.clone()),
            None => TransferError::UnknownSegment(id),
        }
    }

    /// Re-fetches one open segment: replaced when found, marked vanished when the store no
    /// longer has it.
    pub(crate) fn refresh(&self, id: SegmentId, name: &str) -> Result<(), EngineError> {
        match self.fetch_segment(name, Some(id)) {
            Ok(peer) => {
                let mut table = self.segments.write();
                if table.by_name.get(name) == Some(&id) {
                    table.vanished.remove(&id);
                    table.by_id.insert(id, Arc::new(peer));
                }
                Ok(())
            }
            Err(EngineError::Metadata(MetadataError::SegmentNotFound(_))) => {
                self.mark_vanished(name);
                Err(MetadataError::SegmentNotFound(name.to_owned()).into())
            }
            Err(e) => Err(e),
        }
    }

    pub(crate) fn mark_vanished(&self, name: &str) {
        let mut table = self.segments.write();
        if let Some(&id) = table.by_name.get(name)
            && table.by_id.remove(&id).is_some()
        {
            table.vanished.insert(id, name.to_owned());
        }
    }

    /// Applies a change seen by the metadata store's watch to the segment cache.
    pub(crate) fn apply(&self, event: MetadataEvent) {
        match event {
            MetadataEvent::Segment { name, desc: None } => self.mark_vanished(&name),
            MetadataEvent::Segment {
                name,
                desc: Some(desc),
            } => {
                let mut table = self.segments.write();
                let Some(&id) = table.by_name.get(&name) else {
                    return;
                };
                let rpc = match (table.by_id.get(&id), table.vanished.contains_key(&id)) {
                    (Some(peer), _) => peer.rpc.clone(),
                    (None, true) => {
                        // Back from the dead: its RPC location is fetched in the background,
                        // as the store must not be called from its own watch thread.
                        drop(table);
                        self.refresh_in_background(vec![(id, name)]);
                        return;
                    }
                    (None, false) => return,
                };
                table.by_id.insert(
                    id,
                    Arc::new(PeerSegment {
                        id,
                        name,
                        desc,
                        rpc,
                        routes: Default::default(),
                    }),
                );
            }
            MetadataEvent::RpcMeta {
                server,
                meta: Some(meta),
            } => {
                let mut table = self.segments.write();
                let Some(&id) = table.by_name.get(&server) else {
                    return;
                };
                if let Some(peer) = table.by_id.get(&id) {
                    let mut updated = PeerSegment::clone(peer);
                    updated.rpc = meta;
                    table.by_id.insert(id, Arc::new(updated));
                }
            }
            MetadataEvent::RpcMeta { meta: None, .. } => {}
            MetadataEvent::Resync => {
                let table = self.segments.read();
                let open: Vec<(SegmentId, String)> = table
                    .by_name
                    .iter()
                    .map(|(n, id)| (*id, n.clone()))
                    .collect();
                drop(table);
                self.refresh_in_background(open);
            }
        }
    }

    pub(crate) fn refresh_in_background(&self, segments: Vec<(SegmentId, String)>) {
        let weak = self.weak.clone();
        let spawned = std::thread::Builder::new()
            .name("tern-resync".into())
            .spawn(move || {
                for (id, name) in segments {
                    let Some(engine) = weak.upgrade() else { return };
                    if let Err(e) = engine.refresh(id, &name) {
                        tracing::debug!("refreshing segment {name}: {e}");
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot start a segment refresh: {e}");
        }
    }

    pub(crate) fn fetch_segment(
        &self,
        name: &str,
        id: Option<SegmentId>,
    ) -> Result<PeerSegment, EngineError> {
        let desc = self.store.fetch_segment(name)?;
        let rpc = self.store.rpc_meta(name)?;
        let id = id.unwrap_or_else(|| SegmentId(self.next_segment.fetch_add(1, Ordering::Relaxed)));
        Ok(PeerSegment {
            id,
            name: name.to_owned(),
            desc,
            rpc,
            routes: Default::default(),
        })
    }
}

pub(crate) fn handle_event(engine: &Weak<EngineInner>, event: MetadataEvent) {
    if let Some(engine) = engine.upgrade() {
        engine.apply(event);
    }
}
