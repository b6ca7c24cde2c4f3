//! Endpoints: the RC queue pairs between one local NIC and one peer NIC path, and the
//! bounded store that caches them per NIC (SIEVE eviction, as Mooncake).
//!
//! An endpoint is made by the active side's handshake or by the passive side's answer to
//! one; once its peer is gone, evicted or broken it is retired (state `Dead`): its worker
//! moves its QPs to the error state, waits for their flushed work requests, and drops it,
//! which destroys the QPs. So no QP outlives its use, and the store's bound caps them all.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tern_verbs::{CompletionQueue, Gid, PathConfig, Peer, QpCaps, QueuePair, VerbsError};

use crate::nic::{Nic, mtu_enum};
use crate::sieve::Sieve;

/// Where an endpoint stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum State {
    /// Our handshake is in flight.
    Connecting = 0,
    /// Connected by the peer's handshake; waiting for its ready ACK before we send.
    WaitAck = 1,
    /// Usable.
    Ready = 2,
    /// Retired: broken, evicted or replaced.
    Dead = 3,
}

impl State {
    fn from_u8(value: u8) -> Self {
        match value {
            0 => Self::Connecting,
            1 => Self::WaitAck,
            2 => Self::Ready,
            _ => Self::Dead,
        }
    }
}

/// The other end of an endpoint, as its handshake message describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PeerQps {
    pub gid: Gid,
    pub lid: u16,
    pub qps: Vec<u32>,
    /// Path MTU in bytes, already the smaller of both ends'.
    pub mtu: u32,
}

#[derive(Debug)]
struct Link {
    /// The peer's QP numbers this endpoint's QPs are connected to (empty: not yet).
    peer_qps: Vec<u32>,
    /// When the endpoint was made or last changed state.
    since: Instant,
}

