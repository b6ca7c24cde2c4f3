//! The RDMA transport's settings, read from Mooncake's environment variables (and a few of
//! Tern's own, prefixed `TERN_RDMA_`), so a deployment tuned for Mooncake behaves the same
//! under Tern.
//!
//! As in Mooncake, a value that does not parse or is out of range is ignored with a warning
//! naming the variable, and the default stays. This module must not read anything but the
//! variables (the topology file it names is read by the caller) and must not reach verbs.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use crate::topology::parse_device_list;

/// RDMA device allow-list, comma separated.
pub const DEVICE_FILTER_ENV: &str = "MC_TE_FILTERS";
/// Path to a priority-matrix JSON file.
pub const TOPOLOGY_FILE_ENV: &str = "MC_CUSTOM_TOPO_JSON";
/// HCA port.
pub const IB_PORT_ENV: &str = "MC_IB_PORT";
/// GID index; negative means automatic choice.
pub const GID_INDEX_ENV: &str = "MC_GID_INDEX";
/// NCCL's GID index, used when [`GID_INDEX_ENV`] is unset.
pub const NCCL_GID_INDEX_ENV: &str = "NCCL_IB_GID_INDEX";
/// Largest path MTU in bytes.
pub const MTU_ENV: &str = "MC_MTU";
/// QPs per endpoint.
pub const QPS_PER_ENDPOINT_ENV: &str = "MC_NUM_QP_PER_EP";
/// Work requests per QP.
pub const MAX_WR_ENV: &str = "MC_MAX_WR";
/// Completion-queue depth per NIC.
pub const MAX_CQE_ENV: &str = "MC_MAX_CQE_PER_CTX";
/// Endpoint-cache capacity per NIC.
pub const MAX_ENDPOINTS_ENV: &str = "MC_MAX_EP_PER_CTX";
/// Worker threads per NIC.
pub const WORKERS_PER_NIC_ENV: &str = "MC_WORKERS_PER_CTX";
/// Slice size in bytes.
pub const SLICE_SIZE_ENV: &str = "MC_SLICE_SIZE";
/// Tail-merge divisor of the slice size.
pub const FRAGMENT_RATIO_ENV: &str = "MC_FRAGMENT_RATIO";
/// Retries per slice.
pub const RETRY_COUNT_ENV: &str = "MC_RETRY_CNT";
/// Seconds a failed peer rail is avoided.
pub const RAIL_PAUSE_ENV: &str = "MC_RDMA_RAIL_PAUSE_SECONDS";
/// Seconds allowed to connect to a peer's handshake RPC port.
pub const HANDSHAKE_TIMEOUT_ENV: &str = "MC_HANDSHAKE_CONNECT_TIMEOUT";
/// QP ACK timeout exponent (Tern only).
pub const ACK_TIMEOUT_ENV: &str = "TERN_RDMA_ACK_TIMEOUT";
/// QP transport retry count (Tern only).
pub const QP_RETRY_ENV: &str = "TERN_RDMA_QP_RETRY";
/// Whether workers are pinned to CPUs near their NIC (Tern only).
pub const PIN_WORKERS_ENV: &str = "TERN_RDMA_PIN_WORKERS";
/// Microseconds a worker keeps polling after its last work before it sleeps (Tern only).
pub const SPIN_ENV: &str = "TERN_RDMA_SPIN_US";

/// The MTUs `MC_MTU` may name (Mooncake's set; 256 is too small to be worth configuring).
const CONFIGURABLE_MTUS: [u32; 4] = [512, 1024, 2048, 4096];

