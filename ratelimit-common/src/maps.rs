//! Key and value layouts of the maps the daemon writes and the XDP program reads (and the
//! per-client state the program writes and the daemon reads). All `#[repr(C)]`, padding made
//! explicit so nothing uninitialised crosses the kernel boundary.

use crate::caps::MAX_PORT_RANGES;

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

/// Inclusive destination port range.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortRange {
    pub lo: u16,
    pub hi: u16,
}

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
    pub _pad: [u8; 3],
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
    pub elastic: Limit,
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
    pub store_sets: u32,
    /// Non-zero while the host has room (the daemon's pressure level is low): rules and
    /// overrides with `elastic` meter against their elastic limit ([`RuleConfig::elastic`],
    /// [`OverrideValue::elastic`]). 0 (under pressure, and in maps no daemon has written yet):
    /// every limit as configured. The daemon writes it alone, one write of this entry, when
    /// the level changes.
    pub relaxed: u32,
    /// With [`GLOBAL_SYN_COOKIES`]: how many TCP packets of sources refused state one CPU looks
    /// at again in one timer tick (answers with a cookie, hands to a listener, passes to a
    /// connection): [`syn_answer_tick_cap`].
    pub syn_answer_tick_cap: u32,
    /// CLOCK_REALTIME - CLOCK_MONOTONIC in ns, written by the daemon: rules with
    /// [`RULE_GLOBAL`] meter in windows of `now + wall_offset_ns` (the wall clock's), which
    /// every host of a fleet shares.
    pub wall_offset_ns: u64,
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

/// Value of the sources trie (`RL_SOURCES`), which holds the allow list, the deny list and the
/// rules' `src` lists in one LPM trie, so one lookup answers all three. At every prefix the
/// daemon stores the union over all listed prefixes covering it (itself included), so the
/// longest match alone says whether any allow / deny entry covers the address and which rules'
/// source lists contain it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ListValue {
    pub rule_src_mask: u32,
    /// `LIST_ALLOW` | `LIST_DENY`.
    pub flags: u32,
}

/// `ListValue::flags`: an allow-list entry covers the prefix.
pub const LIST_ALLOW: u32 = 1 << 0;
/// `ListValue::flags`: a deny-list entry covers the prefix.
pub const LIST_DENY: u32 = 1 << 1;

/// Entries per CPU in the fast-drop table (`RL_FAST`), indexed by a fold of the source.
pub const FAST_ENTRIES: u32 = 64;

/// `FastEntry::pkt_flags` bits: the parsed packet's booleans.
pub const FAST_V4: u8 = 1 << 0;
pub const FAST_L4: u8 = 1 << 1;
pub const FAST_FRAGMENT: u8 = 1 << 2;
pub const FAST_L4_CUT: u8 = 1 << 3;

/// A fast-drop entry, per CPU (`RL_FAST`). Within one timer tick the coarse clock stands
/// still, so a packet a throttle rule refused on the coarse clock would be refused again by
/// every later packet of the same kind (same source, protocol, port, flags, interface) in
/// that tick: nothing it is judged on can loosen until the clock moves or the policy changes.
/// The program records such a refusal here and drops the rest of the tick's like packets
/// without looking their client up; it counts them in the per-CPU counters as usual and in
/// `pending_*` for the client, added to the client's state when the entry goes stale (a later
/// tick, or another packet taking the slot) and by the daemon when it reports clients.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastEntry {
    pub src: [u8; 16],
    pub dport: u16,
    pub proto: u8,
    pub tcp_flags: u8,
    /// `FAST_*` bits; 0 in an empty entry (a parsed packet always has one: V4 or not, so an
    /// empty entry is told apart by `jiffies == 0`).
    pub pkt_flags: u8,
    pub rule: u8,
    pub _pad: [u8; 2],
    pub slot: u32,
    pub generation: u32,
    /// The tick (jiffies) the entry is good for; 0: empty.
    pub jiffies: u64,
    /// The client whose state the pending counts belong to.
    pub key: ClientKey,
    pub pending_packets: u64,
    pub pending_bytes: u64,
    /// Coarse time of the tick.
    pub now_ns: u64,
    /// `RL_BAN_EPOCH` when the entry was made: a ban added since voids it.
    pub ban_epoch: u64,
}

/// Per-client state key.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ClientKey {
    pub rule: u8,
    /// `KEY_*`.
    pub kind: u8,
    pub _pad: [u8; 2],
    /// Prefix length of `addr` (0..=128) for `KEY_IP`, else 0.
    pub prefix_len: u32,
    /// Masked source address, region code in bytes 0..2 for `KEY_REGION`, zero otherwise.
    pub addr: [u8; 16],
}

