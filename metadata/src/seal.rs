//! Values in metadata stores that prove who wrote them, and in which order.
//!
//! With a cluster secret, every JSON value a Tern node writes to etcd or an HTTP store
//! carries two more fields: `tern_order`, the value's place in its writer's sequence, and
//! `tern_mac`, HMAC-SHA256 under the secret over the value's key and its canonical form (the
//! value without `tern_mac` — `tern_order` included —, object keys sorted, no whitespace). A
//! node with the secret refuses a value that is unsigned or whose MAC does not match — a
//! descriptor whose buffer list someone altered would otherwise send writes to the wrong place
//! inside the victim's registered memory. Binding the key means a sealed value cannot be
//! moved to another segment's name. Mooncake nodes ignore both extra fields.
//!
//! # Order
//!
//! A sealed value is still valid after its writer has replaced it, so someone who can read
//! and write the store could save a node's descriptor and put it back later (after the node
//! restarted: peers would be sent to dead ports and stale buffers). The order refuses that.
//! `tern_order` is `<started>-<nonce>-<counter>`: the writer's [`Incarnation`] — the Unix time
//! in nanoseconds when its [`Sealer`] was made (at engine start) and 64 random bits — and a
//! counter it raises with every value it seals. A value is newer than another of the same key
//! when it comes from the same incarnation with a higher counter, or from an incarnation that
//! started later ([`Order::succession`]). A replay of an older incarnation is thus older than
//! what its restarted writer publishes, whatever its counter. Two incarnations that started in
//! the same nanosecond with different nonces are rivals, and neither replaces the other.
//!
//! Who refuses: the HTTP server given the secret refuses a PUT older than what it holds for
//! that key, and remembers the order of a deleted value (a tombstone) so that the deleted
//! value cannot come back; every node refuses a value older than the newest it has read of
//! that key ([`Sealer::admit`]), kept across deletes.
//!
//! What it does not do: a party that has never seen a newer value of a key — a node that just
//! started, a server that lost its memory, or etcd itself, which keeps whatever is put — takes
//! the newest it is shown, so a replay reaches a node that starts while it sits in the store.
//! Restarts are told apart from replays by the writer's clock: a node restarted with its clock
//! set back past its previous start is taken for a replay until its key is deleted (and its
//! previous value forgotten: peers restarted, the server's tombstone evicted).
//!
//! # Deletes
//!
//! Deleting a key from an HTTP store that has the secret takes a token,
//! `X-Tern-Auth: <order>.<hex MAC>`, over the key and the order of the value it deletes. The
//! server deletes only a value of that very order and keeps the order as the key's tombstone,
//! so a token deletes one value once: used again, or for a value its writer published since,
//! it is refused.

use std::collections::HashMap;
use std::fmt;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde_json::Value;

use crate::auth::ClusterSecret;

/// The field carrying a sealed value's MAC.
pub const MAC_FIELD: &str = "tern_mac";
/// The field carrying a sealed value's [`Order`].
pub const ORDER_FIELD: &str = "tern_order";
/// The HTTP header a delete carries.
pub const DELETE_HEADER: &str = "X-Tern-Auth";
/// Most keys a [`Sealer`] remembers the newest order of; keys beyond it are checked for their
/// MAC only (a metadata prefix holds far fewer).
pub const MAX_REMEMBERED: usize = 1 << 18;

const VALUE_LABEL: &[u8] = b"tern-seal value";
const DELETE_LABEL: &[u8] = b"tern-seal delete of one value";

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
    /// The MAC matches but the value carries no readable `tern_order`: it was sealed by a Tern
    /// version that did not order its values, and could be replayed forever. Upgrade that
    /// node.
    #[error("the value is sealed but carries no order (written by an older Tern?)")]
    Unordered,
    /// The value is genuine but older than one already held for its key (or as old, from a
    /// rival incarnation): a replay of a value its writer has since replaced, or of a deleted
    /// one.
    #[error("the value (order {offered}) is older than the one held (order {held}): a replay?")]
    Stale {
        /// The order of the value refused.
        offered: Order,
        /// The order of the value held.
        held: Order,
    },
    /// A delete token that is malformed or made with another secret.
    #[error("bad delete token: {0}")]
    BadToken(&'static str),
    /// A genuine delete token whose value has been deleted with it already: a token deletes
    /// once.
    #[error("the delete token (order {0}) was used already")]
    TokenSpent(Order),
    /// A genuine delete token for another value of the key than the one held (an older one
    /// its writer replaced since, or none held).
    #[error("the delete token names the value of order {named}, not the one held ({held})")]
    TokenForAnotherValue {
        /// The order the token names.
        named: Order,
        /// The order of the value held.
        held: Order,
    },
}

