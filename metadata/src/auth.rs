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

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Environment variable holding the cluster secret itself (its bytes, as given).
pub const CLUSTER_SECRET_ENV: &str = "TERN_CLUSTER_SECRET";
/// Environment variable naming a file whose contents are the cluster secret (one trailing
/// newline is dropped), to keep the secret out of the environment and process listings.
pub const CLUSTER_SECRET_FILE_ENV: &str = "TERN_CLUSTER_SECRET_FILE";

/// First 8 bytes of every frame.
pub const MAGIC: [u8; 8] = *b"TERNAUTH";
/// The version this build speaks (1 bound only the nonces).
pub const VERSION: u8 = 2;
/// Bytes before a frame's body.
pub const HEADER_LEN: usize = 24;
/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of a MAC (HMAC-SHA256).
pub const MAC_LEN: usize = 32;
/// Bytes of a Hello before its strings.
pub const HELLO_FIXED_LEN: usize = HEADER_LEN + NONCE_LEN + 3;
/// Longest string a Hello carries (each of its three).
pub const MAX_CLAIM_LEN: usize = 255;
/// Longest Hello.
pub const HELLO_MAX_LEN: usize = HELLO_FIXED_LEN + 3 * MAX_CLAIM_LEN;
/// Bytes of a Challenge.
pub const CHALLENGE_LEN: usize = HEADER_LEN + NONCE_LEN + MAC_LEN;
/// Bytes of a Proof.
pub const PROOF_LEN: usize = HEADER_LEN + MAC_LEN;
/// Longest a server waits for each frame of the exchange: a peer that says nothing holds a
/// connection slot no longer than this.
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(5);

const KIND_OFFSET: usize = 16;
const SERVER_LABEL: &[u8] = b"tern-auth server";
const CLIENT_LABEL: &[u8] = b"tern-auth client";

/// Which kind of connection an exchange opens; covered by the MACs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Channel {
    /// The handshake RPC (Metadata, Notify, Probe, Connection).
    Rpc = 1,
    /// A TCP data connection.
    TcpData = 2,
    /// A same-host shared-memory connection (a Unix socket).
    Shm = 3,
}

impl Channel {
    /// The channel for a wire byte.
    pub fn from_byte(byte: u8) -> Option<Self> {
        match byte {
            1 => Some(Self::Rpc),
            2 => Some(Self::TcpData),
            3 => Some(Self::Shm),
            _ => None,
        }
    }
}

/// The three frames of the exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Client → server: the client's nonce.
    Hello = b'H',
    /// Server → client: the server's nonce and its MAC.
    Challenge = b'C',
    /// Client → server: the client's MAC.
    Proof = b'P',
}

impl FrameKind {
    /// The kind for a wire byte.
    pub fn from_byte(byte: u8) -> Option<Self> {
        match byte {
            b'H' => Some(Self::Hello),
            b'C' => Some(Self::Challenge),
            b'P' => Some(Self::Proof),
            _ => None,
        }
    }

    /// The length of a whole frame of this kind (a Hello's without its strings).
    pub fn frame_len(self) -> usize {
        match self {
            Self::Hello => HELLO_FIXED_LEN,
            Self::Challenge => CHALLENGE_LEN,
            Self::Proof => PROOF_LEN,
        }
    }
}

/// What a client says and believes about the connection it opens: carried in its Hello and
/// bound into both MACs.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Claims {
    /// The client's own segment name (empty when it has none).
    pub client_segment: String,
    /// The segment the client wants to reach (empty: whichever answers at the endpoint).
    pub server_segment: String,
    /// The endpoint the client dialed, `ip:port` as the connection's peer address prints.
    pub dialed: String,
}

/// Who a server is: what it binds into its MACs and checks a Hello's claims against.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Identity {
    /// Its segment name.
    pub segment: String,
    /// The endpoint it advertises for this listener, `ip:port`.
    pub endpoint: String,
}

/// A decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AuthFrame {
    /// Client → server.
    Hello {
        /// The connection's kind.
        channel: Channel,
        /// The client's fresh nonce.
        nonce: [u8; NONCE_LEN],
        /// Who it is and whom it wants.
        claims: Claims,
    },
    /// Server → client.
    Challenge {
        /// The connection's kind.
        channel: Channel,
        /// The server's fresh nonce.
        nonce: [u8; NONCE_LEN],
        /// The server's proof over both nonces.
        mac: [u8; MAC_LEN],
    },
    /// Client → server.
    Proof {
        /// The connection's kind.
        channel: Channel,
        /// The client's proof over both nonces.
        mac: [u8; MAC_LEN],
    },
}

impl AuthFrame {
    /// Its kind.
    pub fn kind(&self) -> FrameKind {
        match self {
            Self::Hello { .. } => FrameKind::Hello,
            Self::Challenge { .. } => FrameKind::Challenge,
            Self::Proof { .. } => FrameKind::Proof,
        }
    }

    /// Its channel.
    pub fn channel(&self) -> Channel {
        match self {
            Self::Hello { channel, .. }
            | Self::Challenge { channel, .. }
            | Self::Proof { channel, .. } => *channel,
        }
    }