/// The known-sources filter (`RL_KNOWN`, an mmap-able array of u64): one bit per hash of a
/// per-source [`ClientKey`] (`KEY_IP`), set before the program inserts that key's state, so
/// a clear bit proves the source has no state and its per-client lookup can be skipped. In a
/// random-source flood nearly every packet is such a source, and the lookup that misses (a
/// walk of a hash chain through memory no cache holds) is what it costs most.
///
/// Word 0 is the control word (`KNOWN_*` flags, and the number of bits per half in
/// bits 8..15 as a power of two); then two halves of `1 << (log2 - 6)` words each. The program
/// reads the active half and sets a new key's bit in both. Bits of evicted states stay set
/// (a set bit only costs the lookup), so the daemon rebuilds the other half from the map
/// now and then: it clears it, waits for inserts in flight, sets the bit of every state it
/// walks (states inserted during the walk set their own), then makes it the active half.
/// The filter is off until the daemon's first rebuild after it loads the program.
pub const KNOWN_ENABLED: u64 = 1 << 0;
/// Control word: the active half is the second.
pub const KNOWN_HALF: u64 = 1 << 1;
/// Control word: position of log2(bits per half).
pub const KNOWN_LOG2_SHIFT: u32 = 8;
/// Bounds of log2(bits per half): at least one word, at most 128 MiB a half.
pub const KNOWN_MIN_LOG2: u64 = 6;
pub const KNOWN_MAX_LOG2: u64 = 30;

/// log2 of the bits per half for a per-client map of `max_sources`: 8 to 16 bits per
/// source (a power of two), so a full map leaves 6 to 12% of untracked sources to a lookup.
pub const fn known_log2_bits(max_sources: u32) -> u64 {
    let n = if max_sources < 8 {
        8
    } else {
        max_sources as u64
    };
    let log2 = (n.next_power_of_two() * 8).trailing_zeros() as u64;
    if log2 > KNOWN_MAX_LOG2 {
        KNOWN_MAX_LOG2
    } else {
        log2
    }
}

/// Entries of `RL_KNOWN` for a per-client map of `max_sources`: the control word and two halves.
pub const fn known_map_entries(max_sources: u32) -> u32 {
    1 + 2 * (1u32 << (known_log2_bits(max_sources) - KNOWN_MIN_LOG2))
}

/// 64-bit words of [`HashKey`]: a constant and one multiplier for each of the message's five
/// 32-bit words ([`known_hash`]).
pub const HASH_KEY_WORDS: usize = 6;

/// The per-load key of the placement hash ([`known_hash`]): six 64-bit words the daemon draws
/// from the OS's random source when it creates the maps, and keeps in `RL_HASH_KEY` for as
/// long as they are pinned (a daemon that adopts them reads it back: with another key, every
/// state would sit in sets no lookup visits). All zero until drawn.
pub type HashKey = [u64; HASH_KEY_WORDS];

/// The hash of a per-source key: the known-sources filter indexes by its top bits, the store
/// places the key by it ([`store_sets_of`]) and tags its slot with it ([`slot_tag`]). The
/// program and the daemon compute it alike (this function, in both).
///
/// Keyed per load, because a hash with public constants lets anyone who can choose source
/// addresses (an IPv6 attacker holds 2^64 of them in a /64) compute, offline, sources whose
/// two sets are a chosen client's, and evict its state. What it takes is a hash drawn at
/// random from a *strongly universal* family: for any two distinct messages, their hashes
/// are independent and uniform over the draw of the key, so no source can be chosen, before
/// the key is drawn, to share a client's sets more often than a source tried blind.
///
/// The family is multilinear hashing (Lemire and Kaser, "Strongly universal string hashing
/// is fast", 2014): the message as 32-bit words `m1..m5`, 64-bit keys `k0..k5`, and
/// `(k0 + k1 m1 + ... + k5 m5) mod 2^64`, whose top 32 bits are strongly universal. A fixed
/// bijection (MurmurHash3's 64-bit finalizer) then spreads those 32 bits over the 64 the
/// store and the filter take theirs from: a bijection of independent uniform values leaves
/// them independent and uniform, and it spreads sources that differ by a regular step
/// (consecutive addresses) as random ones would, where the bare sums, an arithmetic
/// progression, bunch up under some keys. (32 bits tell 4 billion sources apart, and two
/// sources that share them share their sets only as two random ones would: the address is
/// compared in full.) The message is the 16-byte address (an IPv4 source as
/// `::ffff:a.b.c.d`, so the two families never share one) as four little-endian words, then
/// the rule and the prefix length (one byte each; a prefix length is at most 128). Seven
/// multiplies and no branch, inline in the packet's path: SipHash-1-3, the pseudorandom
/// function it replaces, cost some 20 ns a lookup on the benchmark's CPU (a call, and four to
/// six rounds of 64-bit rotations, which BPF has no instruction for; BENCHMARKS.md,
/// "Data-plane hardening: before and after").
///
/// What it gives up against a pseudorandom function: the sum is linear in the key, so an
/// attacker who learnt which of its own sources share a set would learn relations between
/// the key's words. The store shows that only through evictions (a source's state lost to
/// a flood of others), which it makes slow to probe (two choices of eight ways, protected
/// states, the admission budget), and a key lasts only as long as its pinned maps.
#[inline(always)]
pub fn known_hash(key: &HashKey, rule: u8, prefix_len: u32, addr: &[u8; 16]) -> u64 {
    let w = |i: usize| {
        u32::from_le_bytes([
            addr[4 * i],
            addr[4 * i + 1],
            addr[4 * i + 2],
            addr[4 * i + 3],
        ]) as u64
    };
    let m5 = rule as u64 | ((prefix_len & 0xff) as u64) << 8;
    let sum = key[0]
        .wrapping_add(key[1].wrapping_mul(w(0)))
        .wrapping_add(key[2].wrapping_mul(w(1)))
        .wrapping_add(key[3].wrapping_mul(w(2)))
        .wrapping_add(key[4].wrapping_mul(w(3)))
        .wrapping_add(key[5].wrapping_mul(m5));
    fmix64(sum >> 32)
}

