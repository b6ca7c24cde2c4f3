//! What a node advertises and how it binds: port choices, random binding in a range, the
//! host and port of a name, the advertised address.

use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::time::{SystemTime, UNIX_EPOCH};

/// Environment variable that fixes the advertised address (as in Mooncake).
pub const BIND_ADDRESS_ENV: &str = "MC_TCP_BIND_ADDRESS";

/// The default port range for the handshake RPC and the TCP data port (Mooncake's).
pub const DEFAULT_PORT_RANGE: (u16, u16) = (15000, 17000);

/// How many random ports are tried before giving up on a range.
pub const BIND_ATTEMPTS: usize = 500;

/// Where a listener binds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortChoice {
    /// Exactly this port (0 = any port the kernel picks).
    Fixed(u16),
    /// A random free port in `[lo, hi]`, retrying on EADDRINUSE.
    Range(u16, u16),
}

impl Default for PortChoice {
    fn default() -> Self {
        Self::Range(DEFAULT_PORT_RANGE.0, DEFAULT_PORT_RANGE.1)
    }
}

/// Binds a TCP listener on `ip` as `ports` says.
pub fn bind_listener(ip: IpAddr, ports: PortChoice) -> io::Result<TcpListener> {
    match ports {
        PortChoice::Fixed(port) => TcpListener::bind(SocketAddr::new(ip, port)),
        PortChoice::Range(lo, hi) => {
            if lo > hi || lo == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("bad port range {lo}-{hi}"),
                ));
            }
            let span = u64::from(hi - lo) + 1;
            let mut seed = random_seed();
            let mut last = io::Error::from(io::ErrorKind::AddrInUse);
            for _ in 0..BIND_ATTEMPTS {
                seed = xorshift(seed);
                let port = lo + (seed % span) as u16;
                match TcpListener::bind(SocketAddr::new(ip, port)) {
                    Ok(listener) => return Ok(listener),
                    Err(e) if e.kind() == io::ErrorKind::AddrInUse => last = e,
                    Err(e) => return Err(e),
                }
            }
            Err(io::Error::new(
                last.kind(),
                format!("no free port in {lo}-{hi} on {ip} after {BIND_ATTEMPTS} attempts"),
            ))
        }
    }
}

fn random_seed() -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    let stack_addr = &nanos as *const u64 as u64;
    (nanos ^ u64::from(std::process::id()).rotate_left(32) ^ stack_addr) | 1
}

fn xorshift(mut x: u64) -> u64 {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    x
}

/// The host part of `host:port`, `[v6]:port` or a bare host.
pub fn host_part(name: &str) -> &str {
    if let Some(rest) = name.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match name.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.parse::<u16>().is_ok() => host,
        _ => name,
    }
}

/// Splits `host:port`; `None` when there is no valid port.
pub fn split_host_port(name: &str) -> Option<(&str, u16)> {
    let (host, port) = name.rsplit_once(':')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = port.parse().ok()?;
    (!host.is_empty()).then_some((host, port))
}

/// The address a node advertises: `configured` (builder, or `MC_TCP_BIND_ADDRESS`) when set;
/// else the host part of `local_server_name` when that is an IP address; else the first
/// up, non-loopback IPv4 interface address (IPv6 if there is no IPv4), as Mooncake does.
pub fn advertised_ip(configured: Option<&str>, local_server_name: &str) -> io::Result<IpAddr> {
    if let Some(addr) = configured.filter(|a| !a.is_empty()) {
        return addr.parse().map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("advertised address {addr:?} is not an IP address"),
            )
        });
    }
    if let Ok(ip) = host_part(local_server_name).parse::<IpAddr>() {
        return Ok(ip);
    }
    first_non_loopback_ip()
}

fn first_non_loopback_ip() -> io::Result<IpAddr> {
    let interfaces = if_addrs::get_if_addrs()?;
    let candidates: Vec<IpAddr> = interfaces
        .iter()
        .filter(|i| !i.is_loopback() && i.is_oper_up())
        .map(|i| i.ip())
        .filter(|ip| !ip.is_unspecified())
        .collect();
    candidates
        .iter()
        .find(|ip| ip.is_ipv4())
        .or_else(|| candidates.first())
        .copied()
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("no non-loopback interface is up; set {BIND_ADDRESS_ENV}"),
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    #[test]
    fn host_parts() {
        assert_eq!(host_part("127.0.0.1:15000"), "127.0.0.1");
        assert_eq!(host_part("node-a"), "node-a");
        assert_eq!(host_part("[::1]:80"), "::1");
        assert_eq!(host_part("::1"), "::1");
        assert_eq!(
            split_host_port("127.0.0.1:15000"),
            Some(("127.0.0.1", 15000))
        );
        assert_eq!(split_host_port("node"), None);
        assert_eq!(split_host_port(":5"), None);
        assert_eq!(split_host_port("h:99999"), None);
    }

    #[test]
    fn advertised_address_prefers_configuration_then_the_server_name() {
        assert_eq!(
            advertised_ip(Some("127.0.0.2"), "10.1.1.1:5").unwrap(),
            IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2))
        );
        assert_eq!(
            advertised_ip(None, "127.0.0.3:5").unwrap(),
            IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3))
        );
        assert!(advertised_ip(Some("not-an-ip"), "x").is_err());
        if let Ok(ip) = advertised_ip(None, "a-host-name") {
            assert!(!ip.is_loopback());
        }
    }

    #[test]
    fn range_binding_retries_past_ports_in_use() {
        let ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let first = bind_listener(ip, PortChoice::Range(17990, 17991)).unwrap();
        let second = bind_listener(ip, PortChoice::Range(17990, 17991)).unwrap();
        assert_ne!(first.local_addr().unwrap(), second.local_addr().unwrap());
        // The range is now full: the third bind gives up with a clear error.
        let err = bind_listener(ip, PortChoice::Range(17990, 17991)).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse);
        assert!(bind_listener(ip, PortChoice::Range(5, 4)).is_err());
    }
}