    /// The frame's bytes (reserved bytes zero). A Hello's strings are cut to
    /// [`MAX_CLAIM_LEN`] bytes (at a character boundary).
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = vec![0u8; self.kind().frame_len()];
        bytes[..8].copy_from_slice(&MAGIC);
        bytes[8] = VERSION;
        bytes[9] = self.channel() as u8;
        bytes[KIND_OFFSET] = self.kind() as u8;
        let body = &mut bytes[HEADER_LEN..];
        match self {
            Self::Hello { nonce, claims, .. } => {
                body[..NONCE_LEN].copy_from_slice(nonce);
                let strings = claim_strings(claims);
                for (i, text) in strings.iter().enumerate() {
                    body[NONCE_LEN + i] = text.len() as u8;
                }
                for text in strings {
                    bytes.extend_from_slice(text.as_bytes());
                }
            }
            Self::Challenge { nonce, mac, .. } => {
                body[..NONCE_LEN].copy_from_slice(nonce);
                body[NONCE_LEN..].copy_from_slice(mac);
            }
            Self::Proof { mac, .. } => body.copy_from_slice(mac),
        }
        bytes
    }
}

/// The three strings of a Hello, in wire order, each cut to [`MAX_CLAIM_LEN`] bytes.
fn claim_strings(claims: &Claims) -> [&str; 3] {
    [
        &claims.client_segment,
        &claims.server_segment,
        &claims.dialed,
    ]
    .map(|text| cut(text, MAX_CLAIM_LEN))
}

/// The longest prefix of `text` of at most `max` bytes that ends on a character boundary.
fn cut(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The whole length of the Hello whose first bytes are `bytes`, once its string lengths have
/// arrived (`None` before).
pub fn hello_len(bytes: &[u8]) -> Option<usize> {
    let lengths = bytes.get(HEADER_LEN + NONCE_LEN..HELLO_FIXED_LEN)?;
    Some(HELLO_FIXED_LEN + lengths.iter().map(|&l| usize::from(l)).sum::<usize>())
}

/// Decodes one whole frame; any other length, or any header field out of place, is an error.
/// Total over all inputs: it never panics (the fuzz target).
pub fn decode_frame(bytes: &[u8]) -> Result<AuthFrame, AuthError> {
    if bytes.len() < MAGIC.len() || bytes[..MAGIC.len()] != MAGIC {
        return Err(AuthError::NotAuthFrame);
    }
    if bytes.len() < HEADER_LEN {
        return Err(AuthError::BadLength {
            expected: HEADER_LEN,
            got: bytes.len(),
        });
    }
    if bytes[8] != VERSION {
        return Err(AuthError::UnsupportedVersion(bytes[8]));
    }
    let channel = Channel::from_byte(bytes[9]).ok_or(AuthError::UnknownChannel(bytes[9]))?;
    let kind = FrameKind::from_byte(bytes[KIND_OFFSET])
        .ok_or(AuthError::UnknownKind(bytes[KIND_OFFSET]))?;
    let mut reserved = bytes[10..KIND_OFFSET]
        .iter()
        .chain(&bytes[KIND_OFFSET + 1..HEADER_LEN]);
    if reserved.any(|&b| b != 0) {
        return Err(AuthError::ReservedNotZero);
    }
    let expected = match kind {
        FrameKind::Hello => hello_len(bytes).unwrap_or(HELLO_FIXED_LEN),
        other => other.frame_len(),
    };
    if bytes.len() != expected {
        return Err(AuthError::BadLength {
            expected,
            got: bytes.len(),
        });
    }
    let body = &bytes[HEADER_LEN..];
    let take32 = |at: usize| {
        let mut out = [0u8; 32];
        out.copy_from_slice(&body[at..at + 32]);
        out
    };
    Ok(match kind {
        FrameKind::Hello => {
            let mut at = HELLO_FIXED_LEN;
            let mut text = |i: usize| {
                let len = usize::from(bytes[HEADER_LEN + NONCE_LEN + i]);
                let slice = &bytes[at..at + len];
                at += len;
                std::str::from_utf8(slice)
                    .map(str::to_owned)
                    .map_err(|_| AuthError::BadClaim)
            };
            let claims = Claims {
                client_segment: text(0)?,
                server_segment: text(1)?,
                dialed: text(2)?,
            };
            AuthFrame::Hello {
                channel,
                nonce: take32(0),
                claims,
            }
        }
        FrameKind::Challenge => AuthFrame::Challenge {
            channel,
            nonce: take32(0),
            mac: take32(NONCE_LEN),
        },
        FrameKind::Proof => AuthFrame::Proof {
            channel,
            mac: take32(0),
        },
    })
}

/// Why an exchange failed, or a secret could not be had.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// The secret given (or found in the environment or file) is empty; give at least one
    /// byte — 32 random bytes, e.g. `openssl rand -hex 32`, is what it should be.
    #[error("the cluster secret is empty")]
    EmptySecret,
    /// Both `TERN_CLUSTER_SECRET` and `TERN_CLUSTER_SECRET_FILE` are set; unset one.
    #[error("both {CLUSTER_SECRET_ENV} and {CLUSTER_SECRET_FILE_ENV} are set; set one")]
    TwoSecrets,
    /// The secret file could not be read; check the path and its permissions.
    #[error("reading the cluster secret from {path:?}: {source}")]
    SecretFile {
        /// The file.
        path: PathBuf,
        /// Why it could not be read.
        source: io::Error,
    },
    /// The operating system gave no random bytes for a nonce; nothing was sent.
    #[error("no random bytes from the operating system: {0}")]
    Random(String),
    /// The bytes do not start with `TERNAUTH`: the peer speaks plain Mooncake (it has no
    /// cluster secret, or is a Mooncake node), or is not a Tern node at all.
    #[error(
        "the peer sent a plain frame, not a Tern authentication frame (no cluster secret there?)"
    )]
    NotAuthFrame,
    /// A frame of the wrong length (cut short, or with bytes after its end).
    #[error("authentication frame of {got} bytes, expected {expected}")]
    BadLength {
        /// Bytes the frame must have.
        expected: usize,
        /// Bytes it had.
        got: usize,
    },
    /// The peer speaks another version of the exchange; upgrade the older node.
    #[error("authentication version {0} is not spoken here (this node speaks {VERSION})")]
    UnsupportedVersion(u8),
    /// The channel byte is none of RPC, TCP data, shared memory.
    #[error("unknown authentication channel {0}")]
    UnknownChannel(u8),
    /// The kind byte is none of Hello, Challenge, Proof.
    #[error("unknown authentication frame kind {0:#04x}")]
    UnknownKind(u8),
    /// Bytes that must be zero are not: not a frame this version writes.
    #[error("reserved bytes of an authentication frame are not zero")]
    ReservedNotZero,
    /// A Hello's strings are not UTF-8.
    #[error("an authentication hello whose names are not UTF-8")]
    BadClaim,
    /// The client wants another segment than this node's: its metadata points it at the wrong
    /// node (a stale or forged entry, or a relay). Check the metadata store.
    #[error("the peer wants segment {wanted:?}, but this is {here:?}")]
    NotThisSegment {
        /// The segment the client asked for.
        wanted: String,
        /// This node's segment.
        here: String,
    },
    /// The client dialed another endpoint than the one this node advertises: something
    /// between them forwards the connection (a relay, or address translation). Make the
    /// advertised address (`MC_TCP_BIND_ADDRESS`) the one peers dial.
    #[error("the peer dialed {dialed}, but this node is {here}")]
    NotThisEndpoint {
        /// The endpoint the client dialed.
        dialed: String,
        /// This node's advertised endpoint.
        here: String,
    },
    /// A well-formed frame arrived out of turn.
    #[error("expected an authentication {expected:?}, got a {got:?}")]
    UnexpectedFrame {
        /// What this side waited for.
        expected: FrameKind,
        /// What came.
        got: FrameKind,
    },
    /// A frame for another kind of connection (an RPC frame on a data connection or back).
    #[error("authentication frame for the {got:?} channel on a {expected:?} connection")]
    WrongChannel {
        /// This connection's channel.
        expected: Channel,
        /// The frame's.
        got: Channel,
    },
    /// The peer's MAC does not match: it has another cluster secret (or none), or replays a
    /// recorded exchange. Give both nodes the same secret.
    #[error(
        "the peer's proof does not match this node's cluster secret (another secret, or a replay)"
    )]
    BadProof,
    /// The peer closed the connection while this side waited for a frame. A node without a
    /// secret closes right after a Hello; one with another secret closes after the Challenge.
    #[error("{}", closed_reason(*waiting_for, *received))]
    PeerClosed {
        /// The frame this side waited for.
        waiting_for: FrameKind,
        /// Bytes of it that had arrived.
        received: usize,
    },
    /// The peer sent nothing (or not all of a frame) in time.
    #[error("the peer did not send its authentication {waiting_for:?} in time")]
    Timeout {
        /// The frame this side waited for.
        waiting_for: FrameKind,
    },
    /// The socket failed.
    #[error("authentication I/O: {0}")]
    Io(io::Error),
}