/// MurmurHash3's 64-bit finalizer: a bijection of `u64` in which every input bit moves about
/// half the output bits.
#[inline(always)]
pub const fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ h >> 33
}

/// The bit of `hash` in a half of `2^log2` bits: (word within the half, bit within the word).
#[inline(always)]
pub fn known_bit(hash: u64, log2: u64) -> (u64, u64) {
    let idx = hash >> (64 - log2);
    (idx >> 6, idx & 63)
}

/// `ClientState::drops`: bit 63 is the soft-limit episode flag (a soft_limit event was sent
/// and usage has not fallen back below the soft limit since); the count is in bits 0..62.
/// One word instead of two: a packet count cannot reach 2^63, so no add carries into it.
pub const DROPS_SOFT_REPORTED: u64 = 1 << 63;

/// Per-client limiter state. Shared by all CPUs (not per-CPU): the program updates it with
/// atomic instructions so a client's limit is not multiplied by the number of CPUs.
///
/// 88 bytes: with the slot's 24-byte header it makes a per-source slot of 112 bytes
/// ([`Slot`]). Every packet of a throttle rule touches the first 56 bytes (the limiter's
/// word(s), the totals, the last-seen time and the drop count), which share the header's
/// cache lines; what ban rules touch comes after.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientState {
    /// Window index (`now / interval`) for the window algorithms; the GCRA theoretical arrival
    /// time in ns for the token bucket.
    pub stamp: u64,
    /// Admitted cost in the current window. A global token bucket ([`RULE_GLOBAL`]): admitted
    /// cost in the wall-clock window `prev` of [`GLOBAL_TB_WINDOW_NS`].
    pub cur: u64,
    /// Admitted cost in the previous window. A global token bucket: the window of `cur`.
    pub prev: u64,
    /// Totals since the state was created, for `top`.
    pub packets: u64,
    pub bytes: u64,
    /// Last packet (CLOCK_MONOTONIC ns).
    pub last_ns: u64,
    /// Packets refused (a total, like `packets`) in bits 0..62, and
    /// [`DROPS_SOFT_REPORTED`]. Read it with [`ClientState::drop_count`].
    pub drops: u64,
    /// Last packet over the threshold, 0 when the client is not in a throttle episode: the
    /// refusal that swaps it away from 0 sends `throttle_start`, and the admitted packet that
    /// swaps it back to 0 (an interval after the last refusal) sends `throttle_end`.
    pub last_exceed_ns: u64,
    /// Window index of the offered-rate (ban) meter.
    pub ban_stamp: u64,
    /// Offered cost (every matched packet) in the current / previous ban window.
    pub seen_cur: u64,
    pub seen_prev: u64,
}

impl ClientState {
    /// Packets refused.
    #[inline(always)]
    pub const fn drop_count(&self) -> u64 {
        self.drops & !DROPS_SOFT_REPORTED
    }

    /// In a throttle episode whose last refusal is less than `interval_ns` before `now`.
    #[inline(always)]
    pub const fn throttled_at(&self, now: u64, interval_ns: u64) -> bool {
        self.last_exceed_ns != 0 && now.saturating_sub(self.last_exceed_ns) < interval_ns
    }
}

/// The state of a shared key (`KEY_ALL`, `KEY_REGION`) in `RL_SHARED`: a client's state and
/// the end of the key's ban (IP bans live in `RL_BANS`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharedState {
    pub state: ClientState,
    /// Ban end, 0 when not banned, `u64::MAX` until lifted.
    pub banned_until_ns: u64,
}

