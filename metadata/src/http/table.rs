//! The server's table: the values held, and with a secret the order of each key's value
//! (and of the values deleted), so that nothing older is put back and no token is spent twice.

use std::collections::{HashMap, VecDeque};

use crate::seal::{self, Order, Succession};

#[derive(Debug, Default)]
pub(super) struct Table {
    pub(super) entries: HashMap<String, Vec<u8>>,
    /// Bytes of all values held.
    pub(super) bytes: usize,
    /// With a secret: the order of the value held at each key, or of the one last deleted
    /// there (a tombstone).
    pub(super) orders: HashMap<String, HeldOrder>,
    /// Tombstones in the order they were made, to forget the oldest first.
    tombstones: VecDeque<(String, Order)>,
}

/// The order a key's value has, or had until it was deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct HeldOrder {
    pub(super) order: Order,
    pub(super) deleted: bool,
}

/// Why a sealed write or a tokened delete is not applied.
pub(super) enum Admission {
    /// A delete of a key that holds no value.
    NothingHeld,
    /// Refused, for this reason.
    Refused(seal::SealError),
}

impl Table {
    /// Whether a sealed PUT of `body` (of `order`), or a DELETE with a token naming `order`,
    /// may go ahead given what is held for `key`.
    pub(super) fn admit(
        &self,
        method: &str,
        key: &str,
        body: &[u8],
        order: Order,
    ) -> Result<(), Admission> {
        let held = self.orders.get(key);
        match (method, held) {
            ("PUT", None) => Ok(()),
            ("PUT", Some(held)) => match order.succession(&held.order) {
                Succession::Newer => Ok(()),
                // A request sent again (its answer was lost): the very value held.
                Succession::Same
                    if !held.deleted
                        && self.entries.get(key).is_some_and(|v| v[..] == body[..]) =>
                {
                    Ok(())
                }
                _ => Err(Admission::Refused(seal::SealError::Stale {
                    offered: order,
                    held: held.order,
                })),
            },
            ("DELETE", Some(held)) if held.order == order && !held.deleted => Ok(()),
            ("DELETE", Some(held)) if held.order == order => {
                Err(Admission::Refused(seal::SealError::TokenSpent(order)))
            }
            ("DELETE", Some(held)) if !held.deleted => {
                Err(Admission::Refused(seal::SealError::TokenForAnotherValue {
                    named: order,
                    held: held.order,
                }))
            }
            ("DELETE", _) => Err(Admission::NothingHeld),
            _ => Ok(()),
        }
    }

    /// Keeps the order of the value deleted at `key`, so that neither that value (nor an
    /// older one) can be put back nor its token used again; the oldest of more than
    /// `max_entries` tombstones is forgotten.
    pub(super) fn bury(&mut self, key: String, order: Order, max_entries: usize) {
        self.orders.insert(
            key.clone(),
            HeldOrder {
                order,
                deleted: true,
            },
        );
        self.tombstones.push_back((key, order));
        while self.tombstones.len() > max_entries.max(1) {
            let Some((key, order)) = self.tombstones.pop_front() else {
                break;
            };
            let buried = HeldOrder {
                order,
                deleted: true,
            };
            if self.orders.get(&key) == Some(&buried) {
                self.orders.remove(&key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tombstones_refuse_what_was_deleted_and_the_oldest_is_forgotten_first() {
        let order = |started_ns, counter| Order {
            incarnation: seal::Incarnation {
                started_ns,
                nonce: 7,
            },
            counter,
        };
        let mut table = Table::default();
        for key in ["a", "b"] {
            table.orders.insert(
                key.into(),
                HeldOrder {
                    order: order(10, 1),
                    deleted: false,
                },
            );
        }
        table.bury("a".into(), order(10, 1), 1);
        let stale = |table: &Table, key| {
            matches!(
                table.admit("PUT", key, b"{}", order(10, 1)),
                Err(Admission::Refused(seal::SealError::Stale { .. }))
            )
        };
        assert!(stale(&table, "a"));
        assert!(matches!(
            table.admit("DELETE", "a", b"", order(10, 1)),
            Err(Admission::Refused(seal::SealError::TokenSpent(_)))
        ));
        assert!(table.admit("PUT", "a", b"{}", order(11, 1)).is_ok());
        // One tombstone at most: burying "b" forgets "a"'s.
        table.bury("b".into(), order(10, 1), 1);
        assert!(stale(&table, "b"));
        assert!(!table.orders.contains_key("a"));
        assert!(table.admit("PUT", "a", b"{}", order(10, 1)).is_ok());
    }
}
