//! Which path a slice takes, and which paths to avoid: plain logic, no verbs.
//!
//! A path is a (local NIC, peer NIC) pair. Slices are striped over the preferred NICs for
//! their buffers' locations; a slice's peer NIC is the one on the same rail (same device
//! name) when the peer has it, since multi-rail clusters wire NIC i to NIC i, else the
//! peer's preferred NIC at the same stripe position. A retry walks all pairs, rail pairs
//! first, starting one further on per attempt, skipping paths that are paused — unless every
//! path is, when a paused path is still better than none.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Candidate NICs, by index, in order of preference.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Ranked {
    pub preferred: Vec<usize>,
    pub available: Vec<usize>,
}

impl Ranked {
    fn all(&self) -> impl Iterator<Item = usize> + Clone + '_ {
        self.preferred.iter().chain(&self.available).copied()
    }

    fn is_empty(&self) -> bool {
        self.preferred.is_empty() && self.available.is_empty()
    }
}

/// One side's view of a path choice.
pub(crate) struct Side<'a> {
    pub ranked: &'a Ranked,
    /// Device names by index.
    pub names: &'a [String],
}

/// Picks the (local, peer) pair for a slice: `stripe` spreads slices, `attempt` counts
/// retries, `avoid` is the pair that just failed, `paused` says which pairs to skip.
pub(crate) fn choose(
    local: &Side<'_>,
    peer: &Side<'_>,
    stripe: usize,
    attempt: u32,
    avoid: Option<(usize, usize)>,
    paused: &dyn Fn(usize, usize) -> bool,
) -> Option<(usize, usize)> {
    if local.ranked.is_empty() || peer.ranked.is_empty() {
        return None;
    }
    if attempt == 0 {
        // The common case allocates nothing: count the candidates, then take one.
        let usable = |l: &usize| peer.ranked.all().any(|p| !paused(*l, p));
        let preferred = local.ranked.preferred.iter().copied().filter(usable);
        let count = preferred.clone().count();
        let l = if count > 0 {
            preferred.clone().nth(stripe % count)
        } else {
            let count = local.ranked.all().filter(usable).count().max(1);
            local.ranked.all().filter(usable).nth(stripe % count)
        };
        if let Some(l) = l {
            let name = local.names.get(l).map_or("", String::as_str);
            let rail = peer
                .ranked
                .all()
                .find(|&p| peer.names.get(p).is_some_and(|n| n == name) && !paused(l, p));
            let open = || {
                peer.ranked
                    .preferred
                    .iter()
                    .copied()
                    .filter(|&p| !paused(l, p))
            };
            let count = open().count();
            let fallback = if count > 0 {
                open().nth(stripe % count)
            } else {
                peer.ranked.all().find(|&p| !paused(l, p))
            };
            if let Some(p) = rail.or(fallback) {
                return Some((l, p));
            }
        }
    }
    let mut pairs: Vec<(usize, usize)> = Vec::new();
    let mut others: Vec<(usize, usize)> = Vec::new();
    for l in local.ranked.all() {
        for p in peer.ranked.all() {
            let same_rail = local.names.get(l) == peer.names.get(p);
            if same_rail {
                pairs.push((l, p));
            } else {
                others.push((l, p));
            }
        }
    }
    pairs.extend(others);
    let open: Vec<(usize, usize)> = pairs
        .iter()
        .copied()
        .filter(|&(l, p)| !paused(l, p) && Some((l, p)) != avoid)
        .collect();
    let choices = if open.is_empty() {
        // Everything is paused (or only the failed path is left): try anyway rather than
        // fail a transfer that a recovered path could carry.
        let not_failed: Vec<(usize, usize)> = pairs
            .iter()
            .copied()
            .filter(|&pair| Some(pair) != avoid)
            .collect();
        if not_failed.is_empty() {
            pairs
        } else {
            not_failed
        }
    } else {
        open
    };
    choices
        .get((stripe + attempt as usize) % choices.len().max(1))
        .copied()
}

/// How a slice's failure reflects on its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Blame {
    /// The path itself failed (the peer never answered, or the handshake failed): pause it
    /// at once.
    Hard,
    /// Something else went wrong on the path; five within the window pause it.
    Soft,
}

