//! Global thresholds (`scope = "global"`): a rule whose threshold holds across the fleet.
//!
//! The program counts a global rule's clients in windows of the wall clock
//! (`RULE_GLOBAL`, `GlobalConfig::wall_offset_ns`), so window W is the same span of time on
//! every host. This task, every `fleet.sync_interval`:
//!
//! 1. reads each synced client's window meters from the per-source store's mapping (the
//!    admitted count `cur`/`prev` and, for `rate_based_ban`, the offered count
//!    `seen_cur`/`seen_prev`), takes off what it added itself, and publishes this host's own
//!    count of the window as an absolute value (`<key>|<host>` in a hash per rule, meter,
//!    bucket and window); the store's script adds the change into the key's fleet total and
//!    answers the totals (absolute values make a retry or a replay harmless);
//! 2. adds what the other hosts counted (`total - own - already added`) into the client's
//!    state with an atomic add, the program's own operation, so the program's next verdict
//!    for that client measures the fleet's count against the threshold. It only ever adds.
//!
//! Nothing on the packet path waits for the store. Without it the hosts keep what they were
//! given (it ages out with its window) and each enforces its threshold alone (fail-static).
//! A client is synced once its own count reaches [`PUBLISH_ABOVE_PERMILLE`] of the
//! threshold on this host (found by a walk of the store every [`SCAN_EVERY`]), or once
//! another host announces it, and at most [`MAX_SYNCED_KEYS`] are.
//!
//! The fleet admits about `L * (1 + e)`, where `e` is about `(delay / interval) *
//! (hosts - 1) / hosts` (delay = the sync interval plus the store's round trip): the counts a
//! host has not heard of yet.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use ratelimit_common::{
    limiter,
    maps::{
        ACTION_BAN, ALG_TOKEN_BUCKET, BAN_HELD_MARK, ClientKey, ClientState, FleetAdd,
        GLOBAL_TB_WINDOW_NS, KEY_ALL, KEY_IP, KEY_REGION, RULE_GLOBAL, RuleConfig, slot_key,
    },
};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::{
    fleet::{Conn, Settings},
    kernel::clients::{ClientStore, Meter, SlotRef},
};

/// Buckets the keys of a rule are spread over (one hash per bucket and window, each in a
/// slot of its own on a Redis Cluster).
pub const BUCKETS: u64 = 16;
/// A client is synced once this host counted this share (per mille) of its threshold in a
/// window: the many clients far below it cost the store nothing.
pub const PUBLISH_ABOVE_PERMILLE: u64 = 50;
/// A client whose fleet total reaches this share (per mille) of its threshold in a window is
/// announced: every host that holds a state for it syncs it from its next walk of the store,
/// however little of it that host sees (the hosts below [`PUBLISH_ABOVE_PERMILLE`] would
/// otherwise each let it have their own threshold).
pub const NEAR_LIMIT_PERMILLE: u64 = 500;
/// At most this many clients are synced; the rest are held to the threshold per host.
pub const MAX_SYNCED_KEYS: usize = 100_000;
/// How often the store is walked for clients to sync.
pub const SCAN_EVERY: Duration = Duration::from_secs(1);
/// How often the wall clock's offset is checked (an NTP step moves it), and how far it may
/// drift before it is rewritten.
const CLOCK_CHECK_EVERY: Duration = Duration::from_secs(10);
pub const CLOCK_TOLERANCE_NS: u64 = 1_000_000;
/// The longest wait between two connection attempts to a store that failed: a store back
/// is in use again within about this long.
const RECONNECT_MAX: Duration = Duration::from_secs(1);
/// How many clients one script call carries at most.
const CALL_KEYS: usize = 500;
/// How many members of one announcement set a walk reads at most (a random choice of them:
/// `SRANDMEMBER`): a flood of sources each near its limit makes the sets large (each host
/// announces each of its synced clients once a window, up to [`MAX_SYNCED_KEYS`]), and every
/// host reads every set every [`SCAN_EVERY`]; this bounds what a walk costs the store and
/// the host, 16 sets a rule and meter.
pub const ANNOUNCED_READ_MAX: usize = 2_000;