/// One life of a writer: when it started and 64 random bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Incarnation {
    /// Unix time in nanoseconds when it started.
    pub started_ns: u64,
    /// Random, so that two incarnations are never the same.
    pub nonce: u64,
}

impl Incarnation {
    /// A new incarnation, started now.
    pub fn now() -> Self {
        let started_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        let mut nonce = [0u8; 8];
        if getrandom::fill(&mut nonce).is_err() {
            // Without the system's random source the nonce need only differ from other
            // incarnations' of this instant: this process, this thread, this address.
            let local = 0u8;
            let mixed = u64::from(std::process::id()).rotate_left(32)
                ^ (&raw const local as usize as u64)
                ^ started_ns.rotate_left(17);
            nonce = mixed.to_le_bytes();
        }
        Self {
            started_ns,
            nonce: u64::from_le_bytes(nonce),
        }
    }
}

/// A sealed value's place in its writer's sequence: the writer's incarnation and a counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Order {
    /// The writer's incarnation.
    pub incarnation: Incarnation,
    /// Raised by the writer with every value it seals.
    pub counter: u64,
}

/// How an offered order stands to the one held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Succession {
    /// Later in the same incarnation, or of a later incarnation: it replaces the one held.
    Newer,
    /// The very same order.
    Same,
    /// Earlier in the same incarnation, or of an earlier incarnation.
    Older,
    /// Of another incarnation that started in the same nanosecond: neither replaces the other.
    Rival,
}

impl Order {
    /// How `self` stands to `held`.
    pub fn succession(&self, held: &Order) -> Succession {
        use std::cmp::Ordering::*;
        if self.incarnation == held.incarnation {
            return match self.counter.cmp(&held.counter) {
                Greater => Succession::Newer,
                Equal => Succession::Same,
                Less => Succession::Older,
            };
        }
        match self
            .incarnation
            .started_ns
            .cmp(&held.incarnation.started_ns)
        {
            Greater => Succession::Newer,
            Less => Succession::Older,
            Equal => Succession::Rival,
        }
    }

    /// Reads the text form, `<started ns>-<nonce, 16 hex digits>-<counter>`.
    pub fn parse(text: &str) -> Option<Self> {
        let mut parts = text.split('-');
        let started = parts.next()?;
        let nonce = parts.next()?;
        let counter = parts.next()?;
        let decimal = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if parts.next().is_some()
            || !decimal(started)
            || !decimal(counter)
            || nonce.len() != 16
            || !nonce.bytes().all(|b| b.is_ascii_hexdigit())
        {
            return None;
        }
        Some(Self {
            incarnation: Incarnation {
                started_ns: started.parse().ok()?,
                nonce: u64::from_str_radix(nonce, 16).ok()?,
            },
            counter: counter.parse().ok()?,
        })
    }
}

impl fmt::Display for Order {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}-{:016x}-{}",
            self.incarnation.started_ns, self.incarnation.nonce, self.counter
        )
    }
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

/// `json` (an object) with `order` and a MAC for `key` added at its end, the rest of the text
/// as it was (so Mooncake's field order survives). A value sealed before is sealed anew.
fn seal_with(
    secret: &ClusterSecret,
    key: &str,
    json: &str,
    order: &Order,
) -> Result<String, SealError> {
    let mut value: Value =
        serde_json::from_str(json).map_err(|e| SealError::NotAnObject(e.to_string()))?;
    let Some(map) = value.as_object_mut() else {
        return Err(SealError::NotAnObject("not an object".into()));
    };
    // Sealed before: start from the value without its old order and MAC.
    let old_mac = map.remove(MAC_FIELD).is_some();
    let old_order = map.remove(ORDER_FIELD).is_some();
    let resealed =
        (old_mac || old_order).then(|| serde_json::to_string(&value).unwrap_or_default());
    let json = resealed.as_deref().unwrap_or(json);
    let empty = value.as_object().is_none_or(|m| m.is_empty());
    let order_text = order.to_string();
    if let Some(map) = value.as_object_mut() {
        map.insert(ORDER_FIELD.to_owned(), Value::String(order_text.clone()));
    }
    let mac = value_mac(secret, key, &value);
    let body = json.trim_end();
    let Some(open) = body.strip_suffix('}') else {
        return Err(SealError::NotAnObject("does not end with }".into()));
    };
    let separator = if empty { "" } else { "," };
    let trailing = &json[body.len()..];
    Ok(format!(
        "{open}{separator}\"{ORDER_FIELD}\":\"{order_text}\",\"{MAC_FIELD}\":\"{mac}\"}}{trailing}"
    ))
}

