//! The rules: evaluated in file order for each packet that no list and no ban decided, each
//! one a call of the global BPF function [`rl_rule`]: match, find the client's state
//! (`admission.rs`), check bans (`bans.rs`), meter (`meters.rs`), and turn the result into a
//! verdict after preview and `exceed_action`.
//!
//! Glossary (the words this program coins):
//! * **tick**: one timer tick (`jiffies`). The coarse clock reads one `now` for all of it
//!   (`clock.rs`), so a refusal on that clock holds for every like packet until it ends.
//! * **fast-drop entry**: a per-CPU record of this tick's first refusal of a packet by a
//!   throttle rule; like packets of the same tick are dropped from it without a state lookup
//!   (`fast.rs`).
//! * **overflow state**: each rule's one aggregate state, shared by the sources refused a
//!   state of their own (by the admission budget or a full store) (`state.rs`).
//! * **admission budget**: the GCRA meter that paces how many new sources get a state of
//!   their own (`admission.rs`).
//! * **ban table**: one of the three LPM tries of active bans: the operator's, rule bans
//!   that drop, rule bans that pass (`bans.rs`, `maps::ban_table`).
//! * **held ban**: a rule ban whose table was full, kept in the client's own state instead
//!   (`BAN_HELD_MARK` in its ban meter's stamp) and enforced by its rule (`bans.rs`,
//!   `meters.rs`).
//! * **slot**: in this program, an interface's counter slot (`stats::Slot`, from its
//!   ifindex), unless qualified: a *store slot* is one way of a set of the per-source store
//!   (`store.rs`), and a *fast-drop slot* is the `RL_FAST` entry a source hashes to.
//! * **global BPF function**: an `extern "C"` `#[inline(never)]` function the verifier checks
//!   once on its own; the `rl_*` functions. They return plain `u64` codes, named by the
//!   constants next to each.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use ratelimit_common::{
    addr::V4_MAPPED_PREFIX,
    caps::MAX_RULES,
    maps::*,
    stats::{global, rule as rc},
};

use crate::{
    admission::state_for,
    atomic,
    bans::{AGGREGATE_BANNED, BAN_NOT_RECORDED, rl_aggregate_ban, rl_ban},
    cookies, fast, matching,
    meters::{ABOVE_BAN_THRESHOLD, ADMITTED, BAN_HELD, rl_after, rl_ban_meter, rl_limit},
    parse::Parsed,
    policy,
    scratch::{Env, Ext, RuleLoop},
    state::{StateFor, masked_copy, zero_addr},
    stats::{self, Slot},
};

pub enum RuleVerdict {
    Pass,
    Drop,
    /// Dropped only because its source was refused state (by one rule or more; every other
    /// rule passed it): a TCP packet for the second look (`cookies.rs`).
    Refused,
    /// Dropped, and any like packet would be for the rest of this tick (see `fast.rs`).
    DropForTick,
}

/// `rl_rule` results.
const RULE_NO_MATCH: u64 = 0;
const RULE_DROP: u64 = 1;
const RULE_PASS: u64 = 2;
const RULE_DROP_FOR_TICK: u64 = 3;

