//! The frames themselves: what each says, and the kind byte that names it on the wire.

use super::{FABRIC_HANDLE_LEN, IPC_HANDLE_LEN, NONCE_LEN};

/// One piece of a device buffer as the owner hands it out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceChunk {
    /// Its start in the owner's address space.
    pub base: u64,
    /// Its length.
    pub len: u64,
    /// How the peer reaches it.
    pub handle: ChunkHandle,
}

/// How a peer reaches a [`DeviceChunk`] (kind byte 0, 1 or 2 on the wire).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkHandle {
    /// Its physical memory comes as the next descriptor of the answer (VMM memory).
    Descriptor,
    /// A CUDA IPC handle of the whole allocation (`cuMemAlloc` memory).
    Ipc([u8; IPC_HANDLE_LEN]),
    /// A fabric handle of its physical memory (VMM memory whose chunks allow no
    /// descriptor), imported without one.
    Fabric([u8; FABRIC_HANDLE_LEN]),
}

/// What one Open found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opened {
    /// The buffer `[addr, addr + len)` lives in a memfd of `map_len` bytes, attached.
    Memfd {
        /// Start of the registered buffer in the owner's address space.
        addr: u64,
        /// Its length.
        len: u64,
        /// The memfd's size (at least `len`).
        map_len: u64,
    },
    /// The buffer `[addr, addr + len)` is other memory: reach it by cross-memory attach
    /// under a lease.
    Plain {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// The range is not inside a registered, remote-accessible buffer.
    Rejected(String),
    /// The buffer is memory this transport does not carry (device memory): the slice goes
    /// to the next transport.
    Declined {
        /// Start of the buffer.
        addr: u64,
        /// Its length.
        len: u64,
        /// Why.
        reason: String,
    },
    /// The buffer `[addr, addr + len)` is device memory of the GPU with PCI bus ID `bus_id`:
    /// map these chunks of it (those from the one holding the asked-for start) and copy with
    /// the GPU. One descriptor comes along for each chunk without an IPC handle, in order.
    Device {
        /// Start of the registered buffer.
        addr: u64,
        /// Its length.
        len: u64,
        /// The GPU's PCI bus ID (device ordinals differ between processes).
        bus_id: String,
        /// The chunks, in address order.
        chunks: Vec<DeviceChunk>,
    },
}

impl Opened {
    /// Descriptors that come with this answer.
    pub fn descriptors(&self) -> usize {
        match self {
            Self::Memfd { .. } => 1,
            Self::Device { chunks, .. } => chunks
                .iter()
                .filter(|c| c.handle == ChunkHandle::Descriptor)
                .count(),
            _ => 0,
        }
    }
}

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Client → server, first.
    Hello {
        /// [`MAGIC`](super::MAGIC).
        magic: [u8; 8],
        /// Protocol version.
        version: u16,
        /// What the server is to write at its probe address.
        nonce: [u8; NONCE_LEN],
        /// The client's segment.
        client_segment: String,
        /// The segment the client wants.
        server_segment: String,
    },
    /// Server → client, the answer to Hello.
    Welcome {
        /// Protocol version.
        version: u16,
        /// Where in the server the nonce now is.
        probe_addr: u64,
        /// The server's segment.
        segment: String,
    },
    /// Client → server: which buffer holds `[addr, addr + len)`, and how to reach it.
    Open {
        /// Request ID.
        id: u64,
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// Server → client.
    Opened {
        /// The Open's ID.
        id: u64,
        /// What it found.
        outcome: Opened,
    },
    /// Client → server: pin these ranges while they are moved by cross-memory attach.
    Lease {
        /// Lease ID.
        id: u64,
        /// `(addr, len)` each.
        ranges: Vec<(u64, u64)>,
    },
    /// Server → client: which ranges are pinned (in order).
    Leased {
        /// The Lease's ID.
        id: u64,
        /// One per range.
        granted: Vec<bool>,
    },
    /// Client → server: the lease's ranges are no longer touched.
    Release {
        /// Lease ID.
        id: u64,
    },
    /// Server → client: the memfd buffer at `addr` is being unregistered; stop using it.
    Revoke {
        /// Revocation ID.
        id: u64,
        /// Start of the buffer.
        addr: u64,
    },
    /// Client → server: nothing touches the revoked buffer any more.
    Revoked {
        /// Revocation ID.
        id: u64,
    },
    /// Server → client: bad input; the connection closes.
    Refused {
        /// Why.
        reason: String,
    },
}

