//! What the engine and its transports have done: bytes, slices, retries and failures per
//! transport, peer and NIC, the state of each peer, and how long transfers took (histograms
//! per operation and size class) — and all of it as Prometheus text
//! ([`EngineStats::prometheus`]).
//!
//! Counting is meant to cost nothing on the data path. What the engine counts per
//! transport and times per task is not counted as it happens: it is read off the tasks
//! themselves when someone asks ([`Tally`]). A task keeps its bytes and slices in the one
//! atomic add each slice makes anyway, and its end in the compare-and-swap that ends it,
//! which also carries when it ended; a submit call records when its tasks started, once
//! for all of them. So metrics add no atomic operation to a slice or a task: one clock
//! reading per task end — or per poll, where a transport reports the ends it found together
//! ([`ReportTogether`]) — and one record per submit call. Live batches are read where they
//! are; a batch that goes adds its tasks to the engine's totals once. What does not fit a
//! task's words — slices carried by a transport other than the one their task went to
//! first, failures — each thread counts into a shard of its own ([`LocalCounter`]s: a load
//! and a store, no atomic read-modify-write, no shared cache line), summed when asked; a
//! transport's own per-peer counts are one [`MovedCounter`] store per slice or per poll.
//! [`TransferEngineBuilder::metrics`]
//! (crate::TransferEngineBuilder::metrics) turns the engine's own counting off.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder, NoLabelSet, prometheus_text};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::MetricType::{Counter as COUNTER, Gauge as GAUGE};
use prometheus_client::registry::Registry;

use crate::batch::{TaskTable, tally_tasks};
use crate::transport::Routes;

/// A counter one thread adds to and any thread reads: adding is a relaxed load and store,
/// no atomic read-modify-write. If two threads add at once a count may be lost, never more;
/// so each writer keeps counters of its own (a worker's, a lane's) and readers sum them.
#[derive(Debug, Default)]
pub struct LocalCounter(AtomicU64);

impl LocalCounter {
    /// Adds `n` (from the counter's one writer).
    pub fn add(&self, n: u64) {
        self.0.store(
            self.0.load(Ordering::Relaxed).wrapping_add(n),
            Ordering::Relaxed,
        );
    }

    /// The count so far.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Bytes and slices moved, in one word that one thread adds to and any thread reads: adding
/// is one relaxed load and store (bytes in the low 40 bits, slices above), so a transport's
/// per-peer count costs a slice no more than that. Before a field would overflow (past a
/// TiB, or 16 M slices) the writer moves the word into wide counters, under a sequence
/// number that readers check (a seqlock). For a count that several threads add to, see
/// [`SharedMovedCounter`].
#[derive(Debug, Default)]
pub struct MovedCounter {
    word: AtomicU64,
    spilled: Spilled,
}

/// Bits of a moved-count word that count bytes.
const MOVED_BYTES_BITS: u32 = 40;
const MOVED_BYTES_MAX: u64 = (1 << MOVED_BYTES_BITS) - 1;
const MOVED_SLICES_MAX: u64 = u64::MAX >> MOVED_BYTES_BITS;

impl MovedCounter {
    /// Adds `slices` that moved `bytes` in all (from the counter's one writer).
    pub fn add(&self, bytes: u64, slices: u64) {
        let word = self.word.load(Ordering::Relaxed);
        let (sum_bytes, sum_slices) = (
            (word & MOVED_BYTES_MAX).saturating_add(bytes),
            (word >> MOVED_BYTES_BITS).saturating_add(slices),
        );
        if sum_bytes <= MOVED_BYTES_MAX && sum_slices <= MOVED_SLICES_MAX {
            self.word.store(
                sum_slices << MOVED_BYTES_BITS | sum_bytes,
                Ordering::Relaxed,
            );
        } else {
            let take = || {
                self.word.store(0, Ordering::Relaxed);
                word
            };
            self.spilled.spill(take, bytes, slices);
        }
    }