const SOFT_FAILURES_TO_PAUSE: usize = 5;
const SOFT_WINDOW: Duration = Duration::from_secs(5);
/// Failures in a row on one local NIC that pause the NIC, if they came from at least
/// [`NIC_FAILING_PEERS`] different peers: one dead peer must not take a NIC away from the
/// others.
const NIC_FAILURES_TO_PAUSE: u32 = 16;
const NIC_FAILING_PEERS: usize = 3;

/// Failures in a row on one local NIC, and the peer servers they came from.
#[derive(Debug, Default, Clone)]
struct Streak {
    failures: u32,
    peers: Vec<String>,
}

#[derive(Debug, Default)]
struct PathHealth {
    recent: Vec<Instant>,
    paused_until: Option<Instant>,
}

/// Failures per path and per local NIC, and which are paused.
#[derive(Debug)]
pub(crate) struct Health {
    pause: Duration,
    paths: HashMap<(usize, Arc<str>), PathHealth>,
    nic_streak: Vec<Streak>,
    nic_paused_until: Vec<Option<Instant>>,
}

impl Health {
    pub fn new(nics: usize, pause: Duration) -> Self {
        Self {
            pause,
            paths: HashMap::new(),
            nic_streak: vec![Streak::default(); nics],
            nic_paused_until: vec![None; nics],
        }
    }

    /// Records a failure; returns true when it paused the local NIC (the caller republishes
    /// the descriptor without it).
    pub fn failed(&mut self, nic: usize, path: &Arc<str>, blame: Blame, now: Instant) -> bool {
        let pause = self.pause;
        let health = self.paths.entry((nic, path.clone())).or_default();
        health
            .recent
            .retain(|t| now.duration_since(*t) < SOFT_WINDOW);
        health.recent.push(now);
        if blame == Blame::Hard || health.recent.len() >= SOFT_FAILURES_TO_PAUSE {
            if health.paused_until.is_none_or(|until| until <= now) {
                tracing::warn!("pausing path {} from NIC #{nic} for {:?}", path, pause);
            }
            health.paused_until = Some(now + pause);
            health.recent.clear();
        }
        let Some(streak) = self.nic_streak.get_mut(nic) else {
            return false;
        };
        streak.failures += 1;
        let server = path.rsplit_once('@').map_or(&**path, |(server, _)| server);
        if !streak.peers.iter().any(|p| p == server) && streak.peers.len() < NIC_FAILING_PEERS {
            streak.peers.push(server.to_owned());
        }
        if streak.failures >= NIC_FAILURES_TO_PAUSE && streak.peers.len() >= NIC_FAILING_PEERS {
            *streak = Streak::default();
            if let Some(until) = self.nic_paused_until.get_mut(nic) {
                let newly = until.is_none_or(|u| u <= now);
                *until = Some(now + pause);
                return newly;
            }
        }
        false
    }

    /// Records a success: the NIC's failure streak ends.
    pub fn succeeded(&mut self, nic: usize) {
        if let Some(streak) = self.nic_streak.get_mut(nic) {
            *streak = Streak::default();
        }
    }

    pub fn path_paused(&self, nic: usize, path: &Arc<str>, now: Instant) -> bool {
        self.paths
            .get(&(nic, path.clone()))
            .and_then(|h| h.paused_until)
            .is_some_and(|until| until > now)
    }

    /// Whether the NIC was paused for failing (port state is tracked elsewhere).
    pub fn nic_paused(&self, nic: usize, now: Instant) -> bool {
        self.nic_paused_until
            .get(nic)
            .copied()
            .flatten()
            .is_some_and(|until| until > now)
    }