/// What the other hosts of the fleet counted for a shared key (`KEY_ALL`, `KEY_REGION`) of
/// a global rule (`RULE_GLOBAL`), in `RL_FLEET_ADD`: written by the daemon every sync round,
/// only read by the program, which adds it to the key's own counts when it judges (a shared
/// state lives in a hash map the daemon cannot add into atomically). Each meter's counts are
/// for wall-clock window `window` (`cur`) and the one before (`prev`); a meter whose state
/// is in another window finds nothing of its own there (or, one window on, `cur` as its
/// previous window's).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FleetAdd {
    pub window: u64,
    pub cur: u64,
    pub prev: u64,
    /// The ban meter's window and counts (offered), for `rate_based_ban`.
    pub ban_window: u64,
    pub seen_cur: u64,
    pub seen_prev: u64,
}

impl FleetAdd {
    /// The other hosts' counts `(cur, prev)` for a meter in window `w`, given what was
    /// written for window `window`.
    #[inline(always)]
    pub fn counts_in(window: u64, cur: u64, prev: u64, w: u64) -> (u64, u64) {
        if window == w {
            (cur, prev)
        } else if window.wrapping_add(1) == w {
            (0, cur)
        } else {
            (0, 0)
        }
    }
}

/// Ways per set of the per-source store (`RL_CLIENTS`).
pub const STORE_WAYS: usize = 8;

/// A tag with this bit is in use (so a tag is never 0, the empty slot's).
pub const SLOT_USED: u32 = 1 << 0;
/// A tag with this bit is being written by the CPU that claimed its slot.
pub const SLOT_BUSY: u32 = 1 << 1;

/// One per-source state of the per-source store: the key's (masked) address and the state.
/// The rest of the key is in the set's tag for the slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slot {
    pub addr: [u8; 16],
    pub state: ClientState,
}

/// One set of the per-source store (`RL_CLIENTS`, an array of sets): [`STORE_WAYS`] slots
/// and their tags. 864 bytes, 108 per source, and nothing else per source: no hash-table
/// element header, no bucket array. The eight 4-byte tags start a set, at a multiple of 32
/// bytes from the map's page-aligned values, so they always share one cache line: a lookup
/// reads that line, then only the slot whose tag matches.
///
/// A key may live in either of two sets chosen by its hash ([`store_sets_of`]); a new key
/// goes to the one with more free slots, so the store fills evenly (two choices).
///
/// A tag is 0 for an empty slot; otherwise ([`slot_tag`]) bit 0 is [`SLOT_USED`], bit 1
/// [`SLOT_BUSY`] while a CPU writes the slot, bits 2..6 the rule, bits 6..14 the prefix
/// length (0..=128), and bits 14..32 the top 18 bits of the key's hash (a quick reject; the
/// address is compared in full). A CPU claims a slot by compare-and-swap of its tag to the
/// busy tag, writes the address and a zeroed state, and publishes the tag by an atomic swap;
/// see the program's `store.rs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreSet {
    pub tags: [u32; STORE_WAYS],
    pub slots: [Slot; STORE_WAYS],
}

const _: () = assert!(
    crate::caps::MAX_RULES <= 16,
    "the slot tag holds the rule in 4 bits"
);

/// The tag of a ready slot holding `rule`'s per-source key of prefix `prefix_len` whose hash
/// ([`known_hash`]) is `hash`.
#[inline(always)]
pub const fn slot_tag(rule: u8, prefix_len: u32, hash: u64) -> u32 {
    ((hash >> 46) as u32) << 14 | (prefix_len & 0xff) << 6 | (rule as u32 & 0xf) << 2 | SLOT_USED
}

/// The key of a ready slot's tag and address.
pub const fn slot_key(tag: u32, addr: [u8; 16]) -> ClientKey {
    ClientKey {
        rule: ((tag >> 2) & 0xf) as u8,
        kind: KEY_IP,
        _pad: [0; 2],
        prefix_len: (tag >> 6) & 0xff,
        addr,
    }
}

/// Whether a tag holds a key (not empty, not being written).
#[inline(always)]
pub const fn slot_ready(tag: u32) -> bool {
    tag & SLOT_USED != 0 && tag & SLOT_BUSY == 0
}