/// The store's side: for each `(key, own absolute count)`, raise this host's count to it
/// (never lower: a count only grows within a window), add the change into the key's total,
/// and answer the totals in order. KEYS[1] is the hash of one rule, meter, bucket and window;
/// ARGV: host, expiry (unix ms), then key and count pairs.
const SYNC_SCRIPT: &str = r#"
local host = ARGV[1]
local out = {}
for i = 3, #ARGV, 2 do
  local k = ARGV[i]
  local abs = tonumber(ARGV[i + 1])
  local f = k .. '|' .. host
  local old = tonumber(redis.call('HGET', KEYS[1], f) or '0')
  local total
  if abs > old then
    redis.call('HSET', KEYS[1], f, abs)
    total = redis.call('HINCRBY', KEYS[1], k, abs - old)
  else
    total = tonumber(redis.call('HGET', KEYS[1], k) or '0')
  end
  out[#out + 1] = total
end
redis.call('PEXPIREAT', KEYS[1], ARGV[2])
return out
"#;

/// [`SYNC_SCRIPT`] with the fleet key (`crate::fleet::trust`): each host's count of a key goes
/// with its MAC into one field per key, `<key>#m`, as `host,count,mac` entries joined by `;`
/// (this host's entry raised to its count, never lowered), and the script answers each
/// field whole: the hosts sum the entries that verify. A field longer than ARGV[3] (bytes)
/// is started anew. ARGV: host, expiry (unix ms), the longest field, then key, count and MAC
/// triples. The fields are not those of [`SYNC_SCRIPT`]: hosts with and without the key
/// never add into each other's counts.
const SYNC_AUTH_SCRIPT: &str = r#"
local host = ARGV[1]
local maxlen = tonumber(ARGV[3])
local mine = host .. ','
local out = {}
for i = 4, #ARGV, 3 do
  local f = ARGV[i] .. '#m'
  local abs = tonumber(ARGV[i + 1])
  local cur = redis.call('HGET', KEYS[1], f) or ''
  if #cur > maxlen then
    cur = ''
  end
  local old = 0
  local rest = {}
  for e in string.gmatch(cur, '[^;]+') do
    if string.sub(e, 1, #mine) == mine then
      local c = tonumber(string.match(e, '^[^,]*,(%d+)')) or 0
      if c > old then
        old = c
      end
    else
      rest[#rest + 1] = e
    end
  end
  if abs > old then
    rest[#rest + 1] = mine .. ARGV[i + 1] .. ',' .. ARGV[i + 2]
    cur = table.concat(rest, ';')
    redis.call('HSET', KEYS[1], f, cur)
  end
  out[#out + 1] = cur
end
redis.call('PEXPIREAT', KEYS[1], ARGV[2])
return out
"#;

/// A global rule as the data plane holds it.
#[derive(Clone, Debug, PartialEq)]
pub struct GlobalRule {
    pub index: u8,
    pub name: String,
    /// The rule's id in the store: its name and what its counts mean (interval, algorithm,
    /// prefixes, ban interval), so rules of the same name that count differently never mix.
    pub rid: String,
    pub interval_ns: u64,
    pub threshold: u64,
    /// The ban meter's interval and threshold; 0 for a rule that does not ban.
    pub ban_interval_ns: u64,
    pub ban_threshold: u64,
    /// A token bucket's burst (units); `None` for the window algorithms. A global token
    /// bucket counts its admissions in wall-clock windows of [`GLOBAL_TB_WINDOW_NS`]
    /// (`cur`, its window in `prev`), and the other hosts' admissions are taken out of it by
    /// moving its TAT on ([`SlotStates::charge_bucket`]).
    pub burst: Option<u64>,
    /// A token bucket's burst tolerance (ns), the program's `Limit::gcra_burst_ns`; 0 for
    /// the window algorithms.
    pub burst_ns: u64,
    /// The rule's key: `KEY_IP` (per-source states, synced by [`round`]), or `KEY_ALL` /
    /// `KEY_REGION` (shared states, synced by [`shared_round`]).
    pub kind: u8,
}

impl GlobalRule {
    /// The global rules among `rules` (name and configuration, in data-plane order).
    pub fn of(rules: &[(String, RuleConfig)]) -> Vec<GlobalRule> {
        rules
            .iter()
            .enumerate()
            .filter(|(_, (_, r))| {
                r.flags & RULE_GLOBAL != 0 && matches!(r.key, KEY_IP | KEY_ALL | KEY_REGION)
            })
            .map(|(i, (name, r))| {
                let bans = r.action == ACTION_BAN;
                let l = &r.limit;
                let mut what = format!(
                    "{}|{}|{}|{}|{}|{}",
                    l.interval_ns,
                    r.algorithm,
                    r.v4_prefix,
                    r.v6_prefix,
                    if bans { l.ban_interval_ns } else { 0 },
                    r.flags & ratelimit_common::maps::RULE_BYTES
                );
                if r.key != KEY_IP {
                    what.push_str(&format!("|k{}", r.key));
                }
                GlobalRule {
                    index: i as u8,
                    name: name.clone(),
                    rid: format!("{}#{:08x}", name, fnv32(what.as_bytes())),
                    interval_ns: l.interval_ns,
                    threshold: l.threshold,
                    ban_interval_ns: if bans { l.ban_interval_ns } else { 0 },
                    ban_threshold: if bans { l.ban_threshold } else { 0 },
                    burst: (r.algorithm == ALG_TOKEN_BUCKET).then_some(l.burst),
                    burst_ns: if r.algorithm == ALG_TOKEN_BUCKET {
                        l.gcra_burst_ns
                    } else {
                        0
                    },
                    kind: r.key,
                }
            })
            .collect()
    }

    fn meters(&self) -> impl Iterator<Item = (Meter, u64)> + '_ {
        [
            (Meter::Admitted, self.admitted_window_ns()),
            (Meter::Offered, self.ban_interval_ns),
        ]
        .into_iter()
        .filter(|&(_, t)| t > 0)
    }

    /// The window the admitted counts are shared in: the rule's interval, or for a token
    /// bucket [`GLOBAL_TB_WINDOW_NS`].
    pub fn admitted_window_ns(&self) -> u64 {
        if self.burst.is_some() {
            GLOBAL_TB_WINDOW_NS
        } else {
            self.interval_ns
        }
    }

    /// Whether `meter` is a token bucket's admitted count (not a window meter the other
    /// hosts' counts are added into).
    fn is_bucket(&self, meter: Meter) -> bool {
        self.burst.is_some() && meter == Meter::Admitted
    }

    /// Whether a client whose state is `st` is worth syncing: this host's own count in a
    /// window of one of the rule's meters is worth sharing.
    pub fn wants(&self, st: &ClientState) -> bool {
        self.meters().any(|(m, _)| {
            let (cur, prev) = self.own_counts(st, m);
            self.worth(m, cur.max(prev))
        })
    }

    /// The count `meter` is measured against in one of its windows: the threshold, or the
    /// ban threshold; for a token bucket what it can admit in one: a window's refill and
    /// its burst.
    pub fn limit_of(&self, meter: Meter) -> u64 {
        match (meter, self.burst) {
            (Meter::Admitted, None) => self.threshold,
            (Meter::Admitted, Some(burst)) => {
                limiter::mul_div_floor(self.threshold, GLOBAL_TB_WINDOW_NS, self.interval_ns.max(1))
                    .saturating_add(burst)
            }
            (Meter::Offered, _) => self.ban_threshold,
        }
    }

    /// A meter's `(cur, prev)` in `st` (a ban held in the meter is no window: nothing; a
    /// token bucket's previous window is not kept: 0).
    pub fn own_counts(&self, st: &ClientState, m: Meter) -> (u64, u64) {
        match m {
            Meter::Admitted if self.burst.is_some() => (st.cur, 0),
            Meter::Admitted => (st.cur, st.prev),
            Meter::Offered if st.ban_stamp == BAN_HELD_MARK => (0, 0),
            Meter::Offered => (st.seen_cur, st.seen_prev),
        }
    }

    /// A meter's window in `st`.
    pub fn stamp_of(&self, st: &ClientState, m: Meter) -> u64 {
        match m {
            Meter::Admitted if self.burst.is_some() => st.prev,
            Meter::Admitted => st.stamp,
            Meter::Offered => st.ban_stamp,
        }
    }

    /// A token bucket's time (ns) for `units` (`units * interval / threshold`, rounded up as
    /// the program's increment is).
    pub fn bucket_ns(&self, units: u64) -> u64 {
        let t = self.threshold.max(1) as u128;
        let ns = (units as u128 * self.interval_ns as u128).div_ceil(t);
        u64::try_from(ns).unwrap_or(u64::MAX)
    }

    /// How far past now a token bucket's TAT may be moved: its burst tolerance (an empty
    /// bucket) and an interval of debt, which the program
    /// keeps for a global bucket. Without the debt, what the other hosts admitted while this
    /// host's own packets emptied its bucket would be forgiven, and each host would admit
    /// the rate on its own.
    pub fn charge_cap_ns(&self) -> u64 {
        self.burst_ns.saturating_add(self.interval_ns)
    }

    /// Whether `own` (this host's count in a window of `meter`) is worth sharing.
    fn worth(&self, meter: Meter, own: u64) -> bool {
        let l = self.limit_of(meter);
        own > 0 && own.saturating_mul(1000) >= l.saturating_mul(PUBLISH_ABOVE_PERMILLE)
    }

    /// Whether a fleet total of `total` in a window of `meter` is near the limit.
    fn near(&self, meter: Meter, total: u64) -> bool {
        total > 0
            && total.saturating_mul(1000)
                >= self.limit_of(meter).saturating_mul(NEAR_LIMIT_PERMILLE)
    }
}

/// 32-bit FNV-1a.
pub fn fnv32(b: &[u8]) -> u32 {
    b.iter().fold(0x811c_9dc5u32, |h, &c| {
        (h ^ c as u32).wrapping_mul(0x0100_0193)
    })
}

/// The store's name of a client: its masked address and prefix length.
pub fn key_name(addr: &[u8; 16], prefix_len: u32) -> String {
    let a = std::net::Ipv6Addr::from(*addr);
    match a.to_ipv4_mapped() {
        Some(v4) if prefix_len >= 96 => format!("{v4}/{}", prefix_len - 96),
        _ => format!("{a}/{prefix_len}"),
    }
}

/// The bucket of client `name` of rule `rid`.
pub fn bucket_of(rid: &str, name: &str) -> u64 {
    fnv32(format!("{rid}|{name}").as_bytes()) as u64 % BUCKETS
}

/// The hash of `rid`'s counts of `meter` in `bucket` and `window`. The tag `{g<bucket>}`
/// keeps one call's keys in one Cluster slot.
pub fn hash_name(rid: &str, meter: Meter, bucket: u64, window: u64) -> String {
    format!(
        "ratelimit:{{g{bucket}}}:{}:{rid}:{window}",
        meter_tag(meter)
    )
}

/// A meter's letter in the store's names.
fn meter_tag(meter: Meter) -> &'static str {
    match meter {
        Meter::Admitted => "a",
        Meter::Offered => "o",
    }
}

/// What this host added into one meter of one client, and what it published of its own.
#[derive(Clone, Copy, Debug, Default)]
struct Added {
    /// The meter's window when last read (its `stamp`).
    window: u64,
    /// Added into `cur` in `window`, and into `prev` (window - 1).
    cur: u64,
    prev: u64,
    /// Rounds since the meter moved to `window`: the previous window is shared for
    /// [`PREV_ROUNDS`] of them (the other hosts' last counts of it come in late), then no more.
    rounds: u32,
    /// This host announced the client near its limit in `window`.
    announced: bool,
    /// Found with counts this task may have added before it (re)started, which it cannot tell
    /// from the host's own: nothing is published or added for it until its meter's next
    /// window (publishing them as its own would count the other hosts' twice).
    wait_window: bool,
    /// The previous window's counts may hold what a previous run added: not shared.
    prev_unknown: bool,
    /// A token bucket found at the first walk after this task (re)started: what the other
    /// hosts admitted in this window may already be taken out of it by the previous run, so
    /// the first answer's count of them is taken as charged.
    charged_unknown: bool,
    /// This window: this host's own count last published, the fleet total last answered,
    /// and rounds since the last publish.
    published: u64,
    total: u64,
    quiet_rounds: u32,
    /// This host's own count of the previous window last published (a token bucket's
    /// previous window is not kept in its state: this is what it shares of it).
    published_prev: u64,
    /// The last window in which another host was seen counting the client (its fleet total
    /// above this host's own count), kept across windows.
    others_window: Option<u64>,
}

/// A client far from its limit (its fleet total under [`NEAR_LIMIT_PERMILLE`]) whose own
/// count moved less than [`PUBLISH_ABOVE_PERMILLE`] of it is shared every this many rounds
/// (about a second at the default interval), not every round.
const WARM_ROUNDS: u32 = 10;

/// Rounds after a window ends during which its counts are still shared.
const PREV_ROUNDS: u32 = 20;

impl Added {
    /// No other host was seen counting the client in this window or the one before: this
    /// host's counts are all the fleet has of it, so it is shared at the warm pace however
    /// near its limit it is (the program holds it to the threshold here on its own), and its
    /// previous window once. Another host that starts counting it publishes every round as
    /// soon as it sees this host's count in the total; this host sees that host's at its next
    /// publish, within [`WARM_ROUNDS`], and shares it every round from then on.
    fn solo(&self) -> bool {
        self.others_window
            .is_none_or(|w| self.window.saturating_sub(w) > 1)
    }

    /// The meter moved to `stamp`: what was added to the current window is now the previous
    /// window's (the program moved `cur` into `prev`), or nothing if it skipped windows.
    fn roll(&mut self, stamp: u64) {
        if stamp == self.window {
            return;
        }
        let next = stamp == self.window.wrapping_add(1);
        self.prev = if next { self.cur } else { 0 };
        self.published_prev = if next { self.published } else { 0 };
        self.cur = 0;
        self.window = stamp;
        self.rounds = 0;
        self.announced = false;
        self.prev_unknown = self.wait_window;
        self.wait_window = false;
        self.charged_unknown = false;
        self.published = 0;
        self.total = 0;
        self.quiet_rounds = 0;
    }
}

/// A synced client.
#[derive(Clone, Debug)]
pub struct Synced {
    rule: usize,
    at: SlotRef,
    name: String,
    bucket: u64,
    added: [Added; 2],
    /// Last time it counted anything of its own here.
    active: Instant,
}

impl Synced {
    /// Client `at` (its prefix `prefix_len` bits long) of `rules[rule]`, synced from now on.
    pub fn new(rules: &[GlobalRule], rule: usize, at: SlotRef, prefix_len: u32) -> Synced {
        let name = key_name(&at.addr, prefix_len);
        let bucket = bucket_of(&rules[rule].rid, &name);
        Synced {
            rule,
            at,
            name,
            bucket,
            added: [Added::default(); 2],
            active: Instant::now(),
        }
    }

    /// A client found at the first walk after this task (re)started: its state may hold
    /// counts the previous run added, so its current windows are left alone. A token
    /// bucket's own count holds nothing added (its count is shared at once), but the previous
    /// run may have charged it the other hosts' admissions of this window.
    fn cautious(mut self, g: &GlobalRule, st: &ClientState) -> Synced {
        for (a, m) in self.added.iter_mut().zip([Meter::Admitted, Meter::Offered]) {
            a.window = g.stamp_of(st, m);
            if g.is_bucket(m) {
                a.charged_unknown = true;
                a.prev_unknown = true;
            } else {
                a.wait_window = true;
            }
            a.others_window = Some(a.window.wrapping_sub(1));
        }
        self
    }
}

/// The per-source states a round reads and adds into: the program's ([`ClientStore`]).
pub trait SlotStates {
    /// The state in `at`, if the slot still holds that client.
    fn slot_state(&self, at: &SlotRef) -> Option<ClientState>;
    /// Add `delta` into `cur` (or `prev`) of `meter` of `at` if the meter is still in
    /// `window`, atomically; false if the slot or the window moved on.
    fn add_in_window(
        &self,
        at: &SlotRef,
        meter: Meter,
        window: u64,
        to_prev: bool,
        delta: u64,
    ) -> bool;
    /// Take `ns` of bucket time out of the token bucket in `at`: move its TAT on from
    /// CLOCK_MONOTONIC now at the earliest, never past now + `cap_ns`
    /// ([`GlobalRule::charge_cap_ns`]); false if the slot moved on.
    fn charge_bucket(&self, at: &SlotRef, ns: u64, cap_ns: u64) -> bool {
        let _ = (at, ns, cap_ns);
        false
    }
}

impl SlotStates for ClientStore {
    fn slot_state(&self, at: &SlotRef) -> Option<ClientState> {
        ClientStore::slot_state(self, at)
    }

    fn add_in_window(
        &self,
        at: &SlotRef,
        meter: Meter,
        window: u64,
        to_prev: bool,
        delta: u64,
    ) -> bool {
        ClientStore::add_in_window(self, at, meter, window, to_prev, delta)
    }

    fn charge_bucket(&self, at: &SlotRef, ns: u64, cap_ns: u64) -> bool {
        ClientStore::charge_bucket(self, at, ns, cap_ns, crate::clock::mono_ns())
    }
}

/// The store's side of a round: [`SYNC_SCRIPT`] on one hash.
pub trait CountStore {
    /// Raise `host`'s count of each `(key, own)` of `hash` to `own`, have `hash` expire at
    /// `expire_ms` (unix ms), and answer the keys' fleet totals in order.
    fn sync(
        &mut self,
        hash: &str,
        host: &str,
        expire_ms: u64,
        pairs: &[(&str, u64)],
    ) -> impl std::future::Future<Output = anyhow::Result<Vec<u64>>> + Send;

    /// Every call of a round: each call's own answer (one failing costs only its own keys).
    /// One after another by default; a store that can runs them at once.
    fn sync_all(
        &mut self,
        host: &str,
        calls: &[Call],
    ) -> impl std::future::Future<Output = Vec<anyhow::Result<Vec<u64>>>> {
        async move {
            let mut out = Vec::with_capacity(calls.len());
            for c in calls {
                let pairs: Vec<(&str, u64)> =
                    c.pairs.iter().map(|(k, n)| (k.as_str(), *n)).collect();
                out.push(self.sync(&c.hash, host, c.expire_ms, &pairs).await);
            }
            out
        }
    }
}

/// Announcing near-limit clients: a set per rule, meter, bucket and window
/// ([`announce_set`]).
pub trait Announce {
    /// Add `keys` to `set`, which expires at `expire_ms` (unix ms).
    fn announce(
        &mut self,
        set: &str,
        expire_ms: u64,
        keys: &[String],
    ) -> impl std::future::Future<Output = anyhow::Result<()>>;

    /// The members of each of `sets`, at most [`ANNOUNCED_READ_MAX`] of each (an empty list
    /// for a set that cannot be read).
    fn announced(&mut self, sets: &[String])
    -> impl std::future::Future<Output = Vec<Vec<String>>>;
}

/// One script call of a round: a hash, its expiry, and its `(key, own count)` pairs.
#[derive(Clone, Debug)]
pub struct Call {
    pub hash: String,
    pub expire_ms: u64,
    pub pairs: Vec<(String, u64)>,
}

/// [`CountStore`] on Redis: the script on a connection ([`SYNC_SCRIPT`], or
/// [`SYNC_AUTH_SCRIPT`] with the fleet key), the hashes' names in the fleet's namespace.
pub struct RedisCounts<'a> {
    pub conn: &'a mut Conn,
    pub scripts: &'a Scripts,
    pub trust: &'a Arc<crate::fleet::trust::Trust>,
}

/// The count scripts.
#[derive(Clone)]
pub struct Scripts {
    plain: redis::Script,
    auth: redis::Script,
}

impl Default for Scripts {
    fn default() -> Self {
        Self {
            plain: redis::Script::new(SYNC_SCRIPT),
            auth: redis::Script::new(SYNC_AUTH_SCRIPT),
        }
    }
}

impl CountStore for RedisCounts<'_> {
    fn sync(
        &mut self,
        hash: &str,
        host: &str,
        expire_ms: u64,
        pairs: &[(&str, u64)],
    ) -> impl std::future::Future<Output = anyhow::Result<Vec<u64>>> + Send {
        let trust = self.trust.clone();
        let store_hash = trust.store_name(hash);
        let authenticated = trust.authenticated();
        let inv = if authenticated {
            let mut inv = self.scripts.auth.key(&store_hash);
            inv.arg(host)
                .arg(expire_ms)
                .arg(crate::fleet::trust::MAX_COUNT_FIELD);
            for &(key, own) in pairs {
                inv.arg(key)
                    .arg(own)
                    .arg(trust.count_mac(hash, key, host, own));
            }
            inv
        } else {
            let mut inv = self.scripts.plain.key(&store_hash);
            inv.arg(host).arg(expire_ms);
            for &(key, own) in pairs {
                inv.arg(key).arg(own);
            }
            inv
        };
        let keys: Vec<String> = pairs.iter().map(|(k, _)| k.to_string()).collect();
        let hash = hash.to_string();
        let conn = &mut *self.conn;
        async move {
            if !authenticated {
                return Ok(inv.invoke_async(conn).await?);
            }
            let fields: Vec<String> = inv.invoke_async(conn).await?;
            Ok(fields
                .iter()
                .zip(&keys)
                .map(|(f, k)| trust.count_total(&hash, k, f))
                .collect())
        }
    }

    /// Every call at once: one round trip for all (a multiplexed connection pipelines them; a
    /// Cluster's goes to each slot's master).
    async fn sync_all(&mut self, host: &str, calls: &[Call]) -> Vec<anyhow::Result<Vec<u64>>> {
        let mut set = tokio::task::JoinSet::new();
        for (ix, c) in calls.iter().enumerate() {
            let (scripts, trust, mut conn, c, host) = (
                self.scripts.clone(),
                self.trust.clone(),
                self.conn.clone(),
                c.clone(),
                host.to_string(),
            );
            set.spawn(async move {
                let pairs: Vec<(&str, u64)> =
                    c.pairs.iter().map(|(k, n)| (k.as_str(), *n)).collect();
                let mut one = RedisCounts {
                    conn: &mut conn,
                    scripts: &scripts,
                    trust: &trust,
                };
                (ix, one.sync(&c.hash, &host, c.expire_ms, &pairs).await)
            });
        }
        let mut out: Vec<anyhow::Result<Vec<u64>>> = (0..calls.len())
            .map(|_| Err(anyhow::anyhow!("the call's task ended")))
            .collect();
        while let Some(done) = set.join_next().await {
            if let Ok((ix, r)) = done {
                out[ix] = r;
            }
        }
        out
    }
}

impl Announce for RedisCounts<'_> {
    async fn announce(&mut self, set: &str, expire_ms: u64, keys: &[String]) -> anyhow::Result<()> {
        let set = self.trust.store_name(set);
        let mut p = redis::pipe();
        p.cmd("SADD").arg(&set).arg(keys).ignore();
        p.cmd("PEXPIREAT").arg(&set).arg(expire_ms).ignore();
        let () = p.query_async(&mut *self.conn).await?;
        Ok(())
    }

    async fn announced(&mut self, sets: &[String]) -> Vec<Vec<String>> {
        let mut set = tokio::task::JoinSet::new();
        for (ix, name) in sets.iter().enumerate() {
            let (mut conn, name) = (self.conn.clone(), self.trust.store_name(name));
            set.spawn(async move {
                let r: redis::RedisResult<Vec<String>> = redis::cmd("SRANDMEMBER")
                    .arg(&name)
                    .arg(ANNOUNCED_READ_MAX)
                    .query_async(&mut conn)
                    .await;
                (ix, r.unwrap_or_default())
            });
        }
        let mut out = vec![Vec::new(); sets.len()];
        while let Some(Ok((ix, m))) = set.join_next().await {
            out[ix] = m;
        }
        out
    }
}

