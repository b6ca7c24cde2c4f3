//! [`EngineStats`] as Prometheus text (format 0.0.4), every metric named `tern_…`.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, MetricEncoder, NoLabelSet, prometheus_text};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::MetricType::{Counter as COUNTER, Gauge as GAUGE};
use prometheus_client::registry::Registry;

use super::report::{EngineStats, NicStats, PeerState, PeerStats, TransportStats};

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
