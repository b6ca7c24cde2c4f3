//! Both sides of one exchange, without I/O: the Hello, the Challenge and the Proof made
//! and checked against what each side believes the connection joins.

use super::secret::Transcript;
use super::{
    AuthError, AuthFrame, Channel, Claims, ClusterSecret, FrameKind, MAX_CLAIM_LEN, NONCE_LEN,
    decode_frame,
};
use crate::text::truncate_at_char_boundary;

const SERVER_LABEL: &[u8] = b"tern-auth server";
const CLIENT_LABEL: &[u8] = b"tern-auth client";

/// Who a server is: what it binds into its MACs and checks a Hello's claims against.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Identity {
    /// Its segment name.
    pub segment: String,
    /// The endpoint it advertises for this listener, `ip:port`.
    pub endpoint: String,
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
        let here = truncate_at_char_boundary(&me.segment, MAX_CLAIM_LEN);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::fixtures::{claims, exchange, me, secret};

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
}
