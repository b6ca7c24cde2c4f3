//! Mooncake's arguments and environment turned into engine settings: which store, which
//! transports, which RPC ports, which deadline. Plain functions over strings, tested without
//! sockets or an interpreter.

use std::time::Duration;

use tern_engine::PortChoice;

/// Forces TCP even where RDMA devices exist (Mooncake's `MC_FORCE_TCP`).
pub(crate) const FORCE_TCP_ENV: &str = "MC_FORCE_TCP";
/// Forces the RDMA transport: no TCP fallback when no device opens (`MC_FORCE_HCA`).
pub(crate) const FORCE_HCA_ENV: &str = "MC_FORCE_HCA";
/// Lowest handshake RPC port in P2P mode, and Mooncake's misspelt alias of it.
const MIN_RPC_PORT_ENVS: [&str; 2] = ["MC_MIN_RPC_PORT", "MC_MIN_PRC_PORT"];
/// Highest handshake RPC port, and its alias.
const MAX_RPC_PORT_ENVS: [&str; 2] = ["MC_MAX_RPC_PORT", "MC_MAX_PRC_PORT"];
/// Mooncake's Python layer: transfer deadline in seconds, at least 5, default 30.
const TRANSFER_TIMEOUT_ENV: &str = tern_engine::TRANSFER_TIMEOUT_ENV;
const DEFAULT_RPC_PORTS: (u16, u16) = (15000, 17000);

/// Where a variable's value comes from (the process environment, or a test's table).
pub(crate) type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process environment as a [`Lookup`].
pub(crate) fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn value(lookup: Lookup<'_>, name: &str) -> Option<String> {
    lookup(name)
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// Whether a flag variable is on: set, and not `0`/`false`/`no`/`off`.
pub(crate) fn flag(lookup: Lookup<'_>, name: &str) -> bool {
    value(lookup, name).is_some_and(|v| {
        !matches!(
            v.to_ascii_lowercase().as_str(),
            "0" | "false" | "no" | "off"
        )
    })
}

/// The connection string `initialize_ext` builds from a server and a metadata type:
/// `P2PHANDSHAKE` and strings that already carry a scheme stay as they are, anything else
/// becomes `<type>://<server>` (an empty type leaves a bare `host:port`, which means etcd).
pub(crate) fn metadata_conn(server: &str, metadata_type: &str) -> String {
    let server = server.trim();
    let metadata_type = metadata_type.trim();
    if server == "P2PHANDSHAKE" || server.contains("://") || metadata_type.is_empty() {
        server.to_owned()
    } else {
        format!("{metadata_type}://{server}")
    }
}

/// The handshake RPC's port range from `MC_MIN_RPC_PORT`..`MC_MAX_RPC_PORT` (default
/// 15000–17000; `min == max` allowed). A bad value is an error naming the variable; the
/// caller logs it and keeps the default, as Mooncake does.
pub(crate) fn rpc_ports(lookup: Lookup<'_>) -> Result<PortChoice, String> {
    let read = |names: [&str; 2], default: u16| -> Result<u16, String> {
        let Some((name, text)) = names
            .iter()
            .find_map(|name| value(lookup, name).map(|text| (*name, text)))
        else {
            return Ok(default);
        };
        text.parse::<u16>()
            .ok()
            .filter(|&port| port > 0)
            .ok_or_else(|| format!("{name}={text:?} is not a port number"))
    };
    let lo = read(MIN_RPC_PORT_ENVS, DEFAULT_RPC_PORTS.0)?;
    let hi = read(MAX_RPC_PORT_ENVS, DEFAULT_RPC_PORTS.1)?;
    if lo > hi {
        return Err(format!(
            "{}={lo} is above {}={hi}",
            MIN_RPC_PORT_ENVS[0], MAX_RPC_PORT_ENVS[0]
        ));
    }
    Ok(PortChoice::Range(lo, hi))
}

/// `MC_TRANSFER_TIMEOUT` as Mooncake's Python layer reads it: seconds, at least 5, default 30.
pub(crate) fn mooncake_transfer_timeout(lookup: Lookup<'_>) -> Duration {
    let secs = value(lookup, TRANSFER_TIMEOUT_ENV)
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(30)
        .max(5);
    Duration::from_secs(secs)
}

/// Which transport an engine gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TransportChoice {
    /// TCP.
    Tcp,
    /// Shared memory for peers on this host (memfd mappings for engine-allocated memory,
    /// cross-memory attach for the rest), before the transports after it.
    Shm,
    /// RDMA over these devices (empty: `MC_TE_FILTERS`, else every device with an active
    /// port); no fallback.
    Rdma(Vec<String>),
    /// RDMA over these devices if any opens, else TCP (Mooncake's auto-discovery).
    RdmaOrTcp(Vec<String>),
}

