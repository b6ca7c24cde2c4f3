//! The cluster secret: where it comes from, and the MACs keyed with it.

use std::path::Path;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use super::{AuthError, Channel, MAC_LEN, MAX_CLAIM_LEN, NONCE_LEN, VERSION};
use crate::text::truncate_at_char_boundary;

/// Environment variable holding the cluster secret itself (its bytes, as given).
pub const CLUSTER_SECRET_ENV: &str = "TERN_CLUSTER_SECRET";
/// Environment variable naming a file whose contents are the cluster secret (one trailing
/// newline is dropped), to keep the secret out of the environment and process listings.
pub const CLUSTER_SECRET_FILE_ENV: &str = "TERN_CLUSTER_SECRET_FILE";

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
            let text = truncate_at_char_boundary(text, MAX_CLAIM_LEN);
            mac.update(&[text.len() as u8]);
            mac.update(text.as_bytes());
        }
        mac
    }

    pub(super) fn sign(&self, label: &[u8], transcript: &Transcript<'_>) -> [u8; MAC_LEN] {
        let tag = self.mac_for(label, transcript).finalize().into_bytes();
        let mut out = [0u8; MAC_LEN];
        out.copy_from_slice(&tag);
        out
    }

    /// Constant-time comparison (`verify_slice` compares every byte whatever differs).
    pub(super) fn check(
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
pub(super) struct Transcript<'a> {
    pub(super) channel: Channel,
    pub(super) client_nonce: &'a [u8; NONCE_LEN],
    pub(super) server_nonce: &'a [u8; NONCE_LEN],
    pub(super) client_segment: &'a str,
    pub(super) server_segment: &'a str,
    /// On the client's side the endpoint it dialed; on the server's the one it advertises.
    pub(super) server_endpoint: &'a str,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::fixtures::{claims, exchange, me, secret};

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
}