/// The two sets a key whose hash is `hash` may live in, in a store of `sets` sets: the low
/// half of the hash, and of a remix of it, scaled to `sets` (no division; the tag holds the
/// top bits). They may coincide.
#[inline(always)]
pub const fn store_sets_of(hash: u64, sets: u32) -> (u32, u32) {
    let b = (hash ^ (hash >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (
        (((hash & 0xffff_ffff) * sets as u64) >> 32) as u32,
        (((b >> 32) * sets as u64) >> 32) as u32,
    )
}

/// Sets of a store holding `max_sources` states: `max_sources` rounded up to whole sets.
pub const fn store_sets(max_sources: u32) -> u32 {
    let s = max_sources.div_ceil(STORE_WAYS as u32);
    if s == 0 { 1 } else { s }
}

/// `BanEntry::flags`.
/// Issued by an operator (`ratelimit ban add`), not by a rule.
pub const BAN_MANUAL: u32 = 1 << 0;
/// The issuing rule is in preview: count would-drops, do not drop.
pub const BAN_PREVIEW: u32 = 1 << 1;
/// The issuing rule's `exceed_action` is pass.
pub const BAN_EXCEED_PASS: u32 = 1 << 2;
/// Received from the fleet (issued on another host, by its operator or one of its rules; with
/// `BAN_MANUAL`, so it always drops): in the remote bans' table, never the operator's.
pub const BAN_REMOTE: u32 = 1 << 8;
/// A remote ban that found the remote bans' table full, kept in the rules' table of bans that
/// drop instead (with `BAN_REMOTE`): enforced, and expired in the kernel, like a rule ban.
pub const BAN_SPILLED: u32 = 1 << 9;

/// Value of the `BANS` LPM trie. It repeats its own key, because an LPM lookup does not say
/// which prefix matched and the program must delete exactly that entry when the ban expires.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BanEntry {
    /// CLOCK_MONOTONIC ns when the ban ends; 0 = until removed.
    pub expires_ns: u64,
    /// When it was issued.
    pub since_ns: u64,
    pub rule: u32,
    pub flags: u32,
    /// The entry's own key: prefix length (of the 16-byte address) and address.
    pub prefix_len: u32,
    pub _pad: u32,
    pub addr: [u8; 16],
}

/// `BanEntry::rule` of a manual ban.
pub const BAN_RULE_NONE: u32 = u32::MAX;

/// The ban tables, by what their bans do. A ban that drops is never in the same trie as one
/// that lets packets through, so a longest match that passes can never hide a wider one that
/// drops (the strictest ban in force wins); the operator's bans have a table of their own,
/// which no number of rule-issued bans can fill; and bans received from the fleet have one
/// too, so no number of them can fill the operator's.
/// `BAN_TABLE_OPERATOR`: `ratelimit ban add` and restored manual bans (they always drop).
pub const BAN_TABLE_OPERATOR: u32 = 0;
/// `BAN_TABLE_RULE`: rule-issued bans that drop (and remote bans spilled, `BAN_SPILLED`).
pub const BAN_TABLE_RULE: u32 = 1;
/// `BAN_TABLE_PASSING`: rule-issued bans that let packets on (preview, `exceed_action = pass`).
pub const BAN_TABLE_PASSING: u32 = 2;
/// `BAN_TABLE_REMOTE`: bans received from the fleet (`BAN_REMOTE`; they always drop).
pub const BAN_TABLE_REMOTE: u32 = 3;
/// Number of ban tables (`RL_BANS_PRESENT` has one flag for each).
pub const BAN_TABLES: u32 = 4;

/// The table a ban belongs in, from its flags.
#[inline(always)]
pub const fn ban_table(flags: u32) -> u32 {
    if flags & BAN_REMOTE != 0 {
        if flags & BAN_SPILLED != 0 {
            BAN_TABLE_RULE
        } else {
            BAN_TABLE_REMOTE
        }
    } else if flags & BAN_MANUAL != 0 {
        BAN_TABLE_OPERATOR
    } else if flags & (BAN_PREVIEW | BAN_EXCEED_PASS) != 0 {
        BAN_TABLE_PASSING
    } else {
        BAN_TABLE_RULE
    }
}

/// `ClientState::ban_stamp` of a client whose rule ban is held in its own state, because the
/// rule bans' table was full: `seen_prev` is then the ban's end (`u64::MAX`: until removed)
/// and `seen_cur` its `BAN_*` flags. The ban meter is not running while a client is banned,
/// so its words are free; no window index ever reaches this value.
pub const BAN_HELD_MARK: u64 = u64::MAX;

impl BanEntry {
    /// An operator's ban of `addr/prefix_len` issued at `now_ns`, ending at `expires_ns`
    /// (0 = until removed).
    pub const fn manual(prefix_len: u32, addr: [u8; 16], now_ns: u64, expires_ns: u64) -> Self {
        Self {
            expires_ns,
            since_ns: now_ns,
            rule: BAN_RULE_NONE,
            flags: BAN_MANUAL,
            prefix_len,
            _pad: 0,
            addr,
        }
    }
}

/// Data part of the per-CIDR override LPM trie key: the rule index first, then the family
/// (both always matched in full, so the trie's prefix length is `OVERRIDE_RULE_BITS +
/// address prefix`), then the address.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OverrideKey {
    /// Rule index, big-endian so it forms the leading bits of the trie key.
    pub rule_be: u32,
    /// `addr::FAMILY_V4` or `FAMILY_V6`: an IPv6 override never covers an IPv4 client.
    pub family: u8,
    pub addr: [u8; 16],
    pub _pad: [u8; 3],
}