/// `json` sealed for `key` as the first value of an incarnation of its own: for tools and
/// tests. A node seals through its [`Sealer`], whose values are ordered.
pub fn seal(secret: &ClusterSecret, key: &str, json: &str) -> Result<String, SealError> {
    let order = Order {
        incarnation: Incarnation::now(),
        counter: 1,
    };
    seal_with(secret, key, json, &order)
}

/// Checks that `value` (stored at `key`) carries a MAC that matches it under `secret`, and
/// returns its order.
pub fn verify(secret: &ClusterSecret, key: &str, value: &[u8]) -> Result<Order, SealError> {
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
    if !secret.tag_matches(VALUE_LABEL, &[key.as_bytes(), text.as_bytes()], &mac) {
        return Err(SealError::BadMac);
    }
    parsed
        .get(ORDER_FIELD)
        .and_then(Value::as_str)
        .and_then(Order::parse)
        .ok_or(SealError::Unordered)
}

/// A token that allows deleting the value of `order` at `key`, and nothing else.
pub fn delete_token(secret: &ClusterSecret, key: &str, order: &Order) -> String {
    let order = order.to_string();
    let mac = secret.tag_hex(DELETE_LABEL, &[key.as_bytes(), order.as_bytes()]);
    format!("{order}.{mac}")
}

/// Checks a delete token for `key` and returns the order of the value it may delete (the
/// server checks that it holds that very value).
pub fn verify_delete(secret: &ClusterSecret, key: &str, token: &str) -> Result<Order, SealError> {
    let (order_text, mac) = token
        .trim()
        .split_once('.')
        .ok_or(SealError::BadToken("not <order>.<mac>"))?;
    let order = Order::parse(order_text).ok_or(SealError::BadToken("its order is unreadable"))?;
    if secret.tag_matches(DELETE_LABEL, &[key.as_bytes(), order_text.as_bytes()], mac) {
        Ok(order)
    } else {
        Err(SealError::BadToken("its MAC does not match"))
    }
}

/// Keys and the newest order known of each, bounded by [`MAX_REMEMBERED`].
#[derive(Debug, Default)]
struct Remembered(HashMap<String, Order>);

impl Remembered {
    fn get(&self, key: &str) -> Option<Order> {
        self.0.get(key).copied()
    }

    fn set(&mut self, key: &str, order: Order) {
        if let Some(held) = self.0.get_mut(key) {
            *held = order;
        } else if self.0.len() < MAX_REMEMBERED {
            self.0.insert(key.to_owned(), order);
        }
    }
}

#[derive(Debug)]
struct Writing {
    incarnation: Incarnation,
    counter: u64,
    /// The order of the last value sealed for each key: what a delete token names.
    sealed: Remembered,
}

/// A node's sealing: its secret, its incarnation (chosen when the sealer is made, at engine
/// start) and counter for what it writes, and the newest order it has read of each key, to
/// refuse older values of it.
#[derive(Debug)]
pub struct Sealer {
    secret: ClusterSecret,
    writing: Mutex<Writing>,
    /// The newest order read of each key, kept across deletes.
    read: Mutex<Remembered>,
}

impl Sealer {
    /// A sealer with a new incarnation, started now.
    pub fn new(secret: ClusterSecret) -> Self {
        Self {
            secret,
            writing: Mutex::new(Writing {
                incarnation: Incarnation::now(),
                counter: 0,
                sealed: Remembered::default(),
            }),
            read: Mutex::new(Remembered::default()),
        }
    }

    /// The secret it seals with.
    pub fn secret(&self) -> &ClusterSecret {
        &self.secret
    }

    /// The incarnation it seals as.
    pub fn incarnation(&self) -> Incarnation {
        self.writing.lock().incarnation
    }

    /// `json` sealed for `key` with the next order of this incarnation.
    pub fn seal(&self, key: &str, json: &str) -> Result<String, SealError> {
        let mut writing = self.writing.lock();
        writing.counter += 1;
        let order = Order {
            incarnation: writing.incarnation,
            counter: writing.counter,
        };
        let sealed = seal_with(&self.secret, key, json, &order)?;
        writing.sealed.set(key, order);
        Ok(sealed)
    }