    /// `(bytes, slices)` so far.
    pub fn get(&self) -> (u64, u64) {
        self.spilled.read(&self.word)
    }
}

/// A [`MovedCounter`] that any number of threads add to: adding is one relaxed
/// `fetch_add` on the word. Adds of 4 GiB or 64 Ki slices and more go to the wide
/// counters directly; a writer whose add takes a field past half its range moves the word
/// there, one writer at a time — so a field overflows only if more than 128 threads add
/// at once before one of them does.
#[derive(Debug, Default)]
pub struct SharedMovedCounter {
    word: AtomicU64,
    spilled: Spilled,
    spilling: Mutex<()>,
}

impl SharedMovedCounter {
    /// Adds `slices` that moved `bytes` in all.
    pub fn add(&self, bytes: u64, slices: u64) {
        if bytes >= 1 << 32 || slices >= 1 << 16 {
            let _one = self.spilling.lock().unwrap_or_else(|p| p.into_inner());
            return self.spilled.spill(|| 0, bytes, slices);
        }
        let before = self
            .word
            .fetch_add(slices << MOVED_BYTES_BITS | bytes, Ordering::Relaxed);
        if (before & MOVED_BYTES_MAX) + bytes > MOVED_BYTES_MAX / 2
            || (before >> MOVED_BYTES_BITS) + slices > MOVED_SLICES_MAX / 2
        {
            let _one = self.spilling.lock().unwrap_or_else(|p| p.into_inner());
            // Another writer may have moved it meanwhile: this moves what is there now.
            self.spilled
                .spill(|| self.word.swap(0, Ordering::Relaxed), 0, 0);
        }
    }

    /// `(bytes, slices)` so far.
    pub fn get(&self) -> (u64, u64) {
        self.spilled.read(&self.word)
    }
}

/// The wide counters a moved-count word is moved into before a field overflows, under a
/// sequence number that readers check (a seqlock). One thread moves at a time.
#[derive(Debug, Default)]
struct Spilled {
    bytes: AtomicU64,
    slices: AtomicU64,
    /// Odd while a word is being moved.
    sequence: AtomicU64,
}

impl Spilled {
    /// Adds the word that `take` empties, and `bytes` and `slices`, to the wide counters.
    #[cold]
    fn spill(&self, take: impl FnOnce() -> u64, bytes: u64, slices: u64) {
        let sequence = self.sequence.load(Ordering::Relaxed);
        self.sequence.store(sequence + 1, Ordering::Relaxed);
        // Readers that see any store below see the odd sequence (fence to fence).
        fence(Ordering::Release);
        let word = take();
        let add = |counter: &AtomicU64, n: u64| {
            counter.store(
                counter.load(Ordering::Relaxed).wrapping_add(n),
                Ordering::Relaxed,
            );
        };
        add(&self.bytes, (word & MOVED_BYTES_MAX).wrapping_add(bytes));
        add(
            &self.slices,
            (word >> MOVED_BYTES_BITS).wrapping_add(slices),
        );
        self.sequence.store(sequence + 2, Ordering::Release);
    }

    /// `(bytes, slices)` of `word` and the wide counters together, read while no word
    /// was being moved.
    fn read(&self, word: &AtomicU64) -> (u64, u64) {
        loop {
            let before = self.sequence.load(Ordering::Acquire);
            let now = word.load(Ordering::Relaxed);
            let bytes = self.bytes.load(Ordering::Relaxed);
            let slices = self.slices.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if before.is_multiple_of(2) && self.sequence.load(Ordering::Relaxed) == before {
                return (
                    bytes.wrapping_add(now & MOVED_BYTES_MAX),
                    slices.wrapping_add(now >> MOVED_BYTES_BITS),
                );
            }
            // A word is being moved: a few instructions, unless its mover was preempted.
            std::thread::yield_now();
        }
    }
}

/// Transfer sizes the latency histograms tell apart: up to 4 KiB, 64 KiB, 1 MiB, and more.
pub const SIZE_CLASSES: [(&str, usize); 4] = [
    ("4KiB", 4 << 10),
    ("64KiB", 64 << 10),
    ("1MiB", 1 << 20),
    ("larger", usize::MAX),
];

/// Upper bounds of the latency buckets, in microseconds (the last is everything above).
pub const LATENCY_BUCKETS_US: [u64; 16] = [
    5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 1_000_000,
    10_000_000,
];

fn size_class(len: usize) -> usize {
    SIZE_CLASSES
        .iter()
        .position(|&(_, max)| len <= max)
        .unwrap_or(SIZE_CLASSES.len() - 1)
}

#[derive(Debug, Clone, Copy, Default)]
struct Histogram {
    /// Per bucket (not cumulative); the last counts what is above every bound.
    buckets: [u64; LATENCY_BUCKETS_US.len() + 1],
    sum_ns: u64,
}

impl Histogram {
    /// `tasks` tasks took `ns` each.
    fn record(&mut self, ns: u64, tasks: u64) {
        // The first bound not below the whole µs of `ns` (the bounds ascend) — the first
        // whose next µs starts above `ns`; past the last, the overflow.
        const ABOVE_NS: [u64; LATENCY_BUCKETS_US.len()] = {
            let mut above = [0; LATENCY_BUCKETS_US.len()];
            let mut i = 0;
            while i < above.len() {
                above[i] = (LATENCY_BUCKETS_US[i] + 1) * 1_000;
                i += 1;
            }
            above
        };
        let bucket = ABOVE_NS.partition_point(|&above| above <= ns);
        self.buckets[bucket] += tasks;
        self.sum_ns += ns * tasks;
    }
}

/// What tasks moved and how long they took, read off the tasks: per transport `(bytes,
/// slices)`, and the latency histograms `[read, write][size class]`.
#[derive(Debug, Clone, Default)]
pub(crate) struct Tally {
    moved: [(u64, u64); Routes::MAX],
    latency: [[Histogram; SIZE_CLASSES.len()]; 2],
}

impl Tally {
    /// `bytes` in `slices` went over `transport`.
    pub(crate) fn moved(&mut self, transport: usize, bytes: u64, slices: u64) {
        if let Some(cell) = self.moved.get_mut(transport) {
            *cell = (cell.0 + bytes, cell.1 + slices);
        }
    }