/// Evaluate the rules in file order. Each rule is one call of the global function `rl_rule`,
/// which the verifier checks once on its own, so this loop costs it a call per rule. `rl` is
/// this CPU's scratch record, which the entry looked up for the packet and wrote the packet
/// into (`RuleLoop::pkt`).
#[inline(always)]
pub fn evaluate_rules(
    rl: *mut RuleLoop,
    (slot, len): (Slot, u64),
    (now, tick, ban_epoch): (u64, u64, u64),
    g: &GlobalConfig,
    // Whether a ban (one that lets packets on to the rules) matched: then no fast-drop entry
    // is made, as it would skip that ban's counting.
    ban_matched: bool,
) -> RuleVerdict {
    let n = g.rule_count;
    if n == 0 {
        return RuleVerdict::Pass;
    }
    // SAFETY: this CPU's scratch record, used only during this packet.
    unsafe {
        (*rl).env = Env {
            slot,
            len,
            now,
            preview_all: g.preview_all,
            admission_fine: (g.flags & GLOBAL_ADMISSION_FINE_CLOCK != 0) as u32,
            generation: g.generation,
            relaxed: g.relaxed,
            admission_inc_ns: g.admission_inc_ns,
            admission_burst_ns: g.admission_burst_ns,
            admission_tick_cap: g.admission_tick_cap,
            store_sets: g.store_sets,
            wall_offset_ns: g.wall_offset_ns,
        };
        (*rl).coarse_now = now;
        (*rl).fine_now = 0;
        (*rl).tick = tick;
        (*rl).ban_epoch = ban_epoch;
        (*rl).cookie = 0;
        (*rl).cookies_on = (g.flags & GLOBAL_SYN_COOKIES != 0) as u32;
    }
    // Whether an earlier rule matched: a refusal is remembered for the tick only when its rule
    // was the first to match (a later like packet then meets no other rule first either).
    let mut matched = false;
    // A TCP packet a second look may answer (`cookies.rs`): a drop only because its source
    // was refused state does not end the loop; the rules after it judge it too, and any
    // other drop of theirs is final.
    // SAFETY: this CPU's scratch record.
    let second_look = unsafe { (*rl).cookies_on != 0 && cookies::may_answer(&(*rl).pkt) };
    let mut refused = false;
    for i in 0..MAX_RULES {
        if i >= n {
            break;
        }
        match rl_rule(i as u64, rl) {
            RULE_NO_MATCH => {}
            RULE_PASS => matched = true,
            // SAFETY: as above; `cookie` is the position + 1 of the last rule that dropped the
            // packet in its overflow state.
            RULE_DROP if second_look && unsafe { (*rl).cookie } == i + 1 => {
                refused = true;
                matched = true;
            }
            RULE_DROP_FOR_TICK if !matched && !ban_matched && i < g.narrow_rules => {
                fast::rl_fast_fill(rl, i as u64);
                return RuleVerdict::Drop;
            }
            _ => return RuleVerdict::Drop,
        }
    }
    if refused {
        RuleVerdict::Refused
    } else {
        RuleVerdict::Pass
    }
}

/// One rule for one packet (a global BPF function): [`RULE_NO_MATCH`], [`RULE_PASS`],
/// [`RULE_DROP`] or [`RULE_DROP_FOR_TICK`].
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_rule(index: u64, rl: *mut RuleLoop) -> u64 {
    if rl.is_null() || index >= MAX_RULES as u64 {
        return RULE_NO_MATCH;
    }
    // SAFETY: non-null pointer to this CPU's scratch record.
    let rl = unsafe { &mut *rl };
    let i = index as u32;
    let Some(rule) = policy::rule(i) else {
        return RULE_NO_MATCH;
    };
    if !matches(rule, &rl.pkt) {
        return RULE_NO_MATCH;
    }
    if rule.flags & (RULE_SRC_MATCH | RULE_EXCEPT) != 0 {
        if rl.src_mask_known == 0 {
            let (mask, except) = policy::rule_sources(&rl.pkt.src);
            rl.src_mask = mask;
            rl.src_except = except;
            rl.src_mask_known = 1;
        }
        if rule.flags & RULE_SRC_MATCH != 0 && rl.src_mask & (1 << i) == 0 {
            return RULE_NO_MATCH;
        }
        if rl.src_except & (1 << i) != 0 {
            return RULE_NO_MATCH;
        }
    }
    if rule.flags & (RULE_MORE_MATCH | RULE_DST_MATCH | RULE_TCP_STATE) != 0
        && matching::rl_match(index, rl) != matching::MATCHED
    {
        return RULE_NO_MATCH;
    }
    stats::add_rule(rl.env.slot, i, rc::MATCHED, rl.env.len);
    rl.env.now = if rule.flags & RULE_FINE_CLOCK != 0 {
        if rl.fine_now == 0 {
            // SAFETY: a helper without arguments that reads the clock.
            rl.fine_now = unsafe { bpf_ktime_get_ns() };
        }
        rl.fine_now
    } else {
        rl.coarse_now
    };
    match apply(rl, i, rule) {
        // (`apply` marks a refusal in `RuleLoop::cookie` and says Drop.)
        RuleVerdict::Drop | RuleVerdict::Refused => RULE_DROP,
        RuleVerdict::DropForTick => RULE_DROP_FOR_TICK,
        RuleVerdict::Pass => RULE_PASS,
    }
}