/// Mooncake's protocol rule: `"rdma"` means RDMA where a device opens and TCP elsewhere
/// (`MC_FORCE_TCP` skips RDMA, `MC_FORCE_HCA` refuses the fallback), `"tcp"` means TCP. Tern
/// adds `"shm"`: shared memory for peers on this host, TCP for the rest (the caller installs
/// TCP after it).
/// `rdma_built` says whether this build has the RDMA transport at all.
pub(crate) fn mooncake_transport(
    protocol: &str,
    devices: &str,
    rdma_built: bool,
    lookup: Lookup<'_>,
) -> Result<(TransportChoice, Option<String>), String> {
    let devices = parse_devices(devices);
    match protocol.trim() {
        "tcp" => Ok((TransportChoice::Tcp, None)),
        "shm" => Ok((TransportChoice::Shm, None)),
        "rdma" if !rdma_built => Ok((
            TransportChoice::Tcp,
            Some("this tern wheel was built without RDMA (--tcp-only): using TCP".into()),
        )),
        "rdma" if flag(lookup, FORCE_HCA_ENV) => Ok((TransportChoice::Rdma(devices), None)),
        "rdma" if flag(lookup, FORCE_TCP_ENV) => Ok((
            TransportChoice::Tcp,
            Some(format!("{FORCE_TCP_ENV} is set: using TCP")),
        )),
        "rdma" => Ok((TransportChoice::RdmaOrTcp(devices), None)),
        other => Err(format!(
            "protocol {other:?} is not supported by Tern; use \"rdma\" (falls back to TCP), \"tcp\" or \"shm\" (same-host peers over shared memory, the rest over TCP)"
        )),
    }
}

/// A device list as Mooncake's `device_name` gives it: comma (or space) separated, empty
/// meaning every device. A build without RDMA has no devices to name.
pub(crate) fn parse_devices(list: &str) -> Vec<String> {
    #[cfg(feature = "rdma")]
    return tern_transport_rdma::topology::parse_device_list(list);
    #[cfg(not(feature = "rdma"))]
    {
        let _ = list;
        Vec::new()
    }
}

