//! What `TransferEngine::stats` reports after real transfers over loopback TCP, and its
//! Prometheus text: bytes and slices per transport and per peer match what moved, one latency
//! sample per transfer in its operation's size class, histograms cumulative up to `+Inf` =
//! count; the target counts what it served; with metrics off, transfers still complete and the engine counts nothing.

use std::time::Duration;

use tern_engine::{TransferEngine, TransferRequest, TransferStatus};
use tern_transport_tcp::{TcpConfig, TcpTransport};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn engine(metrics: bool) -> TransferEngine {
    TransferEngine::builder()
        .local_server_name("127.0.0.1")
        .metrics(metrics)
        .transport(TcpTransport::new(TcpConfig::default()))
        .build()
        .unwrap()
}

/// The value of the series `series` (name and labels exactly as rendered).
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}

/// Runs 10 reads of 4 KiB, 5 writes of 64 KiB and 2 reads of 2 MiB from `initiator` to
/// `target`; returns the bytes moved. A gap after each request keeps the engine from merging
/// neighbours, so that each request's slices are its own.
fn transfer(initiator: &TransferEngine, target: &TransferEngine) -> usize {
    let remote = target.allocate(10 * MIB, "cpu:0").unwrap();
    let local = initiator.allocate(10 * MIB, "cpu:0").unwrap();
    let peer = initiator.open_segment(target.segment_name()).unwrap();
    let (l, r) = (local.addr(), remote.addr() as u64);
    let mut requests = Vec::new();
    for i in 0..10 {
        requests.push(TransferRequest::read(l + i * 8 * KIB, peer, r, 4 * KIB));
    }
    for i in 0..5 {
        let at = MIB + i * 128 * KIB;
        requests.push(TransferRequest::write(
            l + at,
            peer,
            r + at as u64,
            64 * KIB,
        ));
    }
    for i in 0..2 {
        let at = 4 * MIB + i * 3 * MIB;
        requests.push(TransferRequest::read(l + at, peer, r + at as u64, 2 * MIB));
    }
    let batch = initiator.allocate_batch(requests.len()).unwrap();
    initiator.submit(&batch, &requests).unwrap();
    batch.wait(Duration::from_secs(60));
    for task in 0..requests.len() {
        assert_eq!(
            batch.task_status(task).unwrap().status,
            TransferStatus::Completed,
            "task {task}"
        );
    }
    requests.iter().map(|r| r.length).sum()
}

