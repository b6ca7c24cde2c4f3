//! Segment descriptors exactly as Mooncake writes them: compact JSON, keys in sorted order,
//! one trailing newline. Field order in the structs below is alphabetical on purpose: serde
//! writes fields in declaration order, and that order is part of the format.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Why a descriptor was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DescriptorError {
    /// Not valid JSON, or not the expected shape; the message names line, column and field.
    #[error("malformed descriptor JSON: {0}")]
    MalformedJson(String),
    /// Valid JSON that breaks a rule a Mooncake reader enforces.
    #[error("invalid descriptor: {0}")]
    Invalid(String),
}

/// One RDMA device of a segment: `rkey[i]`/`lkey[i]` of every buffer belong to `devices[i]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceDesc {
    /// GID as 16 lowercase hex pairs joined by `:`.
    pub gid: String,
    /// Port LID (0 on RoCE).
    #[serde(default)]
    pub lid: u16,
    /// Device name, e.g. `mlx5_0` or `rxe0`.
    pub name: String,
}

/// One registered buffer of a segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferDesc {
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub length: u64,
    /// Local keys, one per device (RDMA only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lkey: Option<Vec<u32>>,
    /// Location (`cpu:0`, `cuda:1`) for RDMA; the server name for TCP.
    pub name: String,
    /// Remote keys, one per device (RDMA only); empty when not remote-accessible.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rkey: Option<Vec<u32>>,
}

impl BufferDesc {
    /// Whether `[addr, addr + len)` lies wholly inside this buffer (overflow-checked).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let (Some(end), Some(buf_end)) =
            (addr.checked_add(len), self.addr.checked_add(self.length))
        else {
            return false;
        };
        len > 0 && addr >= self.addr && end <= buf_end
    }
}

/// NIC preference per storage type: `{"cpu:0": [[preferred..], [available..]]}`.
pub type PriorityMatrix = BTreeMap<String, [Vec<String>; 2]>;

/// A segment: one node's published memory and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDesc {
    /// Registered buffers.
    #[serde(default)]
    pub buffers: Vec<BufferDesc>,
    /// RDMA devices (absent for TCP-only segments).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceDesc>,
    /// Segment (server) name.
    pub name: String,
    /// NIC priority matrix (RDMA only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority_matrix: Option<PriorityMatrix>,
    /// Protocols: one string, or an array in multi-protocol builds.
    #[serde(
        serialize_with = "serialize_protocols",
        deserialize_with = "deserialize_protocols"
    )]
    pub protocol: Vec<String>,
    /// Name RDMA NIC paths use instead of `name` on dual-NIC hosts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma_server_name: Option<String>,
    /// TCP data port; 0 when TCP is not installed.
    #[serde(default)]
    pub tcp_data_port: u16,
    /// TCP data protocol version; absent means 1.
    #[serde(default = "legacy_tcp_version")]
    pub tcp_proto_version: u32,
    /// Tern transports' own fields, one entry per protocol (`{"shm": {...}}`); Mooncake
    /// peers ignore the key, and it is absent when empty.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub tern: BTreeMap<String, serde_json::Value>,
    /// Local time of writing, `YYYY-MM-DD HH:MM:SS.uuuuuu`; ignored for equality.
    #[serde(default)]
    pub timestamp: String,
}

fn legacy_tcp_version() -> u32 {
    1
}

fn serialize_protocols<S: Serializer>(protocols: &[String], s: S) -> Result<S::Ok, S::Error> {
    match protocols {
        [one] => s.serialize_str(one),
        many => many.serialize(s),
    }
}

fn deserialize_protocols<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(p) => vec![p],
        OneOrMany::Many(ps) => ps,
    })
}

/// RDMA-family protocols whose buffers must carry one rkey per device.
const KEYED_PROTOCOLS: [&str; 3] = ["rdma", "efa", "cxi"];

impl SegmentDesc {
    /// An empty descriptor for `name` speaking `protocol`.
    pub fn new(name: impl Into<String>, protocol: impl Into<String>) -> Self {
        Self {
            buffers: Vec::new(),
            devices: Vec::new(),
            name: name.into(),
            priority_matrix: None,
            protocol: vec![protocol.into()],
            rdma_server_name: None,
            tcp_data_port: 0,
            tcp_proto_version: 1,
            tern: BTreeMap::new(),
            timestamp: String::new(),
        }
    }

    /// The protocols this segment speaks.
    pub fn protocols(&self) -> &[String] {
        &self.protocol
    }