/// The RDMA transport's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RdmaConfig {
    /// Devices to use; empty means every device (`MC_TE_FILTERS`).
    pub devices: Vec<String>,
    /// A priority matrix as JSON text, given programmatically (Mooncake's
    /// `nic_priority_matrix`); `None` means discover it. Never set from the environment.
    pub priority_matrix: Option<String>,
    /// A file holding the priority matrix (`MC_CUSTOM_TOPO_JSON`); the caller reads it, so
    /// that an unreadable file is an error it can report rather than a silent default.
    pub topology_file: Option<PathBuf>,
    /// HCA port, 1..=255 (`MC_IB_PORT`, default 1).
    pub ib_port: u8,
    /// GID index; `None` = choose automatically (`MC_GID_INDEX`, else `NCCL_IB_GID_INDEX`;
    /// negative = automatic).
    pub gid_index: Option<u32>,
    /// Largest path MTU in bytes, one of 512/1024/2048/4096 (`MC_MTU`, default 4096); the
    /// port's active MTU and the peer's may lower it.
    pub mtu: u32,
    /// QPs per endpoint, 1..=64 (`MC_NUM_QP_PER_EP`, default 2).
    pub qps_per_endpoint: usize,
    /// Work requests per QP, 16..=16384 (`MC_MAX_WR`, default 256).
    pub max_wr: u32,
    /// Completion-queue depth per NIC, 64..=4194304 (`MC_MAX_CQE_PER_CTX`, default 4096).
    pub max_cqe: u32,
    /// Endpoints cached per NIC, at least 1 (`MC_MAX_EP_PER_CTX`, default 65536).
    pub max_endpoints: usize,
    /// Worker threads per NIC, 1..=8 (`MC_WORKERS_PER_CTX`, default 1: Tern's workers both
    /// post and poll, so one per NIC keeps a NIC's completions on one core).
    pub workers_per_nic: usize,
    /// Slice size in bytes, 4 KiB..=64 MiB (`MC_SLICE_SIZE`, default 64 KiB). Set by hand,
    /// it must leave every slice (a merged tail included) within one work request, at most
    /// `u32::MAX` bytes and the ports' `max_msg_sz`; `RdmaTransport::discover` refuses it
    /// otherwise ([`ConfigError::SliceTooLarge`]).
    pub slice_size: usize,
    /// A request's tail shorter than `slice_size / fragment_ratio` is merged into the
    /// previous slice; 1..=64 (`MC_FRAGMENT_RATIO`, default 4).
    pub fragment_ratio: usize,
    /// Retries per slice before it fails, 0..=127 (`MC_RETRY_CNT`, default 9).
    pub retry_count: u32,
    /// How long a peer rail that failed is avoided (`MC_RDMA_RAIL_PAUSE_SECONDS`, default
    /// 30 s, at most a day).
    pub rail_pause: Duration,
    /// Bound on connecting to the peer's handshake RPC port (`MC_HANDSHAKE_CONNECT_TIMEOUT`
    /// seconds, default 5 s, 1 s to 1 h).
    pub handshake_timeout: Duration,
    /// QP ACK timeout exponent: 4.096 µs × 2^n, 1..=31 (`TERN_RDMA_ACK_TIMEOUT`, default 14
    /// ≈ 67 ms).
    pub ack_timeout: u8,
    /// QP transport retry count, 0..=6 (`TERN_RDMA_QP_RETRY`, default 6). 7 would mean
    /// "retry forever" on Soft-RoCE; Tern retries above the QP instead.
    pub qp_retry_count: u8,
    /// Pin worker threads to CPUs on their NIC's NUMA node (`TERN_RDMA_PIN_WORKERS`, default
    /// on; `0`/`false`/`no`/`off` turn it off). Where the node has fewer than four CPUs the
    /// workers are not pinned either way.
    pub pin_workers: bool,
    /// How long a worker keeps polling after its last work before it sleeps on its
    /// completion channel (`TERN_RDMA_SPIN_US`, default 500 µs, at most 100 ms): longer
    /// spins cut the latency of the next request, shorter ones the CPU of a quiet node.
    pub spin: Duration,
}

impl Default for RdmaConfig {
    /// The defaults, ignoring the environment.
    fn default() -> Self {
        Self {
            devices: Vec::new(),
            priority_matrix: None,
            topology_file: None,
            ib_port: 1,
            gid_index: None,
            mtu: 4096,
            qps_per_endpoint: 2,
            max_wr: 256,
            max_cqe: 4096,
            max_endpoints: 65536,
            workers_per_nic: 1,
            slice_size: 64 << 10,
            fragment_ratio: 4,
            retry_count: 9,
            rail_pause: Duration::from_secs(30),
            handshake_timeout: Duration::from_secs(5),
            ack_timeout: 14,
            qp_retry_count: 6,
            pin_workers: true,
            spin: Duration::from_micros(500),
        }
    }
}