    /// `tasks` tasks of `len` bytes each took `ns` to complete.
    pub(crate) fn took(&mut self, write: bool, len: u64, ns: u64, tasks: u64) {
        self.latency[usize::from(write)][size_class(len as usize)].record(ns, tasks);
    }

    /// The latency histograms with something in them.
    pub(crate) fn latencies(&self) -> Vec<LatencyStats> {
        let mut out = Vec::new();
        for (op, name) in ["read", "write"].iter().enumerate() {
            for (class, (size, _)) in SIZE_CLASSES.iter().enumerate() {
                let histogram = &self.latency[op][class];
                let count: u64 = histogram.buckets.iter().sum();
                if count == 0 {
                    continue;
                }
                out.push(LatencyStats {
                    operation: (*name).to_owned(),
                    size: (*size).to_owned(),
                    buckets: LATENCY_BUCKETS_US
                        .iter()
                        .zip(&histogram.buckets)
                        .map(|(&le, &n)| (le, n))
                        .collect(),
                    count,
                    sum_seconds: histogram.sum_ns as f64 / 1e9,
                });
            }
        }
        out
    }

    fn of(&self, transport: usize) -> (u64, u64) {
        self.moved.get(transport).copied().unwrap_or_default()
    }
}

/// The tasks an engine reads its tally off: those of live batches, and what batches that
/// went had tallied.
#[derive(Debug, Default)]
struct Ledger {
    retired: Tally,
    live: Vec<Arc<TaskTable>>,
    /// Per transport, the `(bytes, slices)` last shown: a slice carried by another
    /// transport than its task's first is taken off the first's count a moment after it
    /// shows on the task, and a reader between the two would see the first's count drop;
    /// counters never go down, so that reader is shown the count before.
    shown: [(u64, u64); Routes::MAX],
}

#[derive(Debug, Default)]
struct TransportCells {
    bytes: LocalCounter,
    slices: LocalCounter,
    failures: LocalCounter,
}

/// One thread's counts for one engine.
#[derive(Debug)]
struct Shard {
    transports: Box<[TransportCells]>,
}

/// How this thread times the tasks it ends: each by a clock reading of its own, or (inside
/// a [`ReportTogether`]) all by one reading, taken when the first of them ends.
#[derive(Debug, Clone, Copy)]
enum CompletionClock {
    Each,
    /// Nanoseconds since [`clock_ns`]'s epoch, once read.
    Shared(Option<u64>),
}

thread_local! {
    static COMPLETION_CLOCK: Cell<CompletionClock> = const { Cell::new(CompletionClock::Each) };
}

/// While it lives, the slices this thread reports (and the tasks they end) are timed by one
/// clock reading instead of one each: for a transport that learns of many ends at once — one
/// poll of a completion queue, one read of status frames — so that timing costs a clock
/// reading per poll, not per slice. The reading is taken when the first task ends. Hold it
/// only while reporting what has already ended (drop it before moving more bytes, or the
/// times come out early). One begun while another lives shares the outer one's reading.
#[derive(Debug)]
#[must_use = "reports are timed together only while it lives"]
pub struct ReportTogether {
    outer: Option<CompletionClock>,
    /// Thread-bound: it restores this thread's clock.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl ReportTogether {
    /// Starts timing this thread's reports together.
    pub fn begin() -> Self {
        let outer = match COMPLETION_CLOCK.get() {
            CompletionClock::Shared(_) => None,
            outer @ CompletionClock::Each => {
                COMPLETION_CLOCK.set(CompletionClock::Shared(None));
                Some(outer)
            }
        };
        Self {
            outer,
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for ReportTogether {
    fn drop(&mut self) {
        if let Some(outer) = self.outer {
            COMPLETION_CLOCK.set(outer);
        }
    }
}

/// The fixed instant of this process that tasks are timed and batches' deadlines kept from.
pub(crate) fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Nanoseconds since [`epoch`].
pub(crate) fn clock_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

/// When a task this thread ends now ended, by [`clock_ns`] (see [`ReportTogether`]).
pub(crate) fn completion_ns() -> u64 {
    match COMPLETION_CLOCK.get() {
        CompletionClock::Each => clock_ns(),
        CompletionClock::Shared(Some(at)) => at,
        CompletionClock::Shared(None) => {
            let at = clock_ns();
            COMPLETION_CLOCK.set(CompletionClock::Shared(Some(at)));
            at
        }
    }
}

static NEXT_ENGINE: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// This thread's shards, by engine.
    static SHARDS: RefCell<Vec<(u64, Arc<Shard>)>> = const { RefCell::new(Vec::new()) };
}

/// An engine's counts: per transport (same index) and the latency histograms, in one shard
/// per thread that counted.
#[derive(Debug)]
pub(crate) struct EngineCounters {
    id: u64,
    transports: usize,
    enabled: bool,
    shards: Mutex<Vec<Arc<Shard>>>,
    ledger: Mutex<Ledger>,
}

impl Default for EngineCounters {
    fn default() -> Self {
        Self::new(0, true)
    }
}

impl EngineCounters {
    pub(crate) fn new(transports: usize, enabled: bool) -> Self {
        Self {
            id: NEXT_ENGINE.fetch_add(1, Ordering::Relaxed),
            transports,
            enabled,
            shards: Mutex::new(Vec::new()),
            ledger: Mutex::default(),
        }
    }

    /// Runs `f` on this thread's shard of this engine, making it on first use. The shard
    /// used last sits first, so a thread counting for one engine finds it at once.
    fn with_shard(&self, f: impl FnOnce(&Shard)) {
        if !self.enabled {
            return;
        }
        SHARDS.with(|shards| {
            {
                let shards = shards.borrow();
                if let Some((id, shard)) = shards.first()
                    && *id == self.id
                {
                    return f(shard);
                }
            }
            let shards = &mut *shards.borrow_mut();
            f(&self.shard_first(shards));
        });
    }

    /// Puts this engine's shard of this thread first in `shards`, making it if there is none.
    #[cold]
    #[inline(never)]
    fn shard_first(&self, shards: &mut Vec<(u64, Arc<Shard>)>) -> Arc<Shard> {
        if let Some(at) = shards.iter().position(|(id, _)| *id == self.id) {
            shards.swap(0, at);
            return shards[0].1.clone();
        }
        // Shards of engines gone (only this thread holds them) go first.
        shards.retain(|(_, shard)| Arc::strong_count(shard) > 1);
        let shard = Arc::new(Shard {
            transports: (0..self.transports)
                .map(|_| TransportCells::default())
                .collect(),
        });
        self.shards
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(shard.clone());
        shards.insert(0, (self.id, shard.clone()));
        shard
    }

    pub(crate) fn moved(&self, transport: usize, bytes: u64) {
        self.with_shard(|shard| {
            if let Some(cells) = shard.transports.get(transport) {
                cells.bytes.add(bytes);
                cells.slices.add(1);
            }
        });
    }

    pub(crate) fn failed(&self, transport: usize) {
        self.with_shard(|shard| {
            if let Some(cells) = shard.transports.get(transport) {
                cells.failures.add(1);
            }
        });
    }

    /// Whether transfers are timed.
    pub(crate) fn timing(&self) -> bool {
        self.enabled
    }

    /// The tasks of a new batch, to be read by [`tally`](Self::tally) while it lives.
    pub(crate) fn register(&self, tasks: Arc<TaskTable>) {
        if self.enabled {
            self.ledger().live.push(tasks);
        }
    }

    /// A batch goes: what its tasks did joins the totals, once.
    pub(crate) fn retire(&self, tasks: &Arc<TaskTable>) {
        let mut ledger = self.ledger();
        if let Some(at) = ledger.live.iter().position(|t| Arc::ptr_eq(t, tasks)) {
            let gone = ledger.live.swap_remove(at);
            tally_tasks(&gone, &mut ledger.retired);
        }
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What every task so far moved and took.
    pub(crate) fn tally(&self) -> Tally {
        let mut ledger = self.ledger();
        let mut tally = ledger.retired.clone();
        for tasks in &ledger.live {
            tally_tasks(tasks, &mut tally);
        }
        for (now, shown) in tally.moved.iter_mut().zip(ledger.shown.iter_mut()) {
            *now = (now.0.max(shown.0), now.1.max(shown.1));
            *shown = *now;
        }
        tally
    }

    fn sum(&self, f: impl Fn(&Shard) -> u64) -> u64 {
        let shards = self.shards.lock().unwrap_or_else(|p| p.into_inner());
        shards.iter().map(|s| f(s)).sum()
    }

    /// `(bytes, slices, failures)` of one transport, with `tally` from [`tally`](Self::tally).
    pub(crate) fn totals(&self, transport: usize, tally: &Tally) -> (u64, u64, u64) {
        let of =
            |f: fn(&TransportCells) -> u64| self.sum(|s| s.transports.get(transport).map_or(0, f));
        let (bytes, slices) = tally.of(transport);
        (
            bytes + of(|c| c.bytes.get()),
            slices + of(|c| c.slices.get()),
            of(|c| c.failures.get()),
        )
    }
}

/// How long transfers of one operation and size class took: a histogram.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LatencyStats {
    /// `read` or `write`.
    pub operation: String,
    /// The size class ([`SIZE_CLASSES`]).
    pub size: String,
    /// `(upper bound in µs, transfers in that bucket)`, not cumulative; transfers above the
    /// last bound are `count` minus their sum.
    pub buckets: Vec<(u64, u64)>,
    /// Transfers timed.
    pub count: u64,
    /// Their total time.
    pub sum_seconds: f64,
}

/// How a transport sees one peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum PeerState {
    /// At least one connection or endpoint is up.
    Connected,
    /// A connection or handshake is under way, none is up yet.
    Connecting,
    /// Known, but nothing is open (closed after idling, or never used).
    Idle,
    /// The last attempt failed; see `last_error`.
    Failed,
}

impl PeerState {
    /// Its name in snake case, as in JSON and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Self::Connected => "connected",
            Self::Connecting => "connecting",
            Self::Idle => "idle",
            Self::Failed => "failed",
        }
    }

