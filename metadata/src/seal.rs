//! Values in metadata stores that prove who wrote them.
//!
//! With a cluster secret, every JSON value a Tern node writes to etcd or an HTTP store
//! carries one more field, `tern_mac`: HMAC-SHA256 under the secret over the value's key and
//! its canonical form (the value without `tern_mac`, object keys sorted, no whitespace). A
//! node with the secret refuses a value that is unsigned or whose MAC does not match — a
//! descriptor whose buffer list someone altered would otherwise send writes to the wrong place
//! inside the victim's registered memory. Binding the key means a sealed value cannot be
//! moved to another segment's name. Mooncake nodes ignore the extra field.
//!
//! Deleting a key from an HTTP store that has the secret takes a token,
//! `X-Tern-Auth: <unix seconds>.<hex MAC>`, over the key and the time, accepted within
//! [`DELETE_WINDOW`] of the server's clock.
//!
//! What it does not do: a value once sealed stays valid, so someone who can write the store
//! can put back an older value of the same key (a stale descriptor of that same node).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::auth::ClusterSecret;

/// The field a sealed value carries.
pub const MAC_FIELD: &str = "tern_mac";
/// The HTTP header a delete carries.
pub const DELETE_HEADER: &str = "X-Tern-Auth";
/// How far a delete token's time may be from the server's clock.
pub const DELETE_WINDOW: Duration = Duration::from_secs(300);

const VALUE_LABEL: &[u8] = b"tern-seal value";
const DELETE_LABEL: &[u8] = b"tern-seal delete";

/// Why a value or token was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SealError {
    /// The value is not a JSON object, so it cannot carry a MAC.
    #[error("not a JSON object: {0}")]
    NotAnObject(String),
    /// The value has no `tern_mac`: it was written by a node without the cluster secret (a
    /// Mooncake node, or a Tern node configured without it), or by someone else.
    #[error("the value carries no MAC (written without the cluster secret?)")]
    Unsigned,
    /// The MAC does not match the key and the value: it was altered, moved from another key,
    /// or written with another secret.
    #[error("the value's MAC does not match (altered, moved from another key, or another secret)")]
    BadMac,
    /// A delete token that is malformed, too old or too new, or made with another secret.
    #[error("bad delete token: {0}")]
    BadToken(&'static str),
}

