//! Reading the data plane back: counters, per-client state, bans. Pure functions over the maps
//! (plus the clock), shared by the control API, the metrics endpoint and the CLI's tables.

use std::collections::BTreeMap;

use ratelimit_common::{
    addr::IpKey,
    caps::{MAX_IFACES, UNLISTED_SLOT},
    limiter,
    maps::*,
    stats::{self, Counter, global, rule},
};
use serde::{Deserialize, Serialize};

use crate::{
    clock::{mono_ns, rfc3339, wall_of},
    kernel::datapath::Maps,
    policy::apply::net_of,
};

#[derive(Serialize, Deserialize, Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct Pb {
    pub packets: u64,
    pub bytes: u64,
}

impl std::ops::AddAssign for Pb {
    fn add_assign(&mut self, o: Self) {
        self.packets += o.packets;
        self.bytes += o.bytes;
    }
}

/// Counters by name (`stats::global::NAMES`, `stats::rule::NAMES`).
pub type Named = BTreeMap<String, Pb>;

#[derive(Serialize, Deserialize, Default, Debug, Clone, PartialEq)]
pub struct Counters {
    /// Frames seen (the sum of the verdicts).
    pub total: Pb,
    pub verdicts: Named,
    pub reasons: Named,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RuleCounters {
    pub name: String,
    pub counters: Named,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct IfaceCounters {
    pub iface: String,
    pub slot: u32,
    #[serde(flatten)]
    pub counters: Counters,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Stats {
    /// Every slot: the interfaces', the unlisted interfaces', and those of the interfaces no
    /// longer attached.
    #[serde(flatten)]
    pub all: Counters,
    pub interfaces: Vec<IfaceCounters>,
    /// The frames of the interfaces beyond the per-interface slots (`caps::UNLISTED_SLOT`).
    /// Part of `all` (which is what the JSON shows), apart for `/metrics`.
    #[serde(skip)]
    pub unlisted: Counters,
    pub rules: Vec<RuleCounters>,
}

impl Counters {
    /// A verdict's counts (`stats::global::NAMES`); zero for a name it does not have.
    pub fn verdict(&self, name: &str) -> Pb {
        self.verdicts.get(name).copied().unwrap_or_default()
    }

    /// A reason's counts (`stats::global::NAMES`); zero for a name it does not have.
    pub fn reason(&self, name: &str) -> Pb {
        self.reasons.get(name).copied().unwrap_or_default()
    }
}

impl RuleCounters {
    /// One counter of the rule (`stats::rule::NAMES`); zero for a name it does not have.
    pub fn get(&self, counter: &str) -> Pb {
        self.counters.get(counter).copied().unwrap_or_default()
    }
}

impl Stats {
    /// The counters of the rule named `name`.
    pub fn rule(&self, name: &str) -> Option<&RuleCounters> {
        self.rules.iter().find(|r| r.name == name)
    }

    /// The counters of the interface named `iface`.
    pub fn iface(&self, iface: &str) -> Option<&Counters> {
        self.interfaces
            .iter()
            .find(|i| i.iface == iface)
            .map(|i| &i.counters)
    }
}

/// The packets of one global counter (`stats::global::*`) over every interface slot: a
/// few lookups instead of the whole array `stats` reads.
pub fn global_packets(maps: &Maps, index: u32) -> anyhow::Result<u64> {
    let mut sum = 0;
    for slot in 0..MAX_IFACES {
        let vals = maps.stats.get(&(slot * stats::PER_IFACE + index), 0)?;
        sum += vals.iter().map(|c: &Counter| c.packets).sum::<u64>();
    }
    Ok(sum)
}

/// Every counter summed over the CPUs: `[slot][index]`.
fn read_all(maps: &Maps) -> anyhow::Result<Vec<Vec<Pb>>> {
    let mut out = vec![vec![Pb::default(); stats::PER_IFACE as usize]; MAX_IFACES as usize];
    for (i, vals) in maps.stats.iter().enumerate() {
        let vals = vals?;
        let sum = vals.iter().fold(Pb::default(), |mut a, c: &Counter| {
            a += Pb {
                packets: c.packets,
                bytes: c.bytes,
            };
            a
        });
        let slot = i / stats::PER_IFACE as usize;
        if slot < out.len() {
            out[slot][i % stats::PER_IFACE as usize] = sum;
        }
    }
    Ok(out)
}

fn counters(v: &[Pb]) -> Counters {
    let mut c = Counters::default();
    for (i, (name, value)) in global::NAMES.iter().zip(v).enumerate() {
        if (i as u32) < global::VERDICTS {
            c.total += *value;
            c.verdicts.insert(name.to_string(), *value);
        } else {
            c.reasons.insert(name.to_string(), *value);
        }
    }
    c
}

/// Counters by verdict, interface and rule. `ifaces` maps slot → interface name;
/// `rule_names` are the rules in file order.
pub fn stats(
    maps: &Maps,
    ifaces: &[(u32, String)],
    rule_names: &[String],
) -> anyhow::Result<Stats> {
    Ok(stats_of(&read_all(maps)?, ifaces, rule_names))
}

/// [`stats`] of counters already read (`[slot][index]`, as [`read_all`] gives them).
pub fn stats_of(all: &[Vec<Pb>], ifaces: &[(u32, String)], rule_names: &[String]) -> Stats {
    let mut total = vec![Pb::default(); stats::PER_IFACE as usize];
    for slot in all {
        for (t, v) in total.iter_mut().zip(slot) {
            *t += *v;
        }
    }
    let interfaces = ifaces
        .iter()
        .map(|(slot, name)| IfaceCounters {
            iface: name.clone(),
            slot: *slot,
            counters: counters(&all[*slot as usize]),
        })
        .collect();
    let rules = rule_names
        .iter()
        .enumerate()
        .map(|(r, name)| {
            let base = (global::COUNT + r as u32 * rule::COUNT) as usize;
            let counters = (0..rule::COUNT as usize)
                .map(|k| (rule::NAMES[k].to_string(), total[base + k]))
                .collect();
            RuleCounters {
                name: name.clone(),
                counters,
            }
        })
        .collect();
    Stats {
        all: counters(&total),
        interfaces,
        unlisted: all
            .get(UNLISTED_SLOT as usize)
            .map_or_else(Counters::default, |c| counters(c)),
        rules,
    }
}

/// One tracked client, as reports show it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Client {
    pub rule: String,
    pub key: Key,
    /// CIDR for `ip`, country code for `region`, the fields for `fields` (`dst=192.0.2.1
    /// dst_port=53`), `*` for `all` and `overflow`.
    pub client: String,
    pub packets: u64,
    pub bytes: u64,
    pub drops: u64,
    /// Limiter usage now, in threshold units (admitted cost in the sliding interval; spent
    /// burst for the token bucket).
    pub usage: u64,
    /// What `usage` is measured against (threshold or burst).
    pub limit: u64,
    /// Admitted rate, per second, over the current sliding interval.
    pub admitted_per_sec: f64,
    /// Offered rate (every matched packet), per second, where the rule meters it (bans).
    pub offered_per_sec: Option<f64>,
    pub throttled: bool,
    pub above_soft_limit: bool,
    pub last_seen: String,
}

/// What a client state or a ban is keyed by: a prefix (`ip`), every source of its rule
/// (`all`), a region, packet fields (`fields`: destination, ports, protocol), or a rule's
/// shared state for sources it has no room for (`overflow`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Key {
    All,
    Ip,
    Region,
    Fields,
    Overflow,
}

impl Key {
    /// The key of a `ClientKey::kind` (`maps::KEY_*`).
    pub fn of(kind: u8) -> Self {
        match kind {
            KEY_ALL => Key::All,
            KEY_IP => Key::Ip,
            KEY_REGION => Key::Region,
            KEY_TUPLE => Key::Fields,
            _ => Key::Overflow,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Key::All => "all",
            Key::Ip => "ip",
            Key::Region => "region",
            Key::Fields => "fields",
            Key::Overflow => "overflow",
        }
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

pub fn key_name(kind: u8) -> &'static str {
    Key::of(kind).as_str()
}

pub fn client_label(k: &ClientKey) -> String {
    match k.kind {
        KEY_IP => net_of(k.prefix_len, &IpKey { addr: k.addr }).to_string(),
        KEY_REGION => String::from_utf8_lossy(&k.addr[..2]).into_owned(),
        KEY_TUPLE => tuple_label(k),
        _ => "*".to_string(),
    }
}

/// A `KEY_TUPLE` key's fields, as `ip=198.51.100.7 dst=192.0.2.1 dst_port=53 protocol=udp`
/// (the source masked to the rule's prefix: `ip=198.51.100.0` for a /24).
fn tuple_label(k: &ClientKey) -> String {
    let mut parts = Vec::new();
    if k.fields & KEY_FIELD_SRC != 0 {
        parts.push(format!("ip={}", net_of(128, &IpKey { addr: k.src }).addr()));
    }
    if k.fields & KEY_FIELD_DST != 0 {
        parts.push(format!(
            "dst={}",
            net_of(128, &IpKey { addr: k.addr }).addr()
        ));
    }
    if k.fields & KEY_FIELD_DST_PORT != 0 {
        parts.push(format!("dst_port={}", k.prefix_len >> 16));
    }
    if k.fields & KEY_FIELD_SRC_PORT != 0 {
        parts.push(format!("src_port={}", k.prefix_len & 0xffff));
    }
    if k.fields & KEY_FIELD_PROTOCOL != 0 {
        let name = match k.proto {
            PROTO_TCP => "tcp".to_string(),
            PROTO_UDP => "udp".to_string(),
            PROTO_ICMP => "icmp".to_string(),
            PROTO_ICMPV6 => "icmpv6".to_string(),
            n => n.to_string(),
        };
        parts.push(format!("protocol={name}"));
    }
    parts.join(" ")
}

/// Describe one client state against its rule (`None` if the rule no longer exists).
pub fn describe(
    k: &ClientKey,
    s: &ClientState,
    rules: &[(String, RuleConfig)],
    now: u64,
) -> Option<Client> {
    let (name, rc) = rules.get(k.rule as usize)?;
    let l = &rc.limit;
    let interval = l.interval_ns.max(1);
    let (usage, limit) = if rc.algorithm == ALG_TOKEN_BUCKET {
        let debt = s.stamp.saturating_sub(now);
        let per = (interval / l.threshold.max(1)).max(1);
        (debt / per, l.burst)
    } else {
        let w = limiter::window_of(now, interval);
        let (cur, prev) = limiter::rotate(s.stamp, w, s.cur, s.prev);
        let weight = if rc.algorithm == ALG_FIXED_WINDOW {
            0
        } else {
            limiter::prev_weight(now, interval)
        };
        (limiter::sliding_estimate(prev, cur, weight), l.threshold)
    };
    let secs = interval as f64 / 1e9;
    let offered = (rc.action == ACTION_BAN && l.ban_interval_ns > 0).then(|| {
        let bi = l.ban_interval_ns;
        let w = limiter::window_of(now, bi);
        let (cur, prev) = limiter::rotate(s.ban_stamp, w, s.seen_cur, s.seen_prev);
        limiter::sliding_estimate(prev, cur, limiter::prev_weight(now, bi)) as f64
            / (bi as f64 / 1e9)
    });
    let throttled = s.throttled_at(now, interval);
    Some(Client {
        rule: name.clone(),
        key: Key::of(k.kind),
        client: client_label(k),
        packets: s.packets,
        bytes: s.bytes,
        drops: s.drop_count(),
        usage,
        limit,
        admitted_per_sec: if rc.algorithm == ALG_TOKEN_BUCKET {
            0.0
        } else {
            usage as f64 / secs
        },
        offered_per_sec: offered,
        throttled,
        above_soft_limit: limiter::above_share(usage, limit, rc.soft_limit_permille),
        last_seen: rfc3339(wall_of(s.last_ns)),
    })
}

/// Every tracked client (one pass over the map).
pub fn clients(maps: &Maps, rules: &[(String, RuleConfig)]) -> anyhow::Result<Vec<Client>> {
    let now = mono_ns();
    let mut out = Vec::new();
    for_each_client(maps, |k, s| out.extend(describe(k, s, rules, now)))?;
    Ok(out)
}

/// What `top` ranks by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rank {
    Packets,
    Bytes,
    Drops,
}

/// The `n` heaviest tracked clients by `by`, heaviest first. Only those `n` are described, so
/// a walk of a million states allocates next to nothing.
pub fn top(
    maps: &Maps,
    rules: &[(String, RuleConfig)],
    n: usize,
    by: Rank,
) -> anyhow::Result<Vec<Client>> {
    let metric = |s: &ClientState| match by {
        Rank::Packets => s.packets,
        Rank::Bytes => s.bytes,
        Rank::Drops => s.drop_count(),
    };
    // Keep at most 2n candidates; trim to the best n whenever full (amortised O(N log n)).
    // Entries `describe` drops (states of retired rule positions) are kept as candidates too,
    // so keep a margin of extra candidates beyond n.
    let keep = n.saturating_mul(2).max(n + 64);
    let mut best: Vec<(u64, ClientKey, ClientState)> = Vec::new();
    // The keep-th best metric seen so far, once known: anything below it cannot make the cut.
    let mut floor: Option<u64> = None;
    let trim = |best: &mut Vec<(u64, ClientKey, ClientState)>| {
        best.sort_by_key(|e| std::cmp::Reverse(e.0));
        best.truncate(keep);
    };
    let now = mono_ns();
    for_each_client(maps, |k, s| {
        let m = metric(s);
        if n == 0 || floor.is_some_and(|f| m < f) {
            return;
        }
        best.push((m, *k, *s));
        if best.len() >= 2 * keep {
            trim(&mut best);
            floor = best.last().map(|e| e.0);
        }
    })?;
    trim(&mut best);
    let mut out: Vec<Client> = best
        .iter()
        .filter_map(|(_, k, s)| describe(k, s, rules, now))
        .collect();
    out.truncate(n);
    Ok(out)
}

/// Number of tracked per-client states.
pub fn tracked_clients(maps: &Maps) -> anyhow::Result<u64> {
    let mut n = 0u64;
    for_each_client(maps, |_, _| n += 1)?;
    Ok(n)
}

/// Call `f` on every per-client state, then on each rule's aggregate overflow state that has
/// seen a packet (key kind `overflow`). The per-client map is read with BPF_MAP_LOOKUP_BATCH: a
/// few hundred system calls for a million states instead of two per state (next key, then
/// lookup); it falls back to the key walk where the kernel refuses batches. Entries may change
/// while they are read; each is read whole.
///
/// The program's fast-drop entries (`RL_FAST`, per CPU) hold per-client counts of this tick's
/// fast-dropped packets not yet added to the clients' states, and `RL_OVF_TICK` the same for
/// the overflow states: they are added here, so a report is exact once traffic stops, and
/// while it flows no packet is counted twice or left out that was pending when the report
/// began. The program may add an entry's counts to the state at any moment (a new tick, or
/// another packet taking the slot), so a state with pending counts is reported as the state
/// read after a first read of the entries plus what a second read finds still pending, if
/// none of the first read's entries for it went in between; otherwise the state is read again
/// and the entries after it, a few rounds at most.
pub fn for_each_client(
    maps: &Maps,
    mut f: impl FnMut(&ClientKey, &ClientState),
) -> anyhow::Result<()> {
    for_each_client_raced(maps, &mut f, &mut |_| {})
}

/// Where [`for_each_client_raced`] lets a test race the program.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReportPoint {
    /// The pending counts are read, the states not yet.
    PendingRead,
    /// The states are read, the pending counts not yet again.
    StatesRead,
}

