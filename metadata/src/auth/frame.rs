//! The three frames of the exchange (the layout is in the [module's](super) table): what
//! they carry, their bytes, and [`decode_frame`], total over all inputs.

use super::AuthError;
use crate::text::truncate_at_char_boundary;

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

const KIND_OFFSET: usize = 16;

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
    .map(|text| truncate_at_char_boundary(text, MAX_CLAIM_LEN))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::fixtures::claims;

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
}
