//! The one accept loop every listener runs: connections accepted, set up, limited, served on
//! a thread each, and all of them cut and joined when the listener goes.

use std::io;
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::slots::{Conn, Opening, Phase, Table, also};
use super::{Listen, ServeLimits, ServeStream, Served};

/// One accept loop for every listener: the connection limits of [`ServeLimits`] (a budget
/// for connections past their opening, a separate one for connections still in it, and the
/// exchange timeout), connections set up the same way ([`Served`]), one thread each, and on
/// drop every connection cut and every thread joined, so that nothing a listener started
/// outlives it. The accept thread never waits for a slot: a connection over the opening
/// budget takes the place of the oldest still opening, and a thread of its own closes every
/// connection whose opening outlasts the exchange timeout.
pub struct Acceptor<L: Listen = TcpListener> {
    local: L::Addr,
    table: Arc<Table>,
    thread: Option<JoinHandle<()>>,
    reaper: Option<JoinHandle<()>>,
}

impl<L: Listen> std::fmt::Debug for Acceptor<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Acceptor")
            .field("local", &self.local)
            .field("name", &self.table.name)
            .finish_non_exhaustive()
    }
}

/// What an [`Acceptor`] runs for each connection.
pub type Handler<S = TcpStream> = Arc<dyn Fn(Served<S>) + Send + Sync>;

impl Acceptor {
    /// Serves `listener` on a thread named `name`, running `handler` on a thread of its own
    /// for each connection, within `limits`.
    pub fn serve(
        listener: TcpListener,
        name: &str,
        limits: ServeLimits,
        handler: Handler,
    ) -> io::Result<Self> {
        Self::serve_on(listener, name, limits, handler)
    }
}

impl<L: Listen> Acceptor<L> {
    /// [`Acceptor::serve`] for any listener (a Unix socket's, say).
    pub fn serve_on(
        listener: L,
        name: &str,
        limits: ServeLimits,
        handler: Handler<L::Stream>,
    ) -> io::Result<Self> {
        let local = listener.address()?;
        let table = Arc::new(Table {
            slots: Mutex::default(),
            changed: Condvar::new(),
            limits,
            name: name.to_owned(),
            stop: Arc::new(AtomicBool::new(false)),
        });
        let reaping = table.clone();
        let reaper = std::thread::Builder::new()
            .name(format!("{name}-reap"))
            .spawn(move || reap(&reaping))?;
        let serving = table.clone();
        let conn_name = format!("{name}-conn");
        let thread = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || accept_loop(&listener, &conn_name, &serving, &handler));
        let mut acceptor = Self {
            local,
            table,
            thread: None,
            reaper: Some(reaper),
        };
        // On an error the reaper is stopped and joined by the drop.
        acceptor.thread = Some(thread?);
        Ok(acceptor)
    }

    /// The bound address.
    pub fn local_addr(&self) -> L::Addr {
        self.local.clone()
    }
}

fn accept_loop<L: Listen>(
    listener: &L,
    conn_name: &str,
    table: &Arc<Table>,
    handler: &Handler<L::Stream>,
) {
    let limits = table.limits;
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    let mut next_id = 0u64;
    loop {
        let accepted = listener.next_connection();
        if table.stop.load(Ordering::Acquire) {
            break;
        }
        threads.retain(|t| !t.is_finished());
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!("{conn_name}: accept failed: {e}");
                continue;
            }
        };
        let handle = match stream.prepare(limits.write_timeout) {
            Ok(handle) => handle,
            Err(e) => {
                tracing::warn!("{conn_name}: setting up the connection from {peer}: {e}");
                continue;
            }
        };
        next_id += 1;
        let id = next_id;
        let deadline = Instant::now() + limits.exchange_timeout;
        {
            let mut slots = table.slots.lock();
            if slots.opening >= limits.max_opening.max(1)
                && let Some(oldest) = slots.conns.iter().position(|c| c.phase == Phase::Opening)
            {
                if let Some(more) = slots.displaced.note(1) {
                    tracing::warn!(
                        "{}: {} connections still opening; closing the oldest, from {}, for \
                         the one from {peer}{}",
                        table.name,
                        limits.max_opening,
                        slots.conns[oldest].peer,
                        also(more - 1)
                    );
                }
                slots.cut(oldest);
            }
            slots.conns.push(Conn {
                id,
                phase: Phase::Opening,
                deadline,
                peer: peer.clone(),
                cut: Box::new(move || handle.cut()),
            });
            slots.opening += 1;
        }
        table.changed.notify_all();
        let served = Served {
            stream,
            peer,
            limits,
            stop: table.stop.clone(),
            opening: Opening {
                table: table.clone(),
                id,
                deadline,
                done: AtomicBool::new(false),
            },
        };
        let (handler, table_here) = (handler.clone(), table.clone());
        let spawned = std::thread::Builder::new()
            .name(conn_name.to_owned())
            .spawn(move || {
                handler(served);
                table_here.slots.lock().remove(id);
                table_here.changed.notify_all();
            });
        match spawned {
            Ok(thread) => threads.push(thread),
            Err(e) => {
                tracing::warn!("{conn_name}: cannot start a thread: {e}");
                table.slots.lock().remove(id);
            }
        }
    }
    // Stopping: cut every connection and wait for its thread, so that no peer is served once
    // the listener is gone.
    for conn in table.slots.lock().conns.iter() {
        (conn.cut)();
    }
    table.changed.notify_all();
    for thread in threads {
        let _ = thread.join();
    }
}

/// Closes every connection still opening past its deadline, as the deadlines come, until
/// the listener stops.
fn reap(table: &Table) {
    let mut slots = table.slots.lock();
    loop {
        if table.stop.load(Ordering::Acquire) {
            return;
        }
        let now = Instant::now();
        let mut expired = 0;
        let mut next: Option<Instant> = None;
        for at in 0..slots.conns.len() {
            let (phase, deadline) = (slots.conns[at].phase, slots.conns[at].deadline);
            if phase != Phase::Opening {
                continue;
            }
            if deadline <= now {
                slots.cut(at);
                expired += 1;
            } else {
                next = Some(next.map_or(deadline, |n| n.min(deadline)));
            }
        }
        if expired > 0 {
            if let Some(closed) = slots.expired.note(expired) {
                tracing::warn!(
                    "{}: closed {closed} connection(s) that did not complete their opening \
                     within {:?} of being accepted",
                    table.name,
                    table.limits.exchange_timeout
                );
            }
            table.changed.notify_all();
        }
        let wait = next.map_or(Duration::from_secs(1), |n| n.saturating_duration_since(now));
        table.changed.wait_for(&mut slots, wait);
    }
}

impl<L: Listen> Drop for Acceptor<L> {
    fn drop(&mut self) {
        self.table.stop.store(true, Ordering::Release);
        // Under the lock, so that the reaper is either waiting (and woken) or sees the flag.
        drop(self.table.slots.lock());
        self.table.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            L::wake(&self.local);
            let _ = thread.join();
        }
        if let Some(reaper) = self.reaper.take() {
            let _ = reaper.join();
        }
    }
}
