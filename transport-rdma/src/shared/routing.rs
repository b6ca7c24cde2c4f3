//! Routing: the path, NIC and keys a slice takes (the peer's buffer, both sides' NICs as
//! ranked for their locations, health), a new route after a failure, and the worker that
//! owns a path. The choice among NIC pairs and the health it weighs are `crate::route`'s.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use tern_engine::{PeerSegment, Slice, TransferError};
use tern_memreg::nic::NicKeys;
use tern_metadata::PriorityMatrix;

use super::{KEYLESS_PEER_BUFFER, Shared};
use crate::route::{Ranked, Side, choose};
use crate::topology::candidates;
use crate::worker::Job;

/// Where a slice goes.
#[derive(Debug)]
pub(crate) struct Route {
    pub nic: usize,
    pub key: Arc<str>,
    pub lkey: u32,
    pub rkey: u32,
}

/// A peer as routing sees it: its NIC paths and, per location of its buffers, its ranked
/// NICs. Built once per descriptor the engine hands over.
#[derive(Debug)]
pub(crate) struct PeerView {
    segment: Arc<PeerSegment>,
    names: Vec<String>,
    paths: Vec<Arc<str>>,
    ranked: HashMap<String, Ranked>,
}

impl PeerView {
    fn new(segment: &Arc<PeerSegment>) -> Self {
        let desc = &segment.desc;
        let server = desc
            .rdma_server_name
            .clone()
            .unwrap_or_else(|| segment.name.clone());
        let names: Vec<String> = desc.devices.iter().map(|d| d.name.clone()).collect();
        let matrix = desc.priority_matrix.clone().unwrap_or_default();
        let mut ranked = HashMap::new();
        for buffer in &desc.buffers {
            ranked
                .entry(buffer.name.clone())
                .or_insert_with(|| ranked_in(&matrix, &buffer.name, &names));
        }
        Self {
            segment: segment.clone(),
            paths: names
                .iter()
                .map(|n| Arc::from(format!("{server}@{n}")))
                .collect(),
            names,
            ranked,
        }
    }
}

/// The NICs of `names` for `location`, as the matrix ranks them.
fn ranked_in(matrix: &PriorityMatrix, location: &str, names: &[String]) -> Ranked {
    let found = candidates(matrix, location, names);
    Ranked {
        preferred: indices(&found.preferred, names),
        available: indices(&found.available, names),
    }
}

/// What routing looked up for one submit call, reused across its slices.
#[derive(Debug, Default)]
pub(crate) struct RouteCache {
    /// The local region (by address): its keys and the local NICs ranked for its location.
    keys: Option<(usize, Arc<NicKeys>, Arc<Ranked>)>,
    peer: Option<Arc<PeerView>>,
    /// Index of the peer buffer the last slice landed in.
    buffer: Option<usize>,
    /// The worker of the last path routed to.
    worker: Option<(Arc<str>, usize)>,
}

impl RouteCache {
    /// The worker (of `workers` per NIC) for path `key`: the same path always maps to the
    /// same worker, so that one worker owns each endpoint; hashed once per run of slices.
    pub fn worker_of(&mut self, key: &Arc<str>, workers: usize) -> usize {
        match &self.worker {
            Some((last, worker)) if Arc::ptr_eq(last, key) => *worker,
            _ => {
                let worker = worker_of(key, workers);
                self.worker = Some((key.clone(), worker));
                worker
            }
        }
    }
}

/// Which of a NIC's workers owns the endpoints of a peer NIC path.
pub(crate) fn worker_of(key: &str, workers: usize) -> usize {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut hasher);
    (hasher.finish() % workers.max(1) as u64) as usize
}

