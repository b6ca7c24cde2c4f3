//! Which host, network namespace and user a node runs as, published under `tern.shm` of its
//! descriptor (a field Mooncake peers ignore), and the comparison that decides whether a
//! peer may be same-host. The descriptor only makes a peer a candidate: the Unix socket it
//! names, which lives in its network namespace, confirms it (`client`).

use serde_json::{Value, json};

/// Version of the `tern.shm` field and of the socket protocol.
pub const VERSION: u64 = 2;

/// Where a process runs, as far as sharing memory with it is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostIdentity {
    /// `/proc/sys/kernel/random/boot_id`: one per boot of one kernel.
    pub boot_id: String,
    /// `/proc/self/ns/net` as `readlink` gives it (`net:[4026531840]`): the network namespace,
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

/// What every socket name Tern binds starts with.
const SOCKET_PREFIX: &str = "tern-shm-";

/// Hex digits of the random tag that ends a socket name.
const SOCKET_TAG_DIGITS: usize = 16;

/// The abstract socket name a node binds: `tern-shm-<pid>-<tag in 16 hex digits>`. The only
/// form [`check_socket_name`] lets a peer's descriptor name.
pub fn socket_name(pid: u32, tag: &[u8; SOCKET_TAG_DIGITS / 2]) -> String {
    let tag: String = tag.iter().map(|b| format!("{b:02x}")).collect();
    format!("{SOCKET_PREFIX}{pid}-{tag}")
}

/// Why a peer's descriptor names a socket this node does not dial.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SocketNameError {
    /// The name is not one Tern binds ([`socket_name`]'s form). Whoever can write the peer's
    /// descriptor could otherwise send this node to any abstract socket of its network
    /// namespace (another service's), or a filesystem-looking name: it is not dialed, and
    /// the slices go to the next transport. Check what publishes the peer's descriptor.
    #[error(
        "the descriptor names the socket {name:?}, which is not of the form \
         tern-shm-<pid>-<16 hex digits> that Tern binds; not dialed"
    )]
    Foreign {
        /// The name as the descriptor gave it.
        name: String,
    },
}

/// Accepts only a socket name of the form Tern itself binds ([`socket_name`]): the prefix,
/// a decimal process ID (no sign, no leading zero), a dash, and 16 lowercase hex digits.
pub fn check_socket_name(name: &str) -> Result<(), SocketNameError> {
    let foreign = || SocketNameError::Foreign {
        name: name.to_owned(),
    };
    let rest = name.strip_prefix(SOCKET_PREFIX).ok_or_else(foreign)?;
    let (pid, tag) = rest.split_once('-').ok_or_else(foreign)?;
    let pid_ok = !pid.is_empty()
        && !pid.starts_with('0')
        && pid.bytes().all(|b| b.is_ascii_digit())
        && pid.parse::<u32>().is_ok();
    let tag_ok = tag.len() == SOCKET_TAG_DIGITS
        && tag.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if pid_ok && tag_ok {
        Ok(())
    } else {
        Err(foreign())
    }
}

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
            socket: socket_name(1, &[0xab; 8]),
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
    fn only_socket_names_of_the_form_tern_binds_are_accepted() {
        let made = socket_name(4242, &[0x00, 0x1f, 0xa0, 0xff, 0x12, 0x34, 0x56, 0x78]);
        assert_eq!(made, "tern-shm-4242-001fa0ff12345678");
        assert_eq!(check_socket_name(&made), Ok(()));
        assert_eq!(check_socket_name(&socket_name(u32::MAX, &[0; 8])), Ok(()));
        for foreign in [
            "/run/docker.sock",
            "../x",
            "tern-shm-../../x",
            "@/tmp/.X11-unix/X0",
            "/tmp/.X11-unix/X0",
            "tern-shm-fake-4242",
            "tern-shm-4242",
            "tern-shm-4242-",
            "tern-shm--001fa0ff12345678",
            "tern-shm-04242-001fa0ff12345678",
            "tern-shm-+4242-001fa0ff12345678",
            "tern-shm-99999999999-001fa0ff12345678",
            "tern-shm-4242-001FA0FF12345678",
            "tern-shm-4242-001fa0ff1234567",
            "tern-shm-4242-001fa0ff123456789",
            "tern-shm-4242-001fa0ff1234567g",
            "tern-shm-4242-001fa0ff12345678/../x",
            "xtern-shm-4242-001fa0ff12345678",
            "",
        ] {
            let refused = check_socket_name(foreign).unwrap_err();
            assert_eq!(
                refused,
                SocketNameError::Foreign {
                    name: foreign.into()
                }
            );
            assert!(refused.to_string().contains("not dialed"), "{refused}");
        }
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
