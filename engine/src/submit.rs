//! Batches: checking and slicing requests, handing slices to the transport that reaches
//! each peer, and the synchronous helper.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tern_metadata::SegmentDesc;

use crate::batch::{Batch, BatchInner, MAX_TASK_BYTES};
use crate::engine::{EngineInner, TransferEngine};
use crate::error::{EngineError, TransferError};
use crate::slicing::split;
use crate::transport::{PeerSegment, Routes, Slice, Submission};
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
            inner: Arc::new(BatchInner::timed(
                capacity,
                self.inner.wait_spin,
                self.inner
                    .counters
                    .timing()
                    .then(|| self.inner.counters.clone()),
                self.inner.helpers.clone(),
                self.inner.weak.clone(),
            )),
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
        // The peer of the request before, and its routes: a batch usually has one peer.
        let mut cached: Option<(Arc<PeerSegment>, Routes)> = None;
        let mut refreshed: Vec<SegmentId> = Vec::new();
        // The submission of the request before: one pin and one shared record for every run
        // of requests from one region to one peer.
        let mut group: Option<Arc<Submission>> = None;
        for (i, request) in requests.iter().enumerate() {
            let task = first + i;
            if cached
                .as_ref()
                .is_none_or(|(peer, _)| peer.id != request.target)
            {
                cached = self.inner.segment(request.target).map(|peer| {
                    let routes = self.inner.routes_to(&peer.desc);
                    (peer, routes)
                });
            }
            let mut prepared = self.prepare(
                batch_inner,
                task,
                request,
                cached.as_ref(),
                &mut group,
                &mut groups,
            );
            if let Err(TransferError::TargetOutOfRange { .. }) = prepared
                && request.target != SegmentId::LOCAL
                && !refreshed.contains(&request.target)
            {
                // The cached descriptor may predate the peer's latest registration: re-fetch it
                // once per submit (only on this error path) before failing the task.
                refreshed.push(request.target);
                if self.refresh_segment(request.target).is_ok() {
                    cached = self.inner.segment(request.target).map(|peer| {
                        let routes = self.inner.routes_to(&peer.desc);
                        (peer, routes)
                    });
                    group = None;
                    prepared = self.prepare(
                        batch_inner,
                        task,
                        request,
                        cached.as_ref(),
                        &mut group,
                        &mut groups,
                    );
                }
            }
            match prepared {
                Ok((slices, first)) => batch_inner.start_task(task, slices, request.opcode, first),
                Err(error) => batch_inner.fail_unstarted(task, error),
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

    /// Checks one request and cuts it into slices for the best transport to its peer,
    /// pushed onto that transport's group; returns how many, and that transport.
    fn prepare(
        &self,
        batch: &Arc<BatchInner>,
        task: usize,
        request: &TransferRequest,
        peer: Option<&(Arc<PeerSegment>, Routes)>,
        group: &mut Option<Arc<Submission>>,
        groups: &mut [Vec<Slice>],
    ) -> Result<(u32, usize), TransferError> {
        let len = request.length;
        if len == 0 {
            return Err(TransferError::ZeroLength);
        }
        let (peer, routes) = peer.ok_or_else(|| self.inner.missing_segment(request.target))?;
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
        let transport_index = routes
            .first()
            .ok_or_else(|| TransferError::NoCommonTransport {
                segment: peer.name.clone(),
                protocols: peer.desc.protocol.clone(),
            })?;
        if len as u64 > MAX_TASK_BYTES {
            return Err(TransferError::TooLarge {
                len,
                max: MAX_TASK_BYTES,
            });
        }
        let transport = &self.inner.transports[transport_index];
        let pieces = split(
            len,
            transport.max_slice_size(),
            transport.merge_tail_below(),
        );
        let reuse = group
            .as_ref()
            .filter(|g| g.peer_id() == peer.id && g.covers(request.source, len));
        let shared = match reuse {
            Some(shared) => shared.clone(),
            None => {
                let local = self.inner.registry.pin(request.source, len).map_err(|_| {
                    TransferError::SourceNotRegistered {
                        addr: request.source,
                        len,
                    }
                })?;
                let fresh = Arc::new(Submission::new(
                    local,
                    peer.clone(),
                    batch.clone(),
                    *routes,
                    &self.inner,
                ));
                group.insert(fresh).clone()
            }
        };
        let slices = pieces.clone().count() as u32;
        groups[transport_index].extend(pieces.map(|(offset, piece)| {
            Slice::new(
                shared.clone(),
                request.opcode,
                task,
                request.source + offset,
                piece,
                request.target_offset + offset as u64,
            )
        }));
        Ok((slices, transport_index))
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
            // Cancel waits (bounded) for the slices still out; a task whose slices are still
            // out after it is reported Pending: its memory is not free yet.
            batch.cancel();
            let status = batch
                .task_status(0)
                .map_or(TransferStatus::Pending, |s| s.status);
            let status = match status {
                TransferStatus::Canceled => TransferStatus::Timeout,
                other => other,
            };
            let _ = self.free_batch(&batch);
            return Err(EngineError::TransferFailed { status });
        }
        let _ = self.free_batch(&batch);
        match status {
            TransferStatus::Completed => Ok(bytes),
            status => Err(EngineError::TransferFailed { status }),
        }
    }
}

impl EngineInner {
    /// The installed transports that can reach a peer, best first: by priority, the first
    /// installed among equals. The first moves its slices; a slice it declines goes to the
    /// next.
    pub(crate) fn routes_to(&self, peer: &SegmentDesc) -> Routes {
        // On the stack: this runs once per peer in every submit.
        let mut reach = [(std::cmp::Reverse(0u8), 0usize); Routes::MAX];
        let mut count = 0;
        for (i, t) in self.transports.iter().enumerate() {
            if count < Routes::MAX && t.can_reach(peer) {
                reach[count] = (std::cmp::Reverse(t.priority()), i);
                count += 1;
            }
        }
        // Keys are unique (the index breaks ties), so an unstable sort orders as a stable one.
        reach[..count].sort_unstable();
        let mut routes = Routes::default();
        for &(_, i) in &reach[..count] {
            routes.push(i);
        }
        routes
    }
}
