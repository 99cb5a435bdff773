//! A rule as the program evaluates it (`RULES`): key kinds, actions, algorithms, flags,
//! protocols, port ranges, and its limits (with the clock they are judged on and how long a
//! state under them must be kept).

use crate::caps::MAX_PORT_RANGES;

use super::{MoreMatch, PortRange};

// Rule key kinds (Cloud Armor's enforce-on-key).
/// One bucket for all traffic the rule matches.
pub const KEY_ALL: u8 = 0;
/// One bucket per source address, aggregated to the rule's IPv4/IPv6 prefix.
pub const KEY_IP: u8 = 1;
/// One bucket per country from the GeoIP-derived region map.
pub const KEY_REGION: u8 = 2;
/// The aggregate bucket of a rule's sources that were refused state of their own under a
/// random-source flood (never configured; chosen by the program).
pub const KEY_OVERFLOW: u8 = 3;
/// One bucket per combination of the packet fields in `RuleConfig::key_fields`
/// (`KEY_FIELD_*`): the source prefix, destination address, ports, protocol (`key = "dst"`,
/// `key = ["ip", "dst_port"]`). Its states live beside the shared keys', in `RL_KEYED`.
pub const KEY_TUPLE: u8 = 4;

// `RuleConfig::key_fields` of a `KEY_TUPLE` rule (see `ClientKey` for where each is held).
pub const KEY_FIELD_DST: u8 = 1 << 0;
pub const KEY_FIELD_DST_PORT: u8 = 1 << 1;
pub const KEY_FIELD_SRC_PORT: u8 = 1 << 2;
pub const KEY_FIELD_PROTOCOL: u8 = 1 << 3;
/// The source address, masked to the rule's `v4_prefix` / `v6_prefix` (`ip` with other fields).
pub const KEY_FIELD_SRC: u8 = 1 << 4;

// Actions.
pub const ACTION_THROTTLE: u8 = 0;
pub const ACTION_BAN: u8 = 1;

// Algorithms.
pub const ALG_SLIDING_WINDOW: u8 = 0;
pub const ALG_TOKEN_BUCKET: u8 = 1;
pub const ALG_FIXED_WINDOW: u8 = 2;

// `RuleConfig::flags`.
/// Never drop for this rule; count what would have been dropped.
pub const RULE_PREVIEW: u32 = 1 << 0;
/// `exceed_action = "pass"`: count and report, never drop.
pub const RULE_EXCEED_PASS: u32 = 1 << 1;
/// Threshold is in bytes (frame length) rather than packets.
pub const RULE_BYTES: u32 = 1 << 2;
/// Match TCP flags: `(flags & tcp_flags_mask) == tcp_flags_value` (implies TCP).
pub const RULE_TCP_FLAGS: u32 = 1 << 3;
/// Rule matches only sources in its `src` CIDRs (see `ListValue::rule_src_mask`).
pub const RULE_SRC_MATCH: u32 = 1 << 4;
/// The rule has per-CIDR overrides (skip the override lookup when it has none).
pub const RULE_CIDR_OVERRIDES: u32 = 1 << 5;
/// The rule has per-region overrides.
pub const RULE_REGION_OVERRIDES: u32 = 1 << 6;
/// The rule (or one of its overrides) needs the precise clock (`bpf_ktime_get_ns`); others use
/// the coarse clock (the last timer tick, at most a tick = 1..10 ms behind), which costs a
/// fraction of a clock-source read. See [`needs_fine_clock`].
pub const RULE_FINE_CLOCK: u32 = 1 << 7;
/// `scope = "global"`: the rule's window meters (threshold and ban meter) count in windows of
/// the wall clock (`now + GlobalConfig::wall_offset_ns`), so every host of the fleet counts
/// in the same windows and the daemon can add the fleet's counts into its client's state.
/// A global token bucket also counts what it admits in windows of [`GLOBAL_TB_WINDOW_NS`] of
/// the wall clock (`ClientState::cur`, its window in `prev`), which the daemon shares; it
/// takes the other hosts' admissions out of the bucket by moving the TAT forward.
pub const RULE_GLOBAL: u32 = 1 << 8;
/// The rule has conditions in `RuleConfig::more` (source ports, length, TTL, fragments,
/// ICMP types or codes, payload): one test skips them all for a rule without.
pub const RULE_MORE_MATCH: u32 = 1 << 9;
/// `MoreMatch::icmp_types` is a condition.
pub const RULE_ICMP_TYPES: u32 = 1 << 10;
/// `MoreMatch::icmp_codes` is a condition.
pub const RULE_ICMP_CODES: u32 = 1 << 11;
/// Rule matches only destinations in its `dst` CIDRs (the destinations trie, `RL_DESTS`).
pub const RULE_DST_MATCH: u32 = 1 << 12;
/// Rule never matches sources in its `except` CIDRs (`ListValue::rule_except_mask`).
pub const RULE_EXCEPT: u32 = 1 << 13;
/// `tcp_state = "no_connection"`: matches a TCP segment without SYN that no local socket
/// accepts (`Parsed::conn`).
pub const RULE_TCP_STATE: u32 = 1 << 14;

/// The wall-clock window in which a global token bucket counts its admissions for the fleet
/// (the bucket itself has no window). Long against the sync interval: the admissions between
/// a window's last sync and its end (one sync interval's at most) are the only ones the
/// other hosts never hear of.
pub const GLOBAL_TB_WINDOW_NS: u64 = 10_000_000_000;