impl RdmaConfig {
    /// The defaults, overridden by the process environment.
    pub fn from_env() -> Self {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// The defaults, overridden by whatever `lookup` returns for each variable name (an empty
    /// or blank value counts as unset).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Self {
        let env = Env(&lookup);
        let defaults = Self::default();
        Self {
            devices: env
                .get(DEVICE_FILTER_ENV)
                .map(|list| parse_device_list(&list))
                .unwrap_or_default(),
            priority_matrix: None,
            topology_file: env.get(TOPOLOGY_FILE_ENV).map(PathBuf::from),
            ib_port: env.ranged(IB_PORT_ENV, 1..=u8::MAX, defaults.ib_port),
            gid_index: env.gid_index(),
            mtu: env.one_of(MTU_ENV, &CONFIGURABLE_MTUS, defaults.mtu),
            qps_per_endpoint: env.ranged(QPS_PER_ENDPOINT_ENV, 1..=64, defaults.qps_per_endpoint),
            max_wr: env.ranged(MAX_WR_ENV, 16..=16384, defaults.max_wr),
            max_cqe: env.ranged(MAX_CQE_ENV, 64..=4_194_304, defaults.max_cqe),
            max_endpoints: env.ranged(MAX_ENDPOINTS_ENV, 1..=usize::MAX, defaults.max_endpoints),
            workers_per_nic: env.ranged(WORKERS_PER_NIC_ENV, 1..=8, defaults.workers_per_nic),
            slice_size: env.ranged(SLICE_SIZE_ENV, 4096..=64 << 20, defaults.slice_size),
            fragment_ratio: env.ranged(FRAGMENT_RATIO_ENV, 1..=64, defaults.fragment_ratio),
            retry_count: env.ranged(RETRY_COUNT_ENV, 0..=127, defaults.retry_count),
            rail_pause: Duration::from_secs(env.ranged(
                RAIL_PAUSE_ENV,
                0..=86_400,
                defaults.rail_pause.as_secs(),
            )),
            handshake_timeout: Duration::from_secs(env.ranged(
                HANDSHAKE_TIMEOUT_ENV,
                1..=3600,
                defaults.handshake_timeout.as_secs(),
            )),
            ack_timeout: env.ranged(ACK_TIMEOUT_ENV, 1..=31, defaults.ack_timeout),
            qp_retry_count: env.ranged(QP_RETRY_ENV, 0..=6, defaults.qp_retry_count),
            pin_workers: env.flag(PIN_WORKERS_ENV, defaults.pin_workers),
            spin: Duration::from_micros(env.ranged(
                SPIN_ENV,
                0..=100_000,
                defaults.spin.as_micros() as u64,
            )),
        }
    }

    /// Tails shorter than this many bytes are merged into the previous slice.
    pub fn tail_merge_below(&self) -> usize {
        // fragment_ratio is at least 1 when it comes from the environment, but the field is
        // public, so a hand-made 0 must not divide by zero.
        self.slice_size / self.fragment_ratio.max(1)
    }

    /// The longest slice these settings make: a full slice with the longest tail merged
    /// into it (one byte short of [`tail_merge_below`](Self::tail_merge_below)).
    pub fn largest_slice(&self) -> u64 {
        let slice = self.slice_size.max(1) as u64;
        slice + (self.tail_merge_below() as u64).saturating_sub(1)
    }