/// The canonical text of `value`: object keys sorted, no whitespace, scalars as serde_json
/// writes them. Independent of how the value was parsed or which serde_json features a build
/// has.
pub fn canonical(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(key.clone()).to_string());
                out.push(':');
                write_canonical(&map[key.as_str()], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

fn value_mac(secret: &ClusterSecret, key: &str, unsealed: &Value) -> String {
    let text = canonical(unsealed);
    secret.tag_hex(VALUE_LABEL, &[key.as_bytes(), text.as_bytes()])
}

/// `json` (an object) with a `tern_mac` for `key` added at its end, the rest of the text as
/// it was (so Mooncake's field order survives).
pub fn seal(secret: &ClusterSecret, key: &str, json: &str) -> Result<String, SealError> {
    let mut value: Value =
        serde_json::from_str(json).map_err(|e| SealError::NotAnObject(e.to_string()))?;
    let Some(map) = value.as_object_mut() else {
        return Err(SealError::NotAnObject("not an object".into()));
    };
    // Sealed before: start from the value without its old MAC.
    let resealed = map
        .remove(MAC_FIELD)
        .map(|_| serde_json::to_string(&value).unwrap_or_default());
    let json = resealed.as_deref().unwrap_or(json);
    let empty = value.as_object().is_none_or(|m| m.is_empty());
    let mac = value_mac(secret, key, &value);
    let body = json.trim_end();
    let Some(open) = body.strip_suffix('}') else {
        return Err(SealError::NotAnObject("does not end with }".into()));
    };
    let separator = if empty { "" } else { "," };
    let trailing = &json[body.len()..];
    Ok(format!(
        "{open}{separator}\"{MAC_FIELD}\":\"{mac}\"}}{trailing}"
    ))
}

/// Checks that `value` (stored at `key`) carries a MAC that matches it under `secret`.
pub fn verify(secret: &ClusterSecret, key: &str, value: &[u8]) -> Result<(), SealError> {
    let mut parsed: Value =
        serde_json::from_slice(value).map_err(|e| SealError::NotAnObject(e.to_string()))?;
    let map = parsed
        .as_object_mut()
        .ok_or_else(|| SealError::NotAnObject("not an object".into()))?;
    let mac = match map.remove(MAC_FIELD) {
        Some(Value::String(mac)) => mac,
        Some(_) => return Err(SealError::BadMac),
        None => return Err(SealError::Unsigned),
    };
    let text = canonical(&parsed);
    if secret.tag_matches(VALUE_LABEL, &[key.as_bytes(), text.as_bytes()], &mac) {
        Ok(())
    } else {
        Err(SealError::BadMac)
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A token that allows deleting `key`, made now.
pub fn delete_token(secret: &ClusterSecret, key: &str) -> String {
    delete_token_at(secret, key, unix_now())
}

fn delete_token_at(secret: &ClusterSecret, key: &str, secs: u64) -> String {
    let time = secs.to_string();
    let mac = secret.tag_hex(DELETE_LABEL, &[key.as_bytes(), time.as_bytes()]);
    format!("{time}.{mac}")
}

/// Checks a delete token for `key` against the clock.
pub fn verify_delete(secret: &ClusterSecret, key: &str, token: &str) -> Result<(), SealError> {
    verify_delete_at(secret, key, token, unix_now())
}

fn verify_delete_at(
    secret: &ClusterSecret,
    key: &str,
    token: &str,
    now: u64,
) -> Result<(), SealError> {
    let (time, mac) = token
        .trim()
        .split_once('.')
        .ok_or(SealError::BadToken("not <seconds>.<mac>"))?;
    let secs: u64 = time
        .parse()
        .map_err(|_| SealError::BadToken("the time is not a number"))?;
    if secs.abs_diff(now) > DELETE_WINDOW.as_secs() {
        return Err(SealError::BadToken("its time is too far from this clock"));
    }
    if secret.tag_matches(DELETE_LABEL, &[key.as_bytes(), time.as_bytes()], mac) {
        Ok(())
    } else {
        Err(SealError::BadToken("its MAC does not match"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> ClusterSecret {
        ClusterSecret::new(s.as_bytes()).unwrap()
    }

    const DESC: &str = r#"{"name":"node-a","buffers":[{"addr":4096,"length":8192,"name":"cpu:0"}],"tcp_data_port":15001}
"#;

    #[test]
    fn a_sealed_value_keeps_its_text_and_verifies() {
        let key = secret("k");
        let sealed = seal(&key, "mooncake/ram/node-a", DESC).unwrap();
        assert!(sealed.starts_with(&DESC.trim_end()[..DESC.trim_end().len() - 1]));
        assert!(sealed.ends_with("\"}\n"), "{sealed}");
        verify(&key, "mooncake/ram/node-a", sealed.as_bytes()).unwrap();
        // Sealing again replaces the MAC rather than adding a second.
        let again = seal(&key, "mooncake/ram/node-a", &sealed).unwrap();
        verify(&key, "mooncake/ram/node-a", again.as_bytes()).unwrap();
        assert_eq!(again.matches(MAC_FIELD).count(), 1);
        // Key order and whitespace do not matter; values do.
        let value: Value = serde_json::from_str(&sealed).unwrap();
        let reordered = serde_json::to_string_pretty(&value).unwrap();
        verify(&key, "mooncake/ram/node-a", reordered.as_bytes()).unwrap();
        assert_eq!(seal(&key, "k", "{}").unwrap().matches(',').count(), 0);
    }

    #[test]
    fn altered_moved_unsigned_and_foreign_values_are_refused() {
        let key = secret("k");
        let sealed = seal(&key, "mooncake/ram/node-a", DESC).unwrap();
        let altered = sealed.replace("\"addr\":4096", "\"addr\":4097");
        assert_eq!(
            verify(&key, "mooncake/ram/node-a", altered.as_bytes()),
            Err(SealError::BadMac)
        );
        assert_eq!(
            verify(&key, "mooncake/ram/node-b", sealed.as_bytes()),
            Err(SealError::BadMac),
            "moved to another key"
        );
        assert_eq!(
            verify(&key, "mooncake/ram/node-a", DESC.as_bytes()),
            Err(SealError::Unsigned)
        );
        assert_eq!(
            verify(&secret("other"), "mooncake/ram/node-a", sealed.as_bytes()),
            Err(SealError::BadMac)
        );
        assert!(matches!(
            verify(&key, "k", b"[1,2]"),
            Err(SealError::NotAnObject(_))
        ));
        assert!(matches!(
            verify(&key, "k", b"not json"),
            Err(SealError::NotAnObject(_))
        ));
        let wrong_kind = sealed.replace(
            &sealed[sealed.find("\"tern_mac\":").unwrap()..sealed.rfind('}').unwrap()],
            "\"tern_mac\":7",
        );
        assert_eq!(
            verify(&key, "mooncake/ram/node-a", wrong_kind.as_bytes()),
            Err(SealError::BadMac)
        );
    }

    #[test]
    fn delete_tokens_are_bound_to_key_time_and_secret() {
        let key = secret("k");
        let now = 1_800_000_000;
        let token = delete_token_at(&key, "mooncake/ram/a", now);
        verify_delete_at(&key, "mooncake/ram/a", &token, now + 10).unwrap();
        for (token, key_name, at, secret_used) in [
            (token.clone(), "mooncake/ram/b", now, &key),
            (token.clone(), "mooncake/ram/a", now + 301, &key),
            (token.clone(), "mooncake/ram/a", now - 301, &key),
            (token.clone(), "mooncake/ram/a", now, &secret("other")),
            ("garbage".to_owned(), "mooncake/ram/a", now, &key),
            (format!("x.{}", &token[11..]), "mooncake/ram/a", now, &key),
        ] {
            assert!(
                verify_delete_at(secret_used, key_name, &token, at).is_err(),
                "{token} {key_name} {at}"
            );
        }
    }
}
