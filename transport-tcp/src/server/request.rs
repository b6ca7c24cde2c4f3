//! The admission path of one request: the range pinned against registered,
//! remote-accessible memory before a byte moves, then the bytes copied.

use std::io::{self, Read, Write};

use tern_memreg::{MemoryRegistry, RegionIo, RegionPin, Stage};
use tern_metadata::auth;

use crate::wire::{Header, OP_READ, OP_WRITE, Status};

/// The body of a rejected write is read and thrown away to keep the stream in step, up to
/// this size; a larger one closes the connection instead.
pub(super) const MAX_DRAIN: u64 = 256 << 20;

/// What [`serve_request`] did with a request the connection survives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOutcome {
    /// Sent this many bytes of registered memory.
    Read(u64),
    /// Took this many bytes into registered memory.
    Wrote(u64),
    /// Refused the range, told the peer so, and kept the stream in step.
    Rejected,
}

/// The server's one admission check: the request's range pinned in registered memory that
/// peers may reach, with its address and size; else why not.
pub(super) fn admit(
    header: &Header,
    registry: &MemoryRegistry,
) -> Result<(RegionPin, usize, usize), String> {
    usize::try_from(header.size)
        .ok()
        .zip(usize::try_from(header.addr).ok())
        .ok_or_else(|| "address or size beyond this machine's address space".to_owned())
        .and_then(|(size, addr)| {
            registry
                .pin_remote(addr, size)
                .map_err(|e| e.to_string())
                .map(|pin| (pin, addr, size))
        })
}

/// Serves one request whose header has been read from `conn`: admits it against the
/// registered, remote-accessible memory of `registry` (the server's only admission check) and
/// moves its bytes over `conn` (device memory through `stage`'s pinned buffers, the same
/// admission for both kinds). `Ok` (with what it did) to go on with the next request; `Err`
/// with the reason to close the connection. What the server runs for every request, public
/// so that it can be fuzzed without a socket.
pub fn serve_request<C: RegionIo + Read + Write>(
    conn: &mut C,
    header: &Header,
    registry: &MemoryRegistry,
    stage: &mut Stage,
) -> Result<RequestOutcome, String> {
    let op = header.operation();
    if op != OP_READ && op != OP_WRITE {
        if header.size.to_le_bytes() == auth::MAGIC {
            return Err(
                "the peer wants to authenticate with a cluster secret and this node has none"
                    .into(),
            );
        }
        return Err(format!("unknown opcode {:#04x}", header.opcode));
    }
    let pin = admit(header, registry);
    let io = |e: io::Error| format!("{e} during a {} byte transfer", header.size);
    let status_len = header.status_len();
    let ok = Status::Ok.encode_padded();
    match (op, pin) {
        (OP_READ, Ok((pin, addr, size))) => {
            stage
                .write_prefixed_to(&pin, &ok[..status_len], addr, size, conn)
                .map_err(io)?;
            Ok(RequestOutcome::Read(header.size))
        }
        (_, Ok((pin, addr, size))) => {
            stage.read_exact_from(&pin, addr, size, conn).map_err(io)?;
            conn.write_all(&ok[..status_len]).map_err(io)?;
            Ok(RequestOutcome::Wrote(header.size))
        }
        (_, Err(reason)) if !header.is_v2() => Err(format!(
            "v1 request rejected ({reason}); v1 cannot signal it"
        )),
        (OP_READ, Err(reason)) => {
            tracing::debug!(
                "rejecting read at {:#x}+{}: {reason}",
                header.addr,
                header.size
            );
            conn.write_all(&Status::AddressRejected.encode_padded()[..status_len])
                .map_err(io)?;
            Ok(RequestOutcome::Rejected)
        }
        (_, Err(reason)) => {
            if header.size > MAX_DRAIN {
                return Err(format!(
                    "rejected write of {} bytes is too large to drain ({reason})",
                    header.size
                ));
            }
            tracing::debug!(
                "rejecting write at {:#x}+{}: {reason}",
                header.addr,
                header.size
            );
            let drained = io::copy(&mut conn.take(header.size), &mut io::sink()).map_err(io)?;
            if drained != header.size {
                return Err("peer closed during a rejected write".into());
            }
            conn.write_all(&Status::AddressRejected.encode_padded()[..status_len])
                .map_err(io)?;
            Ok(RequestOutcome::Rejected)
        }
    }
}