/// [`for_each_client`], calling `race` at each [`ReportPoint`] (tests run packets there).
#[doc(hidden)]
pub fn for_each_client_raced(
    maps: &Maps,
    f: &mut dyn FnMut(&ClientKey, &ClientState),
    race: &mut dyn FnMut(ReportPoint),
) -> anyhow::Result<()> {
    let first = fast_entries(maps)?;
    race(ReportPoint::PendingRead);
    let mut held: std::collections::HashMap<ClientKey, ClientState> = Default::default();
    if first.is_empty() {
        for_each_client_state(maps, &mut |k: &ClientKey, s: &ClientState| f(k, s))?;
    } else {
        let keys: std::collections::HashSet<ClientKey> = first.iter().map(|e| e.2.key).collect();
        for_each_client_state(maps, &mut |k: &ClientKey, s: &ClientState| {
            if keys.contains(k) {
                held.insert(*k, *s);
            } else {
                f(k, s)
            }
        })?;
    }
    // Each held state against the entries read after it.
    let ovf_first = ovf_entries(maps)?;
    let ovf_states = overflow_states(maps)?;
    race(ReportPoint::StatesRead);
    let mut before = first;
    for round in 0.. {
        if held.is_empty() {
            break;
        }
        let after = fast_entries(maps)?;
        let mut moved = Vec::new();
        for (k, s) in &held {
            let went_in = before
                .iter()
                .filter(|e| e.2.key == *k)
                .any(|e| !still_pending(&e.2, at(&after, e.0, e.1)));
            if went_in && round < 4 {
                moved.push(*k);
                continue;
            }
            let mut s = *s;
            for e in after.iter().filter(|e| e.2.key == *k) {
                add_pending(&mut s, &e.2);
            }
            f(k, &s);
        }
        if moved.is_empty() {
            break;
        }
        held.retain(|k, _| moved.contains(k));
        for (k, s) in held.iter_mut() {
            match maps.clients.get(k) {
                Some(now) => *s = now,
                // Gone since (evicted or retired): so are its counts.
                None => *s = ClientState::default(),
            }
        }
        held.retain(|_, s| s.packets != 0);
        before = after;
    }
    // The overflow states the same way, per rule.
    let mut before = ovf_first;
    let mut states = ovf_states;
    for round in 0.. {
        let after = ovf_entries(maps)?;
        let mut again = false;
        for (rule, s) in states.iter_mut().enumerate() {
            let Some(st) = s else { continue };
            let went_in = before
                .iter()
                .filter(|e| e.0 == rule as u32)
                .any(|e| !still_pending(&e.2, at(&after, e.0, e.1)));
            if went_in && round < 4 {
                again = true;
                *st = maps
                    .overflow
                    .get(&(rule as u32), 0)
                    .map_err(|e| anyhow::anyhow!("reading the overflow states: {e}"))?;
                continue;
            }
            let mut st = *st;
            for e in after.iter().filter(|e| e.0 == rule as u32) {
                add_pending(&mut st, &e.2);
            }
            *s = None;
            if st.packets != 0 {
                let key = ClientKey {
                    rule: rule as u8,
                    kind: ratelimit_common::maps::KEY_OVERFLOW,
                    ..ClientKey::default()
                };
                f(&key, &st);
            }
        }
        if !again {
            break;
        }
        before = after;
    }
    Ok(())
}