impl Shared {
    /// Picks the path, NIC and keys of a slice.
    pub fn route(
        &self,
        slice: &Slice,
        attempt: u32,
        stripe: usize,
        avoid: Option<(usize, &str)>,
        cache: &mut RouteCache,
    ) -> Result<Route, TransferError> {
        let region = slice.local().info();
        if cache
            .keys
            .as_ref()
            .is_none_or(|(addr, _, _)| *addr != region.addr)
        {
            let keys = self.keys.read().get(&region.addr).cloned().ok_or(
                TransferError::SourceNotRegistered {
                    addr: slice.local_addr,
                    len: slice.len,
                },
            )?;
            let ranked = self
                .local_ranked
                .lock()
                .entry(region.location.clone())
                .or_insert_with(|| Arc::new(ranked_in(&self.matrix, &region.location, &self.names)))
                .clone();
            cache.keys = Some((region.addr, keys, ranked));
        }
        if cache
            .peer
            .as_ref()
            .is_none_or(|view| !Arc::ptr_eq(&view.segment, slice.peer()))
        {
            cache.peer = Some(self.peer_view(slice.peer()));
            cache.buffer = None;
        }
        let (Some((_, keys, local_ranked)), Some(peer)) = (&cache.keys, &cache.peer) else {
            return Err(TransferError::SourceNotRegistered {
                addr: slice.local_addr,
                len: slice.len,
            });
        };
        let desc = &slice.peer().desc;
        // Slices of one run usually land in one buffer of the peer: try the last one first.
        let (from, len) = (slice.remote_addr, slice.len as u64);
        let buffer = match cache.buffer.and_then(|i| desc.buffers.get(i)) {
            Some(buffer) if buffer.contains(from, len) => buffer,
            _ => {
                let found = desc.buffer_containing(from, len);
                cache.buffer =
                    found.and_then(|b| desc.buffers.iter().position(|x| std::ptr::eq(x, b)));
                found.ok_or_else(|| TransferError::TargetOutOfRange {
                    segment: slice.peer().name.clone(),
                    addr: slice.remote_addr,
                    len: slice.len,
                })?
            }
        };
        let rkeys = match &buffer.rkey {
            Some(rkeys) if !rkeys.is_empty() => rkeys,
            // Published without keys (device memory this build does not register on NICs):
            // another transport may carry it.
            None => {
                self.device_declines
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.device_declined_bytes
                    .fetch_add(slice.len as u64, std::sync::atomic::Ordering::Relaxed);
                return Err(TransferError::Declined {
                    segment: slice.peer().name.clone(),
                    reason: KEYLESS_PEER_BUFFER.into(),
                });
            }
            // Not remote-accessible there: the peer would refuse it.
            _ => {
                return Err(TransferError::RemoteRejected {
                    peer: slice.peer().name.clone(),
                    addr: slice.remote_addr,
                    len: slice.len,
                });
            }
        };
        let unreachable = |why: String| TransferError::Connection {
            peer: slice.peer().name.clone(),
            message: why,
        };
        let computed;
        let peer_ranked = match peer.ranked.get(&buffer.name) {
            Some(ranked) => ranked,
            None => {
                computed = ranked_in(&PriorityMatrix::new(), &buffer.name, &peer.names);
                &computed
            }
        };
        // Health (and a clock read) only once something has failed.
        let health = self
            .maybe_paused
            .load(Ordering::Relaxed)
            .then(|| (self.health.lock(), Instant::now()));
        let paused = |l: usize, p: usize| -> bool {
            if self.nics[l].port_down.load(Ordering::Relaxed) {
                return true;
            }
            health.as_ref().is_some_and(|(h, now)| {
                h.nic_paused(l, *now)
                    || peer
                        .paths
                        .get(p)
                        .is_some_and(|path| h.path_paused(l, path, *now))
            })
        };
        let avoid = avoid.and_then(|(l, key)| {
            peer.paths
                .iter()
                .position(|path| &**path == key)
                .map(|p| (l, p))
        });
        let (l, p) = choose(
            &Side {
                ranked: local_ranked,
                names: &self.names,
            },
            &Side {
                ranked: peer_ranked,
                names: &peer.names,
            },
            stripe,
            attempt,
            avoid,
            &paused,
        )
        .ok_or_else(|| {
            unreachable(format!(
                "no path from this node's NICs {:?} to the peer's {:?}",
                self.names, peer.names
            ))
        })?;
        let lkey = *keys
            .lkeys
            .get(l)
            .ok_or_else(|| unreachable("no local key for the chosen NIC".into()))?;
        let rkey = *rkeys.get(p).ok_or_else(|| {
            unreachable(format!(
                "the peer's buffer has {} rkeys for {} devices",
                rkeys.len(),
                peer.names.len()
            ))
        })?;
        let key = peer
            .paths
            .get(p)
            .cloned()
            .ok_or_else(|| unreachable("no NIC path for the chosen peer NIC".into()))?;
        Ok(Route {
            nic: l,
            key,
            lkey,
            rkey,
        })
    }

