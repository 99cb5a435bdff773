//! One round for the shared keys of global rules (`key = "all"`, `"region"`): every active
//! one shared each round, what the other hosts counted written whole for the program.

use std::collections::{BTreeMap, HashMap, HashSet};

use ratelimit_common::maps::{ClientKey, ClientState, FleetAdd, KEY_IP};

use super::{
    Round, SCAN_EVERY,
    counts::{CountStore, Groups, answered, calls_of},
    keys::{bucket_of, expire_ms, hash_name, shared_key_name},
    rule::GlobalRule,
};
use crate::kernel::clients::{ClientStore, Meter};

/// The shared states (`key = "all"`, `"region"`) a round reads, and where it writes what
/// the other hosts counted for them: the program's (`RL_SHARED`, `RL_FLEET_ADD`).
pub trait SharedStates {
    /// The shared keys of the rules at `indexes` (a walk of the map: at the store's walk,
    /// every [`SCAN_EVERY`]).
    fn shared_keys(&self, indexes: &[u8]) -> anyhow::Result<Vec<ClientKey>>;
    /// The state of shared key `key`, if it has one.
    fn shared_state(&self, key: &ClientKey) -> Option<ClientState>;
    /// Write what the other hosts counted for `key`.
    fn set_fleet_add(&self, key: &ClientKey, add: &FleetAdd) -> anyhow::Result<()>;
}

impl SharedStates for ClientStore {
    fn shared_keys(&self, indexes: &[u8]) -> anyhow::Result<Vec<ClientKey>> {
        self.shared_keys_of(indexes)
    }

    fn shared_state(&self, key: &ClientKey) -> Option<ClientState> {
        self.get(key)
    }

    fn set_fleet_add(&self, key: &ClientKey, add: &FleetAdd) -> anyhow::Result<()> {
        ClientStore::set_fleet_add(self, key, add)
    }
}

/// A shared key is shared while it saw a packet within this many of its rule's intervals.
const SHARED_ACTIVE_INTERVALS: u64 = 2;

/// One round for the shared keys of global rules (`key = "all"`: one per rule; `"region"`:
/// one per rule and region): few, so each active one is shared every round, without the
/// per-source keys' thresholds and pacing. For each meter, this host's own counts of the
/// wall clock's window `w` and `w - 1` (nothing is added into a shared state: its counts are
/// all its own) are published as in [`round`], and what the other hosts counted (the
/// totals less its own, at most the meter's limit) is written whole into `RL_FLEET_ADD`,
/// where the program adds it to the key's counts when it judges. `keys` are the shared keys
/// found at the last walk; `last` holds what was written last (for the count of what was
/// added); `mono_ns` is CLOCK_MONOTONIC now (for the keys' last packets), `unix_ns` the wall
/// clock.
#[expect(
    clippy::too_many_arguments,
    reason = "the round's inputs, each of its own kind"
)]
pub async fn shared_round<S: SharedStates + ?Sized, C: CountStore>(
    counts: &mut C,
    host: &str,
    store: &S,
    rules: &[GlobalRule],
    keys_found: &[ClientKey],
    last: &mut HashMap<ClientKey, FleetAdd>,
    mono_ns: u64,
    unix_ns: u64,
) -> anyhow::Result<Round> {
    let by_index: HashMap<u8, usize> = rules
        .iter()
        .enumerate()
        .filter(|(_, g)| g.kind != KEY_IP && g.burst.is_none())
        .map(|(i, g)| (g.index, i))
        .collect();
    if by_index.is_empty() {
        last.clear();
        return Ok(Round::default());
    }
    let (groups, keys) = entries(store, rules, &by_index, keys_found, mono_ns, unix_ns);
    let (calls, chunks) = calls_of(groups, |&(ki, _, _, own): &Entry| (keys[ki].2.clone(), own));
    let answers = counts.sync_all(host, &calls).await;
    let (totals, failed, mut last_error) = answered(answers);
    let others = others_of(rules, &keys, &chunks, totals);
    let (added, written, write_error) = write_adds(store, rules, &keys, &others, last);
    if write_error.is_some() {
        last_error = write_error;
    }
    // Keys no longer shared: what was written for them stays until it is out of its window.
    last.retain(|k, _| written.contains(k) || by_index.contains_key(&k.rule));
    let n = calls.len() as u64;
    match last_error {
        Some(e) if failed == n && n > 0 => Err(e),
        e => Ok(Round {
            calls: n,
            keys: calls.iter().map(|c| c.pairs.len() as u64).sum(),
            failed,
            added,
            last_error: e.map(|e| format!("{e:#}")),
            shared_keys: keys.len(),
        }),
    }
}

/// One entry of the shared keys' round: (key, meter, previous window?, own count).
type Entry = (usize, usize, bool, u64);

/// A shared key found active: the key, its rule, its name in the store, and its meters'
/// windows now.
type Active = (ClientKey, usize, String, [u64; 2]);