/// Prefix bits taken by `OverrideKey::rule_be` and `OverrideKey::family`: an override of a
/// prefix of `N` bits over the 16-byte address has the trie prefix `OVERRIDE_RULE_BITS + N`.
pub const OVERRIDE_RULE_BITS: u32 = 32 + crate::addr::FAMILY_BITS;

/// Key of the per-region override hash map.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RegionOverrideKey {
    pub rule: u32,
    /// ISO 3166 alpha-2 code as two ASCII bytes, `ZZ` for unknown.
    pub region: [u8; 2],
    pub _pad: [u8; 2],
}

/// Value of both override maps.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OverrideValue {
    pub limit: Limit,
    /// The override's limit while the host has room (as [`RuleConfig::elastic`]); `limit`
    /// itself without elastic.
    pub elastic: Limit,
}

impl OverrideValue {
    /// The override's limit in force (as [`RuleConfig::limit_now`]).
    #[inline(always)]
    pub const fn limit_now(&self, relaxed: bool) -> &Limit {
        if relaxed { &self.elastic } else { &self.limit }
    }
}

/// The new-source admission budget (`ADMISSION[0]`), a GCRA meter shared by all CPUs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Admission {
    pub tat_ns: u64,
}

/// Region code used when the GeoIP map has no entry for an address.
pub const REGION_UNKNOWN: [u8; 2] = *b"ZZ";

#[cfg(test)]
mod tests {
    extern crate std;

    use super::*;

    /// A key as the daemon draws one: random words (here from splitmix64 of `seed`).
    fn key_from(seed: u64) -> HashKey {
        let mut x = seed;
        core::array::from_fn(|_| {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        })
    }

    const KEY: HashKey = [
        0x6d5a_56da_5c7a_6b1e,
        0x1f3c_2b8e_9d47_a601,
        0xc4e1_0f93_27b8_5d6a,
        0x83a7_4c1d_e905_f2b3,
        0x5e29_b6f0_1c8d_4a77,
        0xa91f_d3c2_6e40_8b15,
    ];

    /// `known_hash` is the hash it documents: the key's constant plus its multipliers times
    /// the message's words (the address as four little-endian words, then the rule and the
    /// prefix length), modulo 2^64, top 32 bits, through MurmurHash3's finalizer (checked on
    /// known values).
    #[test]
    fn known_hash_is_the_multilinear_sum_it_documents() {
        fn reference(key: &HashKey, m: [u64; 5]) -> u64 {
            let sum = (0..5).fold(key[0] as u128, |h, i| h + key[i + 1] as u128 * m[i] as u128);
            fmix64(((sum % (1u128 << 64)) >> 32) as u64)
        }
        let mut v4 = [0u8; 16];
        v4[10] = 0xff;
        v4[11] = 0xff;
        v4[12..].copy_from_slice(&[198, 18, 0, 1]);
        let v6: [u8; 16] = core::array::from_fn(|i| 0x20 + i as u8);
        let word = |a: &[u8; 16], i: usize| {
            u32::from_le_bytes(a[4 * i..4 * i + 4].try_into().unwrap()) as u64
        };
        for key in [KEY, key_from(1), [u64::MAX; HASH_KEY_WORDS]] {
            for (rule, plen, a) in [(3u8, 128u32, v4), (3, 64, v6), (15, 0, [0xff; 16])] {
                let m = [word(&a, 0), word(&a, 1), word(&a, 2), word(&a, 3)];
                assert_eq!(
                    known_hash(&key, rule, plen, &a),
                    reference(
                        &key,
                        [m[0], m[1], m[2], m[3], rule as u64 | (plen as u64) << 8]
                    ),
                    "{a:x?}"
                );
            }
        }
        // The same address bytes under two families never give one message.
        assert_ne!(
            known_hash(&KEY, 3, 128, &v4),
            known_hash(&KEY, 3, 128, &[0; 16])
        );
        assert_eq!(fmix64(0), 0);
        assert_eq!(fmix64(1), 0xb456_bcfc_34c2_cb2c);
    }