pub(super) const HELLO: u8 = 1;
pub(super) const OPEN: u8 = 2;
pub(super) const LEASE: u8 = 3;
pub(super) const RELEASE: u8 = 4;
pub(super) const REVOKED: u8 = 5;
pub(super) const WELCOME: u8 = 0x81;
pub(super) const OPENED: u8 = 0x82;
pub(super) const LEASED: u8 = 0x83;
pub(super) const REVOKE: u8 = 0x84;
pub(super) const REFUSED: u8 = 0x85;

/// Every kind byte a frame has.
#[cfg(test)]
pub(super) const KINDS: [u8; 10] = [
    HELLO, OPEN, LEASE, RELEASE, REVOKED, WELCOME, OPENED, LEASED, REVOKE, REFUSED,
];

impl Frame {
    /// The kind byte of the frame's header.
    pub(super) fn kind(&self) -> u8 {
        match self {
            Self::Hello { .. } => HELLO,
            Self::Open { .. } => OPEN,
            Self::Lease { .. } => LEASE,
            Self::Release { .. } => RELEASE,
            Self::Revoked { .. } => REVOKED,
            Self::Welcome { .. } => WELCOME,
            Self::Opened { .. } => OPENED,
            Self::Leased { .. } => LEASED,
            Self::Revoke { .. } => REVOKE,
            Self::Refused { .. } => REFUSED,
        }
    }
}

/// The name of the frame of kind `kind`, for errors; `None` for a byte no frame has.
pub(super) fn name(kind: u8) -> Option<&'static str> {
    Some(match kind {
        HELLO => "Hello",
        OPEN => "Open",
        LEASE => "Lease",
        RELEASE => "Release",
        REVOKED => "Revoked",
        WELCOME => "Welcome",
        OPENED => "Opened",
        LEASED => "Leased",
        REVOKE => "Revoke",
        REFUSED => "Refused",
        _ => return None,
    })
}

/// One frame of every kind and every outcome, for the tests of encoding and reading.
#[cfg(test)]
pub(super) fn samples() -> Vec<Frame> {
    use super::MAGIC;
    vec![
        Frame::Hello {
            magic: MAGIC,
            version: 1,
            nonce: [7; NONCE_LEN],
            client_segment: "127.0.0.1:15001".into(),
            server_segment: "node-é".into(),
        },
        Frame::Welcome {
            version: 1,
            probe_addr: 0x7fff_0000,
            segment: "s".into(),
        },
        Frame::Open {
            id: 1,
            addr: 2,
            len: 3,
        },
        Frame::Opened {
            id: 4,
            outcome: Opened::Memfd {
                addr: 5,
                len: 6,
                map_len: 8192,
            },
        },
        Frame::Opened {
            id: 4,
            outcome: Opened::Plain { addr: 5, len: 6 },
        },
        Frame::Opened {
            id: 4,
            outcome: Opened::Rejected("not registered".into()),
        },
        Frame::Opened {
            id: 4,
            outcome: Opened::Declined {
                addr: 5,
                len: 6,
                reason: "device".into(),
            },
        },
        Frame::Opened {
            id: 4,
            outcome: Opened::Device {
                addr: 5,
                len: 6,
                bus_id: "0000:3b:00.0".into(),
                chunks: vec![
                    DeviceChunk {
                        base: 4,
                        len: 2 << 20,
                        handle: ChunkHandle::Ipc([9; IPC_HANDLE_LEN]),
                    },
                    DeviceChunk {
                        base: 4 + (2 << 20),
                        len: 2 << 20,
                        handle: ChunkHandle::Descriptor,
                    },
                    DeviceChunk {
                        base: 4 + (4 << 20),
                        len: 2 << 20,
                        handle: ChunkHandle::Fabric([7; FABRIC_HANDLE_LEN]),
                    },
                ],
            },
        },
        Frame::Lease {
            id: 9,
            ranges: vec![(1, 2), (3, 4)],
        },
        Frame::Leased {
            id: 9,
            granted: vec![true, false],
        },
        Frame::Release { id: 9 },
        Frame::Revoke { id: 10, addr: 11 },
        Frame::Revoked { id: 10 },
        Frame::Refused {
            reason: "no".into(),
        },
    ]
}