    /// The state of a peer with `open` connections or endpoints up, `connecting` under way,
    /// and whether the last attempt failed.
    pub fn of(open: usize, connecting: usize, failed: bool) -> Self {
        if open > 0 {
            Self::Connected
        } else if connecting > 0 {
            Self::Connecting
        } else if failed {
            Self::Failed
        } else {
            Self::Idle
        }
    }
}

/// One peer of one transport.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PeerStats {
    /// The peer: its data endpoint (TCP `host:port`) or its server name (RDMA).
    pub peer: String,
    /// Where it stands.
    pub state: PeerState,
    /// Open connections (TCP) or endpoints (RDMA) to it.
    pub endpoints: usize,
    /// Bytes moved with it (of completed slices).
    pub bytes: u64,
    /// Completed slices with it.
    pub slices: u64,
    /// The last failure seen with it, if any.
    pub last_error: Option<String>,
}

/// One NIC of a transport.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NicStats {
    /// Device name.
    pub name: String,
    /// Bytes of completed slices.
    pub bytes: u64,
    /// Completed slices.
    pub slices: u64,
    /// Failed slices.
    pub failures: u64,
    /// Whether the NIC is paused (its port is down, or it kept failing).
    pub paused: bool,
}

/// What a transport reports of itself: what only it knows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransportReport {
    /// Slices it moved again after a failure (to another path, connection or NIC).
    pub retries: u64,
    /// Its peers.
    pub peers: Vec<PeerStats>,
    /// Its NICs (RDMA).
    pub nics: Vec<NicStats>,
    /// What peers moved from or to this node's memory through it.
    pub served: ServedStats,
    /// Slices it handed to the next transport, by why.
    pub declined: Vec<DeclinedStats>,
}