/// Protocol, destination ports and TCP flags. Non-first fragments carry no L4 header: they
/// match on protocol alone (port conditions count as met, so a fragment flood cannot slip past
/// a port rule) and never match a TCP-flags condition. A packet whose L4 header should be
/// there but could not be read counts as meeting every L4 condition.
#[inline(always)]
fn matches(rule: &RuleConfig, pkt: &Parsed) -> bool {
    if rule.protocol != PROTO_ANY && rule.protocol != pkt.proto {
        return false;
    }
    if rule.flags & RULE_TCP_FLAGS != 0 {
        if pkt.proto != PROTO_TCP {
            return false;
        }
        if pkt.l4 {
            if pkt.tcp_flags & rule.tcp_flags_mask != rule.tcp_flags_value {
                return false;
            }
        } else if !pkt.l4_cut {
            return false;
        }
    }
    if rule.port_count == 0 || pkt.fragment || pkt.l4_cut {
        return true;
    }
    if !pkt.l4 || (pkt.proto != PROTO_TCP && pkt.proto != PROTO_UDP) {
        return false;
    }
    let n = rule.port_count as usize;
    for j in 0..ratelimit_common::caps::MAX_PORT_RANGES {
        if j >= n {
            break;
        }
        let r = &rule.ports[j];
        if pkt.dport >= r.lo && pkt.dport <= r.hi {
            return true;
        }
    }
    false
}

/// Keep the first `prefix_len` bits of a 16-byte address in place (two 64-bit words, no loop:
/// a byte loop with a variable bound costs the verifier a state per byte).
#[inline(always)]
fn mask_addr(addr: &mut [u8; 16], prefix_len: u32) {
    let p = addr as *mut [u8; 16] as *mut [u8; 8];
    // SAFETY: two 8-byte halves of a 16-byte array.
    unsafe {
        let hi = u64::from_be_bytes(core::ptr::read_unaligned(p));
        let lo = u64::from_be_bytes(core::ptr::read_unaligned(p.add(1)));
        let keep_hi = if prefix_len >= 64 {
            u64::MAX
        } else if prefix_len == 0 {
            0
        } else {
            u64::MAX << (64 - prefix_len)
        };
        let keep_lo = if prefix_len >= 128 {
            u64::MAX
        } else if prefix_len <= 64 {
            0
        } else {
            u64::MAX << (128 - prefix_len)
        };
        core::ptr::write_unaligned(p, (hi & keep_hi).to_be_bytes());
        core::ptr::write_unaligned(p.add(1), (lo & keep_lo).to_be_bytes());
    }
}