/// The active shared keys of `keys_found`, and their own counts of the wall clock's windows
/// grouped by the hash they go to.
fn entries<S: SharedStates + ?Sized>(
    store: &S,
    rules: &[GlobalRule],
    by_index: &HashMap<u8, usize>,
    keys_found: &[ClientKey],
    mono_ns: u64,
    unix_ns: u64,
) -> (Groups<Entry>, Vec<Active>) {
    let states = keys_found
        .iter()
        .filter_map(|k| store.shared_state(k).map(|st| (*k, st)));
    // Entries by hash: (expiry, [(key, meter, previous window?, own count)]).
    let mut groups: Groups<Entry> = BTreeMap::new();
    let mut keys: Vec<Active> = Vec::new();
    for (key, st) in states {
        let Some(&ri) = by_index.get(&key.rule) else {
            continue;
        };
        let g = &rules[ri];
        let active = SHARED_ACTIVE_INTERVALS
            .saturating_mul(g.interval_ns.max(g.ban_interval_ns))
            .max(SCAN_EVERY.as_nanos() as u64);
        if st.last_ns == 0 || mono_ns.saturating_sub(st.last_ns) > active {
            continue;
        }
        let name = shared_key_name(&key);
        let bucket = bucket_of(&g.rid, &name);
        let ki = keys.len();
        let mut windows = [0u64; 2];
        for (mi, (m, interval)) in g.meters().enumerate() {
            let w = unix_ns / interval.max(1);
            windows[mi] = w;
            let stamp = g.stamp_of(&st, m);
            let (cur, prev) = g.own_counts(&st, m);
            let (own_w, own_before) = FleetAdd::counts_in(stamp, cur, prev, w);
            for (to_prev, window, own) in [(false, w, own_w), (true, w.wrapping_sub(1), own_before)]
            {
                let h = hash_name(&g.rid, m, bucket, window);
                let expire_ms = expire_ms(window, interval);
                groups
                    .entry(h)
                    .or_insert((expire_ms, Vec::new()))
                    .1
                    .push((ki, mi, to_prev, own));
            }
        }
        keys.push((key, ri, name, windows));
    }
    (groups, keys)
}

/// Per key: [meter][window: 0 = w, 1 = w - 1] the other hosts' counts (the totals less this
/// host's own, at most the meter's limit), where answered.
fn others_of(
    rules: &[GlobalRule],
    keys: &[Active],
    chunks: &[Vec<Entry>],
    answers: Vec<Option<Vec<u64>>>,
) -> Vec<[[Option<u64>; 2]; 2]> {
    // Per key: [meter][window: 0 = w, 1 = w - 1] the others' counts, if answered.
    let mut others: Vec<[[Option<u64>; 2]; 2]> = vec![[[None; 2]; 2]; keys.len()];
    for (chunk, totals) in chunks.iter().zip(answers) {
        let Some(totals) = totals else {
            continue;
        };
        for (&(ki, mi, to_prev, own), total) in chunk.iter().zip(totals) {
            let g = &rules[keys[ki].1];
            let m = g.meters().nth(mi).expect("a meter of its rule").0;
            others[ki][mi][to_prev as usize] = Some(total.saturating_sub(own).min(g.limit_of(m)));
        }
    }
    others
}

/// Write what the other hosts counted for each key into the program's `RL_FLEET_ADD` where
/// it changed (`last`: what was written before). Returns the counts added, the keys written
/// (or unchanged), and the last failure to write.
fn write_adds<S: SharedStates + ?Sized>(
    store: &S,
    rules: &[GlobalRule],
    keys: &[Active],
    others: &[[[Option<u64>; 2]; 2]],
    last: &mut HashMap<ClientKey, FleetAdd>,
) -> (u64, HashSet<ClientKey>, Option<anyhow::Error>) {
    let mut last_error = None;
    let mut added = 0u64;
    let mut written = HashSet::new();
    for ((key, ri, _, windows), o) in keys.iter().zip(others) {
        let g = &rules[*ri];
        let old = last.get(key).copied().unwrap_or_default();
        let mut add = old;
        let mut any = false;
        for (mi, (m, _)) in g.meters().enumerate() {
            let (Some(cur), Some(prev)) = (o[mi][0], o[mi][1]) else {
                continue;
            };
            any = true;
            let w = windows[mi];
            match m {
                Meter::Admitted => {
                    let (was, _) = FleetAdd::counts_in(old.window, old.cur, old.prev, w);
                    added += cur.saturating_sub(was);
                    (add.window, add.cur, add.prev) = (w, cur, prev);
                }
                Meter::Offered => {
                    let (was, _) =
                        FleetAdd::counts_in(old.ban_window, old.seen_cur, old.seen_prev, w);
                    added += cur.saturating_sub(was);
                    (add.ban_window, add.seen_cur, add.seen_prev) = (w, cur, prev);
                }
            }
        }
        if !any || add == old {
            written.insert(*key);
            continue;
        }
        match store.set_fleet_add(key, &add) {
            Ok(()) => {
                last.insert(*key, add);
                written.insert(*key);
            }
            Err(e) => last_error = Some(e),
        }
    }
    (added, written, last_error)
}
