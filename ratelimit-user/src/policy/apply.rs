//! Turning a validated config into map contents (`plan`, pure) and writing them (`apply`).
//!
//! `plan` cannot fail on a config that passed validation, and `apply` writes the maps in an
//! order that never exposes a half-applied rule set to the data plane: entries are added before
//! stale ones are removed, rules are written before the rule count grows and after it shrinks.
//! Capacities were checked by validation, so a map write can only fail for reasons outside
//! the config (memory), and that is reported as such.

use std::collections::{BTreeMap, BTreeSet};

use anyhow::Context as _;
use aya::maps::lpm_trie::Key;
use ratelimit_common::{
    addr::{IpKey, LpmAddr},
    caps::{MAX_PORT_RANGES, MAX_RULE_DST_ENTRIES, MAX_SOURCES_ENTRIES},
    maps::*,
};

use crate::{
    config::{
        Action, Algorithm, Config, Counts, ExceedAction, KeyKind, OverrideTarget, Protocol, Rule,
        Threshold, Unit,
    },
    kernel::datapath::Maps,
};

use super::matching::{
    Read, dests, excepts, fetches, global_flags, more_match, narrow_rules, payload_reads,
};
pub use super::prefixes::{Prefix, close_over_covering, lpm_key, net_of, prefix, prefix_of_lpm};

/// Everything the maps should hold for a config.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub global: GlobalConfig,
    pub rules: Vec<RuleConfig>,
    /// The sources trie: allow, deny, rule source and `except` lists, closed over covering
    /// prefixes.
    pub sources: BTreeMap<Prefix, ListValue>,
    /// The destinations trie: per prefix, the rules whose `dst` list covers it.
    pub dests: BTreeMap<Prefix, u32>,
    pub overrides: BTreeMap<(u32, Prefix), OverrideValue>,
    pub region_overrides: BTreeMap<(u32, [u8; 2]), OverrideValue>,
}

pub fn limit_of(
    t: &Threshold,
    burst: Option<u64>,
    ban: Option<&Threshold>,
    ban_duration: Option<std::time::Duration>,
) -> Limit {
    let interval_ns = t.interval.as_nanos() as u64;
    let burst = burst.unwrap_or(t.amount);
    let ban = ban.unwrap_or(t);
    let (gcra_inc_ns, gcra_burst_ns) = if t.amount == 0 || interval_ns == 0 {
        (0, 0)
    } else {
        (
            ratelimit_common::limiter::gcra_increment(1, t.amount, interval_ns),
            ratelimit_common::limiter::gcra_burst_ns(burst, t.amount, interval_ns),
        )
    };
    Limit {
        threshold: t.amount,
        interval_ns,
        burst,
        ban_threshold: ban.amount,
        ban_interval_ns: ban.interval.as_nanos() as u64,
        // Validation bounds ban durations to 10 years; saturate anyway rather than wrap (a
        // wrapped duration could come out as 0, which the program reads as "until removed").
        ban_duration_ns: ban_duration
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0),
        gcra_inc_ns,
        gcra_burst_ns,
    }
}

/// The limit of counts (a rule's or an override's, [`Counts`]), as configured.
pub fn limit_of_counts(c: &Counts) -> Limit {
    limit_of(&c.threshold, Some(c.burst), c.ban.as_ref(), c.ban_duration)
}

/// The elastic limit of counts: every count (threshold, burst, ban threshold) times F, same
/// intervals and ban duration, token bucket constants computed again ([`Counts::relaxed`]),
/// so the program only selects one of the two. Without elastic, the limit itself: the
/// program selects by the level alone, with nothing to test per packet.
pub fn elastic_limit(c: &Counts) -> Limit {
    limit_of_counts(&c.relaxed().unwrap_or(*c))
}