/// Slices a transport declined for one reason (memory it does not carry, a peer it cannot
/// reach), which then went to the next transport: the record that keeps a slower path from
/// being silent.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct DeclinedStats {
    /// Why, in a few words (`device memory`, …).
    pub reason: String,
    /// Slices declined.
    pub slices: u64,
    /// Their bytes.
    pub bytes: u64,
}

/// Requests peers made of this node's memory through one transport, and their bytes. Only
/// transports whose target side runs on this node's CPU see them (TCP); RDMA's one-sided
/// operations never reach it, and count nothing here.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServedStats {
    /// Reads served (peers took bytes from this node).
    pub reads: u64,
    /// Bytes peers read.
    pub read_bytes: u64,
    /// Writes served (peers put bytes into this node).
    pub writes: u64,
    /// Bytes peers wrote.
    pub write_bytes: u64,
    /// Requests refused (outside registered memory, or not allowed remote access).
    pub rejected: u64,
}

/// One transport's totals since the engine started.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TransportStats {
    /// Its protocol (`tcp`, `rdma`).
    pub protocol: String,
    /// Bytes of slices that completed.
    pub bytes: u64,
    /// Slices that completed.
    pub slices: u64,
    /// Slices retried after a failure.
    pub retries: u64,
    /// Slices that failed (a task fails with its first; others of the same task may fail
    /// too before they learn of it).
    pub failures: u64,
    /// Its peers.
    pub peers: Vec<PeerStats>,
    /// Its NICs (RDMA).
    pub nics: Vec<NicStats>,
    /// What peers moved from or to this node through it.
    pub served: ServedStats,
    /// Slices it handed to the next transport, by why.
    pub declined: Vec<DeclinedStats>,
}

