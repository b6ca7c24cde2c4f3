//! The local NICs: which devices to use, opened once, with their port, GID and MTU.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;
use tern_engine::{LocalCounter, MovedCounter};

use tern_verbs::{
    Context, DeviceLimits, GidEntry, PathConfig, ProtectionDomain, QpCaps, VerbsError,
};

use crate::config::RdmaConfig;
use crate::error::RdmaError;
use crate::topology::numa_node_of_nic;

/// Bytes and slices one worker moved, and slices that failed on it, per NIC and per peer:
/// written by that worker alone ([`LocalCounter`]), summed when asked.
#[derive(Debug, Default)]
pub(crate) struct WorkerCounters {
    pub failures: LocalCounter,
    /// Per peer server; a slot looks its entry up once, when it opens.
    pub peers: Mutex<HashMap<String, Arc<MovedCounter>>>,
}

impl WorkerCounters {
    /// The counters of `server`, made on first use.
    pub fn peer(&self, server: &str) -> Arc<MovedCounter> {
        self.peers
            .lock()
            .entry(server.to_owned())
            .or_default()
            .clone()
    }

    /// `(bytes, slices)` moved, over every peer.
    pub fn moved(&self) -> (u64, u64) {
        self.peers
            .lock()
            .values()
            .fold((0, 0), |(bytes, slices), peer| {
                let (peer_bytes, peer_slices) = peer.get();
                (bytes + peer_bytes, slices + peer_slices)
            })
    }
}

/// One opened device and the facts its endpoints need.
#[derive(Debug)]
pub(crate) struct Nic {
    /// Position in the transport's NIC list (and in every region's key arrays).
    pub index: usize,
    pub name: String,
    pub pd: Arc<ProtectionDomain>,
    pub port: u8,
    pub gid: GidEntry,
    pub lid: u16,
    /// Path MTU in bytes: the port's active MTU, capped by the configuration.
    pub mtu: u32,
    pub numa_node: Option<u32>,
    pub limits: DeviceLimits,
    /// The port's largest message in bytes (`max_msg_sz`): the longest slice it can post.
    pub max_msg: u32,
}

impl Nic {
    pub fn context(&self) -> &Arc<Context> {
        self.pd.context()
    }

    /// Whether the port is up now.
    pub fn port_active(&self) -> bool {
        self.context()
            .port(self.port)
            .map(|p| p.active)
            .unwrap_or(false)
    }
}

/// Queue sizes and QP path settings for a configuration on a set of NICs: the
/// configuration's, clamped to what every NIC allows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizing {
    /// Entries of each worker's completion queue.
    pub cq_entries: usize,
    pub caps: QpCaps,
    /// RTR/RTS settings; each endpoint fills in its port, GID index and MTU.
    pub template: PathConfig,
}

pub(crate) fn sizing(config: &RdmaConfig, nics: &[Nic]) -> Sizing {
    let min_limit = |f: fn(&Nic) -> i64| nics.iter().map(f).min().unwrap_or(0);
    let cq_entries = i64::from(config.max_cqe)
        .min(min_limit(|n| i64::from(n.limits.max_cqe)))
        .max(16) as usize;
    let max_wr = i64::from(config.max_wr)
        .min(min_limit(|n| i64::from(n.limits.max_qp_wr)))
        .max(1) as u32;
    Sizing {
        cq_entries,
        caps: QpCaps {
            max_send_wr: max_wr,
            // Tern's data path is one-sided: nothing is ever received.
            max_recv_wr: 1,
            max_sge: 1,
            max_inline: 0,
            // One request in 32 produces a completion (and the last of each chain), so a long
            // chain frees its queue slots before it ends.
            ..QpCaps::default()
        },
        template: PathConfig {
            timeout: config.ack_timeout,
            retry_count: config.qp_retry_count,
            ..PathConfig::default()
        },
    }
}

/// The verbs enum of an MTU in bytes (256 → 1 … 4096 → 5).
pub(crate) fn mtu_enum(bytes: u32) -> u32 {
    match bytes {
        0..=256 => 1,
        257..=512 => 2,
        513..=1024 => 3,
        1025..=2048 => 4,
        _ => 5,
    }
}

/// Opens every device the configuration allows that has an active port and a usable GID,
/// in the host's device order. Fails with a message naming what was looked for and why each
/// device was passed over when none is usable, or when the allow-list names a device that
/// is missing.
pub(crate) fn open_nics(config: &RdmaConfig) -> Result<Vec<Nic>, RdmaError> {
    let looked_for = if config.devices.is_empty() {
        "any device (no allow-list: MC_TE_FILTERS or the device list is empty)".to_owned()
    } else {
        config.devices.join(", ")
    };
    let names = tern_verbs::device_names().map_err(|source| RdmaError::Device {
        device: "(device list)".into(),
        source,
    })?;
    if names.is_empty() {
        return Err(RdmaError::NoDevice {
            looked_for,
            found: "ibv_get_device_list lists no device (the kernel has no RDMA support, or \
                    no NIC is bound to an RDMA driver)"
                .into(),
        });
    }
    if let Some(missing) = config.devices.iter().find(|d| !names.contains(d)) {
        return Err(RdmaError::NoDevice {
            looked_for,
            found: format!(
                "{missing:?} does not exist; the host has {}",
                names.join(", ")
            ),
        });
    }
    let mut nics = Vec::new();
    let mut passed_over = Vec::new();
    for name in names {
        if !config.devices.is_empty() && !config.devices.contains(&name) {
            continue;
        }
        match open_nic(nics.len(), &name, config) {
            Ok(nic) => nics.push(nic),
            Err(reason) => passed_over.push(format!("{name}: {reason}")),
        }
    }
    if nics.is_empty() {
        return Err(RdmaError::NoDevice {
            looked_for,
            found: format!("none is usable ({})", passed_over.join("; ")),
        });
    }
    for skipped in passed_over {
        tracing::warn!("RDMA device passed over: {skipped}");
    }
    Ok(nics)
}

fn open_nic(index: usize, name: &str, config: &RdmaConfig) -> Result<Nic, String> {
    let verbs = |e: VerbsError| e.to_string();
    let context = Context::open(name).map_err(verbs)?;
    let port = context.port(config.ib_port).map_err(verbs)?;
    if !port.active {
        return Err(format!("port {} is not active", config.ib_port));
    }
    let gid = context
        .select_gid(config.ib_port, config.gid_index)
        .map_err(verbs)?;
    if gid.gid.is_zero() {
        return Err(format!("GID index {} is empty", gid.index));
    }
    let limits = context.limits().map_err(verbs)?;
    let pd = ProtectionDomain::new(&context).map_err(verbs)?;
    Ok(Nic {
        index,
        name: name.to_owned(),
        pd,
        port: config.ib_port,
        gid,
        lid: port.lid,
        mtu: port.mtu_bytes().min(config.mtu),
        numa_node: numa_node_of_nic(Path::new("/sys"), name),
        limits,
        max_msg: port.max_msg_sz,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_bytes_map_to_the_verbs_enum() {
        assert_eq!(
            [256, 512, 1024, 2048, 4096, 9000].map(mtu_enum),
            [1, 2, 3, 4, 5, 5]
        );
    }
}
