//! Which host, network namespace and user a node runs as, published under `tern.shm` of its
//! descriptor (a field Mooncake peers ignore), and the comparison that decides whether a
//! peer may be same-host. The descriptor only makes a peer a candidate: the Unix socket it
//! names, which lives in its network namespace, confirms it (`client`).

use serde_json::{Value, json};

/// Version of the `tern.shm` field and of the socket protocol.
pub const VERSION: u64 = 1;

/// Where a process runs, as far as sharing memory with it is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostIdentity {
    /// `/proc/sys/kernel/random/boot_id`: one per boot of one kernel.
    pub boot_id: String,
    /// `/proc/self/ns/net` as its link reads (`net:[4026531840]`): the network namespace,
    /// which is also where an abstract Unix socket lives.
    pub netns: String,
    /// The host name (of the UTS namespace).
    pub host: String,
    /// Effective user ID: cross-memory attach and the socket's peer check need the same.
    pub uid: u32,
}

impl HostIdentity {
    /// This process's identity, read from `/proc`.
    pub fn current() -> std::io::Result<Self> {
        let read = |path: &str| std::fs::read_to_string(path).map(|s| s.trim().to_owned());
        let netns = std::fs::read_link("/proc/self/ns/net")?
            .to_string_lossy()
            .into_owned();
        Ok(Self {
            boot_id: read("/proc/sys/kernel/random/boot_id")?,
            netns,
            host: read("/proc/sys/kernel/hostname")?,
            uid: tern_memreg::shm::effective_uid(),
        })
    }
}

/// What a node publishes under `tern.shm`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extension {
    /// Where it runs.
    pub identity: HostIdentity,
    /// The abstract Unix socket (name without the leading NUL) it accepts peers on.
    pub socket: String,
    /// Its process ID (informational: the socket's credentials are what count).
    pub pid: u32,
}

impl Extension {
    /// The JSON value published.
    pub fn to_json(&self) -> Value {
        json!({
            "version": VERSION,
            "boot_id": self.identity.boot_id,
            "netns": self.identity.netns,
            "host": self.identity.host,
            "uid": self.identity.uid,
            "socket": self.socket,
            "pid": self.pid,
        })
    }

    /// Reads a peer's `tern.shm` value; `None` when it is missing a field, of another
    /// version, or malformed.
    pub fn from_json(value: &Value) -> Option<Self> {
        let text = |key: &str| value.get(key)?.as_str().map(str::to_owned);
        if value.get("version")?.as_u64()? != VERSION {
            return None;
        }
        let socket = text("socket")?;
        if socket.is_empty() || socket.len() > MAX_SOCKET_NAME || socket.contains('\0') {
            return None;
        }
        Some(Self {
            identity: HostIdentity {
                boot_id: text("boot_id")?,
                netns: text("netns")?,
                host: text("host")?,
                uid: u32::try_from(value.get("uid")?.as_u64()?).ok()?,
            },
            socket,
            pid: u32::try_from(value.get("pid")?.as_u64()?).ok()?,
        })
    }
}

/// Longest abstract socket name (`sun_path` holds 108 bytes, one of them the leading NUL).
pub const MAX_SOCKET_NAME: usize = 107;

/// Whether a peer whose descriptor carries `value` under `tern.shm` claims to run on this
/// host, in this network namespace, as this user. Without the field (a Mooncake peer, or a
/// Tern node without this transport) it does not.
pub fn same_host(mine: &HostIdentity, value: Option<&Value>) -> bool {
    // Compared field by field without building the struct: routing asks once per submit.
    let Some(value) = value else { return false };
    let text = |key: &str| value.get(key).and_then(Value::as_str);
    value.get("version").and_then(Value::as_u64) == Some(VERSION)
        && text("boot_id") == Some(mine.boot_id.as_str())
        && text("netns") == Some(mine.netns.as_str())
        && text("host") == Some(mine.host.as_str())
        && value.get("uid").and_then(Value::as_u64) == Some(u64::from(mine.uid))
        && text("socket").is_some_and(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mine() -> HostIdentity {
        HostIdentity::current().unwrap()
    }

    #[test]
    fn this_process_is_same_host_with_itself_and_not_with_any_one_change() {
        let ext = Extension {
            identity: mine(),
            socket: "tern-shm-1-abc".into(),
            pid: 1,
        };
        let json = ext.to_json();
        assert!(same_host(&mine(), Some(&json)));
        assert_eq!(Extension::from_json(&json), Some(ext));
        for (key, other) in [
            ("boot_id", json!("00000000-0000-0000-0000-000000000000")),
            ("netns", json!("net:[1]")),
            ("host", json!("elsewhere")),
            ("uid", json!(u64::from(mine().uid) + 1)),
            ("version", json!(VERSION + 1)),
            ("socket", json!("")),
        ] {
            let mut changed = json.clone();
            changed[key] = other;
            assert!(!same_host(&mine(), Some(&changed)), "{key} changed");
        }
        assert!(!same_host(&mine(), None), "no field: no shm");
        assert!(!same_host(&mine(), Some(&json!("garbage"))));
    }

    #[test]
    fn malformed_extensions_are_none() {
        let good = Extension {
            identity: mine(),
            socket: "s".into(),
            pid: 7,
        }
        .to_json();
        for broken in [
            json!({}),
            json!([1, 2]),
            {
                let mut v = good.clone();
                v["uid"] = json!(-1);
                v
            },
            {
                let mut v = good.clone();
                v["socket"] = json!("x".repeat(MAX_SOCKET_NAME + 1));
                v
            },
            {
                let mut v = good.clone();
                v["socket"] = json!("a\0b");
                v
            },
            {
                let mut v = good.clone();
                v["pid"] = json!("seven");
                v
            },
        ] {
            assert_eq!(Extension::from_json(&broken), None, "{broken}");
        }
    }
}