fn closed_reason(waiting_for: FrameKind, received: usize) -> String {
    match (waiting_for, received) {
        (FrameKind::Challenge, 0) => "the peer closed the connection instead of answering our \
            authentication hello: it runs without a cluster secret (a plain Mooncake or Tern \
            node), or refused us"
            .to_owned(),
        (FrameKind::Proof, 0) => "the peer closed the connection before proving it knows the \
            cluster secret (a peer with another secret refuses our challenge this way)"
            .to_owned(),
        (kind, received) => format!(
            "the peer closed the connection after {received} of the {} bytes of its \
             authentication {kind:?}",
            kind.frame_len()
        ),
    }
}

impl AuthError {
    /// Whether the peer connected and closed without sending a byte: a port probe or a
    /// listener's own wake-up, nothing to refuse or log.
    pub fn is_silent_close(&self) -> bool {
        matches!(
            self,
            Self::PeerClosed {
                waiting_for: FrameKind::Hello,
                received: 0
            }
        )
    }
}

/// The shared secret of a cluster. Cheap to clone; never printed.
#[derive(Clone)]
pub struct ClusterSecret {
    /// HMAC-SHA256 keyed with the secret, cloned for each MAC (the key schedule runs once).
    keyed: Hmac<Sha256>,
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

impl ClusterSecret {
    /// A secret from its bytes (any length but zero).
    pub fn new(secret: &[u8]) -> Result<Self, AuthError> {
        if secret.is_empty() {
            return Err(AuthError::EmptySecret);
        }
        // HMAC takes keys of any length; the error arm is unreachable but costs nothing.
        let keyed = Hmac::<Sha256>::new_from_slice(secret).map_err(|_| AuthError::EmptySecret)?;
        Ok(Self { keyed })
    }

    /// The secret in a file: its bytes, less one trailing `\n` or `\r\n`.
    pub fn from_file(path: &Path) -> Result<Self, AuthError> {
        let mut bytes = std::fs::read(path).map_err(|source| AuthError::SecretFile {
            path: path.to_owned(),
            source,
        })?;
        if bytes.ends_with(b"\n") {
            bytes.pop();
            if bytes.ends_with(b"\r") {
                bytes.pop();
            }
        }
        Self::new(&bytes)
    }