/// Rule `r` as the program reads it; its payload conditions point into `reads`, the payload
/// reads of all the config's rules ([`payload_reads`]).
pub fn rule_config(r: &Rule, reads: &[Read]) -> RuleConfig {
    let (mut flags, more) = more_match(&r.matcher, reads);
    if r.preview {
        flags |= RULE_PREVIEW;
    }
    if r.exceed_action == ExceedAction::Pass {
        flags |= RULE_EXCEED_PASS;
    }
    if r.threshold.unit == Unit::Bytes {
        flags |= RULE_BYTES;
    }
    let (mut mask, mut value) = (0, 0);
    if let Some(f) = &r.matcher.tcp_flags {
        flags |= RULE_TCP_FLAGS;
        mask = f.mask;
        value = f.value;
    }
    if !r.matcher.src.is_empty() {
        flags |= RULE_SRC_MATCH;
    }
    if r.overrides
        .iter()
        .any(|o| matches!(o.target, OverrideTarget::Cidr(_)))
    {
        flags |= RULE_CIDR_OVERRIDES;
    }
    if r.overrides
        .iter()
        .any(|o| matches!(o.target, OverrideTarget::Region(_)))
    {
        flags |= RULE_REGION_OVERRIDES;
    }
    if r.scope == crate::config::Scope::Global {
        flags |= RULE_GLOBAL;
    }
    let mut ports = [PortRange::default(); MAX_PORT_RANGES];
    for (slot, (lo, hi)) in ports.iter_mut().zip(&r.matcher.dst_ports) {
        *slot = PortRange { lo: *lo, hi: *hi };
    }
    let is_ban = r.action == Action::RateBasedBan;
    let counts = Counts::of_rule(r);
    RuleConfig {
        flags,
        key: match r.key {
            KeyKind::All => KEY_ALL,
            KeyKind::Ip => KEY_IP,
            KeyKind::Region => KEY_REGION,
            KeyKind::Fields(_) => KEY_TUPLE,
        },
        key_fields: match r.key {
            KeyKind::Fields(f) => f.0,
            _ => 0,
        },
        action: if is_ban { ACTION_BAN } else { ACTION_THROTTLE },
        algorithm: match r.algorithm {
            Algorithm::SlidingWindow => ALG_SLIDING_WINDOW,
            Algorithm::TokenBucket => ALG_TOKEN_BUCKET,
            Algorithm::FixedWindow => ALG_FIXED_WINDOW,
        },
        protocol: match r.matcher.protocol {
            None => PROTO_ANY,
            Some(Protocol::Tcp) => PROTO_TCP,
            Some(Protocol::Udp) => PROTO_UDP,
            Some(Protocol::Icmp) => PROTO_ICMP,
            Some(Protocol::Icmpv6) => PROTO_ICMPV6,
        },
        v4_prefix: r.ipv4_prefix,
        v6_prefix: r.ipv6_prefix,
        tcp_flags_mask: mask,
        tcp_flags_value: value,
        port_count: r.matcher.dst_ports.len().min(MAX_PORT_RANGES) as u8,
        _pad: [0; 2],
        ports,
        limit: limit_of_counts(&counts),
        elastic: elastic_limit(&counts),
        // At least 1: a soft limit below 0.0005 rounded to 0, which turns reporting off
        // instead of reporting every client.
        soft_limit_permille: (r.soft_limit * 1000.0).round().clamp(1.0, 1000.0) as u32,
        // The overrides' spans are added in `plan`.
        protect_ms: 0,
        more,
    }
}

/// Whether the kernel makes SYN cookies (`net.ipv4.tcp_syncookies` not 0, in the daemon's
/// network namespace): without them `tracking.syn_cookies` is off, since the program cannot
/// tell a listener with room from one that drops (`cookies.rs`). True if it cannot be read.
pub fn kernel_syncookies_on() -> bool {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_syncookies").map_or(true, |v| v.trim() != "0")
}