/// RC queue pairs from one local NIC to one peer NIC path.
#[derive(Debug)]
pub(crate) struct Endpoint {
    /// The peer NIC path, `<peer server>@<device>`.
    pub key: Arc<str>,
    /// Index of the local NIC.
    pub nic: usize,
    /// The worker whose completion queue the QPs report to.
    pub worker: usize,
    pub qps: Vec<QueuePair>,
    state: AtomicU8,
    /// Serialises QP state changes, which the worker, a handshake thread and the RPC
    /// server may attempt at once.
    link: Mutex<Link>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl Endpoint {
    /// `count` RC QPs on `nic` reporting to `cq`, moved to INIT.
    pub fn create(
        key: Arc<str>,
        nic: &Nic,
        worker: usize,
        cq: &Arc<CompletionQueue>,
        count: usize,
        caps: QpCaps,
        state: State,
    ) -> Result<Self, VerbsError> {
        let mut qps = Vec::with_capacity(count);
        for _ in 0..count {
            let qp = QueuePair::new_rc(&nic.pd, cq, caps)?;
            qp.to_init(nic.port)?;
            qps.push(qp);
        }
        Ok(Self {
            key,
            nic: nic.index,
            worker,
            qps,
            state: AtomicU8::new(state as u8),
            link: Mutex::new(Link {
                peer_qps: Vec::new(),
                since: Instant::now(),
            }),
        })
    }

    pub fn qp_nums(&self) -> Vec<u32> {
        self.qps.iter().map(QueuePair::qp_num).collect()
    }

    /// The peer QPs this endpoint is connected to (empty before it is).
    pub fn peer_qps(&self) -> Vec<u32> {
        lock(&self.link).peer_qps.clone()
    }

    pub fn state(&self) -> State {
        State::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Moves to `state` unless the endpoint is dead; false if it was.
    pub fn set_state(&self, state: State) -> bool {
        let mut link = lock(&self.link);
        if self.state() == State::Dead {
            return false;
        }
        self.state.store(state as u8, Ordering::Release);
        link.since = Instant::now();
        true
    }

    /// Time in the current state.
    pub fn age(&self) -> std::time::Duration {
        lock(&self.link).since.elapsed()
    }

    /// Retires the endpoint: no new work goes to it, and its QPs move to the error state so
    /// that every outstanding request completes (flushed). True the first time.
    pub fn retire(&self) -> bool {
        let _link = lock(&self.link);
        if self.state.swap(State::Dead as u8, Ordering::AcqRel) == State::Dead as u8 {
            return false;
        }
        for qp in &self.qps {
            if let Err(e) = qp.to_error() {
                tracing::debug!("endpoint {}: {e}", self.key);
            }
        }
        true
    }

    /// Connects every QP to the peer's (QP i with the peer's QP i): INIT → RTR → RTS. Being
    /// connected to exactly these QPs already is success (both sides opened at once); being
    /// connected to others is an error.
    pub fn connect(&self, nic: &Nic, peer: &PeerQps, template: &PathConfig) -> Result<(), String> {
        let mut link = lock(&self.link);
        if self.state() == State::Dead {
            return Err(format!("endpoint {} was retired", self.key));
        }
        if !link.peer_qps.is_empty() {
            return if link.peer_qps == peer.qps {
                Ok(())
            } else {
                Err(format!(
                    "endpoint {} is connected to QPs {:?}, the peer now names {:?}",
                    self.key, link.peer_qps, peer.qps
                ))
            };
        }
        if peer.qps.len() != self.qps.len() {
            return Err(format!(
                "the peer has {} QPs for {}, this side {}",
                peer.qps.len(),
                self.key,
                self.qps.len()
            ));
        }
        let path = PathConfig {
            port: nic.port,
            sgid_index: u8::try_from(nic.gid.index)
                .map_err(|_| format!("GID index {} does not fit a QP", nic.gid.index))?,
            mtu: mtu_enum(peer.mtu),
            ..*template
        };
        for (qp, &qp_num) in self.qps.iter().zip(&peer.qps) {
            let remote = Peer {
                qp_num,
                psn: 0,
                gid: peer.gid,
                lid: peer.lid,
            };
            qp.to_rtr(&remote, &path).map_err(|e| e.to_string())?;
            qp.to_rts(&path).map_err(|e| e.to_string())?;
        }
        link.peer_qps.clone_from(&peer.qps);
        link.since = Instant::now();
        Ok(())
    }
}

/// One NIC's endpoints, bounded; the least recently useful ones are evicted (SIEVE).
#[derive(Debug)]
pub(crate) struct EndpointStore {
    cache: Sieve<Arc<str>, Arc<Endpoint>>,
}

impl EndpointStore {
    pub fn new(capacity: usize) -> Self {
        Self {
            cache: Sieve::new(capacity),
        }
    }

    /// The live endpoint for `key`, marked as used.
    pub fn get(&mut self, key: &Arc<str>) -> Option<Arc<Endpoint>> {
        match self.cache.get(key) {
            Some(ep) if ep.state() != State::Dead => Some(ep.clone()),
            Some(_) => {
                self.cache.remove(key);
                None
            }
            None => None,
        }
    }

    /// Adds an endpoint; returns the ones it displaced (the same key's predecessor, an
    /// evicted one), which the caller retires.
    pub fn insert(&mut self, ep: Arc<Endpoint>) -> Vec<Arc<Endpoint>> {
        let inserted = self.cache.insert(ep.key.clone(), ep);
        inserted
            .replaced
            .into_iter()
            .chain(inserted.evicted.map(|(_, ep)| ep))
            .collect()
    }

    /// Removes `ep` if it is still the store's endpoint for its key.
    pub fn remove(&mut self, ep: &Arc<Endpoint>) {
        if self
            .cache
            .peek(&ep.key)
            .is_some_and(|stored| Arc::ptr_eq(stored, ep))
        {
            self.cache.remove(&ep.key);
        }
    }

    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// Every endpoint, emptying the store (shutdown).
    pub fn drain(&mut self) -> Vec<Arc<Endpoint>> {
        self.cache.drain().into_iter().map(|(_, ep)| ep).collect()
    }
}
