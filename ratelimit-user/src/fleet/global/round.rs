//! One round for the per-source clients of global rules: their own counts read and published,
//! what the other hosts counted added into their states, the near-limit ones announced.

use std::{collections::BTreeMap, time::Instant};

use ratelimit_common::maps::BAN_HELD_MARK;

use super::{
    CALL_KEYS, Round,
    counts::{Announce, Call, CountStore},
    keys::{announce_set, hash_name},
    rule::GlobalRule,
    synced::{Added, PREV_ROUNDS, SlotStates, Synced, WARM_ROUNDS},
};
use crate::clients::Meter;

/// One entry of a round: a client's own count of one window of one meter.
struct Entry {
    synced: usize,
    meter_ix: usize,
    to_prev: bool,
    own: u64,
}

/// One round: read, publish, add. Returns (store calls, counts added). The hashes are
/// called in order of their names.
pub async fn round<S: SlotStates + ?Sized, C: CountStore + Announce>(
    counts: &mut C,
    host: &str,
    store: &S,
    rules: &[GlobalRule],
    synced: &mut [Synced],
) -> anyhow::Result<Round> {
    // Group entries by the hash they go to.
    let mut groups: BTreeMap<String, (u64, Vec<Entry>)> = BTreeMap::new();
    for (si, s) in synced.iter_mut().enumerate() {
        let Some(st) = store.slot_state(&s.at) else {
            continue;
        };
        let g = &rules[s.rule];
        for (mi, (m, interval)) in g.meters().enumerate() {
            let stamp = g.stamp_of(&st, m);
            // A meter that never counted (no window yet), or a ban held in it: nothing to share.
            if stamp == 0 || (m == Meter::Offered && stamp == BAN_HELD_MARK) {
                continue;
            }
            let a = &mut s.added[mi];
            let before = *a;
            a.roll(stamp);
            // A client newly synced is taken as shared for the window it was found in: other
            // hosts may count it already, and it is solo only after a whole window of
            // publishing without seeing them.
            if before.window == 0 && a.others_window.is_none() {
                a.others_window = Some(stamp.wrapping_sub(1));
            }
            let (cur, prev) = g.own_counts(&st, m);
            if a.wait_window {
                continue;
            }
            let (own_cur, own_prev) = if g.is_bucket(m) {
                // Nothing is added into a token bucket's count: it is all this host's own. Less
                // than was published means the state was made anew (its TAT too, so what was
                // charged went with it). Its previous window is what was last published of it.
                if cur < a.published {
                    *a = Added {
                        window: stamp,
                        ..Added::default()
                    };
                }
                (cur, a.published_prev)
            } else {
                // Counts only grow within a window: less than was added means the state was
                // made anew (the client evicted and back), so nothing of it is the others';
                // a previous window below what was added means the program is rotating it
                // now (or the read was torn): next round.
                if cur < a.cur {
                    *a = Added {
                        window: stamp,
                        ..Added::default()
                    };
                }
                if prev < a.prev {
                    continue;
                }
                (cur.saturating_sub(a.cur), prev.saturating_sub(a.prev))
            };
            if before.window != stamp || own_cur > 0 {
                s.active = Instant::now();
            }
            a.rounds = a.rounds.saturating_add(1);
            let solo = a.solo();
            // The previous window for a while (the other hosts' last counts of it come in
            // late); a solo client's only once, its final count.
            let prev_too = a.rounds <= if solo { 1 } else { PREV_ROUNDS };
            for (to_prev, window, own) in [
                (false, stamp, own_cur),
                (true, stamp.wrapping_sub(1), own_prev),
            ] {
                if to_prev && (!prev_too || a.prev_unknown) {
                    continue;
                }
                // A warm client (far from its limit, its own count barely moved) only now
                // and then: near ones, and every window's first round, always; a solo one
                // (no other host counts it) only now and then, however near.
                if !to_prev {
                    let moved = g.worth(m, own.saturating_sub(a.published));
                    // A token bucket's nearness is its fill, not its window's count: every
                    // round while another host counts it.
                    let often = !solo && (g.is_bucket(m) || g.near(m, a.total) || moved);
                    if a.rounds > 1 && !often && a.quiet_rounds < WARM_ROUNDS {
                        a.quiet_rounds += 1;
                        continue;
                    }
                    a.quiet_rounds = 0;
                }
                let h = hash_name(&g.rid, m, s.bucket, window);
                // Expire two windows after this one ends, plus a minute of clock skew.
                let expire_ms = u64::try_from(
                    (window.saturating_add(2) as u128 * interval as u128) / 1_000_000,
                )
                .unwrap_or(u64::MAX)
                .saturating_add(60_000);
                let e = groups.entry(h).or_insert((expire_ms, Vec::new()));
                e.1.push(Entry {
                    synced: si,
                    meter_ix: mi,
                    to_prev,
                    own,
                });
            }
        }
    }
    let mut calls = Vec::new();
    let mut chunks: Vec<Vec<Entry>> = Vec::new();
    for (hash, (expire_ms, entries)) in groups {
        let mut entries = entries.into_iter().peekable();
        while entries.peek().is_some() {
            let chunk: Vec<Entry> = entries.by_ref().take(CALL_KEYS).collect();
            calls.push(Call {
                hash: hash.clone(),
                expire_ms,
                pairs: chunk
                    .iter()
                    .map(|e| (synced[e.synced].name.clone(), e.own))
                    .collect(),
            });
            chunks.push(chunk);
        }
    }
    let answers = counts.sync_all(host, &calls).await;
    let (mut failed, mut added) = (0u64, 0u64);
    let mut last_error = None;
    // Near-limit clients to announce: set -> (expiry, (synced, meter, key)).
    type News = Vec<(usize, usize, String)>;
    let mut news: BTreeMap<String, (u64, News)> = BTreeMap::new();
    for ((chunk, call), totals) in chunks.iter().zip(&calls).zip(answers) {
        let totals = match totals {
            Ok(t) => t,
            Err(e) => {
                failed += 1;
                last_error = Some(e);
                continue;
            }
        };
        for (e, total) in chunk.iter().zip(totals) {
            let s = &mut synced[e.synced];
            let (m, _) = rules[s.rule]
                .meters()
                .nth(e.meter_ix)
                .expect("an entry of a meter of its rule");
            let a = &mut s.added[e.meter_ix];
            if !e.to_prev {
                a.published = e.own;
                a.total = total;
            }
            if total > e.own {
                let w = if e.to_prev {
                    a.window.wrapping_sub(1)
                } else {
                    a.window
                };
                a.others_window = Some(a.others_window.map_or(w, |o| o.max(w)));
            }
            if !e.to_prev && !a.announced && rules[s.rule].near(m, total) {
                let set = announce_set(&rules[s.rule].rid, m, s.bucket, a.window);
                let n = news.entry(set).or_insert((call.expire_ms, Vec::new()));
                n.1.push((e.synced, e.meter_ix, s.name.clone()));
            }
            // The other hosts' counts, never more than the meter's limit: the store is shared,
            // and what any writer puts there must not shut a client out for longer than its
            // own excess would, nor wrap its counters.
            let others = total.saturating_sub(e.own).min(rules[s.rule].limit_of(m));
            let have = if e.to_prev { a.prev } else { a.cur };
            // The ban meter's previous window holds a ban's end while the program makes the
            // ban held: nothing is added there.
            if e.to_prev && m == Meter::Offered {
                continue;
            }
            let bucket = rules[s.rule].is_bucket(m);
            if bucket && !e.to_prev && a.charged_unknown {
                // Taken as charged by the previous run (see `Synced::cautious`).
                a.charged_unknown = false;
                a.cur = a.cur.max(others);
                continue;
            }
            if others <= have {
                continue;
            }
            let delta = others - have;
            let window = a.window;
            let g = &rules[s.rule];
            let done = if bucket {
                store.charge_bucket(&s.at, g.bucket_ns(delta), g.charge_cap_ns())
            } else {
                store.add_in_window(&s.at, m, window, e.to_prev, delta)
            };
            if done {
                if e.to_prev {
                    a.prev += delta;
                } else {
                    a.cur += delta;
                }
                added += delta;
            }
        }
    }
    let mut announce_failed = None;
    for (set, (expire_ms, who)) in news {
        let keys: Vec<String> = who.iter().map(|(_, _, k)| k.clone()).collect();
        match counts.announce(&set, expire_ms, &keys).await {
            // Announced once a window; a failed announcement is tried again next round.
            Ok(()) => {
                for &(si, mi, _) in &who {
                    synced[si].added[mi].announced = true;
                }
            }
            Err(e) => announce_failed = Some(e),
        }
    }
    let keys = calls.iter().map(|c| c.pairs.len() as u64).sum();
    let calls = calls.len() as u64;
    if last_error.is_none() {
        last_error = announce_failed;
    }
    match last_error {
        // Every sync call failed: the store is gone (the caller reconnects).
        Some(e) if failed == calls => Err(e),
        _ => Ok(Round {
            calls,
            keys,
            failed,
            added,
            last_error: last_error.map(|e| format!("{e:#}")),
            shared_keys: 0,
        }),
    }
}