    /// The secret from `TERN_CLUSTER_SECRET` or the file named by `TERN_CLUSTER_SECRET_FILE`;
    /// `None` when neither is set. A variable that is set but empty is an error, not "no
    /// secret": a typo must not silently turn authentication off.
    pub fn from_env() -> Result<Option<Self>, AuthError> {
        let direct = std::env::var_os(CLUSTER_SECRET_ENV);
        let file = std::env::var_os(CLUSTER_SECRET_FILE_ENV);
        match (direct, file) {
            (Some(_), Some(_)) => Err(AuthError::TwoSecrets),
            (Some(secret), None) => Self::new(secret.as_encoded_bytes()).map(Some),
            (None, Some(path)) if path.is_empty() => Err(AuthError::EmptySecret),
            (None, Some(path)) => Self::from_file(Path::new(&path)).map(Some),
            (None, None) => Ok(None),
        }
    }

    fn mac_for(&self, label: &[u8], transcript: &Transcript<'_>) -> Hmac<Sha256> {
        let mut mac = self.keyed.clone();
        mac.update(label);
        mac.update(&[VERSION, transcript.channel as u8]);
        mac.update(transcript.client_nonce);
        mac.update(transcript.server_nonce);
        for text in [
            transcript.client_segment,
            transcript.server_segment,
            transcript.server_endpoint,
        ] {
            // Length-prefixed, so that no two transcripts run together into the same bytes.
            let text = cut(text, MAX_CLAIM_LEN);
            mac.update(&[text.len() as u8]);
            mac.update(text.as_bytes());
        }
        mac
    }

    fn sign(&self, label: &[u8], transcript: &Transcript<'_>) -> [u8; MAC_LEN] {
        let tag = self.mac_for(label, transcript).finalize().into_bytes();
        let mut out = [0u8; MAC_LEN];
        out.copy_from_slice(&tag);
        out
    }

    /// Constant-time comparison (`verify_slice` compares every byte whatever differs).
    fn check(
        &self,
        label: &[u8],
        transcript: &Transcript<'_>,
        tag: &[u8; MAC_LEN],
    ) -> Result<(), AuthError> {
        self.mac_for(label, transcript)
            .verify_slice(tag)
            .map_err(|_| AuthError::BadProof)
    }

    fn keyed_parts(&self, label: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut mac = self.keyed.clone();
        mac.update(label);
        for part in parts {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac
    }

    /// A MAC over `parts` (each length-prefixed) under `label`, in hex: what sealed values in
    /// metadata stores carry ([`crate::seal`]).
    pub fn tag_hex(&self, label: &[u8], parts: &[&[u8]]) -> String {
        self.keyed_parts(label, parts)
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Whether `hex` is the MAC [`tag_hex`](Self::tag_hex) gives for `label` and `parts`,
    /// compared in constant time.
    pub fn tag_matches(&self, label: &[u8], parts: &[&[u8]], hex: &str) -> bool {
        from_hex(hex).is_some_and(|tag| self.keyed_parts(label, parts).verify_slice(&tag).is_ok())
    }
}

fn from_hex(hex: &str) -> Option<Vec<u8>> {
    if hex.len() != 2 * MAC_LEN || !hex.is_ascii() {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
        .collect()
}

/// What both MACs of one exchange cover.
struct Transcript<'a> {
    channel: Channel,
    client_nonce: &'a [u8; NONCE_LEN],
    server_nonce: &'a [u8; NONCE_LEN],
    client_segment: &'a str,
    server_segment: &'a str,
    /// On the client's side the endpoint it dialed; on the server's the one it advertises.
    server_endpoint: &'a str,
}

fn fresh_nonce() -> Result<[u8; NONCE_LEN], AuthError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|e| AuthError::Random(e.to_string()))?;
    Ok(nonce)
}

/// Decodes `bytes` as a frame of `kind` on `channel`.
fn expect_frame(bytes: &[u8], kind: FrameKind, channel: Channel) -> Result<AuthFrame, AuthError> {
    let frame = decode_frame(bytes)?;
    if frame.kind() != kind {
        return Err(AuthError::UnexpectedFrame {
            expected: kind,
            got: frame.kind(),
        });
    }
    if frame.channel() != channel {
        return Err(AuthError::WrongChannel {
            expected: channel,
            got: frame.channel(),
        });
    }
    Ok(frame)
}

/// The client's side of one exchange, without I/O: [`start`](Self::start) gives the Hello to
/// send, [`finish`](Self::finish) checks the server's Challenge and gives the Proof to send.
#[derive(Debug)]
pub struct ClientExchange {
    secret: ClusterSecret,
    channel: Channel,
    nonce: [u8; NONCE_LEN],
    claims: Claims,
}

impl ClientExchange {
    /// Starts an exchange making `claims`: returns it and the Hello to send.
    pub fn start(
        secret: &ClusterSecret,
        channel: Channel,
        claims: Claims,
    ) -> Result<(Self, Vec<u8>), AuthError> {
        Ok(Self::with_nonce(secret, channel, claims, fresh_nonce()?))
    }

    /// As [`start`](Self::start) with a given nonce (for tests and fuzzing; a real client
    /// needs a fresh one every time).
    pub fn with_nonce(
        secret: &ClusterSecret,
        channel: Channel,
        claims: Claims,
        nonce: [u8; NONCE_LEN],
    ) -> (Self, Vec<u8>) {
        let hello = AuthFrame::Hello {
            channel,
            nonce,
            claims: claims.clone(),
        }
        .encode();
        let exchange = Self {
            secret: secret.clone(),
            channel,
            nonce,
            claims,
        };
        (exchange, hello)
    }

    /// The client's fresh nonce.
    pub fn nonce(&self) -> &[u8; NONCE_LEN] {
        &self.nonce
    }