    /// Whether every slice fits one work request: an SGE's length is a `u32`, and no
    /// message may be longer than the port's `max_msg_sz` (`ibv_query_port(3)`).
    /// `devices` are the opened NICs' names with their ports' `max_msg_sz`.
    pub fn check_slice_size<'a>(
        &self,
        devices: impl IntoIterator<Item = (&'a str, u32)>,
    ) -> Result<(), ConfigError> {
        if self.slice_size == 0 {
            return Err(ConfigError::ZeroSliceSize);
        }
        let largest = self.largest_slice();
        let mut limit = (
            u64::from(u32::MAX),
            "the 32-bit length of a work request".to_owned(),
        );
        for (name, max_msg) in devices {
            if u64::from(max_msg) < limit.0 {
                limit = (
                    u64::from(max_msg),
                    format!("the max_msg_sz of {name}'s port"),
                );
            }
        }
        if largest > limit.0 {
            return Err(ConfigError::SliceTooLarge {
                slice_size: self.slice_size,
                largest,
                limit: limit.0,
                limited_by: limit.1,
            });
        }
        Ok(())
    }
}

/// Settings the RDMA transport cannot run with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `slice_size` is 0: nothing could be cut into slices.
    #[error("the RDMA slice size is 0")]
    ZeroSliceSize,
    /// A slice would be longer than one work request may carry: lower `slice_size` (or raise
    /// `fragment_ratio`, which bounds the tail merged into a slice).
    #[error(
        "the RDMA slice size {slice_size} makes slices of up to {largest} bytes (with a merged tail), more than {limit}, {limited_by}"
    )]
    SliceTooLarge {
        /// The configured slice size.
        slice_size: usize,
        /// The longest slice it makes.
        largest: u64,
        /// The most one work request may carry.
        limit: u64,
        /// What sets that limit.
        limited_by: String,
    },
}

/// The variable source, with the parse-or-warn rules in one place.
struct Env<'a>(&'a dyn Fn(&str) -> Option<String>);