/// [`CountStore`] in memory, with [`SYNC_SCRIPT`]'s semantics (hashes of fields, expiry by
/// the caller's clock `now_ms`, as Redis expires keys): for simulations and tests.
#[derive(Debug, Default)]
pub struct MemoryCounts {
    /// The store's clock (unix ms).
    pub now_ms: u64,
    hashes: HashMap<String, (u64, HashMap<String, u64>)>,
    /// Announcement sets: expiry (unix ms) and members.
    sets: HashMap<String, (u64, std::collections::BTreeSet<String>)>,
}

impl MemoryCounts {
    /// The script on `hash` at `now_ms`.
    pub fn run(
        &mut self,
        hash: &str,
        host: &str,
        expire_ms: u64,
        pairs: &[(&str, u64)],
    ) -> Vec<u64> {
        let now = self.now_ms;
        if self.hashes.get(hash).is_some_and(|(at, _)| *at <= now) {
            self.hashes.remove(hash);
        }
        let mut out = Vec::with_capacity(pairs.len());
        for &(k, abs) in pairs {
            let f = format!("{k}|{host}");
            let fields = self.hashes.get(hash).map(|(_, f)| f);
            let old = fields.and_then(|h| h.get(&f)).copied().unwrap_or(0);
            let total = if abs > old {
                let (_, h) = self
                    .hashes
                    .entry(hash.to_string())
                    .or_insert((u64::MAX, HashMap::new()));
                h.insert(f, abs);
                let t = h.entry(k.to_string()).or_insert(0);
                *t += abs - old;
                *t
            } else {
                fields.and_then(|h| h.get(k)).copied().unwrap_or(0)
            };
            out.push(total);
        }
        // PEXPIREAT: a hash that does not exist stays so.
        if let Some((at, _)) = self.hashes.get_mut(hash) {
            *at = expire_ms;
        }
        out
    }