impl TransportStats {
    pub(crate) fn new(protocol: &str, totals: (u64, u64, u64), report: TransportReport) -> Self {
        let (bytes, slices, failures) = totals;
        Self {
            protocol: protocol.to_owned(),
            bytes,
            slices,
            retries: report.retries,
            failures,
            peers: report.peers,
            nics: report.nics,
            served: report.served,
            declined: report.declined,
        }
    }
}

/// Everything [`crate::TransferEngine::stats`] reports.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EngineStats {
    /// One entry per installed transport, in installation order.
    pub transports: Vec<TransportStats>,
    /// How long transfers took, per operation and size class (empty with metrics off).
    pub latency: Vec<LatencyStats>,
}

/// The `Content-Type` of [`EngineStats::prometheus`] (Prometheus text format 0.0.4).
pub const PROMETHEUS_CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

impl EngineStats {
    /// These stats in the Prometheus text format (0.0.4), every metric named `tern_…`:
    /// bytes, slices, retries and failures per transport; bytes, slices, endpoints and state
    /// per peer; bytes, slices, failures and pause per NIC; and a latency histogram per
    /// operation and size class.
    pub fn prometheus(&self) -> String {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Snapshot(self.clone())));
        let mut text = String::new();
        if let Err(e) = prometheus_text::encode(&mut text, &registry) {
            // Writing into a String does not fail; should the encoder, say so in the text.
            tracing::error!("rendering metrics: {e}");
            text.push_str("# rendering failed\n");
        }
        text
    }
}

/// Stats taken at one moment, rendered by prometheus-client on each request.
#[derive(Debug)]
struct Snapshot(EngineStats);