    /// Checks the server's Challenge against this client's claims and returns the Proof to
    /// send.
    pub fn finish(self, challenge: &[u8]) -> Result<Vec<u8>, AuthError> {
        let AuthFrame::Challenge { nonce, mac, .. } =
            expect_frame(challenge, FrameKind::Challenge, self.channel)?
        else {
            return Err(AuthError::NotAuthFrame);
        };
        let transcript = Transcript {
            channel: self.channel,
            client_nonce: &self.nonce,
            server_nonce: &nonce,
            client_segment: &self.claims.client_segment,
            server_segment: &self.claims.server_segment,
            server_endpoint: &self.claims.dialed,
        };
        self.secret.check(SERVER_LABEL, &transcript, &mac)?;
        let mac = self.secret.sign(CLIENT_LABEL, &transcript);
        Ok(AuthFrame::Proof {
            channel: self.channel,
            mac,
        }
        .encode())
    }
}

/// The server's side of one exchange, without I/O: [`accept`](Self::accept) reads the Hello
/// and gives the Challenge to send, [`finish`](Self::finish) checks the client's Proof.
#[derive(Debug)]
pub struct ServerExchange {
    secret: ClusterSecret,
    channel: Channel,
    client_nonce: [u8; NONCE_LEN],
    server_nonce: [u8; NONCE_LEN],
    claims: Claims,
    endpoint: String,
}

impl ServerExchange {
    /// Reads a client's Hello as the server `me`: returns the exchange and the Challenge to
    /// send. A Hello naming another segment or endpoint than `me` is refused here.
    pub fn accept(
        secret: &ClusterSecret,
        channel: Channel,
        me: &Identity,
        hello: &[u8],
    ) -> Result<(Self, Vec<u8>), AuthError> {
        let AuthFrame::Hello {
            nonce: client_nonce,
            claims,
            ..
        } = expect_frame(hello, FrameKind::Hello, channel)?
        else {
            return Err(AuthError::NotAuthFrame);
        };
        let here = cut(&me.segment, MAX_CLAIM_LEN);
        if !claims.server_segment.is_empty() && claims.server_segment != here {
            return Err(AuthError::NotThisSegment {
                wanted: claims.server_segment,
                here: me.segment.clone(),
            });
        }
        if !claims.dialed.is_empty() && claims.dialed != me.endpoint {
            return Err(AuthError::NotThisEndpoint {
                dialed: claims.dialed,
                here: me.endpoint.clone(),
            });
        }
        let server_nonce = fresh_nonce()?;
        let exchange = Self {
            secret: secret.clone(),
            channel,
            client_nonce,
            server_nonce,
            claims,
            endpoint: me.endpoint.clone(),
        };
        let mac = secret.sign(SERVER_LABEL, &exchange.transcript());
        let challenge = AuthFrame::Challenge {
            channel,
            nonce: server_nonce,
            mac,
        }
        .encode();
        Ok((exchange, challenge))
    }

    fn transcript(&self) -> Transcript<'_> {
        Transcript {
            channel: self.channel,
            client_nonce: &self.client_nonce,
            server_nonce: &self.server_nonce,
            client_segment: &self.claims.client_segment,
            server_segment: &self.claims.server_segment,
            server_endpoint: &self.endpoint,
        }
    }

    /// Checks the client's Proof; returns what the client claimed, now known to come from a
    /// holder of the secret that dialed this node.
    pub fn finish(self, proof: &[u8]) -> Result<Claims, AuthError> {
        let AuthFrame::Proof { mac, .. } = expect_frame(proof, FrameKind::Proof, self.channel)?
        else {
            return Err(AuthError::NotAuthFrame);
        };
        self.secret.check(CLIENT_LABEL, &self.transcript(), &mac)?;
        Ok(self.claims)
    }
}

/// Runs the client's side over a connected stream: sends the Hello, checks the Challenge,
/// sends the Proof. The caller bounds it with the stream's timeouts.
pub fn client_handshake<S: Read + Write>(
    stream: &mut S,
    secret: &ClusterSecret,
    channel: Channel,
    claims: Claims,
) -> Result<(), AuthError> {
    let (exchange, hello) = ClientExchange::start(secret, channel, claims)?;
    send(stream, &hello, FrameKind::Challenge)?;
    let mut challenge = [0u8; CHALLENGE_LEN];
    receive(stream, &mut challenge, FrameKind::Challenge, 0)?;
    let proof = exchange.finish(&challenge)?;
    // Were the server to refuse the proof, the caller's first read sees it close.
    send(stream, &proof, FrameKind::Proof)
}

/// Runs the server's side over an accepted stream as `me`: reads the Hello (refusing a plain
/// frame on its first 8 bytes), sends the Challenge, checks the Proof. `Ok` means the peer
/// knows the secret and dialed this node, and gives its claims; on `Err` nothing may be
/// served and the connection must be closed. The caller bounds it ([`EXCHANGE_TIMEOUT`]).
pub fn server_handshake<S: Read + Write>(
    stream: &mut S,
    secret: &ClusterSecret,
    channel: Channel,
    me: &Identity,
) -> Result<Claims, AuthError> {
    let mut hello = [0u8; HELLO_MAX_LEN];
    receive(stream, &mut hello[..MAGIC.len()], FrameKind::Hello, 0)?;
    if hello[..MAGIC.len()] != MAGIC {
        return Err(AuthError::NotAuthFrame);
    }
    receive(
        stream,
        &mut hello[MAGIC.len()..HELLO_FIXED_LEN],
        FrameKind::Hello,
        MAGIC.len(),
    )?;
    let len = hello_len(&hello[..HELLO_FIXED_LEN]).unwrap_or(HELLO_FIXED_LEN);
    receive(
        stream,
        &mut hello[HELLO_FIXED_LEN..len],
        FrameKind::Hello,
        HELLO_FIXED_LEN,
    )?;
    let (exchange, challenge) = ServerExchange::accept(secret, channel, me, &hello[..len])?;
    send(stream, &challenge, FrameKind::Proof)?;
    let mut proof = [0u8; PROOF_LEN];
    receive(stream, &mut proof, FrameKind::Proof, 0)?;
    exchange.finish(&proof)
}

