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
//! [`TransferEngineBuilder::metrics`](crate::TransferEngineBuilder::metrics) turns the
//! engine's own counting off.
//!
//! The parts: the counters transports add to ([`counters`]) and the seqlock their words
//! spill under ([`seqlock`]); the clock tasks are timed by ([`clock`]); the latency
//! histograms ([`latency`]); the tally read off the tasks ([`tally`]); the per-thread shards
//! of what does not fit a task ([`shards`]); an engine's counts, which hold both
//! ([`engine_counters`]); what [`crate::TransferEngine::stats`] returns ([`report`]) and its
//! Prometheus text ([`prometheus`]).

mod clock;
mod counters;
mod engine_counters;
mod latency;
mod prometheus;
mod report;
mod seqlock;
mod shards;
mod tally;

pub use clock::ReportTogether;
pub(crate) use clock::{clock_ns, completion_ns, epoch};
pub use counters::{LocalCounter, MovedCounter, SharedMovedCounter};
pub(crate) use engine_counters::EngineCounters;
pub(crate) use latency::bucket_of;
pub use latency::{LATENCY_BUCKETS_US, SIZE_CLASSES};
pub use prometheus::PROMETHEUS_CONTENT_TYPE;
pub use report::{
    DeclinedStats, EngineStats, LatencyStats, NicStats, PeerState, PeerStats, ServedStats,
    TransportReport, TransportStats,
};
pub(crate) use tally::Tally;
