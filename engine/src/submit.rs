//! Batches: checking and slicing requests, handing slices to the transport that reaches
//! each peer, and the synchronous helper.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tern_metadata::SegmentDesc;

use crate::batch::{Batch, BatchInner, SliceCompletion};
use crate::engine::{EngineInner, TransferEngine};
use crate::error::{EngineError, TransferError};
use crate::slicing::split;
use crate::transport::{PeerSegment, Slice};
use crate::types::{SegmentId, TransferRequest, TransferStatus};

impl TransferEngine {
    /// A new batch taking up to `capacity` requests.
    pub fn allocate_batch(&self, capacity: usize) -> Result<Batch, EngineError> {
        if capacity == 0 || capacity > u32::MAX as usize {
            return Err(EngineError::InvalidArgument(format!(
                "batch capacity {capacity} is not in 1..=2^32-1"
            )));
        }
        Ok(Batch {
            inner: Arc::new(BatchInner::with_spin(capacity, self.inner.wait_spin)),
        })
    }

    /// Frees a batch. Fails with `BatchBusy` while tasks are in flight (wait or cancel first)
    /// and with `BatchFreed` the second time.
    pub fn free_batch(&self, batch: &Batch) -> Result<(), EngineError> {
        batch.inner.mark_freed()
    }

    /// Submits requests into `batch`. Fails as a whole (nothing submitted) when the batch
    /// lacks room or was freed. A request that is invalid (zero length, source outside
    /// registered memory, unknown segment, target outside the segment's buffers) fails as a
    /// task, with the reason in its status, before anything is sent. A target outside the
    /// cached descriptor triggers one re-fetch of that descriptor first (the peer may have
    /// registered more memory since it was opened).
    pub fn submit(&self, batch: &Batch, requests: &[TransferRequest]) -> Result<(), EngineError> {
        let batch_inner = &batch.inner;
        let first = batch_inner.reserve(requests.len())?;
        if let Some(timeout) = self.inner.transfer_timeout {
            batch_inner.set_deadline_if_unset(Instant::now() + timeout);
        }
        let mut groups: Vec<Vec<Slice>> =
            self.inner.transports.iter().map(|_| Vec::new()).collect();
        let mut cached: Option<Arc<PeerSegment>> = None;
        let mut refreshed: Vec<SegmentId> = Vec::new();
        for (i, request) in requests.iter().enumerate() {
            let task = first + i;
            let peer = match &cached {
                Some(peer) if peer.id == request.target => Some(peer.clone()),
                _ => {
                    cached = self.inner.segment(request.target);
                    cached.clone()
                }
            };
            let mut prepared = self.prepare(batch_inner, task, request, peer);
            if let Err(TransferError::TargetOutOfRange { .. }) = prepared
                && request.target != SegmentId::LOCAL
                && !refreshed.contains(&request.target)
            {
                // The cached descriptor may predate the peer's latest registration: re-fetch it
                // once per submit (only on this error path) before failing the task.
                refreshed.push(request.target);
                if self.refresh_segment(request.target).is_ok() {
                    cached = self.inner.segment(request.target);
                    prepared = self.prepare(batch_inner, task, request, cached.clone());
                }
            }
            match prepared {
                Ok((transport, slices)) => groups[transport].extend(slices),
                Err(error) => batch_inner.fail_task(task, error),
            }
        }
        batch_inner.publish(first + requests.len());
        for (transport, slices) in self.inner.transports.iter().zip(groups) {
            if !slices.is_empty() {
                transport.submit(slices);
            }
        }
        Ok(())
    }

    fn prepare(
        &self,
        batch: &Arc<BatchInner>,
        task: usize,
        request: &TransferRequest,
        peer: Option<Arc<PeerSegment>>,
    ) -> Result<(usize, Vec<Slice>), TransferError> {
        let len = request.length;
        if len == 0 {
            return Err(TransferError::ZeroLength);
        }
        let local = self.inner.registry.pin(request.source, len).map_err(|_| {
            TransferError::SourceNotRegistered {
                addr: request.source,
                len,
            }
        })?;
        let peer = peer.ok_or_else(|| self.inner.missing_segment(request.target))?;
        if peer
            .desc
            .buffer_containing(request.target_offset, len as u64)
            .is_none()
        {
            return Err(TransferError::TargetOutOfRange {
                segment: peer.name.clone(),
                addr: request.target_offset,
                len,
            });
        }
        let transport_index = self.inner.transport_for(&peer.desc).ok_or_else(|| {
            TransferError::NoCommonTransport {
                segment: peer.name.clone(),
                protocols: peer.desc.protocol.clone(),
            }
        })?;
        let transport = &self.inner.transports[transport_index];
        let counters = &self.inner.counters[transport_index];
        let pieces = split(
            len,
            transport.max_slice_size(),
            transport.merge_tail_below(),
        );
        batch.start_task(task, pieces.clone().count() as u32);
        let slices = pieces
            .map(|(offset, piece)| Slice {
                opcode: request.opcode,
                local: local.clone(),
                local_addr: request.source + offset,
                len: piece,
                peer: peer.clone(),
                remote_addr: request.target_offset + offset as u64,
                completion: SliceCompletion::counted(batch.clone(), task, counters.clone()),
            })
            .collect();
        Ok((transport_index, slices))
    }

    /// Submits one request, waits for it, and returns the bytes moved.
    pub fn transfer_sync(&self, request: TransferRequest) -> Result<u64, EngineError> {
        let batch = self.allocate_batch(1)?;
        self.submit(&batch, &[request])?;
        let wait_for = self
            .inner
            .transfer_timeout
            .map_or(Duration::from_secs(u64::from(u32::MAX)), |t| {
                t + Duration::from_secs(1)
            });
        batch.wait(wait_for);
        let (status, bytes) = batch
            .task_status(0)
            .map_or((TransferStatus::Waiting, 0), |s| {
                (s.status, s.transferred_bytes)
            });
        if status == TransferStatus::Pending {
            batch.cancel();
            return Err(EngineError::TransferFailed {
                status: TransferStatus::Timeout,
            });
        }
        let _ = self.free_batch(&batch);
        match status {
            TransferStatus::Completed => Ok(bytes),
            status => Err(EngineError::TransferFailed { status }),
        }
    }
}

impl EngineInner {
    /// The installed transport that moves slices to a peer: the highest-priority one that
    /// can reach it (the first installed among equals).
    pub(crate) fn transport_for(&self, peer: &SegmentDesc) -> Option<usize> {
        let mut best: Option<(usize, u8)> = None;
        for (i, transport) in self.transports.iter().enumerate() {
            let priority = transport.priority();
            if best.is_none_or(|(_, p)| priority > p) && transport.can_reach(peer) {
                best = Some((i, priority));
            }
        }
        best.map(|(i, _)| i)
    }
}
