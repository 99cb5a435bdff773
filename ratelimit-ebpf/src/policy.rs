//! Policy the daemon writes and the program only reads: global settings, rules, the allow and
//! deny lists, rule source and destination lists, overrides and the GeoIP region map. The daemon replaces
//! entries in place, so a live rule change never touches per-client counters.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, lpm_trie::Key},
};
use ratelimit_common::{
    addr::{IpKey, LpmAddr, lpm_prefix},
    caps::{
        MAX_OVERRIDES, MAX_PAYLOAD_FETCHES, MAX_REGION_OVERRIDES, MAX_REGION_PREFIXES,
        MAX_RULE_DST_ENTRIES, MAX_RULES, MAX_SOURCES_ENTRIES,
    },
    maps::{
        GlobalConfig, ListValue, OVERRIDE_RULE_BITS, OverrideKey, OverrideValue, PayloadFetch,
        REGION_UNKNOWN, RegionOverrideKey, RuleConfig,
    },
};

/// `[0]`: global settings (rule count, preview-all, admission budget). Array: one fixed slot.
#[map(name = "RL_GLOBAL")]
static GLOBAL: Array<GlobalConfig> = Array::pinned(1, 0);

/// Rules in file order. Array: indexed by position, updated in place.
#[map(name = "RL_RULES")]
static RULES: Array<RuleConfig> = Array::pinned(MAX_RULES, 0);

/// The allow list (never limited nor banned), the deny list (always dropped) and the rules'
/// source lists, in one LPM trie so that one lookup answers all three (see `ListValue`).
#[map(name = "RL_SOURCES")]
static SOURCES: LpmTrie<LpmAddr, ListValue> = LpmTrie::pinned(MAX_SOURCES_ENTRIES, 0);

/// The rules' destination lists (`dst`): at every prefix, the mask of the rules whose list
/// covers it (the union over the listed prefixes covering it, as in [`SOURCES`]).
#[map(name = "RL_DESTS")]
static DESTS: LpmTrie<LpmAddr, u32> = LpmTrie::pinned(MAX_RULE_DST_ENTRIES, 0);

/// Per-CIDR threshold overrides: key = (rule, address), most specific prefix wins.
#[map(name = "RL_OVERRIDES")]
static OVERRIDES: LpmTrie<OverrideKey, OverrideValue> = LpmTrie::pinned(MAX_OVERRIDES, 0);

/// Per-region threshold overrides: key = (rule, ISO country code).
#[map(name = "RL_REGION_OVERRIDES")]
static REGION_OVERRIDES: HashMap<RegionOverrideKey, OverrideValue> =
    HashMap::pinned(MAX_REGION_OVERRIDES, 0);

/// CIDR → country code (two ASCII bytes, zero-padded to 4), from the GeoIP database.
#[map(name = "RL_REGIONS")]
static REGIONS: LpmTrie<LpmAddr, [u8; 4]> = LpmTrie::pinned(MAX_REGION_PREFIXES, 0);

const EMPTY: GlobalConfig = GlobalConfig {
    rule_count: 0,
    preview_all: 0,
    admission_inc_ns: 0,
    admission_burst_ns: 0,
    flags: 0,
    generation: 0,
    admission_tick_cap: 0,
    store_sets: 0,
    relaxed: 0,
    syn_answer_tick_cap: 0,
    wall_offset_ns: 0,
    narrow_rules: 0,
    fetch_count: 0,
    fetches: [PayloadFetch {
        from: 0,
        len: 0,
        offset: 0,
    }; MAX_PAYLOAD_FETCHES],
};

#[inline(always)]
pub fn global() -> &'static GlobalConfig {
    GLOBAL.get(0).unwrap_or(&EMPTY)
}

#[inline(always)]
pub fn rule(i: u32) -> Option<&'static RuleConfig> {
    RULES.get(i)
}

/// The full-length trie key of a source: its family, then all its address's bits.
#[inline(always)]
pub fn full(src: &IpKey) -> Key<LpmAddr> {
    Key::new(lpm_prefix(src.is_v4(), 128), LpmAddr::of(src))
}

/// What the sources trie says of the source whose full-length key is `key` ([`full`]), built
/// by the caller: its `LIST_*` flags, the rules whose source list contains it, and those
/// whose `except` list does.
#[inline(always)]
pub fn sources_at(key: &Key<LpmAddr>) -> ListValue {
    match SOURCES.get(key) {
        Some(v) => *v,
        None => ListValue::default(),
    }
}

/// What the sources trie says of `src` for the rules: (rules whose source list contains it,
/// rules whose `except` list does). The key is built on the stack: a global function's
/// pointer argument (the scratch record in `rl_rule`) is no map key to 6.1's verifier ("R2
/// type=mem expected=fp, pkt, pkt_meta, map_key, map_value").
#[inline(always)]
pub fn rule_sources(src: &IpKey) -> (u32, u32) {
    match SOURCES.get(full(src)) {
        Some(v) => (v.rule_src_mask, v.rule_except_mask),
        None => (0, 0),
    }
}

/// The rules whose `dst` list contains the destination whose full-length key is `key`.
#[inline(always)]
pub fn dests_at(key: &Key<LpmAddr>) -> u32 {
    match DESTS.get(key) {
        Some(v) => *v,
        None => 0,
    }
}

#[inline(always)]
pub fn cidr_override(rule: u32, src: &IpKey) -> Option<&'static OverrideValue> {
    let key = Key::new(
        OVERRIDE_RULE_BITS + 128,
        OverrideKey {
            rule_be: rule.to_be(),
            family: LpmAddr::of(src).family,
            addr: src.addr,
            _pad: [0; 3],
        },
    );
    OVERRIDES.get(key)
}

#[inline(always)]
pub fn region_of(src: &IpKey) -> [u8; 2] {
    match REGIONS.get(full(src)) {
        Some(r) => [r[0], r[1]],
        None => REGION_UNKNOWN,
    }
}

#[inline(always)]
#[expect(
    clippy::needless_borrows_for_generic_args,
    reason = "by value, the key takes a stack slot of its own in rl_rule's frame (8 bytes \
              more, measured), and the call chain's stack is tight"
)]
pub fn region_override(rule: u32, region: [u8; 2]) -> Option<&'static OverrideValue> {
    let key = RegionOverrideKey {
        rule,
        region,
        _pad: [0; 2],
    };
    // SAFETY: the value stays allocated while the program runs (the kernel frees hash map
    // values after an RCU grace period; XDP runs in an RCU read-side section). A concurrent
    // update by the daemon can at worst mix old and new plain integers of one override.
    unsafe { REGION_OVERRIDES.get(&key) }
}
