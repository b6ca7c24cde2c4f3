//! Every link of this node, by peer segment and socket: made on first use, one at a time; a
//! peer found not to be same-host is left alone for a while; the links' states for the
//! report.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tern_engine::{PeerSegment, TransportContext};

use super::Link;
use super::attach::Attach;
use super::connect::Unreached;
use crate::declines::DeviceDeclines;
use crate::identity::{Extension, check_socket_name};

/// How long a peer found not to be same-host is left alone before it is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(10);

/// What became of an attempt to reach a peer.
pub(crate) enum Reach {
    Up(Arc<Link>),
    /// Not same-host after all (or not usable): hand its slices to the next transport.
    Decline(String),
    /// The peer is gone: its slices fail.
    Gone(String),
}

enum Entry {
    Up(Arc<Link>),
    Down { reason: String, retry_at: Instant },
}

/// Every link of this node, by peer segment and socket.
pub(crate) struct Links {
    pub(super) context: TransportContext,
    pub(super) connect_timeout: Duration,
    pub(super) io_timeout: Duration,
    table: Mutex<HashMap<(String, String), Entry>>,
    pub(super) readers: Mutex<Vec<JoinHandle<()>>>,
    /// Connection set-up, one at a time (it is rare, and a peer then gets one link).
    connecting: Mutex<()>,
    /// Slices declined for device memory, on every link.
    pub(crate) device_declines: Arc<DeviceDeclines>,
}

/// A peer's state, for the transport's report.
pub(crate) struct LinkReport {
    pub(crate) peer: String,
    pub(crate) up: bool,
    pub(crate) mapped: usize,
    pub(crate) bytes: u64,
    pub(crate) slices: u64,
    pub(crate) error: Option<String>,
}

impl Links {
    /// This engine's registry.
    pub(crate) fn registry(&self) -> &tern_memreg::MemoryRegistry {
        &self.context.registry
    }

    pub(crate) fn new(
        context: TransportContext,
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> Self {
        Self {
            context,
            connect_timeout,
            io_timeout,
            table: Mutex::default(),
            readers: Mutex::default(),
            connecting: Mutex::new(()),
            device_declines: Arc::default(),
        }
    }

    /// The link to `peer`, made now if there is none.
    pub(crate) fn reach(&self, peer: &PeerSegment) -> Reach {
        let key = match link_key(peer) {
            Ok(key) => key,
            Err(why) => return Reach::Decline(why),
        };
        if let Some(reach) = self.known(&key) {
            return reach;
        }
        let _one = self.connecting.lock();
        if let Some(reach) = self.known(&key) {
            return reach;
        }
        let (entry, reach) = match self.connect(peer, &key.1) {
            Ok(link) => (Entry::Up(link.clone()), Reach::Up(link)),
            Err(Unreached::NotSameHost(reason)) => (
                Entry::Down {
                    reason: reason.clone(),
                    retry_at: Instant::now() + RETRY_AFTER,
                },
                Reach::Decline(reason),
            ),
            Err(Unreached::Gone(reason)) => {
                self.table.lock().remove(&key);
                return Reach::Gone(reason);
            }
        };
        self.table.lock().insert(key, entry);
        reach
    }

    /// Whether a link to `peer` is up and maps the buffer holding `addr..addr + len`
    /// (without connecting: a hint for how to share out a submit).
    pub(crate) fn maps(&self, peer: &PeerSegment, addr: u64, len: u64) -> bool {
        match link_key(peer).ok().and_then(|key| self.known(&key)) {
            Some(Reach::Up(link)) => link.mapping(addr, len).is_some(),
            _ => false,
        }
    }

    fn known(&self, key: &(String, String)) -> Option<Reach> {
        let table = self.table.lock();
        match table.get(key)? {
            Entry::Up(link) if link.alive.load(Ordering::Acquire) => Some(Reach::Up(link.clone())),
            Entry::Up(_) => None,
            Entry::Down { reason, retry_at } if Instant::now() < *retry_at => {
                Some(Reach::Decline(reason.clone()))
            }
            Entry::Down { .. } => None,
        }
    }

    /// Every link's state.
    pub(crate) fn report(&self) -> Vec<LinkReport> {
        let table = self.table.lock();
        table
            .iter()
            .map(|((peer, _), entry)| match entry {
                Entry::Up(link) => {
                    let (bytes, slices) = link.moved.get();
                    LinkReport {
                        peer: peer.clone(),
                        up: link.alive.load(Ordering::Acquire),
                        mapped: link.maps.read().len(),
                        bytes,
                        slices,
                        error: link
                            .ended
                            .lock()
                            .clone()
                            .or_else(|| link.refusal.lock().clone())
                            .or_else(|| match &link.attach {
                                Attach::Refused(why) => {
                                    Some(format!("no cross-memory attach: {why}"))
                                }
                                Attach::Process(_) | Attach::SameProcess(_) => None,
                            }),
                    }
                }
                Entry::Down { reason, .. } => LinkReport {
                    peer: peer.clone(),
                    up: false,
                    mapped: 0,
                    bytes: 0,
                    slices: 0,
                    error: Some(reason.clone()),
                },
            })
            .collect()
    }

    /// Closes every link and waits for their readers.
    pub(crate) fn close(&self) {
        let links: Vec<Arc<Link>> = self
            .table
            .lock()
            .drain()
            .filter_map(|(_, e)| match e {
                Entry::Up(link) => Some(link),
                Entry::Down { .. } => None,
            })
            .collect();
        for link in &links {
            let _ = link.stream.shutdown(std::net::Shutdown::Both);
        }
        for reader in self.readers.lock().drain(..) {
            let _ = reader.join();
        }
        for link in links {
            link.end("this node shut down");
        }
    }
}

/// What a link to `peer` is known by: its segment name and the socket its descriptor names
/// (a peer that starts again gets a new socket, and so a new link); why not, without a
/// usable `tern.shm` or with a socket name that is not one Tern binds (never dialed).
fn link_key(peer: &PeerSegment) -> Result<(String, String), String> {
    let ext = peer
        .desc
        .tern
        .get("shm")
        .and_then(Extension::from_json)
        .ok_or("the peer publishes no shared-memory socket")?;
    check_socket_name(&ext.socket).map_err(|e| e.to_string())?;
    Ok((peer.name.clone(), ext.socket))
}