    /// Drop the hashes expired at `now_ms` (Redis's own expiry cycle).
    pub fn expire(&mut self) {
        let now = self.now_ms;
        self.hashes.retain(|_, (at, _)| *at > now);
        self.sets.retain(|_, (at, _)| *at > now);
    }

    /// SADD and PEXPIREAT.
    pub fn add_to_set(&mut self, set: &str, expire_ms: u64, keys: &[String]) {
        let e = self
            .sets
            .entry(set.to_string())
            .or_insert((expire_ms, Default::default()));
        e.0 = expire_ms;
        e.1.extend(keys.iter().cloned());
    }

    /// SRANDMEMBER (up to [`ANNOUNCED_READ_MAX`]; the first ones here) at `now_ms`.
    pub fn members(&self, set: &str) -> Vec<String> {
        match self.sets.get(set) {
            Some((at, m)) if *at > self.now_ms => {
                m.iter().take(ANNOUNCED_READ_MAX).cloned().collect()
            }
            _ => Vec::new(),
        }
    }

    /// Hashes held.
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }
}

impl CountStore for MemoryCounts {
    fn sync(
        &mut self,
        hash: &str,
        host: &str,
        expire_ms: u64,
        pairs: &[(&str, u64)],
    ) -> impl std::future::Future<Output = anyhow::Result<Vec<u64>>> + Send {
        std::future::ready(Ok(self.run(hash, host, expire_ms, pairs)))
    }
}

impl Announce for MemoryCounts {
    async fn announce(&mut self, set: &str, expire_ms: u64, keys: &[String]) -> anyhow::Result<()> {
        self.add_to_set(set, expire_ms, keys);
        Ok(())
    }

    async fn announced(&mut self, sets: &[String]) -> Vec<Vec<String>> {
        sets.iter().map(|s| self.members(s)).collect()
    }
}