pub fn plan(cfg: &Config, preview_all: bool) -> Plan {
    let reads = payload_reads(&cfg.rules);
    let rules: Vec<RuleConfig> = cfg.rules.iter().map(|r| rule_config(r, &reads)).collect();
    let (fetch_count, fetches) = fetches(&reads);
    let match_flags = global_flags(&rules);
    let admission = admission_gcra(
        cfg.tracking.new_sources_per_sec,
        cfg.tracking.new_sources_burst,
    );
    let global = GlobalConfig {
        rule_count: rules.len() as u32,
        preview_all: preview_all as u32,
        admission_inc_ns: admission.0,
        admission_burst_ns: admission.1,
        flags: if cfg.lists.allow.is_empty() {
            0
        } else {
            GLOBAL_HAS_ALLOW
        } | if cfg.lists.deny.is_empty() {
            0
        } else {
            GLOBAL_HAS_DENY
        } | if admission_needs_fine_clock(
            cfg.tracking.new_sources_per_sec,
            cfg.tracking.new_sources_burst,
        ) {
            GLOBAL_ADMISSION_FINE_CLOCK
        } else {
            0
        } | if cfg.tracking.syn_cookies && kernel_syncookies_on() {
            GLOBAL_SYN_COOKIES
        } else {
            0
        } | match_flags,
        generation: 0,
        admission_tick_cap: ratelimit_common::maps::admission_tick_cap(
            cfg.tracking.new_sources_per_sec,
            timer_tick_ns(),
        ),
        store_sets: 0,
        relaxed: 0,
        syn_answer_tick_cap: ratelimit_common::maps::syn_answer_tick_cap(timer_tick_ns()),
        wall_offset_ns: 0,
        narrow_rules: narrow_rules(&rules),
        fetch_count,
        fetches,
    };
    let mut own: Vec<(Prefix, ListValue)> = Vec::new();
    for n in &cfg.lists.allow {
        own.push((
            prefix(&n.trunc()),
            ListValue {
                flags: LIST_ALLOW,
                ..ListValue::default()
            },
        ));
    }
    for n in &cfg.lists.deny {
        own.push((
            prefix(&n.trunc()),
            ListValue {
                flags: LIST_DENY,
                ..ListValue::default()
            },
        ));
    }
    for (i, r) in cfg.rules.iter().enumerate() {
        for n in &r.matcher.src {
            own.push((
                prefix(&n.trunc()),
                ListValue {
                    rule_src_mask: 1 << i,
                    ..ListValue::default()
                },
            ));
        }
    }
    own.extend(excepts(&cfg.rules));
    let sources = close_over_covering(&own);
    let dests = dests(&cfg.rules);
    let mut overrides = BTreeMap::new();
    let mut region_overrides = BTreeMap::new();
    for (i, r) in cfg.rules.iter().enumerate() {
        let rule = Counts::of_rule(r);
        for o in &r.overrides {
            let c = rule.for_override(o);
            let (limit, elastic) = (limit_of_counts(&c), elastic_limit(&c));
            let v = OverrideValue { limit, elastic };
            match &o.target {
                OverrideTarget::Cidr(n) => {
                    overrides.insert((i as u32, prefix(&n.trunc())), v);
                }
                OverrideTarget::Region(code) => {
                    region_overrides.insert((i as u32, *code), v);
                }
            }
        }
    }
    // The precise clock only for the rules that need it (see `needs_fine_clock`), and how
    // long a state stays protected from eviction: what the rule or any override remembers.
    let mut rules = rules;
    for (i, rc) in rules.iter_mut().enumerate() {
        let i = i as u32;
        let own = || {
            overrides
                .iter()
                .filter(|((r, _), _)| *r == i)
                .map(|(_, o)| o)
                .chain(
                    region_overrides
                        .iter()
                        .filter(|((r, _), _)| *r == i)
                        .map(|(_, o)| o),
                )
        };
        // Both limits of each (the same one twice without elastic): either may be in force.
        let limits = |rc: &RuleConfig| {
            let mut v = vec![rc.limit, rc.elastic];
            v.extend(own().flat_map(|o| [o.limit, o.elastic]));
            v
        };
        let limits = limits(rc);
        let fine = limits.iter().any(|l| needs_fine_clock(l, rc.algorithm));
        if fine {
            rc.flags |= RULE_FINE_CLOCK;
        }
        let memory = limits.iter().map(state_memory_ns).fold(0, u64::max);
        rc.protect_ms = protect_ms(memory);
    }
    Plan {
        global,
        rules,
        sources,
        dests,
        overrides,
        region_overrides,
    }
}

/// Make a trie hold exactly `want`. New entries go in before stale ones come out, so no
/// address is ever briefly unlisted — unless old and new together would not fit the map
/// (`capacity`), in which case the stale ones are removed first.
fn sync_list<V: aya::Pod>(
    trie: &mut aya::maps::LpmTrie<aya::maps::MapData, LpmAddr, V>,
    want: &BTreeMap<Prefix, V>,
    capacity: u32,
    what: &str,
) -> anyhow::Result<()> {
    let have: BTreeSet<Prefix> = trie
        .keys()
        .filter_map(|k| k.ok())
        .map(|k| prefix_of_lpm(&k))
        .collect();
    let added = want.keys().filter(|p| !have.contains(p)).count();
    if have.len() + added > capacity as usize {
        for p in have.iter().filter(|p| !want.contains_key(p)) {
            trie.remove(&lpm_key(p))
                .with_context(|| format!("pruning the {what} map"))?;
        }
    }
    for (p, v) in want {
        crate::kernel::datapath::retry_enomem(|| trie.insert(&lpm_key(p), *v, 0))
            .with_context(|| format!("writing the {what} map"))?;
    }
    for p in have {
        if !want.contains_key(&p) && trie.get(&lpm_key(&p), 0).is_ok() {
            trie.remove(&lpm_key(&p))
                .with_context(|| format!("pruning the {what} map"))?;
        }
    }
    Ok(())
}

