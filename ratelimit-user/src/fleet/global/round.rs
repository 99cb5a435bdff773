//! One round for the per-source clients of global rules: their own counts read and published,
//! what the other hosts counted added into their states, the near-limit ones announced.

use std::{collections::BTreeMap, time::Instant};

use ratelimit_common::maps::BAN_HELD_MARK;

use super::{
    Round,
    counts::{Announce, Call, CountStore, Groups, answered, calls_of},
    keys::{announce_set, expire_ms, hash_name},
    rule::GlobalRule,
    synced::{Added, PREV_ROUNDS, SlotStates, Synced, WARM_ROUNDS},
};
use crate::kernel::clients::Meter;

/// One entry of a round: a client's own count of one window of one meter.
struct Entry {
    synced: usize,
    meter_ix: usize,
    to_prev: bool,
    own: u64,
}

/// Near-limit clients to announce in one set: (synced, meter, key).
type News = Vec<(usize, usize, String)>;

/// One round: read, publish, add. Returns (store calls, counts added). The hashes are
/// called in order of their names.
pub async fn round<S: SlotStates + ?Sized, C: CountStore + Announce>(
    counts: &mut C,
    host: &str,
    store: &S,
    rules: &[GlobalRule],
    synced: &mut [Synced],
) -> anyhow::Result<Round> {
    let groups = entries(store, rules, synced);
    let (calls, chunks) = calls_of(groups, |e: &Entry| (synced[e.synced].name.clone(), e.own));
    let answers = counts.sync_all(host, &calls).await;
    let (totals, failed, mut last_error) = answered(answers);
    let (added, news) = take_totals(store, rules, synced, &chunks, &calls, totals);
    let announce_failed = announce(counts, news, synced).await;
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

/// Each synced client's own counts to publish, grouped by the hash they go to: the windows
/// of its meters that are due this round.
fn entries<S: SlotStates + ?Sized>(
    store: &S,
    rules: &[GlobalRule],
    synced: &mut [Synced],
) -> Groups<Entry> {
    // Group entries by the hash they go to.
    let mut groups: Groups<Entry> = BTreeMap::new();
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
            let Some((own_cur, own_prev)) = own_of(g, m, a, stamp, (cur, prev)) else {
                continue;
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
                let expire_ms = expire_ms(window, interval);
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
    groups
}

/// This host's own counts `(cur, prev)` of a meter in window `stamp`: its state's counts less
/// what was added (`a`, started over if the state was made anew); `None` while the program
/// rotates the window (next round).
fn own_of(
    g: &GlobalRule,
    m: Meter,
    a: &mut Added,
    stamp: u64,
    (cur, prev): (u64, u64),
) -> Option<(u64, u64)> {
    Some(if g.is_bucket(m) {
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
            return None;
        }
        (cur.saturating_sub(a.cur), prev.saturating_sub(a.prev))
    })
}

/// Take the fleet totals the store answered (`None` for a call that failed): what the other
/// hosts counted added into the clients' states. Returns the counts added, and the clients
/// now near their limit, to announce (set -> (expiry, clients)).
fn take_totals<S: SlotStates + ?Sized>(
    store: &S,
    rules: &[GlobalRule],
    synced: &mut [Synced],
    chunks: &[Vec<Entry>],
    calls: &[Call],
    answers: Vec<Option<Vec<u64>>>,
) -> (u64, BTreeMap<String, (u64, News)>) {
    let mut added = 0u64;
    // Near-limit clients to announce: set -> (expiry, (synced, meter, key)).
    let mut news: BTreeMap<String, (u64, News)> = BTreeMap::new();
    for ((chunk, call), totals) in chunks.iter().zip(calls).zip(answers) {
        let Some(totals) = totals else {
            continue;
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
    (added, news)
}

/// Announce the near-limit clients of `news`, once a window each: the last failure, if any
/// (a failed announcement is tried again next round).
async fn announce<C: Announce>(
    counts: &mut C,
    news: BTreeMap<String, (u64, News)>,
    synced: &mut [Synced],
) -> Option<anyhow::Error> {
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
    announce_failed
}
