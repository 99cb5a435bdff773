//! The sync loop: the rules in force followed, the store walked for clients to sync, a
//! connection kept to the store, and a round run every `fleet.sync_interval`.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::{Duration, Instant},
};

use ratelimit_common::maps::{ClientKey, FleetAdd, KEY_IP, slot_key};
use tracing::{info, warn};

use super::{
    CLOCK_CHECK_EVERY, MAX_SYNCED_KEYS, Owner, RECONNECT_MAX, Round, SCAN_EVERY, Shared,
    counts::{Announce, RedisCounts, Scripts},
    keys::key_name,
    round::round,
    rule::{GlobalRule, announce_sets_now},
    shared_keys::{SharedStates as _, shared_round},
    synced::Synced,
};
use crate::{
    fleet::{Conn, Settings},
    kernel::clients::{ClientStore, SlotRef},
};

/// What the walks of the store found, kept from one to the next.
#[derive(Default)]
struct Walked {
    rules: Vec<GlobalRule>,
    synced: Vec<Synced>,
    last_scan: Option<Instant>,
    /// The first walk of this run done (clients found before it may hold counts a previous
    /// run added).
    walked: bool,
    /// The shared keys of global rules found at the last walk, and what was last written for
    /// them.
    shared_keys: Vec<ClientKey>,
    fleet_last: HashMap<ClientKey, FleetAdd>,
}

/// Reconnecting after the store failed: not before `at`, the wait doubling up to
/// [`RECONNECT_MAX`].
struct Retry {
    at: Option<Instant>,
    backoff: Duration,
}

impl Retry {
    const FIRST: Duration = Duration::from_millis(100);

    /// The store failed (`e`): the next attempt waits, and the failure is reported.
    fn failed(&mut self, shared: &Shared, e: &anyhow::Error) {
        self.at = Some(Instant::now() + self.backoff);
        self.backoff = (self.backoff * 2).min(RECONNECT_MAX);
        shared.update(|r| {
            r.store_errors += 1;
            r.last_error = Some(format!("{e:#}"));
        });
    }
}

/// The sync loop (supervised: an error ends one run, and the supervisor starts another).
pub async fn run<O: Owner>(
    settings: Arc<Settings>,
    interval: Duration,
    store: Arc<ClientStore>,
    owner: Arc<O>,
    shared: Arc<Shared>,
) -> anyhow::Result<()> {
    let scripts = Scripts::default();
    let mut conn: Option<Conn> = None;
    let mut w = Walked::default();
    let mut retry = Retry {
        at: None,
        backoff: Retry::FIRST,
    };
    let mut last_clock = Instant::now();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let t0 = Instant::now();
        if last_clock.elapsed() >= CLOCK_CHECK_EVERY {
            last_clock = Instant::now();
            match owner.check_clock().await {
                Ok(true) => info!("the wall clock moved: its offset rewritten for global rules"),
                Ok(false) => {}
                Err(e) => warn!("checking the wall clock's offset: {e:#}"),
            }
        }
        if w.last_scan.is_none_or(|t| t.elapsed() >= SCAN_EVERY) {
            w.last_scan = Some(Instant::now());
            let now_rules = owner.rules().await?;
            walk(
                &mut w,
                now_rules,
                &settings,
                &store,
                &shared,
                conn.as_mut(),
                &scripts,
            )
            .await?;
        }
        // No clients to share, this host's clock off the store's (`fleet::Clock`), or its
        // host id used by another process too (`fleet::dup`): each global rule holds its
        // threshold here alone.
        if (w.synced.is_empty() && w.shared_keys.is_empty()) || !settings.counting() {
            continue;
        }
        if conn.is_none() {
            if retry.at.is_some_and(|t| Instant::now() < t) {
                continue;
            }
            match settings.connect_for_counts().await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    retry.failed(&shared, &e);
                    continue;
                }
            }
        }
        let c = conn.as_mut().expect("connected above");
        let mut counts = RedisCounts {
            conn: c,
            scripts: &scripts,
            trust: &settings.trust,
        };
        match sync_round(&mut counts, &settings.host_id, &store, &mut w).await {
            Ok(done) => shared.update(|r| {
                retry.backoff = Retry::FIRST;
                retry.at = None;
                r.rounds += 1;
                r.store_calls += done.calls;
                r.keys_published += done.keys;
                r.store_errors += done.failed;
                r.added_total += done.added;
                r.shared_keys = done.shared_keys;
                r.last_round_ms = Some(t0.elapsed().as_secs_f64() * 1e3);
                if done.last_error.is_some() {
                    r.last_error = done.last_error;
                }
            }),
            Err(e) => {
                conn = None;
                retry.failed(&shared, &e);
            }
        }
    }
}