type Labels = Vec<(&'static str, String)>;

/// One metric family: its name, help, type, and a value per label set.
fn family<V>(
    encoder: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    metric_type: MetricType,
    series: impl IntoIterator<Item = (Labels, V)>,
    mut write: impl FnMut(MetricEncoder<'_>, V) -> std::fmt::Result,
) -> std::fmt::Result {
    let mut metric = encoder.encode_descriptor(name, help, None, metric_type)?;
    for (labels, value) in series {
        write(metric.encode_family(&labels)?, value)?;
    }
    Ok(())
}

fn counter(mut encoder: MetricEncoder<'_>, value: u64) -> std::fmt::Result {
    encoder.encode_counter::<NoLabelSet, _, u64>(&value, None)
}

fn gauge(mut encoder: MetricEncoder<'_>, value: u64) -> std::fmt::Result {
    encoder.encode_gauge(&value)
}

/// One metric family of one kind of thing: name, help, type, and its value for one thing.
type Spec<T> = (&'static str, &'static str, MetricType, fn(&T) -> u64);

/// The families of `specs`, each over every thing `things` yields with its labels.
fn families<'s, T: 's, I: Iterator<Item = (Labels, &'s T)>>(
    encoder: &mut DescriptorEncoder<'_>,
    specs: &[Spec<T>],
    things: impl Fn() -> I,
) -> std::fmt::Result {
    for &(name, help, metric_type, field) in specs {
        let write = match metric_type {
            MetricType::Counter => counter,
            _ => gauge,
        };
        let series = things().map(|(labels, thing)| (labels, field(thing)));
        family(encoder, name, help, metric_type, series, write)?;
    }
    Ok(())
}

const PER_TRANSPORT: [Spec<TransportStats>; 9] = [
    (
        "tern_transport_bytes",
        "Bytes of completed slices.",
        COUNTER,
        |t| t.bytes,
    ),
    ("tern_transport_slices", "Completed slices.", COUNTER, |t| {
        t.slices
    }),
    (
        "tern_transport_retries",
        "Slices moved again after a failure.",
        COUNTER,
        |t| t.retries,
    ),
    (
        "tern_transport_failures",
        "Slices that failed.",
        COUNTER,
        |t| t.failures,
    ),
    (
        "tern_served_reads",
        "Reads peers made of this node's memory.",
        COUNTER,
        |t| t.served.reads,
    ),
    (
        "tern_served_read_bytes",
        "Bytes peers read from this node.",
        COUNTER,
        |t| t.served.read_bytes,
    ),
    (
        "tern_served_writes",
        "Writes peers made into this node's memory.",
        COUNTER,
        |t| t.served.writes,
    ),
    (
        "tern_served_write_bytes",
        "Bytes peers wrote into this node.",
        COUNTER,
        |t| t.served.write_bytes,
    ),
    (
        "tern_served_rejected",
        "Peer requests refused (outside registered memory).",
        COUNTER,
        |t| t.served.rejected,
    ),
];

const PER_PEER: [Spec<PeerStats>; 3] = [
    (
        "tern_peer_bytes",
        "Bytes moved with the peer.",
        COUNTER,
        |p| p.bytes,
    ),
    (
        "tern_peer_slices",
        "Completed slices with the peer.",
        COUNTER,
        |p| p.slices,
    ),
    (
        "tern_peer_endpoints",
        "Open connections (TCP) or endpoints (RDMA) to the peer.",
        GAUGE,
        |p| p.endpoints as u64,
    ),
];

const PER_NIC: [Spec<NicStats>; 4] = [
    (
        "tern_nic_bytes",
        "Bytes of completed slices on the NIC.",
        COUNTER,
        |n| n.bytes,
    ),
    (
        "tern_nic_slices",
        "Completed slices on the NIC.",
        COUNTER,
        |n| n.slices,
    ),
    (
        "tern_nic_failures",
        "Slices that failed on the NIC.",
        COUNTER,
        |n| n.failures,
    ),
    (
        "tern_nic_paused",
        "1 while the NIC is paused (its port is down, or it kept failing).",
        GAUGE,
        |n| u64::from(n.paused),
    ),
];

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let stats = &self.0;
        let transports = || {
            stats
                .transports
                .iter()
                .map(|t| (vec![("transport", t.protocol.clone())], t))
        };
        families(&mut encoder, &PER_TRANSPORT, transports)?;
        let peers = || {
            stats.transports.iter().flat_map(|t| {
                t.peers.iter().map(move |p| {
                    let labels = vec![("transport", t.protocol.clone()), ("peer", p.peer.clone())];
                    (labels, p)
                })
            })
        };
        families(&mut encoder, &PER_PEER, peers)?;
        let declined = || {
            stats.transports.iter().flat_map(|t| {
                t.declined.iter().map(move |d| {
                    let labels = vec![
                        ("transport", t.protocol.clone()),
                        ("reason", d.reason.clone()),
                    ];
                    (labels, d)
                })
            })
        };
        family(
            &mut encoder,
            "tern_transport_declined_slices",
            "Slices a transport handed to the next one, by reason.",
            COUNTER,
            declined().map(|(labels, d)| (labels, d.slices)),
            counter,
        )?;
        family(
            &mut encoder,
            "tern_transport_declined_bytes",
            "Bytes of the slices a transport handed to the next one, by reason.",
            COUNTER,
            declined().map(|(labels, d)| (labels, d.bytes)),
            counter,
        )?;
        let states = [
            PeerState::Connected,
            PeerState::Connecting,
            PeerState::Idle,
            PeerState::Failed,
        ];
        let series = peers().flat_map(|(labels, p)| {
            states.iter().map(move |&state| {
                let mut labels = labels.clone();
                labels.push(("state", state.name().to_owned()));
                (labels, u64::from(p.state == state))
            })
        });
        family(
            &mut encoder,
            "tern_peer_state",
            "1 for the state the peer is in, 0 for the others.",
            GAUGE,
            series,
            gauge,
        )?;
        let nics = || {
            stats.transports.iter().flat_map(|t| {
                t.nics.iter().map(move |n| {
                    let labels = vec![("transport", t.protocol.clone()), ("nic", n.name.clone())];
                    (labels, n)
                })
            })
        };
        families(&mut encoder, &PER_NIC, nics)?;

        let series = stats.latency.iter().map(|l| {
            (
                vec![("operation", l.operation.clone()), ("size", l.size.clone())],
                l,
            )
        });
        family(
            &mut encoder,
            "tern_transfer_duration_seconds",
            "Time from submit to completion of each transfer, per operation and size class.",
            MetricType::Histogram,
            series,
            |mut metric, l| {
                let buckets: Vec<(f64, u64)> = l
                    .buckets
                    .iter()
                    .map(|&(le_us, n)| (le_us as f64 / 1e6, n))
                    .collect();
                metric.encode_histogram::<NoLabelSet>(l.sum_seconds, l.count, &buckets, None)
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn pause() {
        std::thread::sleep(Duration::from_millis(2));
    }

    #[test]
    fn reports_together_share_one_reading_and_only_while_it_lives() {
        let alone = completion_ns();
        pause();
        assert!(
            completion_ns() > alone,
            "without a guard each end reads the clock"
        );
        let outer = ReportTogether::begin();
        pause();
        let first = completion_ns();
        assert!(
            first > alone,
            "the reading is taken at the first end, not before"
        );
        pause();
        assert_eq!(completion_ns(), first);
        {
            let _inner = ReportTogether::begin();
            pause();
            assert_eq!(
                completion_ns(),
                first,
                "a nested guard shares the outer reading"
            );
        }
        assert_eq!(
            completion_ns(),
            first,
            "the inner guard leaves the outer one standing"
        );
        drop(outer);
        pause();
        assert!(completion_ns() > first);
    }

    #[test]
    fn a_moved_counter_keeps_counting_past_its_word() {
        let counter = MovedCounter::default();
        counter.add(10, 1);
        counter.add(MOVED_BYTES_MAX - 20, 2);
        assert_eq!(counter.get(), (MOVED_BYTES_MAX - 10, 3));
        // Past the bytes field: into the wide counters, nothing lost.
        counter.add(100, 1);
        assert_eq!(counter.get(), (MOVED_BYTES_MAX + 90, 4));
        assert_eq!(
            counter.word.load(Ordering::Relaxed),
            0,
            "moved out of the word"
        );
        counter.add(5, 1);
        assert_eq!(counter.get(), (MOVED_BYTES_MAX + 95, 5));
        // Past the slices field.
        counter.add(0, MOVED_SLICES_MAX);
        assert_eq!(counter.get(), (MOVED_BYTES_MAX + 95, MOVED_SLICES_MAX + 5));
        // A reader beside a writer that spills often sees only counts that grow.
        let counter = std::sync::Arc::new(MovedCounter::default());
        let writer = {
            let counter = counter.clone();
            std::thread::spawn(move || {
                for _ in 0..200_000 {
                    counter.add(MOVED_BYTES_MAX / 3, 1);
                }
            })
        };
        let mut last = (0, 0);
        while !writer.is_finished() {
            let now = counter.get();
            assert!(now.0 >= last.0 && now.1 >= last.1, "{last:?} then {now:?}");
            assert_eq!(
                now.0,
                now.1 * (MOVED_BYTES_MAX / 3),
                "bytes and slices agree"
            );
            last = now;
        }
        writer.join().unwrap();
        assert_eq!(counter.get(), (200_000 * (MOVED_BYTES_MAX / 3), 200_000));
    }

    #[test]
    fn a_shared_moved_counter_loses_nothing_to_writers_at_once() {
        const STEP: u64 = 1 << 31;
        const ADDS: u64 = 50_000;
        let counter = std::sync::Arc::new(SharedMovedCounter::default());
        let writers: Vec<_> = (0..4)
            .map(|_| {
                let counter = counter.clone();
                std::thread::spawn(move || {
                    for _ in 0..ADDS {
                        counter.add(STEP, 1);
                    }
                })
            })
            .collect();
        let mut last = (0, 0);
        while !writers.iter().all(|w| w.is_finished()) {
            let now = counter.get();
            assert!(now.0 >= last.0 && now.1 >= last.1, "{last:?} then {now:?}");
            assert_eq!(now.0, now.1 * STEP, "bytes and slices agree");
            last = now;
        }
        for writer in writers {
            writer.join().unwrap();
        }
        assert_eq!(counter.get(), (4 * ADDS * STEP, 4 * ADDS));
        // An add too large for the word goes to the wide counters whole.
        counter.add(1 << 45, 3);
        assert_eq!(counter.get(), (4 * ADDS * STEP + (1 << 45), 4 * ADDS + 3));
    }

    #[test]
    fn latency_buckets_take_the_first_bound_not_below() {
        let mut histogram = Histogram::default();
        for us in [0, 5, 6, 10, 11, 10_000_000, 10_000_001] {
            histogram.record(us * 1_000, 1);
        }
        let counts = histogram.buckets;
        assert_eq!(counts[0], 2, "0 and 5 µs are in the first bucket (≤ 5)");
        assert_eq!(counts[1], 2, "6 and 10 µs in ≤ 10");
        assert_eq!(counts[2], 1, "11 µs in ≤ 20");
        assert_eq!(
            counts[LATENCY_BUCKETS_US.len() - 1],
            1,
            "10 s in the last bound"
        );
        assert_eq!(
            counts[LATENCY_BUCKETS_US.len()],
            1,
            "above it, the overflow"
        );
    }
}