/// [`rpc_ports`], or the default range and the reason the environment was refused.
pub(crate) fn rpc_ports_or_default(lookup: Lookup<'_>) -> (PortChoice, Option<String>) {
    match rpc_ports(lookup) {
        Ok(ports) => (ports, None),
        Err(reason) => (
            PortChoice::Range(DEFAULT_RPC_PORTS.0, DEFAULT_RPC_PORTS.1),
            Some(format!(
                "{reason}; using {}-{}",
                DEFAULT_RPC_PORTS.0, DEFAULT_RPC_PORTS.1
            )),
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| vars.get(name).cloned()
    }

    #[test]
    fn connection_strings_follow_initialize_ext() {
        assert_eq!(metadata_conn("P2PHANDSHAKE", "etcd"), "P2PHANDSHAKE");
        assert_eq!(
            metadata_conn("127.0.0.1:2379", "etcd"),
            "etcd://127.0.0.1:2379"
        );
        assert_eq!(
            metadata_conn("127.0.0.1:8080/metadata", "http"),
            "http://127.0.0.1:8080/metadata"
        );
        assert_eq!(metadata_conn("etcd://h:1", "http"), "etcd://h:1");
        assert_eq!(metadata_conn("h:1", ""), "h:1");
    }

    #[test]
    fn rpc_ports_come_from_the_environment() {
        assert_eq!(rpc_ports(&env(&[])), Ok(PortChoice::Range(15000, 17000)));
        assert_eq!(
            rpc_ports(&env(&[
                ("MC_MIN_RPC_PORT", "20000"),
                ("MC_MAX_RPC_PORT", "20000")
            ])),
            Ok(PortChoice::Range(20000, 20000))
        );
        assert_eq!(
            rpc_ports(&env(&[("MC_MIN_PRC_PORT", "16000")])),
            Ok(PortChoice::Range(16000, 17000))
        );
        assert!(
            rpc_ports(&env(&[("MC_MIN_RPC_PORT", "18000")]))
                .unwrap_err()
                .contains("above")
        );
        assert!(
            rpc_ports(&env(&[("MC_MAX_RPC_PORT", "70000")]))
                .unwrap_err()
                .contains("MC_MAX_RPC_PORT")
        );
    }

    #[test]
    fn transfer_timeout_is_at_least_five_seconds() {
        assert_eq!(
            mooncake_transfer_timeout(&env(&[])),
            Duration::from_secs(30)
        );
        assert_eq!(
            mooncake_transfer_timeout(&env(&[("MC_TRANSFER_TIMEOUT", "1")])),
            Duration::from_secs(5)
        );
        assert_eq!(
            mooncake_transfer_timeout(&env(&[("MC_TRANSFER_TIMEOUT", "12")])),
            Duration::from_secs(12)
        );
        assert_eq!(
            mooncake_transfer_timeout(&env(&[("MC_TRANSFER_TIMEOUT", "soon")])),
            Duration::from_secs(30)
        );
    }

    #[test]
    #[cfg(feature = "rdma")]
    fn protocols_follow_mooncakes_auto_discovery() {
        let none = env(&[]);
        assert_eq!(
            mooncake_transport("rdma", "", true, &none).unwrap().0,
            TransportChoice::RdmaOrTcp(vec![])
        );
        assert_eq!(
            mooncake_transport("rdma", "mlx5_0, mlx5_1,mlx5_0", true, &none)
                .unwrap()
                .0,
            TransportChoice::RdmaOrTcp(vec!["mlx5_0".into(), "mlx5_1".into()])
        );
        assert_eq!(
            mooncake_transport("tcp", "mlx5_0", true, &none).unwrap().0,
            TransportChoice::Tcp
        );
        assert_eq!(
            mooncake_transport("shm", "", true, &none).unwrap().0,
            TransportChoice::Shm
        );
        let forced_tcp = env(&[(FORCE_TCP_ENV, "1")]);
        let (choice, why) = mooncake_transport("rdma", "", true, &forced_tcp).unwrap();
        assert_eq!(choice, TransportChoice::Tcp);
        assert!(why.unwrap().contains(FORCE_TCP_ENV));
        assert_eq!(
            mooncake_transport("rdma", "", true, &env(&[(FORCE_TCP_ENV, "0")]))
                .unwrap()
                .0,
            TransportChoice::RdmaOrTcp(vec![])
        );
        let forced_hca = env(&[(FORCE_HCA_ENV, "1"), (FORCE_TCP_ENV, "1")]);
        assert_eq!(
            mooncake_transport("rdma", "rxe0", true, &forced_hca)
                .unwrap()
                .0,
            TransportChoice::Rdma(vec!["rxe0".into()])
        );
        assert_eq!(
            mooncake_transport("rdma", "", false, &none).unwrap().0,
            TransportChoice::Tcp
        );
        assert!(
            mooncake_transport("nvlink", "", true, &none)
                .unwrap_err()
                .contains("nvlink")
        );
    }
}