    /// Strong universality, as far as a test can see it: two fixed sources that differ in
    /// one bit, or only in their rule, share their first set (of 1024) under about 1 in 1024
    /// of 16384 random keys, as two independent draws would (expected 16).
    #[test]
    fn two_given_sources_share_a_set_only_by_chance_of_the_key() {
        let sets = 1024u32;
        let mut a = [0u8; 16];
        a[10] = 0xff;
        a[11] = 0xff;
        a[12..].copy_from_slice(&[203, 0, 113, 9]);
        let mut b = a;
        b[15] ^= 1;
        let v6: [u8; 16] = core::array::from_fn(|i| 0x20 + i as u8);
        let mut v6b = v6;
        v6b[0] ^= 0x80;
        for (x, y) in [
            ((0u8, 128u32, a), (0u8, 128u32, b)),
            ((0, 128, a), (1, 128, a)),
            ((0, 64, v6), (0, 64, v6b)),
        ] {
            let same = (0..16_384u64)
                .filter(|&seed| {
                    let k = key_from(seed);
                    store_sets_of(known_hash(&k, x.0, x.1, &x.2), sets).0
                        == store_sets_of(known_hash(&k, y.0, y.1, &y.2), sets).0
                })
                .count();
            assert!((2..=40).contains(&same), "{same} of 16384 keys");
        }
    }

    /// Another key, another placement: of 4096 sources, about 1 in `sets` keep their first
    /// set (as two independent draws would), and a key's own placement is repeatable.
    #[test]
    fn the_placement_depends_on_the_key() {
        let sets = 1024u32;
        let other = key_from(2);
        let mut same = 0;
        for i in 0..4096u32 {
            let mut a = [0u8; 16];
            a[0] = 0x20;
            a[1] = 0x01;
            a[12..].copy_from_slice(&i.to_be_bytes());
            let p = store_sets_of(known_hash(&KEY, 0, 64, &a), sets);
            assert_eq!(p, store_sets_of(known_hash(&KEY, 0, 64, &a), sets));
            same += usize::from(p.0 == store_sets_of(known_hash(&other, 0, 64, &a), sets).0);
        }
        assert!(same < 16, "{same} of 4096 kept their set under another key");
    }

    #[test]
    fn state_memory_is_the_longest_span_a_limiter_remembers() {
        let l = Limit {
            interval_ns: 1_000_000_000,
            ..Limit::default()
        };
        assert_eq!(state_memory_ns(&l), 2_000_000_000);
        let tb = Limit {
            interval_ns: 1_000_000_000,
            gcra_burst_ns: 5_000_000_000,
            gcra_inc_ns: 1_000_000,
            ..Limit::default()
        };
        assert_eq!(state_memory_ns(&tb), 5_001_000_000);
        let ban = Limit {
            ban_interval_ns: 3_000_000_000,
            ..l
        };
        assert_eq!(state_memory_ns(&ban), 6_000_000_000);
        assert_eq!(protect_ms(1), 1);
        assert_eq!(protect_ms(2_000_000_000), 2000);
        assert_eq!(protect_ms(u64::MAX), u32::MAX);
    }

    #[test]
    fn admission_tick_cap_is_twice_a_ticks_share_and_at_least_64() {
        assert_eq!(admission_tick_cap(0, 4_000_000), 0);
        assert_eq!(admission_tick_cap(1000, 4_000_000), 64);
        assert_eq!(admission_tick_cap(10_000, 4_000_000), 80);
        assert_eq!(admission_tick_cap(10_000, 1_000_000), 64);
        assert_eq!(admission_tick_cap(1_000_000, 4_000_000), 8000);
        assert_eq!(admission_tick_cap(u64::MAX, u64::MAX), u32::MAX);
    }

    #[test]
    fn store_layout_is_108_bytes_a_source_with_the_tags_in_one_line() {
        assert_eq!(size_of::<ClientState>(), 88);
        assert_eq!(size_of::<Slot>(), 104);
        assert_eq!(size_of::<StoreSet>(), 864);
        assert_eq!(size_of::<StoreSet>() / STORE_WAYS, 108);
        // Set i starts at 864 i, a multiple of 32, and its tags are its first 32 bytes: one
        // cache line holds them whatever i is.
        assert_eq!(size_of::<StoreSet>() % 32, 0);
        assert_eq!(core::mem::offset_of!(StoreSet, slots), 32);
        assert_eq!(store_sets(0), 1);
        assert_eq!(store_sets(1), 1);
        assert_eq!(store_sets(8), 1);
        assert_eq!(store_sets(9), 2);
        assert_eq!(store_sets(1_000_000), 125_000);
    }

