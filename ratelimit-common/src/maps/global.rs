//! Settings of the whole program (`GLOBAL[0]`, flags `GLOBAL_*`) and the new-source admission
//! budget (`ADMISSION[0]`) with its per-tick caps.

use super::{Fetches, rule::COARSE_MIN_BURST_NS};

/// Load-time-independent settings the daemon may change at any time (`GLOBAL[0]`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GlobalConfig {
    pub rule_count: u32,
    /// Non-zero: act as if every rule and ban were in preview (`ratelimit run --preview`).
    pub preview_all: u32,
    /// The new-source admission budget as the program meters it (GCRA, see `Admission`): ns
    /// of budget one new state costs, 0 for no budget. Computed by the daemon from
    /// `tracking.new_sources_per_sec` ([`admission_gcra`]), so no packet pays a division.
    pub admission_inc_ns: u64,
    /// Burst tolerance in ns: `tracking.new_sources_burst` states at once.
    pub admission_burst_ns: u64,
    /// `GLOBAL_*` flags: which lists are non-empty, so empty ones cost no lookup.
    pub flags: u32,
    /// Bumped by the daemon at every policy write: fast-drop entries (`FastEntry`) made under
    /// another generation are void.
    pub generation: u32,
    /// Most new states one CPU inserts in one timer tick ([`admission_tick_cap`]), 0 for no
    /// cap: a budget's burst is spread over ticks instead of stalling the receive ring.
    pub admission_tick_cap: u32,
    /// Sets of the per-source store (`RL_CLIENTS` entries / [`STORE_WAYS`]), written by the
    /// daemon from the map it holds; 0 until then (no per-source state: sources are limited
    /// in their rule's overflow state).
    ///
    /// [`STORE_WAYS`]: super::STORE_WAYS
    pub store_sets: u32,
    /// Non-zero while the host has room (the daemon's pressure level is low): rules and
    /// overrides with `elastic` meter against their elastic limit ([`RuleConfig::elastic`],
    /// [`OverrideValue::elastic`]). 0 (under pressure, and in maps no daemon has written yet):
    /// every limit as configured. The daemon writes it alone, one write of this entry, when
    /// the level changes.
    ///
    /// [`RuleConfig::elastic`]: super::RuleConfig::elastic
    /// [`OverrideValue::elastic`]: super::OverrideValue::elastic
    pub relaxed: u32,
    /// With [`GLOBAL_SYN_COOKIES`]: how many TCP packets of sources refused state one CPU looks
    /// at again in one timer tick (answers with a cookie, hands to a listener, passes to a
    /// connection): [`syn_answer_tick_cap`].
    pub syn_answer_tick_cap: u32,
    /// CLOCK_REALTIME - CLOCK_MONOTONIC in ns, written by the daemon: rules with
    /// [`RULE_GLOBAL`] meter in windows of `now + wall_offset_ns` (the wall clock's), which
    /// every host of a fleet shares.
    ///
    /// [`RULE_GLOBAL`]: super::RULE_GLOBAL
    pub wall_offset_ns: u64,
    /// How many of the first rules match on nothing but what a fast-drop entry keys on
    /// (source, protocol, destination port, TCP flags, interface) and key on the source: a
    /// refusal by one of them is remembered for the tick (`FastEntry`); a refusal by a later
    /// rule is not, since a like packet could match an earlier rule that reads other fields
    /// (a length, a destination, ...) and get another verdict.
    pub narrow_rules: u32,
    /// How many of `fetches` are used.
    pub fetch_count: u32,
    /// The distinct payload reads of all rules (`RuleConfig::more.payload`), made once per
    /// packet before the rules.
    pub fetches: Fetches,
}
/// How many TCP packets of sources refused state one CPU answers or hands on a second, at
/// most ([`GlobalConfig::syn_answer_tick_cap`]): about what one CPU of the kernel's stack
/// answers with SYN cookies, so a flood gets no more replies than it would with nothing
/// attached, and no more than one (no larger) per SYN.
pub const SYN_ANSWERS_PER_SEC: u64 = 200_000;

