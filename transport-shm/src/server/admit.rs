//! A peer's opening, before anything is served: the kernel must say it runs as this node's
//! user (`SO_PEERCRED`), it proves the cluster secret when there is one, and its hello has
//! the right magic and version and asks for this node's segment. The whole opening is
//! bounded by the exchange timeout.

use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use tern_memreg::shm::peer_credentials;
use tern_metadata::auth::{self, Channel, Identity};
use tern_metadata::net::Served;

use super::{Conn, Owner};
use crate::identity::VERSION;
use crate::wire::{Frame, FrameReader, MAGIC, NONCE_LEN};

/// What an admitted peer's opening left: the reader (it may hold what the peer sent after
/// its hello) and the nonce its hello asked to find at the probe address.
pub(super) struct Admitted {
    pub(super) reader: FrameReader,
    pub(super) nonce: [u8; NONCE_LEN],
}

/// Bounds the next read of the opening by what is left of it (the acceptor closes the
/// connection at its end in any case; this makes the read fail first, with a reason).
fn bound_opening(served: &Served<UnixStream>) -> Result<(), String> {
    let left = served.opening_deadline().map_or(Duration::ZERO, |d| {
        d.saturating_duration_since(Instant::now())
    });
    if left.is_zero() {
        return Err("the opening took longer than the exchange timeout".into());
    }
    served
        .stream
        .set_read_timeout(Some(left))
        .map_err(|e| format!("setting up the connection: {e}"))
}

/// Takes a peer's opening: `Ok(None)` when it left before its hello or the listener has no
/// slot for it, `Err(reason)` (which it is told) when it may not be served.
pub(super) fn admit(
    owner: &Owner,
    conn: &Conn,
    served: &Served<UnixStream>,
) -> Result<Option<Admitted>, String> {
    let stream = &served.stream;
    bound_opening(served)?;
    let cred = peer_credentials(stream).map_err(|e| format!("SO_PEERCRED: {e}"))?;
    if cred.uid != owner.uid {
        return Err(format!(
            "process {} runs as uid {}; this node shares memory with uid {} only",
            cred.pid, cred.uid, owner.uid
        ));
    }
    if let Some(secret) = &owner.secret {
        let me = Identity {
            segment: owner.segment.clone(),
            endpoint: owner.socket.clone(),
        };
        let mut io = stream;
        if let Err(e) = auth::server_handshake(&mut io, secret, Channel::Shm, &me) {
            // Nothing was served; the peer did not prove the secret.
            let _ = stream.shutdown(std::net::Shutdown::Both);
            return Err(format!("cluster-secret exchange: {e}"));
        }
    }
    let mut reader = FrameReader::new();
    bound_opening(served)?;
    let hello = match reader.next(stream) {
        Ok(Some(frame)) => frame,
        Ok(None) => return Ok(None),
        Err(e) => return Err(format!("reading its hello: {e}")),
    };
    let Frame::Hello {
        magic,
        version,
        nonce,
        client_segment,
        server_segment,
    } = hello
    else {
        return Err("the first frame is not a hello".into());
    };
    if magic != MAGIC {
        return Err("the hello has the wrong magic".into());
    }
    if u64::from(version) != VERSION {
        return Err(format!("version {version}; this node speaks {VERSION}"));
    }
    conn.state.lock().peer.clone_from(&client_segment);
    if !server_segment.is_empty() && server_segment != owner.segment {
        return Err(format!(
            "it wants segment {server_segment:?}, but this is {:?}",
            owner.segment
        ));
    }
    // The hello is in: the connection takes a slot of the listener's, or is closed.
    if !served.opened() {
        return Ok(None);
    }
    Ok(Some(Admitted { reader, nonce }))
}