/// A walk, every [`SCAN_EVERY`]: the rules in force (`now_rules`) followed, the shared keys
/// found, and the store walked for the clients to sync (those other hosts announced near
/// their limit among them, read on `conn` if connected).
async fn walk(
    w: &mut Walked,
    now_rules: Vec<GlobalRule>,
    settings: &Settings,
    store: &Arc<ClientStore>,
    shared: &Shared,
    conn: Option<&mut Conn>,
    scripts: &Scripts,
) -> anyhow::Result<()> {
    if now_rules != w.rules {
        follow_rules(w, now_rules, store, shared).await;
    }
    let shared_ix: Vec<u8> = w
        .rules
        .iter()
        .filter(|g| g.kind != KEY_IP)
        .map(|g| g.index)
        .collect();
    w.shared_keys = if shared_ix.is_empty() {
        Vec::new()
    } else {
        let st = store.clone();
        tokio::task::spawn_blocking(move || st.shared_keys(&shared_ix))
            .await
            .map_err(|e| anyhow::anyhow!("the shared keys' walk: {e}"))??
    };
    if !w.rules.is_empty() {
        // The clients other hosts announced near their limit in this window.
        let mut hot = HashSet::new();
        if let Some(c) = conn {
            let sets = announce_sets_now(&w.rules, crate::clock::wall_ns());
            let names: Vec<String> = sets.iter().map(|(_, s)| s.clone()).collect();
            let mut counts = RedisCounts {
                conn: c,
                scripts,
                trust: &settings.trust,
            };
            let members = counts.announced(&names).await;
            for ((rule, _), keys) in sets.iter().zip(members) {
                hot.extend(keys.into_iter().map(|k| (*rule, k)));
            }
        }
        // The walk reads the whole store (tens of ms for a million sources): off the
        // runtime's threads.
        let (st, rs, first) = (store.clone(), w.rules.clone(), !w.walked);
        let synced = std::mem::take(&mut w.synced);
        let (capped, back) = tokio::task::spawn_blocking(move || {
            let mut synced = synced;
            scan(&st, &rs, &hot, &mut synced, first).map(|c| (c, synced))
        })
        .await
        .map_err(|e| anyhow::anyhow!("the store walk: {e}"))??;
        w.synced = back;
        w.walked = true;
        shared.update(|r| {
            r.synced_keys = w.synced.len();
            r.capped_keys = capped;
        });
    }
    Ok(())
}

/// Another rule set (or a threshold in force changed with the pressure level): what was
/// synced and added stays with its rule where the rule still counts the same way (its id),
/// and goes where it does not.
async fn follow_rules(
    w: &mut Walked,
    now_rules: Vec<GlobalRule>,
    store: &Arc<ClientStore>,
    shared: &Shared,
) {
    let rules = &w.rules;
    let by_rid: HashMap<&str, usize> = now_rules
        .iter()
        .enumerate()
        .map(|(i, g)| (g.rid.as_str(), i))
        .collect();
    w.synced
        .retain_mut(|s| match by_rid.get(rules[s.rule].rid.as_str()) {
            Some(&i) if now_rules[i].index == rules[s.rule].index => {
                s.rule = i;
                true
            }
            _ => false,
        });
    w.rules = now_rules;
    shared.update(|r| r.rules = w.rules.iter().map(|g| g.name.clone()).collect());
    // What was written for the shared keys of rules no longer global (or no longer the same
    // rule) goes.
    let keep: HashSet<u8> = w
        .rules
        .iter()
        .filter(|g| g.kind != KEY_IP)
        .map(|g| g.index)
        .collect();
    let st = store.clone();
    let gone =
        tokio::task::spawn_blocking(move || st.retain_fleet_add(&|k| keep.contains(&k.rule)))
            .await
            .unwrap_or(0);
    if gone > 0 {
        info!("{gone} shared keys' fleet counts removed with their rules");
    }
    w.fleet_last.clear();
}