    /// Checks `value` read at `key`: its MAC, and that it is not older than the newest value
    /// of `key` this sealer has admitted before. Returns its order, remembered as the newest.
    pub fn admit(&self, key: &str, value: &[u8]) -> Result<Order, SealError> {
        let offered = verify(&self.secret, key, value)?;
        let mut read = self.read.lock();
        match read.get(key) {
            Some(held) => match offered.succession(&held) {
                Succession::Newer => read.set(key, offered),
                Succession::Same => {}
                Succession::Older | Succession::Rival => {
                    return Err(SealError::Stale { offered, held });
                }
            },
            None => read.set(key, offered),
        }
        Ok(offered)
    }

    /// Whether `theirs`, found at `key` where this node published `ours`, is a genuine value
    /// newer than ours (a later incarnation of this node's name): then it is not ours to undo.
    pub fn outranks(&self, key: &str, theirs: &[u8], ours: &[u8]) -> bool {
        match (
            verify(&self.secret, key, theirs),
            verify(&self.secret, key, ours),
        ) {
            (Ok(theirs), Ok(ours)) => theirs.succession(&ours) == Succession::Newer,
            _ => false,
        }
    }

    /// A token deleting the value this sealer last sealed for `key`; `None` if it sealed none.
    pub fn delete_token(&self, key: &str) -> Option<String> {
        let order = self.writing.lock().sealed.get(key)?;
        Some(delete_token(&self.secret, key, &order))
    }

    /// Forgets the value sealed for `key` (it was deleted: its token is spent).
    pub fn forget_sealed(&self, key: &str) {
        self.writing.lock().sealed.0.remove(key);
    }

    /// A token deleting `value`, found at `key` (a holder of the secret may delete any value
    /// it can read).
    pub fn delete_token_for(&self, key: &str, value: &[u8]) -> Result<String, SealError> {
        let order = verify(&self.secret, key, value)?;
        Ok(delete_token(&self.secret, key, &order))
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
        let order = verify(&key, "mooncake/ram/node-a", sealed.as_bytes()).unwrap();
        assert_eq!(order.counter, 1);
        // Sealing again replaces the order and MAC rather than adding a second.
        let again = seal(&key, "mooncake/ram/node-a", &sealed).unwrap();
        verify(&key, "mooncake/ram/node-a", again.as_bytes()).unwrap();
        assert_eq!(again.matches(MAC_FIELD).count(), 1);
        assert_eq!(again.matches(ORDER_FIELD).count(), 1);
        // Key order and whitespace do not matter; values do.
        let value: Value = serde_json::from_str(&sealed).unwrap();
        let reordered = serde_json::to_string_pretty(&value).unwrap();
        verify(&key, "mooncake/ram/node-a", reordered.as_bytes()).unwrap();
        let empty = seal(&key, "k", "{}").unwrap();
        assert_eq!(empty.matches(',').count(), 1, "{empty}");
    }

    #[test]
    fn altered_moved_unsigned_unordered_and_foreign_values_are_refused() {
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
        let mac_at = sealed.find("\"tern_mac\":").unwrap();
        let wrong_kind = sealed.replace(
            &sealed[mac_at..sealed.rfind('}').unwrap()],
            "\"tern_mac\":7",
        );
        assert_eq!(
            verify(&key, "mooncake/ram/node-a", wrong_kind.as_bytes()),
            Err(SealError::BadMac)
        );
        // A value whose order was changed (to pass for a newer one) no longer verifies.
        let order = verify(&key, "mooncake/ram/node-a", sealed.as_bytes()).unwrap();
        let bumped = Order {
            counter: order.counter + 1,
            ..order
        };
        let forged = sealed.replace(&order.to_string(), &bumped.to_string());
        assert_ne!(forged, sealed);
        assert_eq!(
            verify(&key, "mooncake/ram/node-a", forged.as_bytes()),
            Err(SealError::BadMac)
        );
        // Sealed the way the previous version did, without an order: refused.
        let unordered = format!(
            "{},\"{MAC_FIELD}\":\"{}\"}}",
            DESC.trim_end().strip_suffix('}').unwrap(),
            value_mac(&key, "k", &serde_json::from_str(DESC).unwrap())
        );
        assert_eq!(
            verify(&key, "k", unordered.as_bytes()),
            Err(SealError::Unordered)
        );
    }