    #[test]
    fn slot_tags_round_trip_and_never_look_empty_or_busy() {
        for (rule, plen, hash) in [
            (0u8, 0u32, 0u64),
            (15, 128, u64::MAX),
            (3, 127, 0x1234_5678_9abc_def0),
            (1, 1, u64::MAX),
            (0, 0, 1 << 46),
        ] {
            let t = slot_tag(rule, plen, hash);
            assert!(slot_ready(t), "{t:#x}");
            let addr = [7u8; 16];
            let k = slot_key(t, addr);
            assert_eq!(
                (k.rule, k.kind, k.prefix_len, k.addr),
                (rule, KEY_IP, plen, addr)
            );
            assert!(!slot_ready(t | SLOT_BUSY));
        }
        assert!(!slot_ready(0));
    }

    /// Two choices fill the store evenly: of distinct random sources (a random-source flood)
    /// making 90% of its capacity, fewer than 1 in 100 find both their sets full (with one
    /// choice, about 1 in 10 would), and the two sets of a key are independent of each other.
    #[test]
    fn two_choices_place_90_percent_of_capacity_nearly_without_an_eviction() {
        let sets = 4096u32;
        let n = (sets as usize * STORE_WAYS) * 90 / 100;
        let place = |two: bool| {
            let mut used = std::vec![0usize; sets as usize];
            let mut homeless = 0;
            let mut same = 0;
            for i in 0..n as u32 {
                let mut a = [0u8; 16];
                a[10] = 0xff;
                a[11] = 0xff;
                let r = key_from(i as u64)[0] as u32;
                a[12..].copy_from_slice(&r.to_be_bytes());
                let (x, y) = store_sets_of(known_hash(&KEY, 0, 128, &a), sets);
                same += usize::from(x == y);
                let s = if two && used[y as usize] < used[x as usize] {
                    y
                } else {
                    x
                } as usize;
                if used[s] < STORE_WAYS {
                    used[s] += 1;
                } else {
                    homeless += 1;
                }
            }
            (homeless, same)
        };
        let (two, same) = place(true);
        let (one, _) = place(false);
        assert!(
            two < n / 100,
            "two choices: {two} of {n} found both sets full"
        );
        assert!(one > n / 20, "one choice: {one} of {n}");
        std::println!("two choices: {two} of {n} homeless; one choice: {one}");
        // Coinciding sets: about n / sets of them.
        assert!(same < 3 * n / sets as usize + 3, "{same}");
    }

    #[test]
    fn known_filter_sizes() {
        assert_eq!(known_log2_bits(1), 6);
        assert_eq!(known_log2_bits(4000), 15);
        assert_eq!(known_log2_bits(65536), 19);
        assert_eq!(known_log2_bits(65537), 20);
        assert_eq!(known_log2_bits(1_000_000), 23);
        assert_eq!(known_log2_bits(u32::MAX), KNOWN_MAX_LOG2);
        assert_eq!(known_map_entries(1), 3);
        assert_eq!(known_map_entries(65536), 1 + 2 * (1 << 13));
    }

    /// Consecutive IPv4 sources (IPv4-mapped keys: their first 10 bytes are zero) and IPv6
    /// /64s spread over the bits as uniformly random ones would, under every one of 16 keys:
    /// n keys in m bits set about m (1 - e^(-n/m)) of them. (Without the finalizer, under
    /// some keys consecutive sources set 30% fewer.)
    #[test]
    fn known_hash_spreads_mapped_and_v6_keys() {
        let log2 = 16;
        let m = 1u64 << log2;
        let n = 16_384u32;
        let expect = m as f64 * (1.0 - (-(n as f64) / m as f64).exp());
        for seed in 0..16 {
            let key = key_from(seed);
            let count = |keys: &mut dyn Iterator<Item = (u8, u32, [u8; 16])>| {
                let mut bits = std::collections::HashSet::new();
                for (rule, plen, addr) in keys {
                    bits.insert(known_bit(known_hash(&key, rule, plen, &addr), log2));
                }
                bits.len() as f64
            };
            let v4 = count(&mut (0..n).map(|i| {
                let mut a = [0u8; 16];
                a[10] = 0xff;
                a[11] = 0xff;
                a[12..].copy_from_slice(&(0xc612_0000u32 + i).to_be_bytes());
                (0, 128, a)
            }));
            let v6 = count(&mut (0..n).map(|i| {
                let mut a = [0u8; 16];
                a[0] = 0x20;
                a[1] = 0x01;
                a[4..8].copy_from_slice(&i.to_be_bytes());
                (1, 64, a)
            }));
            // One source under several rules: distinct bits too.
            let rules = count(&mut (0..n).map(|i| {
                let mut a = [0u8; 16];
                a[12..].copy_from_slice(&(i / 8).to_be_bytes());
                ((i % 8) as u8, 128, a)
            }));
            for (what, got) in [("v4", v4), ("v6", v6), ("rules", rules)] {
                assert!(
                    (got - expect).abs() < expect * 0.02,
                    "key {seed}, {what}: {got} bits set, {expect:.0} expected"
                );
            }
        }
    }
}
