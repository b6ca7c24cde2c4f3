//! Endpoints: the RC queue pairs between one local NIC and one peer NIC path, and the
//! bounded store that caches them per NIC (SIEVE eviction, as Mooncake).
//!
//! An endpoint is made by the active side's handshake or by the passive side's answer to
//! one; once its peer is gone, evicted or broken it is decommissioned (state `Dead`): its
//! worker moves its QPs to the error state, waits for their flushed work requests, and drops
//! it, which destroys the QPs. So no QP outlives its use, and the store's bound caps them all.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Instant;

use parking_lot::Mutex;
use tern_engine::{Pinned, Submission};
use tern_verbs::{CompletionQueue, Gid, PathConfig, Peer, QpCaps, QueuePair, VerbsError};

use crate::worker::Job;

/// The QPs of an endpoint: each work request holds its slice's submission, and so the pin on its
/// local region, until the request is retired, and carries its job.
pub(crate) type DataQp = QueuePair<Pinned<Submission>, Job>;

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
    /// Decommissioned: broken, evicted or replaced.
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
    /// The first packet sequence number of the peer's QPs, if it sent one (a Tern peer);
    /// without it both ends start at 0, as Mooncake's do.
    pub psn: Option<u32>,
}

/// Which peer QPs an endpoint's QPs are paired with, and when its state last changed: held
/// while its QPs change state.
#[derive(Debug)]
struct Pairing {
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
    pub qps: Vec<DataQp>,
    /// The first packet sequence number of these QPs' send queues when the peer is a Tern
    /// node (random, 24 bits; sent in the handshake's `psn`).
    pub psn: u32,
    state: AtomicU8,
    /// Whether the peer accepted this endpoint's handshake request (our side's, not yet
    /// necessarily connected): it then replaced whatever QPs it had for this NIC's path.
    answered: AtomicBool,
    /// Serialises QP state changes, which the worker, a handshake thread and the RPC
    /// server may attempt at once.
    pairing: Mutex<Pairing>,
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
            let qp = DataQp::new_rc(&nic.pd, cq, caps)?;
            qp.to_init(nic.port)?;
            qps.push(qp);
        }
        Ok(Self {
            key,
            nic: nic.index,
            worker,
            qps,
            psn: crate::handshake::random_psn(),
            state: AtomicU8::new(state as u8),
            answered: AtomicBool::new(false),
            pairing: Mutex::new(Pairing {
                peer_qps: Vec::new(),
                since: Instant::now(),
            }),
        })
    }

    pub fn qp_nums(&self) -> Vec<u32> {
        self.qps.iter().map(DataQp::qp_num).collect()
    }

    /// The peer QPs this endpoint is connected to (empty before it is).
    pub fn peer_qps(&self) -> Vec<u32> {
        self.pairing.lock().peer_qps.clone()
    }

    /// The peer accepted this endpoint's handshake request.
    pub fn mark_answered(&self) {
        self.answered.store(true, Ordering::Release);
    }

    /// Whether the peer accepted this endpoint's handshake request: it replaced the QPs it
    /// had for this NIC's path then (`Shared::answer`; a Mooncake peer resets them), so
    /// nothing an earlier endpoint on the path sent lands through them any more.
    pub fn answered(&self) -> bool {
        self.answered.load(Ordering::Acquire)
    }

    pub fn state(&self) -> State {
        State::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Moves to `state` unless the endpoint is dead; false if it was.
    pub fn set_state(&self, state: State) -> bool {
        let mut pairing = self.pairing.lock();
        if self.state() == State::Dead {
            return false;
        }
        self.state.store(state as u8, Ordering::Release);
        pairing.since = Instant::now();
        true
    }

    /// Time in the current state.
    pub fn age(&self) -> std::time::Duration {
        self.pairing.lock().since.elapsed()
    }

    /// Decommissions the endpoint: no new work goes to it, and its QPs move to the error
    /// state so that every outstanding request completes (flushed). True the first time.
    pub fn decommission(&self) -> bool {
        let _pairing = self.pairing.lock();
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
        let mut pairing = self.pairing.lock();
        if self.state() == State::Dead {
            return Err(format!("endpoint {} was decommissioned", self.key));
        }
        if !pairing.peer_qps.is_empty() {
            return if pairing.peer_qps == peer.qps {
                Ok(())
            } else {
                Err(format!(
                    "endpoint {} is connected to QPs {:?}, the peer now names {:?}",
                    self.key, pairing.peer_qps, peer.qps
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
            // A peer that sent no PSN (Mooncake) expects ours to start at 0, as its own do.
            psn: if peer.psn.is_some() { self.psn } else { 0 },
            ..*template
        };
        for (qp, &qp_num) in self.qps.iter().zip(&peer.qps) {
            let remote = Peer {
                qp_num,
                psn: peer.psn.unwrap_or(0),
                gid: peer.gid,
                lid: peer.lid,
            };
            qp.to_rtr(&remote, &path).map_err(|e| e.to_string())?;
            qp.to_rts(&path).map_err(|e| e.to_string())?;
        }
        pairing.peer_qps.clone_from(&peer.qps);
        pairing.since = Instant::now();
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
    /// evicted one), which the caller decommissions.
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

    /// Every endpoint, without marking any as used.
    pub fn endpoints(&self) -> impl Iterator<Item = &Arc<Endpoint>> {
        self.cache.iter().map(|(_, ep)| ep)
    }

    /// Every endpoint, emptying the store (shutdown).
    pub fn drain(&mut self) -> Vec<Arc<Endpoint>> {
        self.cache.drain().into_iter().map(|(_, ep)| ep).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::config::RdmaConfig;
    use crate::nic::open_nics;

    /// QPs the kernel counts on `device` (`rdma resource show`: `0: rxe0: pd 1 cq 2 qp 9
    /// ...`), the GSI QP (QP 1) included.
    fn kernel_qps(device: &str) -> usize {
        let output = std::process::Command::new("rdma")
            .args(["resource", "show"])
            .output()
            .expect("iproute2's rdma tool runs");
        assert!(output.status.success(), "rdma resource show: {output:?}");
        let text = String::from_utf8_lossy(&output.stdout);
        let line = text
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(&format!("{device}:")))
            .unwrap_or_else(|| panic!("rdma resource show lists no {device}: {text}"));
        let words: Vec<&str> = line.split_whitespace().collect();
        let at = words
            .iter()
            .position(|w| *w == "qp")
            .unwrap_or_else(|| panic!("no qp count in {line:?}"));
        words[at + 1]
            .parse()
            .unwrap_or_else(|_| panic!("no qp count in {line:?}"))
    }

    /// Connecting and evicting endpoints 10 000 times keeps the QPs bounded by the store's
    /// capacity, by Tern's own count and by the kernel's.
    #[test]
    #[ignore = "needs Soft-RoCE: cargo xtask softroce --test -p tern-transport-rdma --lib"]
    fn connecting_and_evicting_10000_times_keeps_the_qps_bounded() {
        const ROUNDS: usize = 10_000;
        const CAPACITY: usize = 4;
        const QPS: usize = 2;
        // The store's endpoints, and the one in hand before it goes in.
        const BOUND: usize = CAPACITY * QPS + QPS;
        let device = std::env::var("TERN_RXE").unwrap_or_else(|_| "rxe0".into());
        let config = RdmaConfig {
            devices: vec![device.clone()],
            ..RdmaConfig::default()
        };
        let nics = open_nics(&config).expect("the Soft-RoCE device opens");
        let nic = &nics[0];
        let crate::nic::Sizing {
            cq_entries,
            caps,
            template,
        } = crate::nic::sizing(&config, &nics);
        let cq = CompletionQueue::new(nic.context(), cq_entries as i32).unwrap();
        let tern_before = tern_verbs::live_queue_pairs();
        let kernel_before = kernel_qps(&device);
        eprintln!("before: Tern counts {tern_before} QPs, the kernel {kernel_before} on {device}");
        let mut store = EndpointStore::new(CAPACITY);
        let mut displaced_total = 0;
        let started = Instant::now();
        for round in 0..ROUNDS {
            // 13 peers over a store of 4: most inserts evict, some replace a cached peer.
            let key: Arc<str> = Arc::from(format!("10.0.0.{}:15000@{device}", round % 13));
            let ep = Arc::new(
                Endpoint::create(key, nic, 0, &cq, QPS, caps, State::Connecting)
                    .unwrap_or_else(|e| panic!("round {round}: {e}")),
            );
            let me = PeerQps {
                gid: nic.gid.gid,
                lid: nic.lid,
                qps: ep.qp_nums(),
                mtu: nic.mtu,
                psn: Some(ep.psn),
            };
            ep.connect(nic, &me, &template)
                .unwrap_or_else(|e| panic!("round {round}: {e}"));
            assert!(ep.set_state(State::Ready));
            assert_eq!(ep.peer_qps(), me.qps);
            let live = tern_verbs::live_queue_pairs() - tern_before;
            assert!(live <= BOUND, "round {round}: {live} QPs live");
            let displaced = store.insert(ep);
            assert!(store.len() <= CAPACITY, "round {round}: {}", store.len());
            if round >= CAPACITY {
                assert_eq!(
                    displaced.len(),
                    1,
                    "round {round}: a full store displaces one"
                );
            }
            displaced_total += displaced.len();
            for old in displaced {
                assert!(old.decommission(), "round {round}: decommissioned twice");
                assert_eq!(old.state(), State::Dead);
                assert_eq!(Arc::strong_count(&old), 1, "round {round}: still shared");
            }
            let live = tern_verbs::live_queue_pairs() - tern_before;
            assert!(
                live <= CAPACITY * QPS,
                "round {round}: {live} QPs live after eviction"
            );
            if round % 1000 == 999 {
                let kernel = kernel_qps(&device);
                eprintln!(
                    "round {}: {:.1} s, Tern {live} QPs, kernel {kernel}",
                    round + 1,
                    started.elapsed().as_secs_f64()
                );
                assert!(
                    kernel <= kernel_before + CAPACITY * QPS,
                    "round {round}: the kernel counts {kernel} QPs (from {kernel_before})"
                );
            }
        }
        let elapsed = started.elapsed();
        eprintln!(
            "{ROUNDS} connect + evict rounds took {:.1} s ({:.0} us each)",
            elapsed.as_secs_f64(),
            elapsed.as_secs_f64() * 1e6 / ROUNDS as f64
        );
        assert_eq!(displaced_total, ROUNDS - CAPACITY);
        let tern_end = tern_verbs::live_queue_pairs() - tern_before;
        let kernel_end = kernel_qps(&device);
        eprintln!("end: Tern counts {tern_end} QPs (store full), the kernel {kernel_end}");
        assert_eq!(tern_end, CAPACITY * QPS);
        // The kernel also counts the GSI QP (QP 1), which the baseline holds.
        assert_eq!(kernel_end, kernel_before + CAPACITY * QPS);
        assert!(
            kernel_end <= BOUND + 1,
            "the kernel counts {kernel_end} QPs"
        );
        for ep in store.drain() {
            assert!(ep.decommission());
        }
        assert_eq!(tern_verbs::live_queue_pairs(), tern_before);
        assert_eq!(
            kernel_qps(&device),
            kernel_before,
            "QPs left after draining"
        );
    }
}