fn closed(kind: io::ErrorKind) -> bool {
    matches!(
        kind,
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
    )
}

fn send(stream: &mut impl Write, frame: &[u8], next: FrameKind) -> Result<(), AuthError> {
    stream
        .write_all(frame)
        .and_then(|()| stream.flush())
        .map_err(|e| match e.kind() {
            kind if closed(kind) => AuthError::PeerClosed {
                waiting_for: next,
                received: 0,
            },
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                AuthError::Timeout { waiting_for: next }
            }
            _ => AuthError::Io(e),
        })
}

/// Fills `buf` with (part of) a frame of `kind`, of which `already` bytes came before.
fn receive(
    stream: &mut impl Read,
    buf: &mut [u8],
    kind: FrameKind,
    already: usize,
) -> Result<(), AuthError> {
    let mut filled = 0;
    while filled < buf.len() {
        match stream.read(&mut buf[filled..]) {
            Ok(0) => {
                return Err(AuthError::PeerClosed {
                    waiting_for: kind,
                    received: already + filled,
                });
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if closed(e.kind()) => {
                return Err(AuthError::PeerClosed {
                    waiting_for: kind,
                    received: already + filled,
                });
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(AuthError::Timeout { waiting_for: kind });
            }
            Err(e) => return Err(AuthError::Io(e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> ClusterSecret {
        ClusterSecret::new(s.as_bytes()).unwrap()
    }

    /// Node a dialing node b at 127.0.0.1:15001.
    fn claims() -> Claims {
        Claims {
            client_segment: "node-a".into(),
            server_segment: "node-b".into(),
            dialed: "127.0.0.1:15001".into(),
        }
    }

    /// Node b.
    fn me() -> Identity {
        Identity {
            segment: "node-b".into(),
            endpoint: "127.0.0.1:15001".into(),
        }
    }

    /// A whole exchange; the client's verdict on the challenge, and the server's on the proof.
    fn exchange(
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

    #[test]
    fn frames_have_the_documented_layout_and_round_trip() {
        let hello = AuthFrame::Hello {
            channel: Channel::TcpData,
            nonce: [7; NONCE_LEN],
            claims: claims(),
        };
        let bytes = hello.encode();
        assert_eq!(bytes.len(), 59 + 6 + 6 + 15);
        assert_eq!(&bytes[..8], b"TERNAUTH");
        assert_eq!(&bytes[8..10], &[2, 2]);
        assert_eq!(&bytes[10..16], &[0; 6]);
        assert_eq!(bytes[16], b'H');
        assert_eq!(&bytes[17..24], &[0; 7]);
        assert_eq!(&bytes[24..56], &[7; 32]);
        assert_eq!(&bytes[56..59], &[6, 6, 15]);
        assert_eq!(&bytes[59..], b"node-anode-b127.0.0.1:15001");
        assert_eq!(hello_len(&bytes[..59]), Some(bytes.len()));
        assert_eq!(decode_frame(&bytes).unwrap(), hello);
        let bare = AuthFrame::Hello {
            channel: Channel::Rpc,
            nonce: [0; NONCE_LEN],
            claims: Claims::default(),
        };
        assert_eq!(bare.encode().len(), HELLO_FIXED_LEN);
        assert_eq!(decode_frame(&bare.encode()).unwrap(), bare);

        let challenge = AuthFrame::Challenge {
            channel: Channel::Rpc,
            nonce: [1; NONCE_LEN],
            mac: [2; MAC_LEN],
        };
        let bytes = challenge.encode();
        assert_eq!((bytes.len(), bytes[16]), (88, b'C'));
        assert_eq!(decode_frame(&bytes).unwrap(), challenge);
        let proof = AuthFrame::Proof {
            channel: Channel::Rpc,
            mac: [3; MAC_LEN],
        };
        let bytes = proof.encode();
        assert_eq!((bytes.len(), bytes[16]), (56, b'P'));
        assert_eq!(decode_frame(&bytes).unwrap(), proof);
    }

    #[test]
    fn long_names_are_cut_at_a_character_boundary_and_bad_utf8_is_refused() {
        let long = Claims {
            client_segment: "é".repeat(200),
            ..Claims::default()
        };
        let bytes = AuthFrame::Hello {
            channel: Channel::Rpc,
            nonce: [0; NONCE_LEN],
            claims: long,
        }
        .encode();
        assert_eq!(bytes[56], 254, "255 would split a two-byte character");
        let AuthFrame::Hello { claims, .. } = decode_frame(&bytes).unwrap() else {
            panic!("not a hello")
        };
        assert_eq!(claims.client_segment, "é".repeat(127));
        let mut bad = bytes.clone();
        bad[59] = 0xFF;
        assert!(matches!(decode_frame(&bad), Err(AuthError::BadClaim)));
    }

    #[test]
    fn a_hello_is_refused_at_once_by_nodes_without_a_secret() {
        let hello = AuthFrame::Hello {
            channel: Channel::Rpc,
            nonce: [0xFF; NONCE_LEN],
            claims: claims(),
        }
        .encode();
        // As a handshake RPC frame: a length far beyond Mooncake's 128 MiB ceiling.
        let mut len = [0u8; 8];
        len.copy_from_slice(&hello[..8]);
        assert!(u64::from_le_bytes(len) > 128 << 20);
        // As a TCP data header: the opcode byte is neither READ nor WRITE, v1 or v2.
        assert!(![0x00, 0x01, 0x80, 0x81].contains(&hello[16]));
    }

    #[test]
    fn bad_frames_are_typed_errors() {
        let good = AuthFrame::Proof {
            channel: Channel::Rpc,
            mac: [9; MAC_LEN],
        }
        .encode();
        assert!(matches!(decode_frame(&[]), Err(AuthError::NotAuthFrame)));
        assert!(matches!(
            decode_frame(b"TERNAUT"),
            Err(AuthError::NotAuthFrame)
        ));
        let mooncake_probe = [&3u64.to_le_bytes()[..], &[3, b'{', b'}']].concat();
        assert!(matches!(
            decode_frame(&mooncake_probe),
            Err(AuthError::NotAuthFrame)
        ));
        assert!(matches!(
            decode_frame(&good[..20]),
            Err(AuthError::BadLength {
                expected: HEADER_LEN,
                got: 20
            })
        ));
        assert!(matches!(
            decode_frame(&good[..PROOF_LEN - 1]),
            Err(AuthError::BadLength { expected: 56, .. })
        ));
        let long = [&good[..], &[0]].concat();
        assert!(matches!(
            decode_frame(&long),
            Err(AuthError::BadLength { got: 57, .. })
        ));
        let with = |at: usize, value: u8| {
            let mut bytes = good.clone();
            bytes[at] = value;
            decode_frame(&bytes)
        };
        assert!(matches!(with(8, 1), Err(AuthError::UnsupportedVersion(1))));
        assert!(matches!(with(9, 4), Err(AuthError::UnknownChannel(4))));
        assert!(matches!(with(16, b'X'), Err(AuthError::UnknownKind(b'X'))));
        assert!(matches!(with(12, 1), Err(AuthError::ReservedNotZero)));
        assert!(matches!(with(23, 1), Err(AuthError::ReservedNotZero)));
        // A Challenge header on a Proof-sized frame: the length must match the kind.
        assert!(matches!(
            with(16, b'C'),
            Err(AuthError::BadLength { expected: 88, .. })
        ));
        // A Hello whose strings are shorter than its lengths say.
        let hello = AuthFrame::Hello {
            channel: Channel::Rpc,
            nonce: [1; NONCE_LEN],
            claims: claims(),
        }
        .encode();
        assert!(matches!(
            decode_frame(&hello[..hello.len() - 1]),
            Err(AuthError::BadLength { .. })
        ));
    }

    #[test]
    fn the_same_secret_completes_and_each_side_proves_itself() {
        let key = secret("s3cret");
        let proven = exchange(&key, claims(), &key, &me()).unwrap();
        assert_eq!(proven, claims());
        // Wanting "any segment" and not saying what was dialed still binds the endpoint.
        let open = Claims {
            server_segment: String::new(),
            ..claims()
        };
        exchange(&key, open, &key, &me()).unwrap();
    }

    #[test]
    fn another_secret_is_refused_on_both_sides() {
        let (ours, theirs) = (secret("ours"), secret("theirs"));
        // A client with another secret refuses the server's challenge...
        assert!(matches!(
            exchange(&theirs, claims(), &ours, &me()),
            Err(AuthError::BadProof)
        ));
        // ...and a client that answers anyway (with its own key) is refused by the server.
        let (client, hello) = ClientExchange::start(&ours, Channel::Rpc, claims()).unwrap();
        let (server, challenge) =
            ServerExchange::accept(&ours, Channel::Rpc, &me(), &hello).unwrap();
        let AuthFrame::Challenge { nonce, .. } = decode_frame(&challenge).unwrap() else {
            panic!("not a challenge")
        };
        let claims = claims();
        let transcript = Transcript {
            channel: Channel::Rpc,
            client_nonce: client.nonce(),
            server_nonce: &nonce,
            client_segment: &claims.client_segment,
            server_segment: &claims.server_segment,
            server_endpoint: &claims.dialed,
        };
        let forged = AuthFrame::Proof {
            channel: Channel::Rpc,
            mac: theirs.sign(CLIENT_LABEL, &transcript),
        };
        assert!(matches!(
            server.finish(&forged.encode()),
            Err(AuthError::BadProof)
        ));
    }

    #[test]
    fn a_relayed_exchange_fails_because_the_node_dialed_is_not_the_node_that_answers() {
        let key = secret("k");
        // The metadata store points node a at a relay (10.9.9.9:15001), which forwards every
        // frame to the real node b; node a binds the endpoint it dialed, node b its own.
        let at_relay = Claims {
            dialed: "10.9.9.9:15001".into(),
            ..claims()
        };
        let (client, hello) = ClientExchange::start(&key, Channel::TcpData, at_relay).unwrap();
        // Forwarded untouched, node b refuses at once: the client dialed somewhere else.
        assert!(matches!(
            ServerExchange::accept(&key, Channel::TcpData, &me(), &hello),
            Err(AuthError::NotThisEndpoint { dialed, here })
                if dialed == "10.9.9.9:15001" && here == "127.0.0.1:15001"
        ));
        // The relay rewrites the Hello to name node b's endpoint: node b answers, but its MAC
        // covers its own endpoint, which is not the one node a dialed, so node a refuses the
        // challenge and never proves anything the relay could pass on.
        let AuthFrame::Hello { nonce, claims, .. } = decode_frame(&hello).unwrap() else {
            panic!("not a hello")
        };
        let rewritten = AuthFrame::Hello {
            channel: Channel::TcpData,
            nonce,
            claims: Claims {
                dialed: me().endpoint,
                ..claims
            },
        }
        .encode();
        let (_, challenge) =
            ServerExchange::accept(&key, Channel::TcpData, &me(), &rewritten).unwrap();
        assert!(matches!(
            client.finish(&challenge),
            Err(AuthError::BadProof)
        ));
    }

    #[test]
    fn a_hello_for_another_segment_is_refused_naming_both() {
        let key = secret("k");
        let elsewhere = Claims {
            server_segment: "node-c".into(),
            ..claims()
        };
        assert!(matches!(
            exchange(&key, elsewhere, &key, &me()),
            Err(AuthError::NotThisSegment { wanted, here }) if wanted == "node-c" && here == "node-b"
        ));
    }

    #[test]
    fn recorded_frames_do_not_replay() {
        let key = secret("k");
        // A recorded exchange...
        let (client, hello) = ClientExchange::with_nonce(&key, Channel::TcpData, claims(), [5; 32]);
        let (server, challenge) =
            ServerExchange::accept(&key, Channel::TcpData, &me(), &hello).unwrap();
        let proof = client.finish(&challenge).unwrap();
        server.finish(&proof).unwrap();
        // ...replayed to the server: the same Hello draws a fresh challenge, so the old proof
        // no longer fits.
        let (server, fresh) =
            ServerExchange::accept(&key, Channel::TcpData, &me(), &hello).unwrap();
        assert_ne!(fresh, challenge);
        assert!(matches!(server.finish(&proof), Err(AuthError::BadProof)));
        // ...replayed to a client: its fresh nonce is not the one the old challenge covers.
        let (client, _) = ClientExchange::start(&key, Channel::TcpData, claims()).unwrap();
        assert!(matches!(
            client.finish(&challenge),
            Err(AuthError::BadProof)
        ));
        // ...and the server's own MAC reflected back as a client proof.
        let (client, hello) = ClientExchange::start(&key, Channel::TcpData, claims()).unwrap();
        let (server, challenge) =
            ServerExchange::accept(&key, Channel::TcpData, &me(), &hello).unwrap();
        let AuthFrame::Challenge { mac, .. } = decode_frame(&challenge).unwrap() else {
            panic!("not a challenge")
        };
        let reflected = AuthFrame::Proof {
            channel: Channel::TcpData,
            mac,
        };
        assert!(matches!(
            server.finish(&reflected.encode()),
            Err(AuthError::BadProof)
        ));
        drop(client);
    }

    #[test]
    fn frames_do_not_cross_channels_or_turns() {
        let key = secret("k");
        let (client, hello) = ClientExchange::start(&key, Channel::Rpc, claims()).unwrap();
        assert!(matches!(
            ServerExchange::accept(&key, Channel::TcpData, &me(), &hello),
            Err(AuthError::WrongChannel {
                expected: Channel::TcpData,
                got: Channel::Rpc
            })
        ));
        assert!(matches!(
            client.finish(&hello),
            Err(AuthError::UnexpectedFrame {
                expected: FrameKind::Challenge,
                got: FrameKind::Hello
            })
        ));
    }

    #[test]
    fn secrets_are_never_empty_and_never_printed() {
        assert!(matches!(
            ClusterSecret::new(b""),
            Err(AuthError::EmptySecret)
        ));
        assert_eq!(format!("{:?}", secret("hunter2")), "ClusterSecret(..)");
        let dir = std::env::temp_dir().join(format!("tern-secret-{}", std::process::id()));
        std::fs::write(&dir, b"from-a-file\r\n").unwrap();
        let from_file = ClusterSecret::from_file(&dir).unwrap();
        let _ = std::fs::remove_file(&dir);
        // The newline is not part of the secret: a client keyed with the bare text agrees.
        exchange(&secret("from-a-file"), claims(), &from_file, &me()).unwrap();
        assert!(matches!(
            ClusterSecret::from_file(Path::new("/nonexistent/tern-secret")),
            Err(AuthError::SecretFile { .. })
        ));
    }

    #[test]
    fn streams_refuse_plain_frames_on_their_first_bytes() {
        let key = secret("k");
        // A plain Mooncake Probe (11 bytes, then the peer waits): refused without waiting.
        let probe = [&3u64.to_le_bytes()[..], &[3, b'{', b'}']].concat();
        let mut stream = io::Cursor::new(probe);
        let mut duplex = Duplex(&mut stream, Vec::new());
        assert!(matches!(
            server_handshake(&mut duplex, &key, Channel::Rpc, &me()),
            Err(AuthError::NotAuthFrame)
        ));
        assert!(duplex.1.is_empty(), "nothing is sent to a plain peer");
        // A bare connect-and-close is silent; a cut Hello is not.
        let mut empty = io::Cursor::new(Vec::new());
        let error = server_handshake(
            &mut Duplex(&mut empty, Vec::new()),
            &key,
            Channel::Rpc,
            &me(),
        )
        .unwrap_err();
        assert!(error.is_silent_close());
        let hello = AuthFrame::Hello {
            channel: Channel::Rpc,
            nonce: [1; 32],
            claims: claims(),
        }
        .encode();
        let mut cut = io::Cursor::new(hello[..70].to_vec());
        let error = server_handshake(&mut Duplex(&mut cut, Vec::new()), &key, Channel::Rpc, &me())
            .unwrap_err();
        assert!(matches!(
            error,
            AuthError::PeerClosed {
                waiting_for: FrameKind::Hello,
                received: 70
            }
        ));
        assert!(!error.is_silent_close());
    }

    /// Reads from a cursor, records what is written.
    struct Duplex<'a>(&'a mut io::Cursor<Vec<u8>>, Vec<u8>);

    impl Read for Duplex<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            self.0.read(buf)
        }
    }

    impl Write for Duplex<'_> {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.1.write(buf)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
}