impl Env<'_> {
    /// The trimmed value, `None` when unset or blank.
    fn get(&self, name: &str) -> Option<String> {
        let value = (self.0)(name)?;
        let value = value.trim();
        (!value.is_empty()).then(|| value.to_owned())
    }

    fn ranged<T>(&self, name: &str, range: std::ops::RangeInclusive<T>, default: T) -> T
    where
        T: FromStr + PartialOrd + std::fmt::Display + Copy,
    {
        let Some(text) = self.get(name) else {
            return default;
        };
        match text.parse::<T>() {
            Ok(value) if range.contains(&value) => value,
            _ => {
                tracing::warn!(
                    "{name}={text:?} is not a number in {}..={}; keeping {default}",
                    range.start(),
                    range.end()
                );
                default
            }
        }
    }

    fn one_of(&self, name: &str, allowed: &[u32], default: u32) -> u32 {
        let Some(text) = self.get(name) else {
            return default;
        };
        match text.parse::<u32>() {
            Ok(value) if allowed.contains(&value) => value,
            _ => {
                tracing::warn!("{name}={text:?} is not one of {allowed:?}; keeping {default}");
                default
            }
        }
    }

    /// `MC_GID_INDEX` when set, else `NCCL_IB_GID_INDEX`; the first one set decides, so a bad
    /// Mooncake value is not silently replaced by NCCL's.
    fn gid_index(&self) -> Option<u32> {
        let (name, text) = [GID_INDEX_ENV, NCCL_GID_INDEX_ENV]
            .into_iter()
            .find_map(|name| self.get(name).map(|text| (name, text)))?;
        match text.parse::<i64>() {
            Ok(index) if index < 0 => None,
            Ok(index) => u32::try_from(index).ok().or_else(|| {
                tracing::warn!("{name}={text:?} is too large for a GID index; choosing one");
                None
            }),
            Err(_) => {
                tracing::warn!("{name}={text:?} is not a GID index; choosing one");
                None
            }
        }
    }

    fn flag(&self, name: &str, default: bool) -> bool {
        let Some(text) = self.get(name) else {
            return default;
        };
        match text.to_ascii_lowercase().as_str() {
            "1" | "true" | "yes" | "on" => true,
            "0" | "false" | "no" | "off" => false,
            _ => {
                tracing::warn!(
                    "{name}={text:?} is not a boolean (1/0/true/false); keeping {default}"
                );
                default
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn with(vars: &[(&str, &str)]) -> RdmaConfig {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        RdmaConfig::from_lookup(move |name| vars.get(name).cloned())
    }

    #[test]
    fn slices_must_fit_one_work_request() {
        const GIB: usize = 1 << 30;
        let with_slice = |slice_size, fragment_ratio| RdmaConfig {
            slice_size,
            fragment_ratio,
            ..RdmaConfig::default()
        };
        // The defaults, and the largest the environment allows, fit rxe's 2 GiB messages.
        let rxe = [("rxe0", 1u32 << 31)];
        assert_eq!(RdmaConfig::default().check_slice_size(rxe), Ok(()));
        assert_eq!(with_slice(64 << 20, 1).check_slice_size(rxe), Ok(()));
        // 4 GiB would be posted as a 0-byte SGE.
        let err = with_slice(4 * GIB, 4).check_slice_size([]).unwrap_err();
        assert!(
            matches!(err, ConfigError::SliceTooLarge { limit, .. } if limit == u64::from(u32::MAX)),
            "{err}"
        );
        // 2 GiB with a merged tail of up to 2 GiB - 1 is exactly u32::MAX: it fits, one
        // byte more does not.
        assert_eq!(with_slice(2 * GIB, 1).largest_slice(), u64::from(u32::MAX));
        assert_eq!(with_slice(2 * GIB, 1).check_slice_size([]), Ok(()));
        assert!(with_slice(2 * GIB + 1, 1).check_slice_size([]).is_err());
        // The tail counts: 3 GiB slices with tails of up to 1.5 GiB merged in do not fit.
        assert!(with_slice(3 * GIB, 2).check_slice_size([]).is_err());
        // The port's max_msg_sz is a limit of its own, and the error names the device.
        let small = [("rxe0", 1u32 << 31), ("mlx5_1", 1u32 << 30)];
        match with_slice(GIB, 4).check_slice_size(small) {
            Err(ConfigError::SliceTooLarge {
                largest,
                limit,
                limited_by,
                ..
            }) => {
                assert_eq!(largest, (GIB + GIB / 4 - 1) as u64);
                assert_eq!(limit, 1 << 30);
                assert!(limited_by.contains("mlx5_1"), "{limited_by}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            with_slice(0, 4).check_slice_size([]),
            Err(ConfigError::ZeroSliceSize)
        );
    }

    #[test]
    fn the_environment_cannot_set_a_slice_beyond_64_mib() {
        let config = with(&[(SLICE_SIZE_ENV, "4294967296")]);
        assert_eq!(config.slice_size, 64 << 10, "ignored with a warning");
        assert_eq!(config.check_slice_size([]), Ok(()));
    }

    #[test]
    fn defaults() {
        let config = RdmaConfig::default();
        assert_eq!(with(&[]), config);
        assert!(config.devices.is_empty());
        assert_eq!(config.priority_matrix, None);
        assert_eq!(config.topology_file, None);
        assert_eq!(config.ib_port, 1);
        assert_eq!(config.gid_index, None);
        assert_eq!(config.mtu, 4096);
        assert_eq!(config.qps_per_endpoint, 2);
        assert_eq!(config.max_wr, 256);
        assert_eq!(config.max_cqe, 4096);
        assert_eq!(config.max_endpoints, 65536);
        assert_eq!(config.workers_per_nic, 1);
        assert_eq!(config.slice_size, 65536);
        assert_eq!(config.fragment_ratio, 4);
        assert_eq!(config.retry_count, 9);
        assert_eq!(config.rail_pause, Duration::from_secs(30));
        assert_eq!(config.handshake_timeout, Duration::from_secs(5));
        assert_eq!(config.ack_timeout, 14);
        assert_eq!(config.qp_retry_count, 6);
        assert!(config.pin_workers);
        assert_eq!(config.tail_merge_below(), 16384);
    }

    #[test]
    fn every_variable_is_read() {
        let config = with(&[
            (DEVICE_FILTER_ENV, "mlx5_0, mlx5_1,,mlx5_0"),
            (TOPOLOGY_FILE_ENV, "/etc/topo.json"),
            (IB_PORT_ENV, "2"),
            (GID_INDEX_ENV, "3"),
            (MTU_ENV, "1024"),
            (QPS_PER_ENDPOINT_ENV, "4"),
            (MAX_WR_ENV, "1024"),
            (MAX_CQE_ENV, "65536"),
            (MAX_ENDPOINTS_ENV, "128"),
            (WORKERS_PER_NIC_ENV, "3"),
            (SLICE_SIZE_ENV, "1048576"),
            (FRAGMENT_RATIO_ENV, "8"),
            (RETRY_COUNT_ENV, "0"),
            (RAIL_PAUSE_ENV, "0"),
            (HANDSHAKE_TIMEOUT_ENV, " 12 "),
            (ACK_TIMEOUT_ENV, "18"),
            (QP_RETRY_ENV, "3"),
            (PIN_WORKERS_ENV, "false"),
        ]);
        assert_eq!(
            config,
            RdmaConfig {
                devices: vec!["mlx5_0".to_owned(), "mlx5_1".to_owned()],
                priority_matrix: None,
                topology_file: Some(PathBuf::from("/etc/topo.json")),
                ib_port: 2,
                gid_index: Some(3),
                mtu: 1024,
                qps_per_endpoint: 4,
                max_wr: 1024,
                max_cqe: 65536,
                max_endpoints: 128,
                workers_per_nic: 3,
                slice_size: 1 << 20,
                fragment_ratio: 8,
                retry_count: 0,
                rail_pause: Duration::ZERO,
                handshake_timeout: Duration::from_secs(12),
                ack_timeout: 18,
                qp_retry_count: 3,
                pin_workers: false,
                spin: Duration::from_micros(500),
            }
        );
        assert_eq!(config.tail_merge_below(), 131072);
    }

    #[test]
    fn range_ends_are_accepted() {
        let low = with(&[
            (IB_PORT_ENV, "1"),
            (QPS_PER_ENDPOINT_ENV, "1"),
            (MAX_WR_ENV, "16"),
            (MAX_CQE_ENV, "64"),
            (MAX_ENDPOINTS_ENV, "1"),
            (SLICE_SIZE_ENV, "4096"),
            (FRAGMENT_RATIO_ENV, "1"),
            (ACK_TIMEOUT_ENV, "1"),
            (QP_RETRY_ENV, "0"),
            (HANDSHAKE_TIMEOUT_ENV, "1"),
            (MTU_ENV, "512"),
        ]);
        assert_eq!(
            (low.ib_port, low.qps_per_endpoint, low.max_wr, low.max_cqe),
            (1, 1, 16, 64)
        );
        assert_eq!(
            (low.max_endpoints, low.slice_size, low.fragment_ratio),
            (1, 4096, 1)
        );
        assert_eq!((low.ack_timeout, low.qp_retry_count, low.mtu), (1, 0, 512));
        assert_eq!(low.handshake_timeout, Duration::from_secs(1));
        let high = with(&[
            (IB_PORT_ENV, "255"),
            (QPS_PER_ENDPOINT_ENV, "64"),
            (MAX_WR_ENV, "16384"),
            (MAX_CQE_ENV, "4194304"),
            (WORKERS_PER_NIC_ENV, "8"),
            (SLICE_SIZE_ENV, "67108864"),
            (FRAGMENT_RATIO_ENV, "64"),
            (RETRY_COUNT_ENV, "127"),
            (ACK_TIMEOUT_ENV, "31"),
            (QP_RETRY_ENV, "6"),
        ]);
        assert_eq!(
            (
                high.ib_port,
                high.qps_per_endpoint,
                high.max_wr,
                high.max_cqe
            ),
            (255, 64, 16384, 4_194_304)
        );
        assert_eq!(
            (high.workers_per_nic, high.slice_size, high.fragment_ratio),
            (8, 64 << 20, 64)
        );
        assert_eq!(
            (high.retry_count, high.ack_timeout, high.qp_retry_count),
            (127, 31, 6)
        );
    }

    #[test]
    fn out_of_range_values_keep_the_default() {
        let config = with(&[
            (IB_PORT_ENV, "0"),
            (MTU_ENV, "1500"),
            (QPS_PER_ENDPOINT_ENV, "65"),
            (MAX_WR_ENV, "15"),
            (MAX_CQE_ENV, "4194305"),
            (MAX_ENDPOINTS_ENV, "0"),
            (WORKERS_PER_NIC_ENV, "9"),
            (SLICE_SIZE_ENV, "4095"),
            (FRAGMENT_RATIO_ENV, "0"),
            (RETRY_COUNT_ENV, "128"),
            (RAIL_PAUSE_ENV, "86401"),
            (HANDSHAKE_TIMEOUT_ENV, "0"),
            (ACK_TIMEOUT_ENV, "32"),
            (QP_RETRY_ENV, "7"),
        ]);
        assert_eq!(config, RdmaConfig::default());
        assert_eq!(with(&[(IB_PORT_ENV, "256")]).ib_port, 1);
        assert_eq!(with(&[(MTU_ENV, "256")]).mtu, 4096);
    }

    #[test]
    fn garbage_keeps_the_default() {
        let config = with(&[
            (IB_PORT_ENV, "one"),
            (GID_INDEX_ENV, "auto"),
            (MTU_ENV, "4k"),
            (QPS_PER_ENDPOINT_ENV, "-2"),
            (MAX_WR_ENV, "1e3"),
            (MAX_CQE_ENV, "0x1000"),
            (MAX_ENDPOINTS_ENV, "99999999999999999999999"),
            (WORKERS_PER_NIC_ENV, "2.5"),
            (SLICE_SIZE_ENV, "64KiB"),
            (FRAGMENT_RATIO_ENV, "four"),
            (RETRY_COUNT_ENV, "-1"),
            (RAIL_PAUSE_ENV, "30s"),
            (HANDSHAKE_TIMEOUT_ENV, "5.0"),
            (ACK_TIMEOUT_ENV, ""),
            (QP_RETRY_ENV, "  "),
            (PIN_WORKERS_ENV, "maybe"),
        ]);
        assert_eq!(config, RdmaConfig::default());
    }

    #[test]
    fn blank_values_count_as_unset() {
        let config = with(&[
            (DEVICE_FILTER_ENV, ""),
            (TOPOLOGY_FILE_ENV, "  "),
            (GID_INDEX_ENV, ""),
            (NCCL_GID_INDEX_ENV, "5"),
        ]);
        assert!(config.devices.is_empty());
        assert_eq!(config.topology_file, None);
        assert_eq!(config.gid_index, Some(5));
    }

    #[test]
    fn gid_index_falls_back_to_nccl_and_negative_means_auto() {
        assert_eq!(with(&[(NCCL_GID_INDEX_ENV, "3")]).gid_index, Some(3));
        assert_eq!(
            with(&[(GID_INDEX_ENV, "1"), (NCCL_GID_INDEX_ENV, "3")]).gid_index,
            Some(1)
        );
        assert_eq!(
            with(&[(GID_INDEX_ENV, "-1"), (NCCL_GID_INDEX_ENV, "3")]).gid_index,
            None
        );
        assert_eq!(with(&[(GID_INDEX_ENV, "-1")]).gid_index, None);
        assert_eq!(with(&[(NCCL_GID_INDEX_ENV, "-7")]).gid_index, None);
        assert_eq!(with(&[(GID_INDEX_ENV, "0")]).gid_index, Some(0));
        assert_eq!(with(&[(GID_INDEX_ENV, "4294967296")]).gid_index, None);
        assert_eq!(
            with(&[(GID_INDEX_ENV, "x"), (NCCL_GID_INDEX_ENV, "3")]).gid_index,
            None
        );
    }

    #[test]
    fn pin_workers_spellings() {
        for off in ["0", "false", "FALSE", "no", "off"] {
            assert!(!with(&[(PIN_WORKERS_ENV, off)]).pin_workers, "{off}");
        }
        for on in ["1", "true", "True", "yes", "on"] {
            assert!(with(&[(PIN_WORKERS_ENV, on)]).pin_workers, "{on}");
        }
    }

    #[test]
    fn tail_merge_survives_a_hand_made_zero_ratio() {
        let config = RdmaConfig {
            fragment_ratio: 0,
            ..RdmaConfig::default()
        };
        assert_eq!(config.tail_merge_below(), 65536);
    }
}