/// One round for the synced clients ([`round`]) and, if it did not fail, one for the shared
/// keys ([`shared_round`]), what they did summed.
async fn sync_round(
    counts: &mut RedisCounts<'_>,
    host: &str,
    store: &ClientStore,
    w: &mut Walked,
) -> anyhow::Result<Round> {
    let mut result = if w.synced.is_empty() {
        Ok(Round::default())
    } else {
        round(counts, host, store, &w.rules, &mut w.synced).await
    };
    if !w.shared_keys.is_empty()
        && let Ok(done) = &mut result
    {
        match shared_round(
            counts,
            host,
            store,
            &w.rules,
            &w.shared_keys,
            &mut w.fleet_last,
            crate::clock::mono_ns(),
            crate::clock::wall_ns(),
        )
        .await
        {
            Ok(s) => {
                done.calls += s.calls;
                done.keys += s.keys;
                done.failed += s.failed;
                done.added += s.added;
                done.shared_keys = s.shared_keys;
                if s.last_error.is_some() {
                    done.last_error = s.last_error;
                }
            }
            Err(e) => result = Err(e),
        }
    }
    result
}

/// Walk the store for clients of global rules to sync: keep those still in their slots,
/// add those whose own count is worth sharing. Returns how many were left out for the cap.
fn scan(
    store: &ClientStore,
    rules: &[GlobalRule],
    hot: &HashSet<(usize, String)>,
    synced: &mut Vec<Synced>,
    first: bool,
) -> anyhow::Result<u64> {
    let by_index: HashMap<u8, usize> = rules
        .iter()
        .enumerate()
        .filter(|(_, r)| r.kind == KEY_IP)
        .map(|(i, r)| (r.index, i))
        .collect();
    let mut known: HashMap<(usize, [u8; 16], u32), usize> = synced
        .iter()
        .enumerate()
        .map(|(i, s)| ((s.rule, s.at.addr, s.at.tag), i))
        .collect();
    let mut keep = vec![false; synced.len()];
    let mut fresh = Vec::new();
    let mut capped = 0u64;
    store.walk_slots(&mut |i, tag, slot| {
        let key = slot_key(tag, slot.addr);
        let Some(&rule) = by_index.get(&key.rule) else {
            return;
        };
        if let Some(&ix) = known.get(&(rule, slot.addr, tag)) {
            keep[ix] = true;
            synced[ix].at.index = i;
            return;
        }
        if !rules[rule].wants(&slot.state)
            && (hot.is_empty() || !hot.contains(&(rule, key_name(&slot.addr, key.prefix_len))))
        {
            return;
        }
        if synced.len() + fresh.len() >= MAX_SYNCED_KEYS {
            capped += 1;
            return;
        }
        let at = SlotRef {
            index: i,
            tag,
            addr: slot.addr,
        };
        let s = Synced::new(rules, rule, at, key.prefix_len);
        let s = if first {
            s.cautious(&rules[rule], &slot.state)
        } else {
            s
        };
        known.insert((rule, slot.addr, tag), usize::MAX);
        fresh.push(s);
    })?;
    // Drop those gone from their slots, and those idle here for two of their windows.
    let mut ix = 0;
    synced.retain(|s| {
        let k = keep[ix];
        ix += 1;
        let idle = Duration::from_nanos(rules[s.rule].interval_ns.saturating_mul(2));
        k && s.active.elapsed() < idle.max(SCAN_EVERY * 2)
    });
    synced.extend(fresh);
    Ok(capped)
}