/// Intervals at least this long are judged on the coarse clock: a tick is then at most 1% of
/// the interval (window edges move by at most a tick; counts stay exact).
pub const COARSE_MIN_INTERVAL_NS: u64 = 1_000_000_000;
/// A token bucket whose burst refills in at least this long is judged on the coarse clock:
/// within one tick the bucket then still holds what a tick refills, so the admitted rate is
/// exact over any span of a few ticks.
pub const COARSE_MIN_BURST_NS: u64 = 50_000_000;

/// Whether a limit must be judged on the precise clock.
pub fn needs_fine_clock(limit: &Limit, algorithm: u8) -> bool {
    let short = |ns: u64| ns != 0 && ns < COARSE_MIN_INTERVAL_NS;
    if short(limit.interval_ns) || short(limit.ban_interval_ns) {
        return true;
    }
    algorithm == ALG_TOKEN_BUCKET
        && limit.threshold != 0
        && crate::limiter::gcra_burst_ns(limit.burst.max(1), limit.threshold, limit.interval_ns)
            < COARSE_MIN_BURST_NS
}

// Protocol match values (`RuleConfig::protocol`); 0 matches any.
pub const PROTO_ANY: u8 = 0;
pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_ICMPV6: u8 = 58;

/// One rule, as the program evaluates it. `RULES[i]` is rule `i` in file order; the program
/// evaluates `GlobalConfig::rule_count` of them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RuleConfig {
    pub flags: u32,
    pub key: u8,
    pub action: u8,
    pub algorithm: u8,
    pub protocol: u8,
    /// Aggregation prefix for `KEY_IP`, IPv4 (0..=32) and IPv6 (0..=128).
    pub v4_prefix: u8,
    pub v6_prefix: u8,
    pub tcp_flags_mask: u8,
    pub tcp_flags_value: u8,
    /// Number of used entries in `ports`; 0 matches every port (and portless protocols).
    pub port_count: u8,
    /// `KEY_FIELD_*` of a `KEY_TUPLE` rule, else 0.
    pub key_fields: u8,
    pub _pad: [u8; 2],
    pub ports: [PortRange; MAX_PORT_RANGES],
    pub limit: Limit,
    /// Fraction of the threshold (per mille) above which a client is reported as an offender.
    pub soft_limit_permille: u32,
    /// How long, in ms, after its last packet a per-source state of this rule is kept from
    /// eviction while it is throttled or metered toward a ban: [`state_memory_ns`] of the
    /// rule and its overrides, the longest (see the program's `store.rs`).
    pub protect_ms: u32,
    /// `elastic = F`: the limit in force while the host has room ([`GlobalConfig::relaxed`]),
    /// every count of `limit` (threshold, burst, ban threshold) times F, precomputed by the
    /// daemon with its token bucket constants. For a rule without elastic, `limit` itself:
    /// the program selects by the level alone, with nothing to test per packet.
    ///
    /// [`GlobalConfig::relaxed`]: super::GlobalConfig::relaxed
    pub elastic: Limit,
    /// Source ports, length, TTL, fragments, ICMP, payload: with [`RULE_MORE_MATCH`].
    pub more: MoreMatch,
}

/// Thresholds in force for a client: the rule's, or an override's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limit {
    /// Packets (or bytes with `RULE_BYTES`) per `interval_ns`.
    pub threshold: u64,
    pub interval_ns: u64,
    /// Token bucket capacity (same unit as `threshold`).
    pub burst: u64,
    /// Offered rate (all matched packets, admitted or not) above which the client is banned.
    pub ban_threshold: u64,
    pub ban_interval_ns: u64,
    pub ban_duration_ns: u64,
    /// Token bucket constants, computed once by the daemon so the program divides nothing per
    /// packet: the GCRA increment of one unit (`limiter::gcra_increment(1, ..)`) and the burst
    /// tolerance (`limiter::gcra_burst_ns(burst, ..)`).
    pub gcra_inc_ns: u64,
    pub gcra_burst_ns: u64,
}

/// How long after its last packet a state under `limit` still differs from a fresh one, so
/// that evicting it would reset something: the sliding window (and the ban meter, a sliding
/// window too) forgets a packet two intervals after the window it fell in began, a fixed
/// window one interval after, and a token bucket is full again once its theoretical arrival
/// time, at most the burst tolerance and one increment ahead of the last packet, has passed.
pub const fn state_memory_ns(limit: &Limit) -> u64 {
    let a = limit.interval_ns.saturating_mul(2);
    let b = limit.gcra_burst_ns.saturating_add(limit.gcra_inc_ns);
    let c = limit.ban_interval_ns.saturating_mul(2);
    let m = if a > b { a } else { b };
    if m > c { m } else { c }
}

/// [`state_memory_ns`] as `RuleConfig::protect_ms`: whole ms, rounded up, at most `u32::MAX`
/// (49 days).
pub const fn protect_ms(memory_ns: u64) -> u32 {
    let ms = memory_ns.div_ceil(1_000_000);
    if ms > u32::MAX as u64 {
        u32::MAX
    } else {
        ms as u32
    }
}
impl RuleConfig {
    /// The rule's limit in force: its elastic limit while the host has room (`relaxed`),
    /// else its limit as configured. A selection by the level alone, no arithmetic and no
    /// test of the rule: both were precomputed by the daemon, and a rule without elastic has
    /// its limit in both.
    #[inline(always)]
    pub const fn limit_now(&self, relaxed: bool) -> &Limit {
        if relaxed { &self.elastic } else { &self.limit }
    }
}