/// Key of the per-CIDR override trie: the rule index in its leading 32 bits, then the prefix.
fn override_key(rule: u32, p: &Prefix) -> Key<OverrideKey> {
    Key::new(
        OVERRIDE_RULE_BITS + p.0,
        OverrideKey {
            rule_be: rule.to_be(),
            family: LpmAddr::of(&p.1).family,
            addr: p.1.addr,
            _pad: [0; 3],
        },
    )
}

/// Write a plan into the maps.
pub fn apply(maps: &mut Maps, plan: &Plan) -> anyhow::Result<()> {
    sync_list(
        &mut maps.sources,
        &plan.sources,
        MAX_SOURCES_ENTRIES,
        "sources (allow, deny, rule src and except)",
    )?;
    sync_list(
        &mut maps.dests,
        &plan.dests,
        MAX_RULE_DST_ENTRIES,
        "destinations (rule dst)",
    )?;

    let have: Vec<(u32, Prefix)> = maps
        .overrides
        .keys()
        .filter_map(|k| k.ok())
        .map(|k| {
            let d = k.data();
            (
                u32::from_be(d.rule_be),
                (k.prefix_len() - OVERRIDE_RULE_BITS, IpKey { addr: d.addr }),
            )
        })
        .collect();
    for ((rule, p), v) in &plan.overrides {
        let key = override_key(*rule, p);
        crate::kernel::datapath::retry_enomem(|| maps.overrides.insert(&key, *v, 0))
            .context("writing the override map")?;
    }
    for (rule, p) in have {
        if !plan.overrides.contains_key(&(rule, p)) {
            let key = override_key(rule, &p);
            maps.overrides
                .remove(&key)
                .context("pruning the override map")?;
        }
    }
    let have: Vec<RegionOverrideKey> = maps
        .region_overrides
        .keys()
        .filter_map(|k| k.ok())
        .collect();
    for ((rule, region), v) in &plan.region_overrides {
        let key = RegionOverrideKey {
            rule: *rule,
            region: *region,
            _pad: [0; 2],
        };
        maps.region_overrides
            .insert(key, *v, 0)
            .context("writing the region override map")?;
    }
    for k in have {
        if !plan.region_overrides.contains_key(&(k.rule, k.region)) {
            maps.region_overrides
                .remove(&k)
                .context("pruning the region override map")?;
        }
    }

    let old = maps.global.get(&0, 0).unwrap_or_default();
    let shrinking = plan.global.rule_count < old.rule_count;
    // Every write is a new generation: the program's fast-drop entries of the old one are
    // void from then on.
    let mut global = plan.global;
    global.generation = old.generation.wrapping_add(1);
    // The pressure level is the daemon's to write ([`write_relaxed`]), not the config's.
    global.relaxed = old.relaxed;
    global.store_sets = maps.clients.sets();
    global.wall_offset_ns = wall_offset_ns();
    if shrinking {
        maps.global
            .set(0, global, 0)
            .context("writing the global settings")?;
        global.generation = global.generation.wrapping_add(1);
    }
    for (i, r) in plan.rules.iter().enumerate() {
        maps.rules.set(i as u32, *r, 0).context("writing a rule")?;
    }
    maps.global
        .set(0, global, 0)
        .context("writing the global settings")?;
    Ok(())
}

/// Write the pressure level into the data plane: `relaxed` (the level is low) puts the rules'
/// and overrides' elastic limits in force, and not relaxed their limits as configured. One
/// write of the global entry, nothing else: a new generation, so the program's fast-drop
/// entries made under the other level are void from then on.
pub fn write_relaxed(maps: &mut Maps, relaxed: bool) -> anyhow::Result<()> {
    let mut global = maps
        .global
        .get(&0, 0)
        .context("reading the global settings")?;
    global.relaxed = relaxed as u32;
    global.generation = global.generation.wrapping_add(1);
    maps.global
        .set(0, global, 0)
        .context("writing the pressure level")
}

