//! The exchange over a connected stream, each side bounded by the stream's timeouts.

use std::io::{self, Read, Write};
use std::time::Duration;

use super::{
    AuthError, CHALLENGE_LEN, Channel, Claims, ClientExchange, ClusterSecret, FrameKind,
    HELLO_FIXED_LEN, HELLO_MAX_LEN, Identity, MAGIC, PROOF_LEN, ServerExchange, hello_len,
};

/// Longest a server waits for each frame of the exchange: a peer that says nothing holds a
/// connection slot no longer than this.
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(5);

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
    use crate::auth::AuthFrame;
    use crate::auth::fixtures::{claims, me, secret};

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