/// Evaluate one matching rule for one packet.
///
/// Verifier cost is the design constraint here: each stage with internal branching (window
/// rotation, compare-and-swap retries, ban issue, event emission) is a *global* BPF function,
/// which the kernel verifies once on its own instead of once per path through the caller.
/// Without that split, the combinations of outcomes exceed the verifier's 1M-instruction
/// budget long before the program is complete.
#[inline(always)]
fn apply(rl: &mut RuleLoop, i: u32, rule: &RuleConfig) -> RuleVerdict {
    let env = &rl.env;
    let pkt = &rl.pkt;
    let cost = if rule.flags & RULE_BYTES != 0 {
        env.len
    } else {
        1
    };
    let key = &mut rl.key;
    key.rule = i as u8;
    key.kind = rule.key;
    key.proto = 0;
    key.fields = 0;
    key.prefix_len = 0;
    zero_addr(&mut key.addr);
    zero_addr(&mut key.src);
    // The limit in force: the precomputed relaxed one while the host has room, which is the
    // limit itself without `elastic` (a select by the level; see `RuleConfig::limit_now`).
    let relaxed = env.relaxed != 0;
    let mut limit = rule.limit_now(relaxed);
    if rule.key == KEY_IP {
        let plen = if pkt.v4 {
            V4_MAPPED_PREFIX + rule.v4_prefix as u32
        } else {
            rule.v6_prefix as u32
        };
        key.prefix_len = plen;
        key.addr = pkt.src.addr;
        mask_addr(&mut key.addr, plen);
        if rule.flags & RULE_CIDR_OVERRIDES != 0
            && let Some(o) = policy::cidr_override(i, &pkt.src)
        {
            limit = o.limit_now(relaxed);
        }
    } else if rule.key == KEY_TUPLE {
        tuple_key(key, rule, pkt, &rl.ext);
    } else if rule.key == KEY_REGION {
        let region = policy::region_of(&pkt.src);
        key.addr[0] = region[0];
        key.addr[1] = region[1];
        if rule.flags & RULE_REGION_OVERRIDES != 0
            && let Some(o) = policy::region_override(i, region)
        {
            limit = o.limit_now(relaxed);
        }
    } else if rule.flags & RULE_CIDR_OVERRIDES != 0
        && let Some(o) = policy::cidr_override(i, &pkt.src)
    {
        // key = all with per-CIDR overrides: the override's threshold for the shared bucket.
        limit = o.limit_now(relaxed);
    }
    let preview = env.preview_all != 0 || rule.flags & RULE_PREVIEW != 0;
    let exceed_pass = rule.flags & RULE_EXCEED_PASS != 0;
    let mut until = &raw mut rl.no_ban;
    let scan = &raw mut rl.scan;
    // A TCP packet may have a proven source (`cookies.rs`), looked up only if it is refused.
    let proven = if rl.cookies_on != 0 && pkt.proto == PROTO_TCP {
        &raw const pkt.src
    } else {
        core::ptr::null()
    };
    let (st, refused_admission) = match state_for(
        env,
        key,
        rl.coarse_now,
        rl.tick,
        &mut rl.inserts,
        scan,
        proven,
    ) {
        StateFor::State(p) => (p, false),
        StateFor::Shared(p) => {
            // SAFETY: addresses of fields of a live map value (no read).
            until = unsafe { &raw mut (*p).banned_until_ns };
            // SAFETY: as above.
            (unsafe { &raw mut (*p).state }, false)
        }
        StateFor::Refused(p) => (p, true),
        StateFor::Closed => {
            return refused_drop(rl, i, exceeded(env, i, preview, exceed_pass, rc::DROPPED));
        }
        StateFor::Nothing => {
            // The map refused even the aggregate state: fail open, counted (here only).
            stats::add(env.slot, global::STATE_INSERT_FAILED, env.len);
            return RuleVerdict::Pass;
        }
    };
    let j = &mut rl.judge;
    j.now = env.now;
    let global = rule.flags & RULE_GLOBAL != 0;
    j.wnow = if global {
        env.now.wrapping_add(env.wall_offset_ns)
    } else {
        env.now
    };
    j.global = global as u32;
    j.cost = cost;
    j.usage = 0;
    j.capacity = 0;
    j.seen = 0;
    j.slot = env.slot;
    j.rule = i;
    j.algorithm = rule.algorithm as u32;
    j.soft_permille = rule.soft_limit_permille;
    j.ban_flags =
        if preview { BAN_PREVIEW } else { 0 } | if exceed_pass { BAN_EXCEED_PASS } else { 0 };
    j.contended = 0;
    // SAFETY: `st` is a live map value; fields are touched through atomics or plain stores of
    // values only reports read.
    unsafe {
        atomic::add(&raw mut (*st).packets, 1);
        atomic::add(&raw mut (*st).bytes, env.len);
        (*st).last_ns = env.now;
    }
    let lim = limit as *const Limit;
    let is_ban = rule.action == ACTION_BAN && key.kind != KEY_OVERFLOW;
    let key = &rl.key;
    let j = &mut rl.judge;
    // A shared key of a global rule: what the other hosts counted for it.
    j.fleet = 0;
    if global
        && (key.kind == KEY_ALL || key.kind == KEY_REGION)
        && let Some(a) = crate::state::fleet_add()
    {
        // SAFETY: a live map value, copied (the daemon replaces it whole).
        j.add = unsafe { *a };
        j.fleet = 1;
    }
    if is_ban && key.kind != KEY_IP && rl_aggregate_ban(until, st, key, j) == AGGREGATE_BANNED {
        return exceeded(env, i, preview, exceed_pass, rc::BANNED_DROPPED);
    }
    if is_ban && key.kind == KEY_IP {
        match rl_ban_meter(st, lim, key, j) {
            BAN_HELD => return exceeded(env, i, preview, exceed_pass, rc::BANNED_DROPPED),
            // Banned only if the ban is in force (in a ban table, or held in the client's
            // state when the table is full): on any other failure the client is throttled
            // by the rule instead of losing all its traffic with no expiry.
            ABOVE_BAN_THRESHOLD if rl_ban(st, until, lim, key, j) != BAN_NOT_RECORDED => {
                return exceeded(env, i, preview, exceed_pass, rc::DROPPED);
            }
            _ => {}
        }
    } else if is_ban
        && rl_ban_meter(st, lim, key, j) == ABOVE_BAN_THRESHOLD
        && rl_ban(st, until, lim, key, j) != BAN_NOT_RECORDED
    {
        return exceeded(env, i, preview, exceed_pass, rc::DROPPED);
    }
    let admitted = rl_limit(st, lim, j);
    rl_after(st, lim, key, j, admitted);
    if admitted == ADMITTED {
        stats::add_rule(env.slot, i, rc::ADMITTED, env.len);
        return RuleVerdict::Pass;
    }
    // A new source refused state, then refused by the overflow state, on the coarse clock,
    // not by a lost race, with one threshold for every source (no per-CIDR overrides), in
    // packets, dropped: every new source of the rule is refused both for the rest of the tick
    // (the budget's horizon and the overflow state only move against them while `now`
    // stands still), so they skip both (`fast::overflow_closed`).
    if refused_admission
        && env.admission_fine == 0
        && !preview
        && !exceed_pass
        && rule.flags & (RULE_BYTES | RULE_FINE_CLOCK | RULE_CIDR_OVERRIDES) == 0
        && rl.judge.contended == 0
    {
        fast::overflow_close(i, env, rl.tick, rl.coarse_now);
    }
    // A refusal on the coarse clock by a throttle rule of packet counts, not a lost race, for
    // a client of its own (or a shared key, not the overflow state): like packets are refused
    // for the rest of the tick.
    let for_tick = rule.action == ACTION_THROTTLE
        && rule.flags & (RULE_BYTES | RULE_FINE_CLOCK) == 0
        && key.kind != KEY_OVERFLOW
        && rl.judge.contended == 0;
    match exceeded(env, i, preview, exceed_pass, rc::DROPPED) {
        RuleVerdict::Drop if for_tick => RuleVerdict::DropForTick,
        v if refused_admission => refused_drop(rl, i, v),
        v => v,
    }
}