/// The set announcing `rid`'s near-limit clients of `meter` in `bucket` and `window` (in
/// the bucket's Cluster slot, as its counts).
pub fn announce_set(rid: &str, meter: Meter, bucket: u64, window: u64) -> String {
    format!(
        "ratelimit:{{g{bucket}}}:n:{}:{rid}:{window}",
        meter_tag(meter)
    )
}

/// The announcement sets of every global rule's meters for the windows in force at wall
/// time `unix_ns`: `(rule, set)`.
pub fn announce_sets_now(rules: &[GlobalRule], unix_ns: u64) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (ri, g) in rules.iter().enumerate() {
        if g.kind != KEY_IP {
            continue;
        }
        for (m, interval) in g.meters() {
            let w = unix_ns / interval;
            for b in 0..BUCKETS {
                out.push((ri, announce_set(&g.rid, m, b, w)));
            }
        }
    }
    out
}

/// What `fleet status` shows of global thresholds.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
pub struct GlobalReport {
    /// Global rules in force, by name.
    pub rules: Vec<String>,
    /// Clients whose counts are shared now.
    pub synced_keys: usize,
    /// Shared keys (`key = "all"`, `"region"`) of global rules shared in the last round.
    #[serde(default)]
    pub shared_keys: usize,
    /// Clients left to their host's own count because [`MAX_SYNCED_KEYS`] were synced.
    pub capped_keys: u64,
    /// Sync rounds done, and store calls made (each one script call).
    pub rounds: u64,
    pub store_calls: u64,
    pub store_errors: u64,
    /// Client counts the calls carried (one key of a hash each, read and, when it grew,
    /// written).
    #[serde(default)]
    pub keys_published: u64,
    /// Counts of other hosts added into this host's states, in all (admitted and offered).
    pub added_total: u64,
    /// The last round's duration (ms), and when it ran (ms ago at the time of the report).
    pub last_round_ms: Option<f64>,
    pub last_error: Option<String>,
}

/// The task's state shared with the reports.
#[derive(Default)]
pub struct Shared {
    report: Mutex<GlobalReport>,
}