/// Entries of a per-CPU table with counts pending: (index, CPU, entry).
type Entries = Vec<(u32, usize, FastEntry)>;

fn at(entries: &Entries, index: u32, cpu: usize) -> Option<&FastEntry> {
    entries
        .iter()
        .find(|e| e.0 == index && e.1 == cpu)
        .map(|e| &e.2)
}

/// Whether `then`'s pending counts are all still pending in `now` (the same entry, not yet
/// added to its state: nothing but its counts changed, and they only grew).
fn still_pending(then: &FastEntry, now: Option<&FastEntry>) -> bool {
    let Some(now) = now else {
        return false;
    };
    let bare = |e: &FastEntry| FastEntry {
        pending_packets: 0,
        pending_bytes: 0,
        ..*e
    };
    bare(then) == bare(now) && now.pending_packets >= then.pending_packets
}

fn add_pending(s: &mut ClientState, e: &FastEntry) {
    s.packets += e.pending_packets;
    s.bytes += e.pending_bytes;
    s.drops += e.pending_packets;
    s.last_ns = s.last_ns.max(e.now_ns);
    s.last_exceed_ns = s.last_exceed_ns.max(e.now_ns);
}

fn pending_of(
    map: &aya::maps::PerCpuArray<aya::maps::MapData, FastEntry>,
    n: u32,
    what: &str,
) -> anyhow::Result<Entries> {
    let mut out = Vec::new();
    for i in 0..n {
        let per_cpu = map
            .get(&i, 0)
            .map_err(|e| anyhow::anyhow!("reading the {what}: {e}"))?;
        for (cpu, e) in per_cpu.iter().enumerate() {
            if e.pending_packets != 0 {
                out.push((i, cpu, *e));
            }
        }
    }
    Ok(out)
}

