//! Batches: checking and slicing requests, handing slices to the transport that reaches
//! each peer, and the synchronous helper.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use tern_metadata::SegmentDesc;

use crate::batch::{Batch, BatchInner, MAX_CAPACITY, MAX_TASK_BYTES};
use crate::engine::{EngineInner, TransferEngine};
use crate::error::{EngineError, TransferError};
use crate::merge::{Extent, PlanRoom, each_alone, plan};
use crate::transport::{PeerSegment, Routes, RunHead, RunPool, Slice, Submission, TaskPart};
use crate::types::{Opcode, SegmentId, TransferRequest, TransferStatus};

/// How many of the submissions made lately in one submit call a request looks through for
/// one it can share before it pins its region anew: enough for the layers of a model
/// submitted in turn, few enough that a lookup stays cheaper than a pin.
const RECENT_SUBMISSIONS: usize = 64;

/// The most entries a thread's kept lists hold room for between submits, beyond four times
/// what the submit itself had: a thread that submits batches of many thousand requests
/// keeps their room (made afresh, the kernel hands it out a page fault per 4 KiB each time),
/// and lets it go at its first much smaller submit.
const KEEP_ROOM_FOR: usize = 4096;

/// What one submit call works in, kept by the thread between calls so that a submit
/// allocates no list: the transports drain the lists of slices they are handed.
struct Scratch {
    extents: Vec<Extent>,
    /// Where the planner puts requests submitted out of address order.
    plan_room: PlanRoom,
    /// One pin and one shared record for the requests from one region to one peer.
    submissions: Vec<Arc<Submission>>,
    /// The slices for each transport (same index); a transport drains its list, and the
    /// room stays for the next submit.
    groups: Vec<Vec<Slice>>,
    /// The merged runs made lately, made again in place once their tasks have ended.
    runs: RunPool,
}

impl Scratch {
    const EMPTY: Self = Self {
        extents: Vec::new(),
        plan_room: PlanRoom::EMPTY,
        submissions: Vec::new(),
        groups: Vec::new(),
        runs: RunPool::EMPTY,
    };
}

impl Default for Scratch {
    fn default() -> Self {
        Self::EMPTY
    }
}

/// What a submit call makes its merged runs with.
struct RunMaking<'a> {
    /// The thread's runs, made again in place once their tasks have ended.
    runs: &'a mut RunPool,
    /// When the call started: its tasks' start.
    started_ns: u64,
}

thread_local! {
    /// Borrowed by a submit for as long as it runs, and left empty.
    static SCRATCH: RefCell<Scratch> = const { RefCell::new(Scratch::EMPTY) };
}

/// Where the requests of one submit call went lately: what its check of the next request
/// tries first.
struct Recent<'a> {
    /// One pin and one shared record for the requests from one region to one peer, the
    /// latest last.
    submissions: &'a mut Vec<Arc<Submission>>,
    /// The index, among the peer's buffers, of the one the request before went to: the next
    /// is most likely in it too (a hint only, checked like any other).
    buffer: usize,
}