impl Shared {
    pub fn report(&self) -> GlobalReport {
        self.report
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn update(&self, f: impl FnOnce(&mut GlobalReport)) {
        f(&mut self.report.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

/// Where the task gets the rules in force and has the wall clock's offset checked: the
/// daemon's owner task.
pub trait Owner: Send + Sync + 'static {
    fn rules(&self) -> impl std::future::Future<Output = anyhow::Result<Vec<GlobalRule>>> + Send;
    fn check_clock(&self) -> impl std::future::Future<Output = anyhow::Result<bool>> + Send;
}

/// One entry of a round: a client's own count of one window of one meter.
struct Entry {
    synced: usize,
    meter_ix: usize,
    to_prev: bool,
    own: u64,
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
    let mut rules: Vec<GlobalRule> = Vec::new();
    let mut synced: Vec<Synced> = Vec::new();
    let mut last_scan: Option<Instant> = None;
    // The first walk of this run done (clients found before it may hold counts a previous
    // run added).
    let mut walked = false;
    // The shared keys of global rules found at the last walk, and what was last written for
    // them.
    let mut shared_keys: Vec<ClientKey> = Vec::new();
    let mut fleet_last: HashMap<ClientKey, FleetAdd> = HashMap::new();
    // Reconnecting after the store failed: not before this, doubling up to RECONNECT_MAX.
    let mut retry_at: Option<Instant> = None;
    let mut backoff = Duration::from_millis(100);
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
        if last_scan.is_none_or(|t| t.elapsed() >= SCAN_EVERY) {
            last_scan = Some(Instant::now());
            let now_rules = owner.rules().await?;
            if now_rules != rules {
                // Another rule set (or a threshold in force changed with the pressure level):
                // what was synced and added stays with its rule where the rule still counts
                // the same way (its id), and goes where it does not.
                let by_rid: HashMap<&str, usize> = now_rules
                    .iter()
                    .enumerate()
                    .map(|(i, g)| (g.rid.as_str(), i))
                    .collect();
                synced.retain_mut(|s| match by_rid.get(rules[s.rule].rid.as_str()) {
                    Some(&i) if now_rules[i].index == rules[s.rule].index => {
                        s.rule = i;
                        true
                    }
                    _ => false,
                });
                rules = now_rules;
                shared.update(|r| r.rules = rules.iter().map(|g| g.name.clone()).collect());
                // What was written for the shared keys of rules no longer global (or no longer
                // the same rule) goes.
                let keep: HashSet<u8> = rules
                    .iter()
                    .filter(|g| g.kind != KEY_IP)
                    .map(|g| g.index)
                    .collect();
                let st = store.clone();
                let gone = tokio::task::spawn_blocking(move || {
                    st.retain_fleet_add(&|k| keep.contains(&k.rule))
                })
                .await
                .unwrap_or(0);
                if gone > 0 {
                    info!("{gone} shared keys' fleet counts removed with their rules");
                }
                fleet_last.clear();
            }
            let shared_ix: Vec<u8> = rules
                .iter()
                .filter(|g| g.kind != KEY_IP)
                .map(|g| g.index)
                .collect();
            shared_keys = if shared_ix.is_empty() {
                Vec::new()
            } else {
                let st = store.clone();
                tokio::task::spawn_blocking(move || st.shared_keys(&shared_ix))
                    .await
                    .map_err(|e| anyhow::anyhow!("the shared keys' walk: {e}"))??
            };
            if !rules.is_empty() {
                // The clients other hosts announced near their limit in this window.
                let mut hot = HashSet::new();
                if let Some(c) = conn.as_mut() {
                    let sets = announce_sets_now(&rules, crate::clock::wall_ns());
                    let names: Vec<String> = sets.iter().map(|(_, s)| s.clone()).collect();
                    let mut counts = RedisCounts {
                        conn: c,
                        scripts: &scripts,
                        trust: &settings.trust,
                    };
                    let members = counts.announced(&names).await;
                    for ((rule, _), keys) in sets.iter().zip(members) {
                        hot.extend(keys.into_iter().map(|k| (*rule, k)));
                    }
                }
                // The walk reads the whole store (tens of ms for a million sources): off the
                // runtime's threads.
                let (st, rs, first) = (store.clone(), rules.clone(), !walked);
                let (capped, back) = tokio::task::spawn_blocking(move || {
                    let mut synced = synced;
                    scan(&st, &rs, &hot, &mut synced, first).map(|c| (c, synced))
                })
                .await
                .map_err(|e| anyhow::anyhow!("the store walk: {e}"))??;
                synced = back;
                walked = true;
                shared.update(|r| {
                    r.synced_keys = synced.len();
                    r.capped_keys = capped;
                });
            }
        }
        // No clients to share, this host's clock off the store's (`fleet::Clock`), or its
        // host id used by another process too (`fleet::dup`): each global rule holds its
        // threshold here alone.
        if (synced.is_empty() && shared_keys.is_empty()) || !settings.counting() {
            continue;
        }
        if conn.is_none() {
            if retry_at.is_some_and(|t| Instant::now() < t) {
                continue;
            }
            match settings.connect_for_counts().await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    retry_at = Some(Instant::now() + backoff);
                    backoff = (backoff * 2).min(RECONNECT_MAX);
                    shared.update(|r| {
                        r.store_errors += 1;
                        r.last_error = Some(format!("{e:#}"));
                    });
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
        let mut result = if synced.is_empty() {
            Ok(Round::default())
        } else {
            round(&mut counts, &settings.host_id, &*store, &rules, &mut synced).await
        };
        if !shared_keys.is_empty()
            && let Ok(done) = &mut result
        {
            match shared_round(
                &mut counts,
                &settings.host_id,
                &*store,
                &rules,
                &shared_keys,
                &mut fleet_last,
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
        match result {
            Ok(done) => shared.update(|r| {
                backoff = Duration::from_millis(100);
                retry_at = None;
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
                retry_at = Some(Instant::now() + backoff);
                backoff = (backoff * 2).min(RECONNECT_MAX);
                shared.update(|r| {
                    r.store_errors += 1;
                    r.last_error = Some(format!("{e:#}"));
                });
            }
        }
    }
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

/// The store's name of a shared key: `all`, or `region:<code>` (`ZZ` for unknown).
pub fn shared_key_name(key: &ClientKey) -> String {
    if key.kind == KEY_REGION {
        let code: String = key.addr[..2]
            .iter()
            .map(|&c| {
                if c.is_ascii_alphanumeric() {
                    c as char
                } else {
                    '?'
                }
            })
            .collect();
        format!("region:{code}")
    } else {
        "all".into()
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
    let states = keys_found
        .iter()
        .filter_map(|k| store.shared_state(k).map(|st| (*k, st)));
    // Entries by hash: (expiry, [(key, meter, previous window?, own count)]).
    type Entries = Vec<(usize, usize, bool, u64)>;
    let mut groups: BTreeMap<String, (u64, Entries)> = BTreeMap::new();
    let mut keys: Vec<(ClientKey, usize, String, [u64; 2])> = Vec::new();
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
                let expire_ms = u64::try_from(
                    (window.saturating_add(2) as u128 * interval as u128) / 1_000_000,
                )
                .unwrap_or(u64::MAX)
                .saturating_add(60_000);
                groups
                    .entry(h)
                    .or_insert((expire_ms, Vec::new()))
                    .1
                    .push((ki, mi, to_prev, own));
            }
        }
        keys.push((key, ri, name, windows));
    }
    let mut calls = Vec::new();
    let mut chunks: Vec<Entries> = Vec::new();
    for (hash, (expire_ms, entries)) in groups {
        for chunk in entries.chunks(CALL_KEYS) {
            calls.push(Call {
                hash: hash.clone(),
                expire_ms,
                pairs: chunk
                    .iter()
                    .map(|&(ki, _, _, own)| (keys[ki].2.clone(), own))
                    .collect(),
            });
            chunks.push(chunk.to_vec());
        }
    }
    let answers = counts.sync_all(host, &calls).await;
    // Per key: [meter][window: 0 = w, 1 = w - 1] the others' counts, if answered.
    let mut others: Vec<[[Option<u64>; 2]; 2]> = vec![[[None; 2]; 2]; keys.len()];
    let (mut failed, mut last_error) = (0u64, None);
    for (chunk, totals) in chunks.iter().zip(answers) {
        let totals = match totals {
            Ok(t) => t,
            Err(e) => {
                failed += 1;
                last_error = Some(e);
                continue;
            }
        };
        for (&(ki, mi, to_prev, own), total) in chunk.iter().zip(totals) {
            let g = &rules[keys[ki].1];
            let m = g.meters().nth(mi).expect("a meter of its rule").0;
            others[ki][mi][to_prev as usize] = Some(total.saturating_sub(own).min(g.limit_of(m)));
        }
    }
    let mut added = 0u64;
    let mut written = HashSet::new();
    for ((key, ri, _, windows), o) in keys.iter().zip(&others) {
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

/// What a round did.
#[derive(Debug, Clone, Default)]
pub struct Round {
    pub calls: u64,
    /// Client counts the calls carried.
    pub keys: u64,
    /// Calls that failed (their clients were not synced this round).
    pub failed: u64,
    pub added: u64,
    pub last_error: Option<String>,
    /// Shared keys synced ([`shared_round`]).
    pub shared_keys: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_was_added_follows_the_program_s_rotation() {
        let mut a = Added {
            window: 7,
            cur: 30,
            prev: 5,
            rounds: 3,
            announced: true,
            ..Added::default()
        };
        a.roll(7);
        assert_eq!((a.window, a.cur, a.prev), (7, 30, 5));
        // The next window: the program moved cur into prev, and so did what was added.
        a.roll(8);
        assert_eq!((a.window, a.cur, a.prev, a.rounds), (8, 0, 30, 0));
        // A window skipped: the program started clean.
        a.cur = 4;
        a.roll(10);
        assert_eq!((a.window, a.cur, a.prev), (10, 0, 0));
    }

    #[test]
    fn a_client_is_synced_from_a_share_of_its_threshold() {
        let g = GlobalRule {
            index: 0,
            name: "r".into(),
            rid: "r#0".into(),
            interval_ns: 1_000_000_000,
            threshold: 1000,
            ban_interval_ns: 0,
            ban_threshold: 0,
            burst: None,
            burst_ns: 0,
            kind: KEY_IP,
        };
        assert!(!g.worth(Meter::Admitted, 0));
        assert!(!g.worth(Meter::Admitted, 49));
        assert!(g.worth(Meter::Admitted, 50));
        assert_eq!(g.meters().count(), 1, "a throttle has no ban meter");
    }

    /// One client's state, as the program would hold it.
    struct OneSlot(std::cell::RefCell<ClientState>);

    impl SlotStates for OneSlot {
        fn slot_state(&self, _: &SlotRef) -> Option<ClientState> {
            Some(*self.0.borrow())
        }

        fn add_in_window(
            &self,
            _: &SlotRef,
            meter: Meter,
            window: u64,
            to_prev: bool,
            delta: u64,
        ) -> bool {
            let mut st = self.0.borrow_mut();
            if meter != Meter::Admitted || st.stamp != window {
                return false;
            }
            if to_prev {
                st.prev += delta;
            } else {
                st.cur += delta;
            }
            true
        }
    }

    fn rule() -> Vec<GlobalRule> {
        vec![GlobalRule {
            index: 0,
            name: "r".into(),
            rid: "r#1".into(),
            interval_ns: 1_000_000_000,
            threshold: 1000,
            ban_interval_ns: 0,
            ban_threshold: 0,
            burst: None,
            burst_ns: 0,
            kind: KEY_IP,
        }]
    }

    fn one_client(rules: &[GlobalRule]) -> Vec<Synced> {
        let at = SlotRef {
            index: 0,
            tag: 1,
            addr: std::net::Ipv6Addr::from([0, 0, 0, 0, 0, 0xffff, 0xc000, 0x0201]).octets(),
        };
        vec![Synced::new(rules, 0, at, 128)]
    }

    /// A round against the memory store (which answers at once).
    fn now_round<S: SlotStates>(
        m: &mut MemoryCounts,
        slots: &S,
        rules: &[GlobalRule],
        synced: &mut [Synced],
    ) -> Round {
        ready(round(m, "a", slots, rules, synced))
    }

    /// A future of the memory store, which never waits.
    fn ready<T>(f: impl std::future::Future<Output = anyhow::Result<T>>) -> T {
        let mut f = std::pin::pin!(f);
        match f
            .as_mut()
            .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
        {
            std::task::Poll::Ready(r) => r.unwrap(),
            std::task::Poll::Pending => unreachable!("the memory store answers at once"),
        }
    }

    #[test]
    fn a_client_no_other_host_counts_is_shared_at_the_warm_pace_however_near() {
        let rules = rule();
        let mut synced = one_client(&rules);
        // 900 of 1000: near its limit, and it keeps moving.
        let slots = OneSlot(std::cell::RefCell::new(ClientState {
            stamp: 7,
            cur: 900,
            ..Default::default()
        }));
        let mut m = MemoryCounts::default();
        let rounds = |m: &mut MemoryCounts, synced: &mut Vec<Synced>, n: u32, step: u64| {
            (0..n)
                .map(|_| {
                    let k = now_round(m, &slots, &rules, synced).keys;
                    slots.0.borrow_mut().cur += step;
                    k
                })
                .collect::<Vec<u64>>()
        };
        let next_window = |cur: u64| {
            let mut st = slots.0.borrow_mut();
            st.prev = st.cur;
            st.cur = cur;
            st.stamp += 1;
        };
        // Newly synced: taken as shared for the window it was found in (its count and the
        // previous window's, every round).
        assert_eq!(rounds(&mut m, &mut synced, 3, 5), [2, 2, 2]);
        // No other host counted it in that window: in the next, its first round (both
        // windows), then once in WARM_ROUNDS + 1.
        next_window(600);
        let keys = rounds(&mut m, &mut synced, WARM_ROUNDS + 2, 5);
        assert_eq!(keys, [2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        // Another host counts it: seen at this host's next publish, every round from then on.
        let name = synced[0].name.clone();
        let h = hash_name("r#1", Meter::Admitted, synced[0].bucket, 8);
        m.run(&h, "b", u64::MAX, &[(&name, 10)]);
        let keys = rounds(&mut m, &mut synced, WARM_ROUNDS + 3, 1);
        let first = keys.iter().position(|&k| k == 1).expect("published");
        assert!(first <= WARM_ROUNDS as usize, "{keys:?}");
        assert!(keys[first..].iter().all(|&k| k == 1), "{keys:?}");
        // The next window stays shared every round (another host counted it in the last one).
        next_window(600);
        let keys = rounds(&mut m, &mut synced, 3, 1);
        assert!(keys.iter().all(|&k| k >= 1), "{keys:?}");
    }

    #[test]
    fn what_another_writer_puts_in_the_store_adds_at_most_the_limit() {
        let rules = rule();
        let mut synced = one_client(&rules);
        let slots = OneSlot(std::cell::RefCell::new(ClientState {
            stamp: 7,
            cur: 100,
            ..Default::default()
        }));
        let mut m = MemoryCounts::default();
        let name = synced[0].name.clone();
        let h = hash_name("r#1", Meter::Admitted, synced[0].bucket, 7);
        // Someone writes an absurd count for the client.
        m.run(&h, "evil", u64::MAX, &[(&name, 1 << 62)]);
        let r = now_round(&mut m, &slots, &rules, &mut synced);
        assert_eq!(r.added, 1000, "capped at the threshold");
        assert_eq!(slots.0.borrow().cur, 1100);
        // And published only its own 100.
        assert_eq!(
            m.run(&h, "a", u64::MAX, &[(&name, 0)]),
            vec![(1u64 << 62) + 100]
        );
    }

    #[test]
    fn a_state_made_anew_is_all_its_own_and_a_restart_waits_a_window() {
        let rules = rule();
        let mut synced = one_client(&rules);
        let slots = OneSlot(std::cell::RefCell::new(ClientState {
            stamp: 7,
            cur: 50,
            ..Default::default()
        }));
        let mut m = MemoryCounts::default();
        let name = synced[0].name.clone();
        let h = hash_name("r#1", Meter::Admitted, synced[0].bucket, 7);
        m.run(&h, "b", u64::MAX, &[(&name, 300)]);
        now_round(&mut m, &slots, &rules, &mut synced);
        assert_eq!(slots.0.borrow().cur, 350, "b's 300 added");
        // Evicted and back in the same window: its state holds 20 of its own only.
        slots.0.borrow_mut().cur = 20;
        now_round(&mut m, &slots, &rules, &mut synced);
        // The store keeps this host's 50 (a count never goes down), so the new state gets the
        // fleet's 350 less its own 20: b's 300 and the 30 the old state had counted.
        assert_eq!(
            slots.0.borrow().cur,
            350,
            "the fleet's count, into the new state"
        );
        assert_eq!(
            m.run(&h, "x", u64::MAX, &[(&name, 0)]),
            vec![350],
            "a's 50 kept"
        );

        // A task restarted finds a state holding b's 300 and its own 50: it publishes nothing
        // as its own and adds nothing in that window.
        let st = ClientState {
            stamp: 7,
            cur: 350,
            ..Default::default()
        };
        slots.0.replace(st);
        let mut synced: Vec<Synced> = one_client(&rules)
            .into_iter()
            .map(|s| s.cautious(&rules[0], &st))
            .collect();
        let r = now_round(&mut m, &slots, &rules, &mut synced);
        assert_eq!((r.calls, r.added), (0, 0));
        assert_eq!(slots.0.borrow().cur, 350);
        // Next window: shared again, and the previous one (which may hold what the last run
        // added) is not.
        slots.0.replace(ClientState {
            stamp: 8,
            cur: 10,
            prev: 350,
            ..Default::default()
        });
        let r = now_round(&mut m, &slots, &rules, &mut synced);
        assert_eq!(r.calls, 1, "window 8 only");
        let h8 = hash_name("r#1", Meter::Admitted, synced[0].bucket, 8);
        assert_eq!(m.run(&h8, "x", u64::MAX, &[(&name, 0)]), vec![10]);
    }

    /// A token bucket's state, and the bucket time charged to it.
    struct BucketSlot(
        std::cell::RefCell<ClientState>,
        std::cell::RefCell<Vec<(u64, u64)>>,
    );

    impl SlotStates for BucketSlot {
        fn slot_state(&self, _: &SlotRef) -> Option<ClientState> {
            Some(*self.0.borrow())
        }

        fn add_in_window(&self, _: &SlotRef, _: Meter, _: u64, _: bool, _: u64) -> bool {
            panic!("nothing is added into a token bucket's counts")
        }

        fn charge_bucket(&self, _: &SlotRef, ns: u64, cap_ns: u64) -> bool {
            self.1.borrow_mut().push((ns, cap_ns));
            true
        }
    }

    #[test]
    fn a_token_bucket_is_charged_what_the_other_hosts_admitted() {
        // 100 a second, burst 20: 10 ms of bucket time a packet, 200 ms of burst.
        let rules = vec![GlobalRule {
            burst: Some(20),
            // The daemon's `gcra_burst_ns(20, 100, 1 s)`.
            burst_ns: 200_000_000,
            threshold: 100,
            ..rule().remove(0)
        }];
        let g = &rules[0];
        assert_eq!(g.limit_of(Meter::Admitted), 100 * 10 + 20);
        // Burst 200 ms and an interval (1 s) of debt.
        assert_eq!(
            (g.bucket_ns(3), g.charge_cap_ns()),
            (30_000_000, 1_200_000_000)
        );
        assert_eq!(g.admitted_window_ns(), GLOBAL_TB_WINDOW_NS);
        let w = 176_000_000;
        // This host admitted 60 in wall window w (`cur`, its window in `prev`); the TAT is
        // no window.
        let st = ClientState {
            stamp: 987_654_321,
            cur: 60,
            prev: w,
            ..Default::default()
        };
        assert!(g.wants(&st));
        let slots = BucketSlot(std::cell::RefCell::new(st), Default::default());
        let mut synced = one_client(&rules);
        let mut m = MemoryCounts::default();
        let name = synced[0].name.clone();
        let h = hash_name(&g.rid, Meter::Admitted, synced[0].bucket, w);
        m.run(&h, "b", u64::MAX, &[(&name, 300)]);
        let r = now_round(&mut m, &slots, &rules, &mut synced);
        // Its own 60 published; b's 300 charged: 3 s of bucket time (the charge's cap holds
        // it to an empty bucket and an interval of debt).
        assert_eq!(r.added, 300);
        assert_eq!(
            slots.1.borrow().as_slice(),
            [(3_000_000_000, 1_200_000_000)]
        );
        assert_eq!(m.run(&h, "x", u64::MAX, &[(&name, 0)]), vec![360]);
        // b admits 10 more, this host 5: only b's 10 are charged.
        m.run(&h, "b", u64::MAX, &[(&name, 310)]);
        slots.0.borrow_mut().cur = 65;
        now_round(&mut m, &slots, &rules, &mut synced);
        assert_eq!(slots.1.borrow().last(), Some(&(100_000_000, 1_200_000_000)));
        assert_eq!(m.run(&h, "x", u64::MAX, &[(&name, 0)]), vec![375]);
        // Nothing new: nothing charged.
        let before = slots.1.borrow().len();
        now_round(&mut m, &slots, &rules, &mut synced);
        assert_eq!(slots.1.borrow().len(), before);

        // The next wall window: the program started its count anew. b's late 20 of window w
        // are still charged; this host's last published 65 is what it shares of w.
        {
            let mut st = slots.0.borrow_mut();
            st.prev = w + 1;
            st.cur = 4;
        }
        m.run(&h, "b", u64::MAX, &[(&name, 330)]);
        now_round(&mut m, &slots, &rules, &mut synced);
        assert!(
            slots.1.borrow().contains(&(200_000_000, 1_200_000_000)),
            "{:?}",
            slots.1.borrow()
        );
        assert_eq!(m.run(&h, "x", u64::MAX, &[(&name, 0)]), vec![395]);

        // A task restarted in a window: b's count so far is taken as charged (the previous
        // run may have), what b admits after it is charged.
        let h1 = hash_name(&g.rid, Meter::Admitted, synced[0].bucket, w + 1);
        m.run(&h1, "b", u64::MAX, &[(&name, 50)]);
        let st = *slots.0.borrow();
        let mut synced: Vec<Synced> = one_client(&rules)
            .into_iter()
            .map(|s| s.cautious(g, &st))
            .collect();
        slots.1.borrow_mut().clear();
        now_round(&mut m, &slots, &rules, &mut synced);
        assert!(slots.1.borrow().is_empty(), "{:?}", slots.1.borrow());
        m.run(&h1, "b", u64::MAX, &[(&name, 57)]);
        now_round(&mut m, &slots, &rules, &mut synced);
        assert_eq!(slots.1.borrow().as_slice(), [(70_000_000, 1_200_000_000)]);
    }

    /// One shared key's state, and what was written for it.
    struct OneShared(
        ClientKey,
        std::cell::RefCell<ClientState>,
        std::cell::RefCell<Vec<FleetAdd>>,
    );

    impl SharedStates for OneShared {
        fn shared_keys(&self, _: &[u8]) -> anyhow::Result<Vec<ClientKey>> {
            Ok(vec![self.0])
        }

        fn shared_state(&self, key: &ClientKey) -> Option<ClientState> {
            (*key == self.0).then(|| *self.1.borrow())
        }

        fn set_fleet_add(&self, _: &ClientKey, add: &FleetAdd) -> anyhow::Result<()> {
            self.2.borrow_mut().push(*add);
            Ok(())
        }
    }

    #[test]
    fn a_shared_key_gets_what_the_other_hosts_counted_in_its_windows() {
        let rules = vec![GlobalRule {
            kind: KEY_ALL,
            ..rule().remove(0)
        }];
        let key = ClientKey {
            rule: 0,
            kind: KEY_ALL,
            ..Default::default()
        };
        assert_eq!(shared_key_name(&key), "all");
        let region = ClientKey {
            kind: KEY_REGION,
            addr: [b'D', b'E', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            ..key
        };
        assert_eq!(shared_key_name(&region), "region:DE");
        // Wall window 7 of 1 s; the key's own counts: 100 in window 7, 40 in window 6.
        let unix_ns = 7_500_000_000;
        let mono = 50_000_000_000;
        let one = OneShared(
            key,
            std::cell::RefCell::new(ClientState {
                stamp: 7,
                cur: 100,
                prev: 40,
                last_ns: mono - 1_000_000,
                ..Default::default()
            }),
            Default::default(),
        );
        let mut m = MemoryCounts::default();
        let b = bucket_of("r#1", "all");
        let (h7, h6) = (
            hash_name("r#1", Meter::Admitted, b, 7),
            hash_name("r#1", Meter::Admitted, b, 6),
        );
        m.run(&h7, "b", u64::MAX, &[("all", 300)]);
        m.run(&h6, "b", u64::MAX, &[("all", 50)]);
        let mut last = HashMap::new();
        let keys = [key];
        let run = |m: &mut MemoryCounts, last: &mut HashMap<ClientKey, FleetAdd>, unix_ns| {
            ready(shared_round(
                m, "a", &one, &rules, &keys, last, mono, unix_ns,
            ))
        };
        let r = run(&mut m, &mut last, unix_ns);
        assert_eq!((r.calls, r.keys, r.added, r.shared_keys), (2, 2, 300, 1));
        let want = FleetAdd {
            window: 7,
            cur: 300,
            prev: 50,
            ..Default::default()
        };
        assert_eq!(one.2.borrow().as_slice(), [want]);
        // Its own counts published for each window.
        assert_eq!(m.run(&h7, "x", u64::MAX, &[("all", 0)]), vec![400]);
        assert_eq!(m.run(&h6, "x", u64::MAX, &[("all", 0)]), vec![90]);
        // Nothing new: nothing written again.
        run(&mut m, &mut last, unix_ns);
        assert_eq!(one.2.borrow().len(), 1);
        // The wall clock in window 8 while the key's state is still in 7: its 100 is window 7's
        // (the one before), and it has nothing of window 8.
        let r = run(&mut m, &mut last, 8_100_000_000);
        assert_eq!(r.keys, 2);
        let h8 = hash_name("r#1", Meter::Admitted, b, 8);
        assert_eq!(m.run(&h8, "x", u64::MAX, &[("all", 0)]), vec![0]);
        assert_eq!(
            one.2.borrow().last(),
            Some(&FleetAdd {
                window: 8,
                cur: 0,
                prev: 300,
                ..Default::default()
            })
        );
        // What another writer puts in the store counts at most the threshold.
        m.run(&h8, "evil", u64::MAX, &[("all", 1 << 60)]);
        run(&mut m, &mut last, 8_200_000_000);
        assert_eq!(one.2.borrow().last().unwrap().cur, 1000);
        // A key idle for two intervals is not shared.
        one.1.borrow_mut().last_ns = mono - 3_000_000_000;
        let r = run(&mut m, &mut last, 8_300_000_000);
        assert_eq!((r.calls, r.shared_keys), (0, 0));
    }

    #[test]
    fn a_walk_reads_at_most_a_bounded_share_of_an_announcement_set() {
        let mut m = MemoryCounts::default();
        let keys: Vec<String> = (0..5_000)
            .map(|i| format!("198.18.{}.{}/32", i / 256, i % 256))
            .collect();
        m.add_to_set("s", u64::MAX, &keys);
        assert_eq!(m.members("s").len(), ANNOUNCED_READ_MAX);
        m.add_to_set("t", u64::MAX, &keys[..10]);
        assert_eq!(m.members("t").len(), 10);
    }

    #[test]
    fn the_memory_store_follows_the_script() {
        let mut m = MemoryCounts {
            now_ms: 1_000,
            ..Default::default()
        };
        // Nothing of its own: no hash made, totals 0.
        assert_eq!(m.run("h", "a", 5_000, &[("k", 0)]), vec![0]);
        assert!(m.is_empty());
        assert_eq!(m.run("h", "a", 5_000, &[("k", 10), ("j", 3)]), vec![10, 3]);
        assert_eq!(m.run("h", "b", 5_000, &[("k", 4)]), vec![14]);
        // Absolute counts: a replay or a lower count changes nothing, a higher one adds the rise.
        assert_eq!(m.run("h", "a", 5_000, &[("k", 10)]), vec![14]);
        assert_eq!(m.run("h", "a", 5_000, &[("k", 7)]), vec![14]);
        assert_eq!(m.run("h", "a", 6_000, &[("k", 12)]), vec![16]);
        // Expired at its time (the last PEXPIREAT's).
        m.now_ms = 6_000;
        assert_eq!(m.run("h", "b", 9_000, &[("k", 4)]), vec![4]);
        m.now_ms = 9_000;
        m.expire();
        assert!(m.is_empty());
    }

    #[test]
    fn store_names_are_readable_and_cluster_safe() {
        let v4: std::net::Ipv6Addr = "::ffff:198.51.100.7".parse().unwrap();
        assert_eq!(key_name(&v4.octets(), 128), "198.51.100.7/32");
        let v6: std::net::Ipv6Addr = "2001:db8::".parse().unwrap();
        assert_eq!(key_name(&v6.octets(), 64), "2001:db8::/64");
        assert_eq!(
            hash_name("r#00000001", Meter::Offered, 3, 42),
            "ratelimit:{g3}:o:r#00000001:42"
        );
    }
}