    /// Whether the segment speaks `protocol`.
    pub fn speaks(&self, protocol: &str) -> bool {
        self.protocol.iter().any(|p| p == protocol)
    }

    /// The buffer wholly containing `[addr, addr + len)`.
    pub fn buffer_containing(&self, addr: u64, len: u64) -> Option<&BufferDesc> {
        self.buffers.iter().find(|b| b.contains(addr, len))
    }

    /// Stamps the current time in Mooncake's format.
    pub fn stamp_now(&mut self) {
        self.timestamp = format_timestamp(SystemTime::now());
    }

    /// Equal apart from the timestamp.
    pub fn same_content(&self, other: &Self) -> bool {
        let mut a = self.clone();
        a.timestamp.clone_from(&other.timestamp);
        a == *other
    }

    /// Compact JSON with sorted keys and one trailing newline, as Mooncake writes it.
    pub fn to_json(&self) -> String {
        // Serialising plain strings, integers and maps with string keys cannot fail.
        let mut json = serde_json::to_string(self).unwrap_or_default();
        json.push('\n');
        json
    }

    /// Reads a descriptor (trailing whitespace tolerated) and checks Mooncake's rules.
    pub fn from_json(json: &[u8]) -> Result<Self, DescriptorError> {
        let desc: Self = serde_json::from_slice(json)
            .map_err(|e| DescriptorError::MalformedJson(e.to_string()))?;
        desc.validate()?;
        Ok(desc)
    }

    /// Mooncake's reader rules: non-empty name and protocol; devices with a name and a GID;
    /// buffers with a name, a non-zero address and length that do not wrap, as many lkeys as
    /// rkeys, and (RDMA family) one rkey per device when remote-accessible.
    pub fn validate(&self) -> Result<(), DescriptorError> {
        let invalid = |msg: String| Err(DescriptorError::Invalid(msg));
        if self.name.is_empty() {
            return invalid("empty segment name".into());
        }
        if self.protocol.is_empty() || self.protocol.iter().any(String::is_empty) {
            return invalid("empty protocol".into());
        }
        for (i, dev) in self.devices.iter().enumerate() {
            if dev.name.is_empty() || dev.gid.is_empty() {
                return invalid(format!("device {i} has an empty name or gid"));
            }
        }
        let keyed = self
            .protocol
            .iter()
            .any(|p| KEYED_PROTOCOLS.contains(&p.as_str()));
        for (i, buf) in self.buffers.iter().enumerate() {
            if buf.name.is_empty() {
                return invalid(format!("buffer {i} has an empty name"));
            }
            if buf.addr == 0 || buf.length == 0 {
                return invalid(format!("buffer {i} has a zero address or length"));
            }
            if buf.addr.checked_add(buf.length).is_none() {
                return invalid(format!("buffer {i} wraps around the address space"));
            }
            let rkeys = buf.rkey.as_ref().map_or(0, Vec::len);
            let lkeys = buf.lkey.as_ref().map_or(0, Vec::len);
            if rkeys != lkeys && rkeys != 0 {
                return invalid(format!("buffer {i} has {rkeys} rkeys but {lkeys} lkeys"));
            }
            if keyed && rkeys != 0 && rkeys != self.devices.len() {
                return invalid(format!(
                    "buffer {i} has {rkeys} rkeys for {} devices",
                    self.devices.len()
                ));
            }
        }
        Ok(())
    }
}

/// `YYYY-MM-DD HH:MM:SS.uuuuuu` in UTC.
pub(crate) fn format_timestamp(time: SystemTime) -> String {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{:06}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        since.subsec_micros()
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn timestamps_use_mooncakes_format() {
        let t = UNIX_EPOCH + Duration::from_micros(1_796_036_708_026_656);
        assert_eq!(format_timestamp(t), "2026-11-30 11:05:08.026656");
        assert_eq!(format_timestamp(UNIX_EPOCH), "1970-01-01 00:00:00.000000");
        assert_eq!(
            format_timestamp(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29 00:00:00.000000"
        );
    }

    #[test]
    fn buffer_containment_is_overflow_checked() {
        let buf = BufferDesc {
            addr: u64::MAX - 10,
            length: 10,
            lkey: None,
            name: "n".into(),
            rkey: None,
        };
        assert!(buf.contains(u64::MAX - 10, 10));
        assert!(!buf.contains(u64::MAX - 5, 10));
        assert!(!buf.contains(u64::MAX - 10, 0));
        assert!(!buf.contains(u64::MAX - 11, 2));
    }
}