/// `v`, rule `i`'s verdict on a packet judged in its overflow state; a drop is marked for
/// the second look at TCP (`RuleLoop::cookie`: the rule's position + 1).
#[inline(always)]
fn refused_drop(rl: &mut RuleLoop, i: u32, v: RuleVerdict) -> RuleVerdict {
    if matches!(v, RuleVerdict::Drop) {
        rl.cookie = i + 1;
    }
    v
}

/// Verdict for a packet over its limit (or banned by its rule), after preview and
/// `exceed_action`.
#[inline(always)]
fn exceeded(env: &Env, i: u32, preview: bool, exceed_pass: bool, drop_counter: u32) -> RuleVerdict {
    if preview {
        stats::add_rule(env.slot, i, rc::WOULD_DROP, env.len);
        stats::add(env.slot, global::PREVIEW_WOULD_DROP, env.len);
        RuleVerdict::Pass
    } else if exceed_pass {
        stats::add_rule(env.slot, i, rc::EXCEED_PASSED, env.len);
        stats::add(env.slot, global::EXCEED_PASS, env.len);
        RuleVerdict::Pass
    } else {
        stats::add_rule(env.slot, i, drop_counter, env.len);
        RuleVerdict::Drop
    }
}

/// The fields of rule `rule`'s `KEY_TUPLE` key (`ClientKey::tuple`) from the packet: its
/// source masked to the rule's prefix and its destination port and protocol as the parser
/// read them, its destination and source port as `matching::rl_prepare` did (every rule set
/// with such a key has them read, `GLOBAL_KEY_TUPLE`). A packet without ports (a non-first
/// fragment, ICMP, a cut header) has ports 0. Without a branch on the fields: each is masked
/// by its bit, so the verifier walks one path, not one per combination of fields.
#[inline(always)]
fn tuple_key(key: &mut ClientKey, rule: &RuleConfig, pkt: &Parsed, ext: &Ext) {
    let fields = rule.key_fields;
    let f = fields as u32;
    // All ones if the field is in the key, else zero.
    let mask = |bit: u8| 0u32.wrapping_sub((f / bit as u32) & 1);
    key.fields = fields;
    masked_copy(&mut key.addr, &ext.dst.addr, mask(KEY_FIELD_DST));
    let plen = if pkt.v4 {
        V4_MAPPED_PREFIX + rule.v4_prefix as u32
    } else {
        rule.v6_prefix as u32
    };
    masked_copy(&mut key.src, &pkt.src.addr, mask(KEY_FIELD_SRC));
    mask_addr(&mut key.src, plen);
    key.prefix_len = (pkt.dport as u32 & mask(KEY_FIELD_DST_PORT)) << 16
        | (ext.sport as u32 & mask(KEY_FIELD_SRC_PORT));
    key.proto = (pkt.proto as u32 & mask(KEY_FIELD_PROTOCOL)) as u8;
}