    #[test]
    fn orders_read_back_and_follow_incarnations_and_counters() {
        let early = Incarnation {
            started_ns: 1_000,
            nonce: 0xabc,
        };
        let late = Incarnation {
            started_ns: 2_000,
            nonce: 0x1,
        };
        let at = |incarnation, counter| Order {
            incarnation,
            counter,
        };
        let text = at(early, 7).to_string();
        assert_eq!(text, "1000-0000000000000abc-7");
        assert_eq!(Order::parse(&text), Some(at(early, 7)));
        for bad in [
            "",
            "1-2-3",
            "1-0000000000000abc",
            "x-0000000000000abc-1",
            "1-000000000000abcg-1",
            "1-0000000000000abc-1-2",
            "1-0000000000000abc-+1",
        ] {
            assert_eq!(Order::parse(bad), None, "{bad:?}");
        }
        assert_eq!(at(early, 8).succession(&at(early, 7)), Succession::Newer);
        assert_eq!(at(early, 7).succession(&at(early, 7)), Succession::Same);
        assert_eq!(at(early, 6).succession(&at(early, 7)), Succession::Older);
        // A restart is newer whatever the counters; a replay of the previous life is older.
        assert_eq!(at(late, 1).succession(&at(early, 900)), Succession::Newer);
        assert_eq!(at(early, 900).succession(&at(late, 1)), Succession::Older);
        let twin = Incarnation {
            nonce: 0xdef,
            ..early
        };
        assert_eq!(at(twin, 9).succession(&at(early, 1)), Succession::Rival);
    }

    #[test]
    fn a_sealer_counts_and_admits_nothing_older_than_it_has_read() {
        let key = "mooncake/ram/node-a";
        let first = Sealer::new(secret("k"));
        let v1 = first.seal(key, DESC).unwrap();
        let v2 = first.seal(key, DESC).unwrap();
        let reader = Sealer::new(secret("k"));
        let o1 = reader.admit(key, v1.as_bytes()).unwrap();
        let o2 = reader.admit(key, v2.as_bytes()).unwrap();
        assert_eq!((o1.counter, o2.counter), (1, 2));
        assert_eq!(o1.incarnation, first.incarnation());
        reader.admit(key, v2.as_bytes()).unwrap();
        assert_eq!(
            reader.admit(key, v1.as_bytes()),
            Err(SealError::Stale {
                offered: o1,
                held: o2
            })
        );
        // The node restarts: its new life replaces the old, and the old cannot come back.
        let second = Sealer::new(secret("k"));
        assert!(second.incarnation().started_ns >= first.incarnation().started_ns);
        let v3 = second.seal(key, DESC).unwrap();
        if second.incarnation().started_ns > first.incarnation().started_ns {
            reader.admit(key, v3.as_bytes()).unwrap();
            assert!(matches!(
                reader.admit(key, v2.as_bytes()),
                Err(SealError::Stale { .. })
            ));
            assert!(second.outranks(key, v3.as_bytes(), v2.as_bytes()));
            assert!(!second.outranks(key, v2.as_bytes(), v3.as_bytes()));
        }
        // Keys are independent.
        reader
            .admit(
                "mooncake/ram/node-b",
                &first
                    .seal("mooncake/ram/node-b", DESC)
                    .unwrap()
                    .into_bytes(),
            )
            .unwrap();
    }

    #[test]
    fn delete_tokens_name_one_value_of_one_key_under_one_secret() {
        let key = secret("k");
        let sealer = Sealer::new(key.clone());
        assert_eq!(sealer.delete_token("mooncake/ram/a"), None);
        let value = sealer.seal("mooncake/ram/a", DESC).unwrap();
        let order = verify(&key, "mooncake/ram/a", value.as_bytes()).unwrap();
        let token = sealer.delete_token("mooncake/ram/a").unwrap();
        assert_eq!(verify_delete(&key, "mooncake/ram/a", &token), Ok(order));
        assert_eq!(
            sealer.delete_token_for("mooncake/ram/a", value.as_bytes()),
            Ok(token.clone())
        );
        let (order_text, mac) = token.split_once('.').unwrap();
        let other = Order {
            counter: order.counter + 1,
            ..order
        };
        for (token, key_name, secret_used) in [
            (token.clone(), "mooncake/ram/b", &key),
            (token.clone(), "mooncake/ram/a", &secret("other")),
            ("garbage".to_owned(), "mooncake/ram/a", &key),
            (format!("1800000000.{mac}"), "mooncake/ram/a", &key),
            (format!("{other}.{mac}"), "mooncake/ram/a", &key),
            (format!("{order_text}.00ff"), "mooncake/ram/a", &key),
        ] {
            assert!(
                matches!(
                    verify_delete(secret_used, key_name, &token),
                    Err(SealError::BadToken(_))
                ),
                "{token} {key_name}"
            );
        }
    }
}