/// CLOCK_REALTIME - CLOCK_MONOTONIC in ns now: what `GlobalConfig::wall_offset_ns` holds, so
/// that global rules count in the wall clock's windows (the same on every host of a fleet).
pub fn wall_offset_ns() -> u64 {
    let clock = |id| {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime fills `ts`; both clocks exist on every Linux.
        unsafe { libc::clock_gettime(id, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    };
    let mono = clock(libc::CLOCK_MONOTONIC);
    clock(libc::CLOCK_REALTIME).saturating_sub(mono)
}

/// Rewrite `GlobalConfig::wall_offset_ns` if the wall clock moved more than `tolerance_ns`
/// against the monotonic one since it was written (an NTP step or slew). True if it did.
pub fn refresh_wall_offset(maps: &mut Maps, tolerance_ns: u64) -> anyhow::Result<bool> {
    let mut global = maps
        .global
        .get(&0, 0)
        .context("reading the global settings")?;
    let now = wall_offset_ns();
    if now.abs_diff(global.wall_offset_ns) <= tolerance_ns {
        return Ok(false);
    }
    global.wall_offset_ns = now;
    global.generation = global.generation.wrapping_add(1);
    maps.global
        .set(0, global, 0)
        .context("writing the wall clock's offset")?;
    Ok(true)
}

/// The pressure level the data plane holds: `Some(true)` when elastic limits are in force.
pub fn read_relaxed(maps: &Maps) -> Option<bool> {
    maps.global.get(&0, 0).ok().map(|g| g.relaxed != 0)
}

/// The kernel's timer tick (the coarse clock's resolution), 4 ms if it cannot be read.
pub fn timer_tick_ns() -> u64 {
    let mut res = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    let rc = unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut res) };
    let ns = res.tv_sec as u64 * 1_000_000_000 + res.tv_nsec as u64;
    if rc != 0 || ns == 0 { 4_000_000 } else { ns }
}

#[cfg(test)]
mod tests {
    use ipnet::IpNet;

    use super::*;

    /// An override with a ban threshold of its own has that one scaled by the rule's elastic
    /// factor, not the rule's (the config check of the same: `config::tests`,
    /// `an_overrides_inherited_ban_threshold_is_checked_as_scaled`).
    #[test]
    fn an_override_s_own_ban_threshold_is_the_one_scaled() {
        let text = "[[rule]]\nname = \"r\"\nthreshold = { count = 10, interval = \"1s\" }\n\
                    action = \"rate_based_ban\"\n\
                    ban_threshold = { count = 600000000, interval = \"1s\" }\nban_duration = \"1m\"\n\
                    [[rule.override]]\ncidr = \"192.0.2.0/24\"\n\
                    threshold = { count = 100, interval = \"1s\" }\n\
                    ban_threshold = { count = 1000, interval = \"1s\" }\nelastic = 2\n";
        let cfg = crate::config::parse("t.toml", text).expect("config");
        let p = plan(&cfg, false);
        let o = p.overrides.values().next().unwrap();
        assert_eq!(
            (o.limit.ban_threshold, o.elastic.ban_threshold),
            (1000, 2000)
        );
    }

    fn fine(rule_body: &str) -> bool {
        let text = format!("[[rule]]\nname = \"r\"\n{rule_body}");
        let cfg = crate::config::parse("t.toml", &text).expect("config");
        plan(&cfg, false).rules[0].flags & RULE_FINE_CLOCK != 0
    }

