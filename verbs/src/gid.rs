//! GIDs and choosing one. A wrong automatic choice (link-local, RoCE v1, an overlay
//! interface) is the most common reason RDMA connections fail to come up, so the choice is
//! plain code with tests, fed by the kernel's GID table in sysfs.

use std::fmt;

/// A 128-bit GID.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// All zero: an empty table slot.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// `fe80::/10`.
    pub fn is_link_local(&self) -> bool {
        self.0[0] == 0xfe && self.0[1] & 0xc0 == 0x80
    }

    /// `::ffff:a.b.c.d`: the GID of an IPv4 address.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.0[..10] == [0; 10] && self.0[10] == 0xff && self.0[11] == 0xff
    }

    /// Parses sysfs' form (`0000:0000:...:0001`, eight groups of four hex digits) or
    /// Mooncake's (sixteen pairs joined by `:`).
    pub fn parse(text: &str) -> Option<Self> {
        let digits: String = text.trim().chars().filter(|c| *c != ':').collect();
        if digits.len() != 32 {
            return None;
        }
        let mut bytes = [0u8; 16];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(digits.get(2 * i..2 * i + 2)?, 16).ok()?;
        }
        Some(Self(bytes))
    }
}

/// Mooncake's text form: sixteen lowercase hex pairs joined by `:`.
impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, byte) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// The RoCE flavour of a GID table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidKind {
    /// RoCE v2 (routable, UDP).
    RoceV2,
    /// InfiniBand or RoCE v1.
    IbOrRoceV1,
    /// Not known (read by index, no sysfs entry).
    Unknown,
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntry {
    /// Table index (the `sgid_index` of a QP).
    pub index: u32,
    /// The GID.
    pub gid: Gid,
    /// Its flavour.
    pub kind: GidKind,
    /// The network interface it belongs to, if any.
    pub netdev: Option<String>,
}

/// Interfaces whose addresses are never the right RDMA path (container overlays, tunnels).
const OVERLAY_PREFIXES: [&str; 6] = ["flannel", "cni", "calico", "vxlan", "docker", "tunl"];

/// The usable entries, best first: non-zero, not link-local, not on an overlay interface;
/// then RoCE v2 before v1, IPv4-mapped before other addresses, with a netdev before without,
/// lower index first.
pub fn rank_gids(table: &[GidEntry]) -> Vec<GidEntry> {
    let mut usable: Vec<GidEntry> = table
        .iter()
        .filter(|e| !e.gid.is_zero() && !e.gid.is_link_local())
        .filter(|e| {
            e.netdev
                .as_deref()
                .is_none_or(|n| !OVERLAY_PREFIXES.iter().any(|p| n.starts_with(p)))
        })
        .cloned()
        .collect();
    usable.sort_by_key(|e| {
        (
            e.kind != GidKind::RoceV2,
            !e.gid.is_ipv4_mapped(),
            e.netdev.is_none(),
            e.index,
        )
    });
    usable
}

/// Reads `device`'s GID table for `port` from sysfs (empty when there is none).
pub fn read_gid_table(device: &str, port: u8) -> Vec<GidEntry> {
    let base = format!("/sys/class/infiniband/{device}/ports/{port}");
    let Ok(entries) = std::fs::read_dir(format!("{base}/gids")) else {
        return Vec::new();
    };
    let mut table: Vec<GidEntry> = entries
        .flatten()
        .filter_map(|entry| {
            let index: u32 = entry.file_name().to_str()?.parse().ok()?;
            let gid = Gid::parse(&std::fs::read_to_string(entry.path()).ok()?)?;
            let kind = match std::fs::read_to_string(format!("{base}/gid_attrs/types/{index}")) {
                Ok(t) if t.contains("v2") => GidKind::RoceV2,
                Ok(t) if !t.trim().is_empty() => GidKind::IbOrRoceV1,
                _ => GidKind::Unknown,
            };
            let netdev = std::fs::read_to_string(format!("{base}/gid_attrs/ndevs/{index}"))
                .ok()
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty());
            Some(GidEntry {
                index,
                gid,
                kind,
                netdev,
            })
        })
        .collect();
    table.sort_by_key(|e| e.index);
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u32, gid: &str, kind: GidKind, netdev: Option<&str>) -> GidEntry {
        GidEntry {
            index,
            gid: Gid::parse(gid).unwrap(),
            kind,
            netdev: netdev.map(str::to_owned),
        }
    }

    #[test]
    fn gids_parse_and_print_in_mooncakes_form() {
        let gid = Gid::parse("0000:0000:0000:0000:0000:ffff:0a4d:0001").unwrap();
        assert_eq!(
            gid.to_string(),
            "00:00:00:00:00:00:00:00:00:00:ff:ff:0a:4d:00:01"
        );
        assert_eq!(Gid::parse(&gid.to_string()), Some(gid));
        assert!(gid.is_ipv4_mapped() && !gid.is_link_local() && !gid.is_zero());
        assert!(
            Gid::parse("fe80:0000:0000:0000:5054:00ff:fe12:3456")
                .unwrap()
                .is_link_local()
        );
        assert!(Gid::parse("12").is_none());
        assert!(Gid::parse("zz00:0000:0000:0000:0000:ffff:0a4d:0001").is_none());
    }

    /// The table rxe shows on a dummy netdev with an IPv4 and an IPv6 link-local address,
    /// plus what container hosts add: the pick is the RoCE v2 IPv4 entry.
    #[test]
    fn ranking_picks_roce_v2_ipv4_and_skips_the_traps() {
        let table = vec![
            entry(
                0,
                "fe80:0000:0000:0000:5054:00ff:fe12:3456",
                GidKind::IbOrRoceV1,
                Some("eth0"),
            ),
            entry(
                1,
                "fe80:0000:0000:0000:5054:00ff:fe12:3456",
                GidKind::RoceV2,
                Some("eth0"),
            ),
            entry(
                2,
                "0000:0000:0000:0000:0000:ffff:0a00:0001",
                GidKind::IbOrRoceV1,
                Some("eth0"),
            ),
            entry(
                3,
                "0000:0000:0000:0000:0000:ffff:0a00:0001",
                GidKind::RoceV2,
                Some("eth0"),
            ),
            entry(
                4,
                "0000:0000:0000:0000:0000:ffff:ac11:0001",
                GidKind::RoceV2,
                Some("docker0"),
            ),
            entry(
                5,
                "2001:0db8:0000:0000:0000:0000:0000:0001",
                GidKind::RoceV2,
                Some("eth0"),
            ),
            entry(
                6,
                "0000:0000:0000:0000:0000:0000:0000:0000",
                GidKind::RoceV2,
                None,
            ),
        ];
        let ranked = rank_gids(&table);
        let order: Vec<u32> = ranked.iter().map(|e| e.index).collect();
        assert_eq!(order, [3, 5, 2]);
        assert!(
            rank_gids(&table[..2]).is_empty(),
            "link-local only: nothing usable"
        );
    }
}