/// The fast-drop entries with counts pending, on any CPU.
fn fast_entries(maps: &Maps) -> anyhow::Result<Entries> {
    pending_of(
        &maps.fast,
        ratelimit_common::maps::FAST_ENTRIES,
        "fast-drop entries",
    )
}

/// Per rule (the index): new sources dropped while the overflow state was closed for their
/// tick, still pending on their CPU.
fn ovf_entries(maps: &Maps) -> anyhow::Result<Entries> {
    pending_of(
        &maps.ovf_tick,
        ratelimit_common::caps::MAX_RULES,
        "overflow states' pending counts",
    )
}

fn overflow_states(maps: &Maps) -> anyhow::Result<Vec<Option<ClientState>>> {
    (0..ratelimit_common::caps::MAX_RULES)
        .map(|rule| {
            maps.overflow
                .get(&rule, 0)
                .map(Some)
                .map_err(|e| anyhow::anyhow!("reading the overflow states: {e}"))
        })
        .collect()
}

fn for_each_client_state(
    maps: &Maps,
    f: &mut impl FnMut(&ClientKey, &ClientState),
) -> anyhow::Result<()> {
    maps.clients.walk(f)
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Ban {
    /// The banned prefix; null for an aggregate ban (`key`: `all` or `region`).
    pub cidr: Option<String>,
    /// What is banned: `ip` (the prefix `cidr`), `all` (every source the rule matches) or
    /// `region` (the rule's sources in `region`).
    pub key: Key,
    /// For `key = region`: the ISO 3166 code (`ZZ`: no region known).
    pub region: Option<String>,
    /// CLOCK_MONOTONIC end (not reported; for saving).
    #[serde(skip)]
    pub expires_ns: Option<u64>,
    /// Rule that issued it, or null for an operator's ban.
    pub rule: Option<String>,
    pub manual: bool,
    pub preview: bool,
    pub since: String,
    /// RFC 3339, or null: until removed.
    pub expires: Option<String>,
    pub remaining_secs: Option<f64>,
    pub reason: Option<String>,
    /// The fleet host that issued it, for a ban received from the fleet; null for this
    /// host's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
}

/// Every ban in force now, as (CIDR, entry).
pub fn active_bans(maps: &Maps) -> Vec<(ipnet::IpNet, BanEntry)> {
    let now = mono_ns();
    maps.all_bans()
        .into_iter()
        .filter(|b| limiter::ban_active(b.expires_ns, now))
        .map(|b| (net_of(b.prefix_len, &IpKey { addr: b.addr }), b))
        .collect()
}

/// Every ban in force now: the ban map's, then the aggregate bans of `rules` (see
/// [`aggregate_bans`]).
/// Bans in force now, with their reasons and origins from `notes` (none without), read
/// after the walk of the maps, so the owner task's writes never wait for the walk.
pub fn bans(
    maps: &Maps,
    rules: &[(String, RuleConfig)],
    notes: Option<&crate::policy::ban_notes::BanNotes>,
) -> Vec<Ban> {
    let now = mono_ns();
    let active = active_bans(maps);
    let none = crate::policy::ban_notes::Notes::default();
    let guard = notes.map(|n| n.read());
    let notes = guard.as_deref().unwrap_or(&none);
    let (reasons, origins) = (&notes.reasons, &notes.origins);
    let mut out: Vec<Ban> = active
        .into_iter()
        .map(|(net, b)| {
            let cidr = net.to_string();
            Ban {
                rule: if b.rule == BAN_RULE_NONE {
                    None
                } else {
                    rules.get(b.rule as usize).map(|(n, _)| n.clone())
                },
                manual: b.flags & BAN_MANUAL != 0,
                preview: b.flags & BAN_PREVIEW != 0,
                since: rfc3339(wall_of(b.since_ns)),
                expires: (b.expires_ns != 0).then(|| rfc3339(wall_of(b.expires_ns))),
                remaining_secs: (b.expires_ns != 0).then(|| (b.expires_ns - now) as f64 / 1e9),
                reason: reasons.get(&cidr).cloned(),
                origin: (b.flags & ratelimit_common::maps::BAN_REMOTE != 0)
                    .then(|| origins.get(&cidr).cloned())
                    .flatten(),
                cidr: Some(cidr),
                key: Key::Ip,
                region: None,
                expires_ns: (b.expires_ns != 0).then_some(b.expires_ns),
            }
        })
        .collect();
    drop(guard);
    out.sort_by(|a, b| a.cidr.cmp(&b.cidr));
    out.extend(aggregate_bans(maps, rules, now));
    out
}

/// Bans by rules whose key is `all` or `region` are not in the ban map: they are the end
/// time in the rule's shared state (`banned_until_ns`), one state for `all`, one per region
/// code for `region` (all 676 two-letter codes are looked up: a lookup each, no walk of the
/// per-client map). Their start is the end less the rule's `ban_duration`.
pub fn aggregate_bans(maps: &Maps, rules: &[(String, RuleConfig)], now: u64) -> Vec<Ban> {
    let mut out = Vec::new();
    for (i, (name, r)) in rules.iter().enumerate() {
        if r.action != ACTION_BAN || (r.key != KEY_ALL && r.key != KEY_REGION) {
            continue;
        }
        let key = |region: Option<[u8; 2]>| {
            let mut k = ClientKey {
                rule: i as u8,
                kind: r.key,
                ..ClientKey::default()
            };
            if let Some(c) = region {
                k.addr[0] = c[0];
                k.addr[1] = c[1];
            }
            k
        };
        let keys: Vec<(ClientKey, Option<[u8; 2]>)> = if r.key == KEY_ALL {
            vec![(key(None), None)]
        } else {
            (b'A'..=b'Z')
                .flat_map(|a| (b'A'..=b'Z').map(move |b| [a, b]))
                .map(|c| (key(Some(c)), Some(c)))
                .collect()
        };
        for (k, region) in keys {
            let Ok(st) = maps.clients.shared.get(&k, 0) else {
                continue;
            };
            let until = st.banned_until_ns;
            if until == 0 || until <= now {
                continue;
            }
            out.push(Ban {
                cidr: None,
                key: Key::of(r.key),
                region: region.map(|c| String::from_utf8_lossy(&c).into_owned()),
                rule: Some(name.clone()),
                manual: false,
                preview: r.flags & RULE_PREVIEW != 0,
                since: rfc3339(wall_of(until.saturating_sub(r.limit.ban_duration_ns))),
                expires: Some(rfc3339(wall_of(until))),
                remaining_secs: Some((until - now) as f64 / 1e9),
                reason: None,
                origin: None,
                expires_ns: Some(until),
            });
        }
    }
    out
}