    /// The sources trie value at every prefix is the union over the listed prefixes covering
    /// it: checked against the quadratic definition on pseudo-random nested prefixes.
    #[test]
    fn sources_are_closed_over_covering_prefixes() {
        let mut own = Vec::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..400 {
            let r = next();
            // Few distinct high bits, so prefixes nest often.
            let v4 = std::net::Ipv4Addr::from(((r as u32) & 0x0f0f_0f0f) | 0x0a00_0000);
            let len = (next() % 33) as u8;
            let net = IpNet::V4(ipnet::Ipv4Net::new(v4, len).unwrap()).trunc();
            let v = match next() % 3 {
                0 => ListValue {
                    rule_src_mask: 0,
                    rule_except_mask: 0,
                    flags: LIST_ALLOW,
                },
                1 => ListValue {
                    rule_src_mask: 0,
                    rule_except_mask: 0,
                    flags: LIST_DENY,
                },
                _ => ListValue {
                    rule_src_mask: 1 << (next() % 16),
                    rule_except_mask: 0,
                    flags: 0,
                },
            };
            own.push((prefix(&net), v));
        }
        let closed = close_over_covering(&own);
        let nets: Vec<(IpNet, ListValue)> =
            own.iter().map(|(p, v)| (net_of(p.0, &p.1), *v)).collect();
        assert_eq!(
            closed.len(),
            nets.iter().map(|(n, _)| *n).collect::<BTreeSet<_>>().len()
        );
        for (p, got) in &closed {
            let n = net_of(p.0, &p.1);
            let want = nets.iter().filter(|(q, _)| q.contains(&n)).fold(
                ListValue::default(),
                |mut a, (_, v)| {
                    a.flags |= v.flags;
                    a.rule_src_mask |= v.rule_src_mask;
                    a
                },
            );
            assert_eq!(*got, want, "{n}");
        }
        // And a hand-checked case: allow /8, deny /16 inside it, a rule source /24 inside that.
        let p = |s: &str| prefix(&s.parse::<IpNet>().unwrap());
        let closed = close_over_covering(&[
            (
                p("10.0.0.0/8"),
                ListValue {
                    rule_src_mask: 0,
                    rule_except_mask: 0,
                    flags: LIST_ALLOW,
                },
            ),
            (
                p("10.1.0.0/16"),
                ListValue {
                    rule_src_mask: 0,
                    rule_except_mask: 0,
                    flags: LIST_DENY,
                },
            ),
            (
                p("10.1.2.0/24"),
                ListValue {
                    rule_src_mask: 2,
                    rule_except_mask: 0,
                    flags: 0,
                },
            ),
            (
                p("192.0.2.0/24"),
                ListValue {
                    rule_src_mask: 1,
                    rule_except_mask: 0,
                    flags: 0,
                },
            ),
        ]);
        assert_eq!(
            closed[&p("10.1.2.0/24")],
            ListValue {
                rule_src_mask: 2,
                rule_except_mask: 0,
                flags: LIST_ALLOW | LIST_DENY
            }
        );
        assert_eq!(
            closed[&p("10.1.0.0/16")],
            ListValue {
                rule_src_mask: 0,
                rule_except_mask: 0,
                flags: LIST_ALLOW | LIST_DENY
            }
        );
        assert_eq!(
            closed[&p("192.0.2.0/24")],
            ListValue {
                rule_src_mask: 1,
                rule_except_mask: 0,
                flags: 0
            }
        );
    }

    /// The admission budget is metered on the precise clock only when its burst refills in
    /// under 50 ms.
    #[test]
    fn admission_budget_clock() {
        let flags = |tracking: &str| {
            let cfg = crate::config::parse(
                "t.toml",
                &format!(
                    "[tracking]\n{tracking}\n[[rule]]\nname = \"r\"\nthreshold = {{ count = 10, interval = \"1s\" }}\n"
                ),
            )
            .unwrap();
            plan(&cfg, false).global.flags & GLOBAL_ADMISSION_FINE_CLOCK
        };
        assert_eq!(flags(""), 0, "no budget");
        // The program's constants: 10k/s is 100 us of budget per new state, a burst of 10k
        // is 1 s of it; no budget is 0.
        assert_eq!(admission_gcra(10_000, 10_000), (100_000, 1_000_000_000));
        assert_eq!(admission_gcra(10_000, 0), (100_000, 100_000));
        assert_eq!(admission_gcra(0, 5), (0, 0));
        assert_eq!(
            flags("new_sources_per_sec = 10000\nnew_sources_burst = 10000"),
            0,
            "refills in 1 s"
        );
        assert_eq!(
            flags("new_sources_per_sec = 10000\nnew_sources_burst = 500"),
            0,
            "refills in 50 ms"
        );
        assert_eq!(
            flags("new_sources_per_sec = 10000\nnew_sources_burst = 100"),
            GLOBAL_ADMISSION_FINE_CLOCK,
            "refills in 10 ms"
        );
    }