    /// The routing view of a peer's current descriptor.
    pub(super) fn peer_view(&self, segment: &Arc<PeerSegment>) -> Arc<PeerView> {
        let mut views = self.peer_views.lock();
        match views.get(&segment.id) {
            Some(view) if Arc::ptr_eq(&view.segment, segment) => view.clone(),
            _ => {
                if views.len() >= 1024 {
                    // Views of segments the engine no longer holds (closed, replaced).
                    views.retain(|_, v| Arc::strong_count(&v.segment) > 1);
                }
                let view = Arc::new(PeerView::new(segment));
                views.insert(segment.id, view.clone());
                view
            }
        }
    }

    /// Sends a job to the worker that owns its path.
    pub fn dispatch(&self, job: Job) {
        let worker = self.worker_index(&job.key);
        match self.nics.get(job.nic).and_then(|n| n.workers.get(worker)) {
            Some(handle) => handle.send_jobs(vec![job]),
            None => job.slice.fail(TransferError::Dropped(
                "no worker for the chosen NIC".into(),
            )),
        }
    }

    /// A new route for a job that could not run where it was: `None` when it has been
    /// settled instead — handed back to the engine for the next transport when no path to the
    /// peer works (out of retries, no path), failed when the peer refused it, dropped when its
    /// task is over.
    pub fn reroute(&self, mut job: Job, reason: Option<String>) -> Option<Job> {
        if !job.slice.is_live() {
            job.let_go();
            return None;
        }
        if job.attempt > self.config.retry_count {
            let message = format!(
                "gave up after {} attempt(s); last: {}",
                job.attempt,
                reason.as_deref().unwrap_or("endpoint lost")
            );
            if job.fence {
                // Never to another transport: an earlier attempt may still land.
                job.fail_unfenced(&message);
            } else {
                job.slice.decline_with(TransferError::Connection {
                    peer: job.key.to_string(),
                    message,
                });
            }
            return None;
        }
        if job.fence {
            // Same path: a fresh endpoint there, whose handshake makes the peer replace the
            // QPs an earlier attempt may still land through.
            self.retries.fetch_add(1, Ordering::Relaxed);
            return Some(job);
        }
        let stripe = self.stripe.fetch_add(1, Ordering::Relaxed);
        let avoid = reason.is_some().then_some((job.nic, &*job.key));
        let route = self.route(
            &job.slice,
            job.attempt,
            stripe,
            avoid,
            &mut RouteCache::default(),
        );
        match route {
            Ok(route) => {
                self.retries.fetch_add(1, Ordering::Relaxed);
                job.nic = route.nic;
                job.key = route.key;
                job.lkey = route.lkey;
                job.rkey = route.rkey;
                Some(job)
            }
            Err(error @ TransferError::Connection { .. }) => {
                job.slice.decline_with(error);
                None
            }
            Err(error) => {
                job.slice.fail(error);
                None
            }
        }
    }
}

/// Positions of `names` in `all`, in the order of `names`.
fn indices(names: &[String], all: &[String]) -> Vec<usize> {
    names
        .iter()
        .filter_map(|n| all.iter().position(|a| a == n))
        .collect()
}
