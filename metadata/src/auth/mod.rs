//! Peers that prove who they are: a challenge–response on a shared cluster secret that opens
//! every handshake-RPC, TCP data and shared-memory connection when a secret is configured,
//! before either side reads or serves anything else. Without a secret none of this runs and a connection speaks
//! plain Mooncake, byte for byte, so Mooncake nodes keep working with Tern nodes.
//!
//! # The exchange
//!
//! ```text
//!  client (connects)                                      server (accepts)
//!    Hello     { channel, Nc, claims }       ───────▶
//!                                            ◀───────     Challenge { channel, Ns, MACs }
//!    checks MACs; on a mismatch it closes
//!    Proof     { channel, MACc }             ───────▶
//!                                                         checks MACc; on a mismatch it closes
//!    plain Mooncake frames from here on, both ways
//!
//!  T    = version | channel | Nc | Ns | client segment | server segment | server endpoint
//!  MACs = HMAC-SHA256(secret, "tern-auth server" | T)
//!  MACc = HMAC-SHA256(secret, "tern-auth client" | T)
//! ```
//!
//! `Nc` and `Ns` are 32 fresh bytes from the operating system's random source, one pair per
//! connection. Each side's MAC covers the other side's fresh nonce, so a recorded Challenge or
//! Proof is worthless on any other connection (no replay). The two labels differ, so a
//! server's MAC is never a client's proof (no reflection). Version and channel are covered, so
//! a frame cannot be moved from a data connection to an RPC one or to another version.
//!
//! Both MACs also bind what each side believes the connection joins ([`Claims`]): the client's
//! segment name and the segment it wants (as the Hello carries them), and the server's
//! endpoint — as the *client* dialed it in the client's MACs, as the *server* advertises it in
//! the server's. A party without the secret that gets an honest node to dial it (by writing
//! the metadata store, or from the path) and relays the frames to the real node therefore
//! fails: the node it dialed is not the node that answers, so the MACs differ, and the client
//! refuses the Challenge before it proves anything. The server also refuses at once a Hello
//! that names another segment or endpoint than its own, saying which.
//!
//! The server proves itself first, so that a client never sends a request — for a TCP write,
//! memory contents — to a node that does not know the secret. MACs are compared in constant
//! time, and a mismatch is refused without saying which byte differed.
//!
//! # Frames
//!
//! Integers are single bytes:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 8 | magic `TERNAUTH` |
//! | 8 | 1 | version, 2 |
//! | 9 | 1 | channel: 1 handshake RPC, 2 TCP data, 3 same-host shared memory (Unix socket) |
//! | 10 | 6 | zero |
//! | 16 | 1 | kind: `H` (0x48) Hello, `C` (0x43) Challenge, `P` (0x50) Proof |
//! | 17 | 7 | zero |
//! | 24 | | Hello: `Nc` (32), three lengths (client segment, server segment, dialed endpoint; 0–255 each), then those UTF-8 strings — 59 bytes and the strings; Challenge: `Ns` (32), `MACs` (32) — 88; Proof: `MACc` (32) — 56 |
//!
//! Why this header: a node without a secret takes a Hello for its own first frame and refuses
//! it at once rather than waiting for more bytes — as a handshake RPC frame its length
//! (`TERNAUTH` read as a little-endian u64, about 5·10^18) exceeds every limit, and as a TCP
//! data header its opcode byte (offset 16) is no Mooncake opcode. The other way round, a
//! secured node decides on the first 8 bytes, so a plain frame (a plain Probe is 11 bytes) is
//! refused at once, not after a timeout. [`decode_frame`] reads any frame from bytes and is
//! the function to fuzz.
//!
//! # What it does not do
//!
//! It authenticates the two ends of a connection; it does not encrypt or sign the bytes that
//! follow. An attacker on the path who forwards the connection untouched, rather than dialing
//! either side itself, can read or change the bytes after the exchange. Against that, run Tern
//! on a network you trust or inside an encrypted overlay (WireGuard, IPsec).

mod error;
mod exchange;
mod frame;
mod secret;
mod stream;

pub use error::AuthError;
pub use exchange::{ClientExchange, Identity, ServerExchange};
pub use frame::{
    AuthFrame, CHALLENGE_LEN, Channel, Claims, FrameKind, HEADER_LEN, HELLO_FIXED_LEN,
    HELLO_MAX_LEN, MAC_LEN, MAGIC, MAX_CLAIM_LEN, NONCE_LEN, PROOF_LEN, VERSION, decode_frame,
    hello_len,
};
pub use secret::{CLUSTER_SECRET_ENV, CLUSTER_SECRET_FILE_ENV, ClusterSecret};
pub use stream::{EXCHANGE_TIMEOUT, client_handshake, server_handshake};

/// What the tests of every part of the exchange share: two nodes and their secrets.
#[cfg(test)]
mod fixtures {
    use super::*;

    pub(super) fn secret(s: &str) -> ClusterSecret {
        ClusterSecret::new(s.as_bytes()).unwrap()
    }

    /// Node a dialing node b at 127.0.0.1:15001.
    pub(super) fn claims() -> Claims {
        Claims {
            client_segment: "node-a".into(),
            server_segment: "node-b".into(),
            dialed: "127.0.0.1:15001".into(),
        }
    }

    /// Node b.
    pub(super) fn me() -> Identity {
        Identity {
            segment: "node-b".into(),
            endpoint: "127.0.0.1:15001".into(),
        }
    }

    /// A whole exchange; the client's verdict on the challenge, and the server's on the proof.
    pub(super) fn exchange(
        client_key: &ClusterSecret,
        claims: Claims,
        server_key: &ClusterSecret,
        me: &Identity,
    ) -> Result<Claims, AuthError> {
        let (client, hello) = ClientExchange::start(client_key, Channel::Rpc, claims)?;
        let (server, challenge) = ServerExchange::accept(server_key, Channel::Rpc, me, &hello)?;
        let proof = client.finish(&challenge)?;
        server.finish(&proof)
    }
}