#[test]
fn stats_and_prometheus_text_count_what_moved_per_transport_peer_and_size_class() {
    let target = engine(true);
    let initiator = engine(true);
    let moved = transfer(&initiator, &target) as u64;
    let stats = initiator.stats();
    let tcp = &stats.transports[0];
    assert_eq!(tcp.protocol, "tcp");
    assert_eq!(tcp.bytes, moved);
    // The 2 MiB reads go in more than one slice each.
    assert!(tcp.slices > 17, "{} slices", tcp.slices);
    assert_eq!(tcp.failures, 0);
    assert_eq!(tcp.peers.len(), 1, "{:?}", tcp.peers);
    let peer = &tcp.peers[0];
    assert_eq!((peer.bytes, peer.slices), (moved, tcp.slices), "{peer:?}");
    assert!(peer.endpoints > 0, "{peer:?}");

    let samples = |operation: &str, size: &str| {
        stats
            .latency
            .iter()
            .find(|l| l.operation == operation && l.size == size)
            .map(|l| l.count)
    };
    assert_eq!(samples("read", "4KiB"), Some(10));
    assert_eq!(samples("write", "64KiB"), Some(5));
    assert_eq!(samples("read", "larger"), Some(2));
    assert_eq!(stats.latency.len(), 3, "{:?}", stats.latency);
    for histogram in &stats.latency {
        let bucketed: u64 = histogram.buckets.iter().map(|b| b.1).sum();
        assert!(bucketed <= histogram.count, "{histogram:?}");
        assert!(histogram.sum_seconds > 0.0, "{histogram:?}");
    }

    let text = stats.prometheus();
    let transport = "{transport=\"tcp\"}";
    let value = |series: String| metric(&text, &series);
    assert_eq!(
        value(format!("tern_transport_bytes_total{transport}")),
        Some(moved as f64),
        "{text}"
    );
    assert_eq!(
        value(format!("tern_transport_slices_total{transport}")),
        Some(tcp.slices as f64)
    );
    assert_eq!(
        value(format!("tern_transport_failures_total{transport}")),
        Some(0.0)
    );
    let peer_labels = format!("{{transport=\"tcp\",peer=\"{}\"}}", peer.peer);
    assert_eq!(
        value(format!("tern_peer_bytes_total{peer_labels}")),
        Some(moved as f64),
        "{text}"
    );
    let connected = format!(
        "{{transport=\"tcp\",peer=\"{}\",state=\"connected\"}}",
        peer.peer
    );
    assert_eq!(
        value(format!("tern_peer_state{connected}")),
        Some(1.0),
        "{text}"
    );

    // The 4 KiB reads' histogram: buckets never fall, +Inf and _count are the 10 reads.
    let labels = "operation=\"read\",size=\"4KiB\"";
    let name = "tern_transfer_duration_seconds";
    let buckets: Vec<f64> = text
        .lines()
        .filter(|line| line.starts_with(&format!("{name}_bucket{{{labels},le=")))
        .map(|line| line.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(
        buckets.len(),
        tern_engine::LATENCY_BUCKETS_US.len() + 1,
        "{text}"
    );
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]), "{buckets:?}");
    assert_eq!(
        value(format!("{name}_bucket{{{labels},le=\"+Inf\"}}")),
        Some(10.0),
        "{text}"
    );
    assert_eq!(value(format!("{name}_count{{{labels}}}")), Some(10.0));
    assert!(value(format!("{name}_sum{{{labels}}}")).unwrap() > 0.0);
    assert!(text.contains(&format!("# TYPE {name} histogram")), "{text}");

    // The target saw every request as served: the reads' and the writes' bytes apart. Its
    // connection threads count a request once they have answered it, so the last counts may
    // land a moment after the initiator saw the answer.
    let read_bytes = (10 * 4 * KIB + 2 * 2 * MIB) as u64;
    let all_served = |s: &tern_engine::ServedStats| s.reads + s.writes + s.rejected >= tcp.slices;
    let waited = std::time::Instant::now();
    let mut served = target.stats().transports[0].served;
    while !all_served(&served) && waited.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(1));
        served = target.stats().transports[0].served;
    }
    assert_eq!(served.read_bytes, read_bytes, "{served:?}");
    assert_eq!(served.write_bytes, (5 * 64 * KIB) as u64, "{served:?}");
    assert_eq!(served.reads + served.writes, tcp.slices, "{served:?}");
    assert_eq!(served.rejected, 0);
    let text = target.stats().prometheus();
    assert_eq!(
        metric(&text, "tern_served_read_bytes_total{transport=\"tcp\"}"),
        Some(read_bytes as f64),
        "{text}"
    );
    // The initiator served nothing.
    assert_eq!(stats.transports[0].served, Default::default());
}

#[test]
fn with_metrics_off_transfers_complete_and_the_engine_counts_nothing() {
    let target = engine(true);
    let initiator = engine(false);
    let moved = transfer(&initiator, &target) as u64;
    let stats = initiator.stats();
    let tcp = &stats.transports[0];
    assert_eq!((tcp.bytes, tcp.slices), (0, 0));
    assert!(stats.latency.is_empty(), "{:?}", stats.latency);
    // Metrics off turns off the engine's counting, not the transport's per-peer figures.
    assert_eq!(tcp.peers.iter().map(|p| p.bytes).sum::<u64>(), moved);
    assert!(
        !stats
            .prometheus()
            .contains("tern_transfer_duration_seconds_count")
    );
}