/// [`SYN_ANSWERS_PER_SEC`] as a cap a tick, on a kernel whose timer tick is `tick_ns`; at
/// least 16.
pub fn syn_answer_tick_cap(tick_ns: u64) -> u32 {
    ((SYN_ANSWERS_PER_SEC as u128 * tick_ns as u128) / 1_000_000_000).clamp(16, u32::MAX as u128)
        as u32
}

/// The per-CPU, per-tick cap on new states for a budget of `rate` per second, on a kernel
/// whose timer tick is `tick_ns`: twice the budget's share of a tick, and at least 64. An
/// insert into a full store costs up to a microsecond (it reads the last-seen times of the
/// 16 slots of two sets no cache holds); a burst of 10,000 at once holds a
/// CPU for ~10 ms, longer than a 256-frame receive ring lasts at a million frames per second,
/// while 64 take well under 0.1 ms.
pub fn admission_tick_cap(rate: u64, tick_ns: u64) -> u32 {
    if rate == 0 {
        return 0;
    }
    let share = (rate as u128 * tick_ns as u128).div_ceil(1_000_000_000) * 2;
    share.clamp(64, u32::MAX as u128) as u32
}

/// `GlobalConfig::flags`: the allow list has entries.
pub const GLOBAL_HAS_ALLOW: u32 = 1 << 0;
/// `GlobalConfig::flags`: the deny list has entries.
pub const GLOBAL_HAS_DENY: u32 = 1 << 1;
/// `GlobalConfig::flags`: the new-source admission budget is metered on the precise clock
/// (its burst refills in under [`COARSE_MIN_BURST_NS`]); otherwise on the coarse clock, like
/// a token bucket rule. See [`admission_needs_fine_clock`].
pub const GLOBAL_ADMISSION_FINE_CLOCK: u32 = 1 << 2;
/// `GlobalConfig::flags`: `tracking.syn_cookies`: TCP SYNs from sources refused state are
/// answered with SYN cookies from XDP, and a valid cookie's ACK proves its source.
pub const GLOBAL_SYN_COOKIES: u32 = 1 << 3;
/// `GlobalConfig::flags`: a rule has `tcp_state`: TCP segments without SYN that are
/// addressed to this host get a socket lookup before the rules (`Parsed::conn`).
pub const GLOBAL_TCP_STATE: u32 = 1 << 4;
/// `GlobalConfig::flags`: a rule has `dst` CIDRs (the destinations trie is looked up).
pub const GLOBAL_DST_MATCH: u32 = 1 << 5;
/// `GlobalConfig::flags`: a rule has `RULE_MORE_MATCH` (the fields it reads are read from the
/// frame before the rules).
pub const GLOBAL_MORE_MATCH: u32 = 1 << 6;
/// `GlobalConfig::flags`: a rule is keyed by the destination or the source port (`KEY_TUPLE`
/// with `KEY_FIELD_DST` or `KEY_FIELD_SRC_PORT`: they are read from the frame before the
/// rules).
pub const GLOBAL_KEY_TUPLE: u32 = 1 << 7;

/// The admission budget's GCRA constants for `rate` new states per second, `burst` at once:
/// (`admission_inc_ns`, `admission_burst_ns`), (0, 0) for no budget.
pub fn admission_gcra(rate: u64, burst: u64) -> (u64, u64) {
    if rate == 0 {
        return (0, 0);
    }
    (
        crate::limiter::gcra_increment(1, rate, 1_000_000_000).max(1),
        crate::limiter::gcra_burst_ns(burst.max(1), rate, 1_000_000_000),
    )
}

/// Whether the admission budget (`rate` new states per second, `burst` at once) must be
/// metered on the precise clock: the same test as a token bucket rule's.
pub fn admission_needs_fine_clock(rate: u64, burst: u64) -> bool {
    rate != 0
        && crate::limiter::gcra_burst_ns(burst.max(1), rate, 1_000_000_000) < COARSE_MIN_BURST_NS
}
/// The new-source admission budget (`ADMISSION[0]`), a GCRA meter shared by all CPUs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Admission {
    pub tat_ns: u64,
}