impl TransferEngine {
    /// A new batch taking up to `capacity` requests.
    pub fn allocate_batch(&self, capacity: usize) -> Result<Batch, EngineError> {
        if capacity == 0 || capacity > MAX_CAPACITY {
            return Err(EngineError::InvalidArgument(format!(
                "batch capacity {capacity} is not in 1..={MAX_CAPACITY}"
            )));
        }
        Ok(Batch {
            inner: BatchInner::timed(
                capacity,
                self.inner.wait_spin,
                self.inner
                    .counters
                    .timing()
                    .then(|| self.inner.counters.clone()),
                self.inner.helpers.clone(),
                self.inner.weak.clone(),
                &self.inner.kept,
            ),
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
    ///
    /// Requests of one call that are neighbours (same peer and opcode, contiguous both
    /// locally and remotely, within one local region and one of the peer's buffers) move as
    /// one run, cut into slices by the transport's slice size, whatever order they came in
    /// (unless the engine was built with
    /// [`merge_requests(false)`](crate::TransferEngineBuilder::merge_requests)). Each request
    /// stays its own task, with its own status and bytes; a run's tasks end together, once
    /// every slice of the run has let go (a task whose bytes were in a failed slice fails,
    /// the others complete).
    pub fn submit(&self, batch: &Batch, requests: &[TransferRequest]) -> Result<(), EngineError> {
        SCRATCH.with(|kept| match kept.try_borrow_mut() {
            Ok(mut scratch) => self.submit_with(batch, requests, &mut scratch),
            // A submit made from inside another (a completion hook run by a transport's
            // `submit`) finds the thread's lists in use and starts with empty ones.
            Err(_) => self.submit_with(batch, requests, &mut Scratch::default()),
        })
    }

    fn submit_with(
        &self,
        batch: &Batch,
        requests: &[TransferRequest],
        scratch: &mut Scratch,
    ) -> Result<(), EngineError> {
        let batch_inner = &batch.inner;
        if requests.is_empty() {
            // Nothing to reserve, time or start: no start recorded for the tasks of a later
            // call, no deadline armed.
            return if batch_inner.is_freed() {
                Err(EngineError::BatchFreed)
            } else {
                Ok(())
            };
        }
        let (first, started_ns) =
            batch_inner.reserve_with_timeout(requests.len(), self.inner.transfer_timeout)?;
        // The peer of the request before, and its routes: a batch usually has one peer.
        let mut cached: Option<(Arc<PeerSegment>, Routes)> = None;
        let mut refreshed: Vec<SegmentId> = Vec::new();
        let Scratch {
            extents,
            plan_room,
            submissions,
            groups,
            runs,
        } = scratch;
        let mut recent = Recent {
            submissions,
            buffer: 0,
        };
        // Where the request before went, in locals: the next is most likely to go there too.
        let mut lane: Option<Lane> = None;
        extents.reserve(requests.len());
        let mut i = 0;
        while i < requests.len() {
            if let Some(lane) = &lane {
                i += lane.take(&requests[i..], first + i, extents);
            }
            let Some(request) = requests.get(i) else {
                break;
            };
            let task = first + i;
            i += 1;
            if cached
                .as_ref()
                .is_none_or(|(peer, _)| peer.id != request.target)
            {
                cached = self.inner.peer_with_routes(request.target);
            }
            let mut checked = self.check(batch_inner, task, request, cached.as_ref(), &mut recent);
            if let Err(TransferError::TargetOutOfRange { .. }) = checked
                && request.target != SegmentId::LOCAL
                && !refreshed.contains(&request.target)
            {
                // The cached descriptor may predate the peer's latest registration: re-fetch it
                // once per submit (only on this error path) before failing the task.
                refreshed.push(request.target);
                // Later requests to the peer are checked against the descriptor fetched now.
                lane = None;
                if self.refresh_segment(request.target).is_ok() {
                    cached = self.inner.peer_with_routes(request.target);
                    checked = self.check(batch_inner, task, request, cached.as_ref(), &mut recent);
                }
            }
            match checked {
                Ok(extent) => {
                    if i < requests.len() {
                        lane = cached
                            .as_ref()
                            .and_then(|(peer, _)| Lane::of(&extent, peer, &recent));
                    }
                    extents.push(extent);
                }
                Err(error) => batch_inner.fail_unstarted(task, error),
            }
        }
        let submissions = recent.submissions;
        groups.resize_with(self.inner.transports.len(), Vec::new);
        let expected = extents.len();
        let bytes: u64 = extents.iter().map(|extent| extent.len as u64).sum();
        let mut making = RunMaking { runs, started_ns };
        if each_alone(extents, self.inner.merge_requests) {
            // What the planner would hand on, cut here in a loop of its own: requests that
            // cannot merge are cut and started with the submit's lists in registers.
            for alone in extents.iter() {
                if !self.cut_alone(batch_inner, alone, submissions, groups, expected) {
                    let run = std::slice::from_ref(alone);
                    self.cut_run(batch_inner, run, submissions, groups, expected, &mut making);
                }
            }
        } else {
            plan(
                extents,
                self.inner.merge_requests,
                MAX_TASK_BYTES,
                plan_room,
                |run| match run {
                    [alone]
                        if self.cut_alone(batch_inner, alone, submissions, groups, expected) => {}
                    _ => self.cut_run(batch_inner, run, submissions, groups, expected, &mut making),
                },
            );
        }
        batch_inner.publish(first + requests.len(), bytes);
        extents.clear();
        let keep = KEEP_ROOM_FOR.max(requests.len().saturating_mul(4));
        for (transport, slices) in self.inner.transports.iter().zip(groups.iter_mut()) {
            if !slices.is_empty() {
                transport.submit(slices);
                // What the transport left is dropped, and so fails.
                slices.clear();
            }
            if slices.capacity() > keep {
                *slices = Vec::new();
            }
        }
        // The batch's tasks may have ended by now: this call's hold on the pins goes before
        // it returns, as it did when the list was the call's own.
        submissions.clear();
        if extents.capacity() > keep {
            *extents = Vec::new();
        }
        plan_room.trim(keep);
        Ok(())
    }

    /// Checks one request and finds (or makes) the submission it goes with: the planner's
    /// view of it, or why it fails as a task of its own. Apart from the loop that calls it,
    /// which tries the [`Lane`] of the request before first: only the first request to a
    /// buffer or from a region, and every request that fails, come here.
    #[inline(never)]
    fn check(
        &self,
        batch: &Arc<BatchInner>,
        task: usize,
        request: &TransferRequest,
        peer: Option<&(Arc<PeerSegment>, Routes)>,
        recent: &mut Recent<'_>,
    ) -> Result<Extent, TransferError> {
        let submissions = &mut *recent.submissions;
        let len = request.length;
        if len == 0 {
            return Err(TransferError::ZeroLength);
        }
        let (peer, routes) = peer.ok_or_else(|| self.inner.missing_segment(request.target))?;
        let buffers = &peer.desc.buffers;
        let (target, target_len) = (request.target_offset, len as u64);
        // The last request's buffer first (a hint only: checked like any other), then all;
        // `recent.buffer` ends up the one holding the target.
        let hinted = buffers
            .get(recent.buffer)
            .is_some_and(|buffer| buffer.contains(target, target_len));
        if !hinted {
            recent.buffer = buffers
                .iter()
                .position(|b| b.contains(target, target_len))
                .ok_or_else(|| TransferError::TargetOutOfRange {
                    segment: peer.name.clone(),
                    addr: target,
                    len,
                })?;
        }
        if routes.first().is_none() {
            return Err(TransferError::NoCommonTransport {
                segment: peer.name.clone(),
                protocols: peer.desc.protocol.clone(),
            });
        }
        if len as u64 > MAX_TASK_BYTES {
            return Err(TransferError::TooLarge {
                len,
                max: MAX_TASK_BYTES,
            });
        }
        // The submission of the request before first (a run of requests from one region),
        // then the few made lately (layers in separate regions, submitted in turn).
        let reuse = submissions
            .iter()
            .rev()
            .take(RECENT_SUBMISSIONS)
            .position(|s| s.serves(peer, request.source, len));
        let index = match reuse {
            Some(back) => submissions.len() - 1 - back,
            None => {
                let local = self.inner.registry.pin(request.source, len).map_err(|_| {
                    TransferError::SourceNotRegistered {
                        addr: request.source,
                        len,
                    }
                })?;
                submissions.push(Arc::new(Submission::new(
                    local,
                    peer.clone(),
                    batch.clone(),
                    *routes,
                )));
                submissions.len() - 1
            }
        };
        Ok(checked_extent(request, recent.buffer, task, index))
    }

    /// Starts the task of a run of one request that fits in one slice of its first
    /// transport, pushed onto that transport's group: most runs. False, with nothing done,
    /// for any other, which [`cut_run`](Self::cut_run) takes.
    #[inline(always)]
    fn cut_alone(
        &self,
        batch: &BatchInner,
        alone: &Extent,
        submissions: &[Arc<Submission>],
        groups: &mut [Vec<Slice>],
        room: usize,
    ) -> bool {
        if let Some(submission) = submissions.get(alone.submission as usize)
            && let Some(transport_index) = submission.first_route()
            && let Some(size) = self.inner.slice_sizes.get(transport_index)
            && alone.len <= size.max
            && let Some(group) = groups.get_mut(transport_index)
        {
            if group.is_empty() {
                // Room for a slice per request at once: most requests are one slice.
                group.reserve(room);
            }
            let task = alone.task as usize;
            group.push(Slice::new(
                submission.clone(),
                alone.opcode,
                task,
                alone.local,
                alone.len,
                alone.remote,
            ));
            batch.start_task(task, 1, alone.opcode, transport_index);
            return true;
        }
        false
    }

    /// Starts the tasks of one run and cuts the run into slices for its first transport,
    /// pushed onto that transport's group. Each task counts the slices that hold bytes of it.
    #[inline(never)]
    fn cut_run(
        &self,
        batch: &Arc<BatchInner>,
        run: &[Extent],
        submissions: &[Arc<Submission>],
        groups: &mut [Vec<Slice>],
        expected: usize,
        making: &mut RunMaking<'_>,
    ) {
        let Some(head) = run.first() else {
            return;
        };
        let submission = &submissions[head.submission as usize];
        let first = submission.first_route().and_then(|transport_index| {
            let size = self.inner.slice_sizes.get(transport_index)?;
            Some((transport_index, *size))
        });
        let Some((transport_index, size)) = first else {
            // Checked before a request joins a run; kept as a typed failure all the same.
            for extent in run {
                batch.fail_unstarted(
                    extent.task as usize,
                    TransferError::NoCommonTransport {
                        segment: submission.peer().name.clone(),
                        protocols: submission.peer().desc.protocol.clone(),
                    },
                );
            }
            return;
        };
        // A run is contiguous: it ends where its last request does.
        let run_len = run
            .last()
            .map_or(0, |last| last.local + last.len - head.local);
        let cuts = size.cuts(run_len);
        let (opcode, local, remote) = (head.opcode, head.local, head.remote);
        let group = &mut groups[transport_index];
        if group.is_empty() {
            // Room for a slice per request at once: most requests are one slice.
            group.reserve(cuts.count().max(expected));
        }
        if let [alone] = run {
            let task = alone.task as usize;
            if cuts.count() == 1 {
                // Most requests: one slice, without the iterator below.
                group.push(Slice::new(
                    submission.clone(),
                    opcode,
                    task,
                    local,
                    run_len,
                    remote,
                ));
                batch.start_task(task, 1, opcode, transport_index);
                return;
            }
            group.extend(cuts.pieces().map(|(offset, len)| {
                Slice::new(
                    submission.clone(),
                    opcode,
                    task,
                    local + offset,
                    len,
                    remote + offset as u64,
                )
            }));
            batch.start_task(task, cuts.count() as u32, opcode, transport_index);
            return;
        }
        // Neighbours: one run, whose slices count down on it, not on each task. Each task
        // is started before any slice goes to a transport.
        for extent in run {
            batch.start_run_task(extent.task as usize, opcode, transport_index);
        }
        let parts = || {
            run.iter().map(|extent| TaskPart {
                start: extent.local,
                task: extent.task,
            })
        };
        let head = RunHead {
            end: local + run_len,
            batch: batch.clone(),
            slices: cuts.count(),
            transport: transport_index,
            write: opcode == Opcode::Write,
            started_ns: making.started_ns,
        };
        let shared = making.runs.run(run.len(), batch.kept.as_ref(), parts, head);
        batch.tasks.count_run_tasks(run.len());
        let mut part = 0;
        group.extend(cuts.pieces().map(|(offset, len)| {
            // Pieces and parts both ascend: the part holding a piece's start is at or after
            // the one holding the piece before's.
            while run
                .get(part + 1)
                .is_some_and(|extent| extent.local <= local + offset)
            {
                part += 1;
            }
            Slice::of_run(
                submission.clone(),
                opcode,
                shared.clone(),
                part,
                local + offset,
                len,
                remote + offset as u64,
            )
        }));
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
    /// A segment and the transports that reach it.
    fn peer_with_routes(&self, id: SegmentId) -> Option<(Arc<PeerSegment>, Routes)> {
        self.segment(id).map(|peer| {
            let routes = peer.routes.get_or_init(|| self.routes_to(&peer.desc));
            (peer, routes)
        })
    }

    /// The installed transports that can reach a peer, best first: by priority, the first
    /// installed among equals. The first moves its slices; a slice it declines goes to the
    /// next.
    pub(crate) fn routes_to(&self, peer: &SegmentDesc) -> Routes {
        // On the stack: this runs once per peer descriptor.
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

/// `request`, task `task` of its batch, checked: its target lies in the peer's buffer
/// `buffer`, its source in the region of the call's `submission`th submission.
#[inline]
fn checked_extent(
    request: &TransferRequest,
    buffer: usize,
    task: usize,
    submission: usize,
) -> Extent {
    Extent {
        local: request.source,
        remote: request.target_offset,
        len: request.length,
        task: task as u32,
        submission: submission as u32,
        buffer: buffer as u32,
        opcode: request.opcode,
    }
}

/// Where a checked request went (the peer, by its ID; the peer's buffer; the submission's
/// pinned region), kept as plain numbers: a request going the same way is checked in a few
/// comparisons, without reaching through the peer's descriptor and the submission's pin
/// again. Only the first request to a buffer or from a region takes the full
/// [`check`](TransferEngine::check).
struct Lane {
    target: SegmentId,
    /// The peer's buffer, `[remote_start, remote_end)`, and its index in the descriptor.
    remote_start: u64,
    remote_end: u64,
    buffer: u32,
    /// The submission's region, `[local_start, local_end)`.
    local_start: usize,
    local_end: usize,
    submission: u32,
}

impl Lane {
    /// The lane of `extent`, just checked against `peer` (which has a route): `None` where
    /// its buffer's end does not fit in 64 bits (no request can go there).
    fn of(extent: &Extent, peer: &Arc<PeerSegment>, recent: &Recent<'_>) -> Option<Self> {
        let buffer = peer.desc.buffers.get(extent.buffer as usize)?;
        let (local_start, local_len) = recent.submissions.get(extent.submission as usize)?.region();
        Some(Self {
            target: peer.id,
            remote_start: buffer.addr,
            remote_end: buffer.addr.checked_add(buffer.length)?,
            buffer: extent.buffer,
            local_start,
            local_end: local_start.checked_add(local_len)?,
            submission: extent.submission,
        })
    }

    /// Checks the first of `requests` (tasks from `first_task` on) that go this way, and
    /// pushes their extents; returns how many. Apart from the submit loop, in a loop of its
    /// own: the lane's bounds stay in registers.
    #[inline(never)]
    fn take(
        &self,
        requests: &[TransferRequest],
        first_task: usize,
        extents: &mut Vec<Extent>,
    ) -> usize {
        // Counted first, then pushed in one go: the check loop keeps the bounds in
        // registers, and the pushes need no room check each.
        let taken = requests
            .iter()
            .position(|request| !self.fits(request))
            .unwrap_or(requests.len());
        let taken_requests = requests.get(..taken).unwrap_or_default();
        extents.extend(
            taken_requests
                .iter()
                .enumerate()
                .map(|(i, request)| self.extent_of(request, first_task + i)),
        );
        taken
    }

    /// Whether `request` goes this way (to this peer, into this buffer, from this region,
    /// with a length the full check would take).
    #[inline]
    fn fits(&self, request: &TransferRequest) -> bool {
        let len = request.length;
        request.target == self.target
            && len != 0
            && len as u64 <= MAX_TASK_BYTES
            && request.target_offset >= self.remote_start
            && request.target_offset <= self.remote_end
            && self.remote_end - request.target_offset >= len as u64
            && request.source >= self.local_start
            && request.source <= self.local_end
            && self.local_end - request.source >= len
    }

    /// The extent of `request`, task `task`, which [`fits`](Self::fits).
    #[inline]
    fn extent_of(&self, request: &TransferRequest, task: usize) -> Extent {
        Extent {
            local: request.source,
            remote: request.target_offset,
            len: request.length,
            task: task as u32,
            submission: self.submission,
            buffer: self.buffer,
            opcode: request.opcode,
        }
    }
}