    /// Whether any path or NIC is paused now (when none is, routing skips the lookups).
    pub fn anything_paused(&self, now: Instant) -> bool {
        self.paths
            .values()
            .any(|h| h.paused_until.is_some_and(|u| u > now))
            || self
                .nic_paused_until
                .iter()
                .any(|u| u.is_some_and(|u| u > now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranked(preferred: &[usize], available: &[usize]) -> Ranked {
        Ranked {
            preferred: preferred.to_vec(),
            available: available.to_vec(),
        }
    }

    static NAMES: std::sync::LazyLock<[String; 2]> =
        std::sync::LazyLock::new(|| ["rxe0".to_owned(), "rxe1".to_owned()]);

    fn side(r: &Ranked) -> Side<'_> {
        Side {
            ranked: r,
            names: &*NAMES,
        }
    }

    #[test]
    fn slices_stripe_over_preferred_nics_on_their_own_rail() {
        let both = ranked(&[0, 1], &[]);
        let never = |_: usize, _: usize| false;
        let picks: Vec<_> = (0..4)
            .map(|s| choose(&side(&both), &side(&both), s, 0, None, &never).unwrap())
            .collect();
        assert_eq!(picks, [(0, 0), (1, 1), (0, 0), (1, 1)]);
    }

    #[test]
    fn a_peer_without_the_rail_gets_its_preferred_nic() {
        let local = ranked(&[1], &[0]);
        let peer = ranked(&[0], &[]);
        let peer_names = ["mlx5_0".to_owned()];
        let peer_side = Side {
            ranked: &peer,
            names: &peer_names,
        };
        let never = |_: usize, _: usize| false;
        assert_eq!(
            choose(&side(&local), &peer_side, 0, 0, None, &never),
            Some((1, 0))
        );
    }

    #[test]
    fn paused_paths_are_skipped_and_retries_move_on() {
        let both = ranked(&[0, 1], &[]);
        let rail_one_paused = |l: usize, p: usize| l == 1 || p == 1;
        for stripe in 0..4 {
            assert_eq!(
                choose(
                    &side(&both),
                    &side(&both),
                    stripe,
                    0,
                    None,
                    &rail_one_paused
                ),
                Some((0, 0))
            );
        }
        let never = |_: usize, _: usize| false;
        let retry = choose(&side(&both), &side(&both), 0, 1, Some((0, 0)), &never).unwrap();
        assert_ne!(retry, (0, 0), "a retry must leave the failed path");
        // Every path paused: still a path, not none.
        let all = |_: usize, _: usize| true;
        assert!(choose(&side(&both), &side(&both), 0, 0, None, &all).is_some());
        assert!(choose(&side(&both), &side(&ranked(&[], &[])), 0, 0, None, &never).is_none());
    }

    #[test]
    fn hard_failures_pause_at_once_and_soft_ones_after_five() {
        let mut health = Health::new(2, Duration::from_secs(30));
        let path: Arc<str> = Arc::from("peer@rxe1");
        let now = Instant::now();
        health.failed(1, &path, Blame::Hard, now);
        assert!(health.path_paused(1, &path, now));
        assert!(!health.path_paused(1, &path, now + Duration::from_secs(31)));
        let other: Arc<str> = Arc::from("peer@rxe0");
        for i in 0..4 {
            health.failed(0, &other, Blame::Soft, now + Duration::from_millis(i));
        }
        assert!(!health.path_paused(0, &other, now));
        health.failed(0, &other, Blame::Soft, now + Duration::from_millis(5));
        assert!(health.path_paused(0, &other, now + Duration::from_millis(6)));
        assert!(health.anything_paused(now));
    }

    #[test]
    fn one_dead_peer_does_not_pause_a_nic() {
        let mut health = Health::new(1, Duration::from_secs(30));
        let now = Instant::now();
        for nic in ["rxe0", "rxe1"] {
            let path: Arc<str> = Arc::from(format!("10.0.0.2:15000@{nic}"));
            for _ in 0..100 {
                assert!(!health.failed(0, &path, Blame::Hard, now));
            }
        }
        assert!(!health.nic_paused(0, now));
    }

    #[test]
    fn a_nic_failing_on_every_path_is_paused_until_it_succeeds_again() {
        let mut health = Health::new(1, Duration::from_secs(30));
        let now = Instant::now();
        let mut paused = false;
        for i in 0..NIC_FAILURES_TO_PAUSE {
            let path: Arc<str> = Arc::from(format!("peer{i}@rxe0"));
            paused |= health.failed(0, &path, Blame::Soft, now);
        }
        assert!(paused && health.nic_paused(0, now));
        let mut health = Health::new(1, Duration::from_secs(30));
        for i in 0..NIC_FAILURES_TO_PAUSE - 1 {
            let path: Arc<str> = Arc::from(format!("peer{i}@rxe0"));
            health.failed(0, &path, Blame::Soft, now);
        }
        health.succeeded(0);
        let path: Arc<str> = Arc::from("peerX@rxe0");
        assert!(!health.failed(0, &path, Blame::Soft, now));
    }
}
