//! The listener, and each connection's life: registered with the owner (for revocations)
//! while it lives, told why when it is refused, closed for revocations to see.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use parking_lot::{Condvar, Mutex};
use tern_metadata::net::{Acceptor, ServeLimits, Served};

use super::{Conn, Owner, in_process, serve};
use crate::wire::{self, Frame};

/// The listener and its connections; stopped and joined on drop.
pub(crate) struct Server {
    owner: Arc<Owner>,
    acceptor: Option<Acceptor<UnixListener>>,
}

impl Server {
    /// Binds `owner.socket` in the abstract namespace and serves it.
    pub(crate) fn start(owner: Arc<Owner>) -> std::io::Result<Self> {
        let addr = SocketAddr::from_abstract_name(owner.socket.as_bytes())?;
        let listener = UnixListener::bind_addr(&addr)?;
        let limits = ServeLimits {
            max_connections: owner.max_inbound,
            max_opening: owner.max_inbound,
            exchange_timeout: owner.exchange_timeout,
            write_timeout: owner.revoke_timeout,
            ..ServeLimits::default()
        };
        let serving = owner.clone();
        let acceptor = Acceptor::serve_on(
            listener,
            "tern-shm-accept",
            limits,
            Arc::new(move |served: Served<UnixStream>| serve_peer(&serving, &served)),
        )?;
        in_process::enter(&owner);
        Ok(Self {
            owner,
            acceptor: Some(acceptor),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        in_process::leave(&self.owner.socket);
        self.owner.stop.store(true, Ordering::Release);
        // Cuts every connection and joins its thread.
        drop(self.acceptor.take());
    }
}

/// Runs one peer's connection: registered with the owner (for revocations) while it lives.
fn serve_peer(owner: &Arc<Owner>, served: &Served<UnixStream>) {
    let Ok(write_half) = served.stream.try_clone() else {
        return;
    };
    let conn = Arc::new(Conn {
        stream: write_half,
        state: Mutex::default(),
        changed: Condvar::new(),
    });
    owner.conns.lock().push(conn.clone());
    if let Err(reason) = serve::serve(owner, &conn, served)
        && !owner.stop.load(Ordering::Acquire)
        && !served.stopping()
    {
        let peer = conn.state.lock().peer.clone();
        tracing::warn!("shm peer {peer:?} refused: {reason}");
        let _ = wire::send(&conn.stream, &Frame::Refused { reason }.encode());
    }
    let mut state = conn.state.lock();
    state.closed = true;
    conn.changed.notify_all();
    drop(state);
    let _ = conn.stream.shutdown(std::net::Shutdown::Both);
    owner.conns.lock().retain(|c| !Arc::ptr_eq(c, &conn));
}