    /// The precise clock for exactly the rules whose judgement a tick could change.
    #[test]
    fn fine_clock_only_where_a_tick_matters() {
        // Windows of a second or more: coarse.
        assert!(!fine(r#"threshold = { count = 100, interval = "1s" }"#));
        assert!(!fine(
            r#"threshold = { count = 5, interval = "1h" }
algorithm = "fixed_window""#
        ));
        // A window shorter than a second: fine.
        assert!(fine(r#"threshold = { count = 100, interval = "500ms" }"#));
        // A token bucket whose burst refills in 100 ms: coarse; in 10 ms: fine.
        assert!(!fine(
            r#"threshold = { count = 1000, interval = "1s" }
algorithm = "token_bucket"
burst = 100"#
        ));
        assert!(fine(
            r#"threshold = { count = 1000, interval = "1s" }
algorithm = "token_bucket"
burst = 10"#
        ));
        // A ban meter over a short interval: fine.
        assert!(fine(
            r#"threshold = { count = 100, interval = "1s" }
action = "rate_based_ban"
ban_threshold = { count = 10, interval = "100ms" }
ban_duration = "1m""#
        ));
        // An override with a short interval makes the whole rule fine.
        assert!(fine(
            r#"threshold = { count = 100, interval = "1s" }
[[rule.override]]
cidr = "10.0.0.0/8"
threshold = { count = 10, interval = "200ms" }"#
        ));
    }

    /// A state stays protected from eviction as long as the rule or any of its overrides
    /// remembers a packet: two intervals, two ban intervals, or a token bucket's burst.
    #[test]
    fn protection_spans_what_the_rule_and_its_overrides_remember() {
        let protect = |rule_body: &str| {
            let text = format!("[[rule]]\nname = \"r\"\n{rule_body}");
            let cfg = crate::config::parse("t.toml", &text).expect("config");
            plan(&cfg, false).rules[0].protect_ms
        };
        assert_eq!(
            protect(r#"threshold = { count = 100, interval = "1s" }"#),
            2000
        );
        assert_eq!(
            protect(
                r#"threshold = { count = 100, interval = "1s" }
action = "rate_based_ban"
ban_threshold = { count = 300, interval = "20m" }
ban_duration = "1m""#
            ),
            2 * 20 * 60 * 1000
        );
        // A burst of 10 s at 10 a second: refilled 10 s (and one 100 ms increment) later.
        assert_eq!(
            protect(
                r#"threshold = { count = 10, interval = "1s" }
algorithm = "token_bucket"
burst = 100"#
            ),
            10_100
        );
        assert_eq!(
            protect(
                r#"threshold = { count = 100, interval = "1s" }
[[rule.override]]
cidr = "10.0.0.0/8"
threshold = { count = 10, interval = "1h" }"#
            ),
            2 * 3600 * 1000
        );
    }

    #[test]
    fn constants_round_toward_the_limit_and_saturate() {
        let t: Threshold = "10GiB/1s".parse().unwrap();
        // A ban of 1000 years in ns passes 2^64: it saturates instead of wrapping (to a short
        // ban, or to 0, which the program reads as "until removed").
        let year = std::time::Duration::from_secs(365 * 86_400);
        let l = limit_of(&t, None, None, Some(year * 1000));
        assert_eq!(l.ban_duration_ns, u64::MAX);
        // 1 byte in 0.093 ns is rounded up to 1 ns, never down to 0 (no limit).
        assert_eq!(l.gcra_inc_ns, 1);
        // A soft limit below 0.0005 still reports (at 1 permille), it does not turn off.
        let text = "[[rule]]\nname = \"r\"\nthreshold = { count = 10, interval = \"1s\" }\nsoft_limit = 0.0001\n";
        let cfg = crate::config::parse("t.toml", text).unwrap();
        assert_eq!(rule_config(&cfg.rules[0], &[]).soft_limit_permille, 1);
    }

    fn plan_of(body: &str) -> Plan {
        let text = format!("[[rule]]\nname = \"r\"\n{body}");
        plan(
            &crate::config::parse("t.toml", &text).expect("config"),
            false,
        )
    }

    /// Elastic scales every count of the rule (threshold, burst, ban threshold) and keeps
    /// its intervals and ban duration, with token bucket constants of its own; the limit as
    /// configured is untouched, and a rule without elastic has its limit as its elastic one.
    #[test]
    fn elastic_limits_are_every_count_times_f_precomputed() {
        let p = plan_of(
            r#"threshold = { count = 1000, interval = "1s" }
algorithm = "token_bucket"
burst = 300
action = "rate_based_ban"
ban_threshold = { count = 4000, interval = "10s" }
ban_duration = "1m"
elastic = 1.5"#,
        );
        let r = &p.rules[0];
        let (l, e) = (r.limit, r.elastic);
        assert_eq!((l.threshold, l.burst, l.ban_threshold), (1000, 300, 4000));
        assert_eq!((e.threshold, e.burst, e.ban_threshold), (1500, 450, 6000));
        assert_eq!(
            (e.interval_ns, e.ban_interval_ns, e.ban_duration_ns),
            (l.interval_ns, l.ban_interval_ns, l.ban_duration_ns)
        );
        let th: Threshold = "1500/1s".parse().unwrap();
        assert_eq!(
            (e.gcra_inc_ns, e.gcra_burst_ns),
            (
                ratelimit_common::limiter::gcra_increment(1, 1500, 1_000_000_000),
                ratelimit_common::limiter::gcra_burst_ns(450, 1500, 1_000_000_000)
            )
        );
        assert_eq!(
            e,
            limit_of(
                &th,
                Some(450),
                Some(&"6000/10s".parse().unwrap()),
                Some(std::time::Duration::from_secs(60))
            )
        );
        // The program selects one, by the level; no arithmetic.
        assert_eq!(r.limit_now(true), &e);
        assert_eq!(r.limit_now(false), &l);
        // Without elastic: the limit in both, so the level selects it either way.
        let p = plan_of(r#"threshold = { count = 1000, interval = "1s" }"#);
        assert_eq!(p.rules[0].elastic, p.rules[0].limit);
        assert_eq!(p.rules[0].limit_now(true), &p.rules[0].limit);
        // A throttle's elastic limit has no ban counts; a window rule's burst is the scaled
        // threshold (as the configured one is the threshold).
        let p = plan_of(
            r#"threshold = { count = 7, interval = "1s" }
elastic = 2.5"#,
        );
        let e = p.rules[0].elastic;
        assert_eq!((e.threshold, e.burst, e.ban_threshold), (17, 17, 17));
        assert_eq!(e.ban_interval_ns, 1_000_000_000);
        assert_eq!(e.ban_duration_ns, 0);
    }

    /// An override takes its own factor, or its rule's; its elastic limit scales its own
    /// counts.
    #[test]
    fn overrides_get_their_own_or_the_rules_factor() {
        let p = plan_of(
            r#"threshold = { count = 10, interval = "1s" }
elastic = 2
[[rule.override]]
cidr = "192.0.2.0/24"
threshold = { count = 100, interval = "1s" }
[[rule.override]]
cidr = "198.51.100.0/24"
threshold = { count = 100, interval = "1s" }
elastic = 3"#,
        );
        let mut thresholds: Vec<(u64, u64)> = p
            .overrides
            .values()
            .map(|o| (o.limit.threshold, o.elastic.threshold))
            .collect();
        thresholds.sort();
        assert_eq!(thresholds, [(100, 200), (100, 300)]);
        let p = plan_of(
            r#"threshold = { count = 10, interval = "1s" }
[[rule.override]]
cidr = "192.0.2.0/24"
threshold = { count = 100, interval = "1s" }
elastic = 1.25"#,
        );
        assert_eq!(p.rules[0].elastic, p.rules[0].limit);
        let o = p.overrides.values().next().unwrap();
        assert_eq!((o.limit.threshold, o.elastic.threshold), (100, 125));
        assert_eq!(o.limit_now(false).threshold, 100);
        assert_eq!(o.limit_now(true).threshold, 125);
    }

    /// The fine clock and the eviction protection cover the elastic limit too: either may be
    /// in force.
    #[test]
    fn fine_clock_and_protection_cover_the_elastic_limit() {
        // 20 a second, burst 2: the burst refills in 100 ms, the coarse clock is fine; times
        // 3 the burst (6) refills in 100 ms too. A burst of 1 at 20/s refills in 50 ms, under
        // 3x it (burst 3 at 60/s) in 50 ms as well: scaling keeps the refill time.
        assert!(!fine(
            "threshold = { count = 20, interval = \"1s\" }\nalgorithm = \"token_bucket\"\nburst = 2\nelastic = 3\n"
        ));
        let p = plan_of(
            r#"threshold = { count = 10, interval = "1s" }
action = "rate_based_ban"
ban_threshold = { count = 100, interval = "1m" }
ban_duration = "1h"
elastic = 2"#,
        );
        assert_eq!(p.rules[0].protect_ms, 120_000);
    }
}
