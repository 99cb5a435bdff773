//! Rules, per-client state, bans and the new-source admission budget.
//!
//! Concurrency: per-client state (`store`, `SHARED`) is one shared entry per client, not per-CPU, so a
//! client whose packets arrive on several CPUs gets its threshold once, not once per CPU. It is
//! updated with atomic instructions only (BPF_ATOMIC: add, xchg, cmpxchg, or), never a lock:
//! * window counters are admitted by compare-and-swap: read the count, decide, commit only if
//!   no other CPU counted in between, retried a bounded number of times; a packet that loses
//!   every retry is treated as exceeding (counted in `CONTENDED`). No CPU can admit past the
//!   threshold, and nothing is ever subtracted, so a count cannot wrap.
//! * the token bucket is one word (GCRA's TAT) updated by compare-and-swap, retried a bounded
//!   number of times; a packet that loses every retry is treated as exceeding (counted in
//!   `CONTENDED`), again never over-admitting.
//! * window rotation is a compare-and-swap on the window index; the winner moves `cur` to
//!   `prev`. A packet another CPU counts between the swap and the move lands in `prev`
//!   instead of `cur`: bounded by the packets in flight at a window edge, and it only makes
//!   the estimate stricter for the rest of that window.
//!
//! The end-to-end test `two_cpu_accuracy` measures the result with senders on both CPUs.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::bpf_ktime_get_ns,
    macros::map,
    maps::{Array, HashMap, LpmTrie, lpm_trie::Key},
};
use ratelimit_common::{
    addr::{FAMILY_V4, FAMILY_V6, IpKey, LpmAddr, V4_MAPPED_PREFIX, lpm_prefix},
    caps::{MAX_BANS, MAX_OPERATOR_BANS, MAX_PASSING_BANS, MAX_RULES, MAX_SHARED_STATES},
    event::{EV_BAN, EV_SOFT_LIMIT, EV_THROTTLE_END, EV_THROTTLE_START, EV_UNBAN},
    limiter,
    maps::*,
    stats::{global, rule as rc},
};

use crate::{
    atomic, events, fast, known,
    parse::Parsed,
    policy,
    stats::{self, Slot},
    store::{self, NONE},
};

/// The states of shared keys (`KEY_ALL`: one per rule; `KEY_REGION`: one per rule and
/// region), with their bans. Per-source states live in the per-source store (`store.rs`),
/// bounded by `tracking.max_sources`; which sources get one at all is decided by the
/// admission budget below, so a random-source flood churns only its own entries. Shared (not
/// per-CPU): see the module comment. Not LRU: churn must not evict a shared key's ban.
#[map(name = "RL_SHARED")]
static SHARED: HashMap<ClientKey, SharedState> = HashMap::pinned(MAX_SHARED_STATES, 0);

/// Active bans, in three tables by what they do (`maps::ban_table`): the operator's, rule
/// bans that drop, and rule bans that let packets on (preview, `exceed_action = pass`). Their
/// own bounded maps, so per-client churn cannot evict a ban; LPM tries so a ban may cover a
/// prefix. A ban that drops never shares a trie with one that passes, so no passing ban can
/// hide or block a dropping one; the operator's table is theirs alone, so rules filling
/// theirs never stop `ratelimit ban add`. Expiry is enforced here, in the kernel: a ban ends
/// on time with no daemon running. A rule ban that finds its table full is held in the
/// client's own state (`BAN_HELD_MARK`).
#[map(name = "RL_BANS_OPERATOR")]
static OPERATOR_BANS: LpmTrie<LpmAddr, BanEntry> = LpmTrie::pinned(MAX_OPERATOR_BANS, 0);

/// Rule-issued bans that drop (`BAN_TABLE_RULE`).
#[map(name = "RL_BANS")]
static BANS: LpmTrie<LpmAddr, BanEntry> = LpmTrie::pinned(MAX_BANS, 0);

/// Rule-issued bans that let packets on to the rules (`BAN_TABLE_PASSING`).
#[map(name = "RL_BANS_PASSING")]
static PASSING_BANS: LpmTrie<LpmAddr, BanEntry> = LpmTrie::pinned(MAX_PASSING_BANS, 0);

/// `[table]`: non-zero when that ban table may hold an entry; zero only after the daemon saw
/// it empty. Whoever inserts a ban sets it *after* the insert; the daemon clears it only when
/// the table is empty, and sets it again if a ban arrived meanwhile. While it is zero that
/// table's lookup (an LPM-trie walk) is skipped.
#[map(name = "RL_BANS_PRESENT")]
static BANS_PRESENT: Array<u64> = Array::pinned(BAN_TABLES, 0);

/// `[0]`: bumped after every ban insert, the program's and the daemon's. A fast-drop entry
/// (made for a packet no ban matched) is void once it moved, so a source banned since is
/// dropped and counted as banned at once.
#[map(name = "RL_BAN_EPOCH")]
static BAN_EPOCH: Array<u64> = Array::pinned(1, 0);

/// The current ban epoch.
#[inline(always)]
pub fn ban_epoch() -> u64 {
    match BAN_EPOCH.get_ptr(0) {
        // SAFETY: a live array value.
        Some(p) => unsafe { atomic::load(p) },
        None => 0,
    }
}

/// Per rule: the one aggregate state shared by the sources that get no state of their own
/// (refused by the admission budget, or refused by a full map). An array, not entries of
/// `CLIENTS`: in a random-source flood nearly every packet lands here, and an indexed load
/// costs a fraction of a second hash lookup; nor can churn evict it.
#[map(name = "RL_OVERFLOW")]
static OVERFLOW: Array<ClientState> = Array::pinned(MAX_RULES, 0);

/// `[0]`: GCRA meter of the new-source admission budget, shared by all CPUs.
#[map(name = "RL_ADMISSION")]
static ADMISSION: Array<Admission> = Array::pinned(1, 0);

pub enum RuleVerdict {
    Pass,
    Drop,
    /// Dropped, and any like packet would be for the rest of this tick (see `fast.rs`).
    DropForTick,
}

/// `rl_rule` results.
const RULE_NO_MATCH: u64 = 0;
const RULE_DROP: u64 = 1;
const RULE_PASS: u64 = 2;
const RULE_DROP_FOR_TICK: u64 = 3;

/// Bounded retries of a compare-and-swap before giving up.
const CAS_RETRIES: u32 = 3;

/// `-EEXIST` from a map update with `BPF_NOEXIST`.
const EEXIST: i32 = -17;
/// `-ENOSPC` from an LPM trie update: the trie holds `max_entries` already.
const ENOSPC: i32 = -28;

/// The flags of the active ban that decides for `src`, removing expired ones on the way: the
/// operator's and the rules' bans that drop first, so a ban that drops always wins; then the
/// bans that pass (whose flags tell the caller so).
#[inline(always)]
pub fn active_ban(slot: Slot, src: &IpKey, now: u64) -> Option<u32> {
    let p = src.addr.as_ptr() as *const [u8; 8];
    // SAFETY: two 8-byte halves of a 16-byte array, read unaligned.
    let (hi, lo) = unsafe {
        (
            u64::from_ne_bytes(core::ptr::read_unaligned(p)),
            u64::from_ne_bytes(core::ptr::read_unaligned(p.add(1))),
        )
    };
    let found = rl_active_ban(slot as u64, hi, lo, now);
    if found & BAN_FOUND != 0 {
        Some(found as u32)
    } else {
        None
    }
}

/// [`rl_active_ban`]: a ban matched; its flags are the low 32 bits.
const BAN_FOUND: u64 = 1 << 32;

/// The ban lookup of [`active_ban`] (a global BPF function: verified once, its key on its
/// own stack). The address comes as two words (in memory order), not a pointer: a key must
/// be the function's own memory for the map helpers on every kernel from 6.1.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_active_ban(slot: u64, hi: u64, lo: u64, now: u64) -> u64 {
    let mut src = IpKey { addr: [0; 16] };
    let p = src.addr.as_mut_ptr() as *mut [u8; 8];
    // SAFETY: two 8-byte halves of a 16-byte array, written unaligned.
    unsafe {
        core::ptr::write_unaligned(p, hi.to_ne_bytes());
        core::ptr::write_unaligned(p.add(1), lo.to_ne_bytes());
    }
    let slot = slot as u32 & (ratelimit_common::caps::MAX_IFACES - 1);
    let key = Key::new(lpm_prefix(128), LpmAddr::of(&src));
    if table_present(BAN_TABLE_OPERATOR)
        && let Some(flags) = find_ban(&OPERATOR_BANS, BAN_TABLE_OPERATOR, slot, &key, now)
    {
        return BAN_FOUND | flags as u64;
    }
    if table_present(BAN_TABLE_RULE)
        && let Some(flags) = find_ban(&BANS, BAN_TABLE_RULE, slot, &key, now)
    {
        return BAN_FOUND | flags as u64;
    }
    if table_present(BAN_TABLE_PASSING)
        && let Some(flags) = find_ban(&PASSING_BANS, BAN_TABLE_PASSING, slot, &key, now)
    {
        return BAN_FOUND | flags as u64;
    }
    0
}

#[inline(always)]
fn table_present(table: u32) -> bool {
    !matches!(BANS_PRESENT.get(table), Some(&0))
}

/// Expired bans a lookup removes before it gives up for this packet (the next packets go on
/// removing). Only bans at nested prefixes of one source, all expired and not yet swept, can
/// need more.
const EXPIRED_PER_LOOKUP: u32 = 4;

/// The longest active ban of one table covering `key`, removing expired ones on the way.
#[inline(always)]
fn find_ban(
    trie: &LpmTrie<LpmAddr, BanEntry>,
    table: u32,
    slot: Slot,
    key: &Key<LpmAddr>,
    now: u64,
) -> Option<u32> {
    for _ in 0..EXPIRED_PER_LOOKUP {
        let entry = trie.get(key)?;
        if limiter::ban_active(entry.expires_ns, now) {
            return Some(entry.flags);
        }
        // Expired: remove exactly the entry that matched, then look again.
        rl_unban(slot as u64, now, entry as *const BanEntry, table as u64);
    }
    None
}

/// Remove an expired ban from its table and report it (a global BPF function: verified once,
/// and its stack is not added to the XDP entry's).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_unban(slot: u64, now: u64, entry: *const BanEntry, table: u64) -> u64 {
    if entry.is_null() {
        return 0;
    }
    // SAFETY: non-null pointer to a live map value.
    let entry = unsafe { &*entry };
    let slot = slot as u32 & (ratelimit_common::caps::MAX_IFACES - 1);
    let ip = IpKey { addr: entry.addr };
    let key = Key::new(lpm_prefix(entry.prefix_len), LpmAddr::of(&ip));
    let ck = client_key(entry.rule as u8, KEY_IP, entry.prefix_len, entry.addr);
    let expires = entry.expires_ns;
    let removed = match table as u32 {
        BAN_TABLE_OPERATOR => OPERATOR_BANS.remove(key).is_ok(),
        BAN_TABLE_RULE => BANS.remove(key).is_ok(),
        _ => PASSING_BANS.remove(key).is_ok(),
    };
    if removed {
        stats::add(slot, global::BANS_EXPIRED, 0);
        events::emit(slot, EV_UNBAN, &ck, now, 0, 0, expires);
        return 1;
    }
    0
}

/// What a rule evaluation needs besides the rule and the packet (one pointer for the call).
#[repr(C)]
pub struct Env {
    pub slot: Slot,
    pub len: u64,
    pub now: u64,
    pub preview_all: u32,
    /// `GLOBAL_ADMISSION_FINE_CLOCK` set: the budget needs the precise clock.
    pub admission_fine: u32,
    /// `GlobalConfig::generation` this packet was judged under.
    pub generation: u32,
    pub admission_inc_ns: u64,
    pub admission_burst_ns: u64,
    /// `GlobalConfig::admission_tick_cap`.
    pub admission_tick_cap: u32,
    /// `GlobalConfig::store_sets`.
    pub store_sets: u32,
}

/// New states this CPU inserted in its current tick (kept across packets in the scratch
/// record, which is per CPU).
#[repr(C)]
pub struct TickInserts {
    pub tick: u64,
    pub count: u64,
}

/// Per-packet working record of the rule evaluation: the packet facts, the environment, and
/// scratch space for the stages. It lives in a per-CPU array, not on the stack: the BPF stack
/// is 512 bytes for the whole call chain, and values in a map cost the verifier nothing to
/// track. Per-CPU is safe: an XDP program runs to completion on its CPU without preemption.
/// Plain data only, because global BPF functions see pointer arguments as untyped memory.
#[repr(C)]
pub struct RuleLoop {
    pub env: Env,
    pub pkt: Parsed,
    pub key: ClientKey,
    pub judge: Judge,
    pub src_mask: u32,
    pub src_mask_known: u32,
    /// The packet's coarse time, and its precise time once a rule has needed it (0 before).
    pub coarse_now: u64,
    pub fine_now: u64,
    /// The tick (jiffies) of `coarse_now`.
    pub tick: u64,
    /// `RL_BAN_EPOCH` read before this packet's ban lookup.
    pub ban_epoch: u64,
    /// Not reset per packet: see [`TickInserts`].
    pub inserts: TickInserts,
    /// The ban end of the rule's shared key when it has one, else a word no one reads (so the
    /// ban stages always get a valid pointer).
    pub no_ban: u64,
    /// Scratch space of the per-source store's insert.
    pub scan: store::Scan,
    /// Scratch space of a ban insert ([`rl_ban`]): the entry and its trie key live here, not
    /// on the stack, which the rule evaluation's call chain has little of.
    pub ban_entry: BanEntry,
    pub ban_key: Key<LpmAddr>,
}

#[map(name = "RL_SCRATCH")]
static SCRATCH: aya_ebpf::maps::PerCpuArray<RuleLoop> =
    aya_ebpf::maps::PerCpuArray::with_max_entries(1, 0);

/// Evaluate the rules in file order. Each rule is one call of the global function `rl_rule`,
/// which the verifier checks once on its own, so this loop costs it a call per rule.
#[inline(always)]
pub fn evaluate_rules(
    slot: Slot,
    pkt: Parsed,
    len: u64,
    (now, tick, ban_epoch): (u64, u64, u64),
    g: &GlobalConfig,
    src_mask: (u32, u32),
    // Whether a ban (one that lets packets on to the rules) matched: then no fast-drop entry
    // is made, as it would skip that ban's counting.
    ban_matched: bool,
) -> RuleVerdict {
    let n = g.rule_count;
    if n == 0 {
        return RuleVerdict::Pass;
    }
    let Some(rl) = SCRATCH.get_ptr_mut(0) else {
        return RuleVerdict::Pass;
    };
    // SAFETY: this CPU's scratch record, used only during this packet.
    unsafe {
        (*rl).env = Env {
            slot,
            len,
            now,
            preview_all: g.preview_all,
            admission_fine: (g.flags & GLOBAL_ADMISSION_FINE_CLOCK != 0) as u32,
            generation: g.generation,
            admission_inc_ns: g.admission_inc_ns,
            admission_burst_ns: g.admission_burst_ns,
            admission_tick_cap: g.admission_tick_cap,
            store_sets: g.store_sets,
        };
        (*rl).pkt = pkt;
        (*rl).src_mask_known = src_mask.0;
        (*rl).src_mask = src_mask.1;
        (*rl).coarse_now = now;
        (*rl).fine_now = 0;
        (*rl).tick = tick;
        (*rl).ban_epoch = ban_epoch;
    }
    // Whether an earlier rule matched: a refusal is remembered for the tick only when its rule
    // was the first to match (a later like packet then meets no other rule first either).
    let mut matched = false;
    for i in 0..MAX_RULES {
        if i >= n {
            break;
        }
        match rl_rule(i as u64, rl) {
            RULE_NO_MATCH => {}
            RULE_PASS => matched = true,
            RULE_DROP_FOR_TICK if !matched && !ban_matched => {
                fast::rl_fast_fill(rl, i as u64);
                return RuleVerdict::Drop;
            }
            _ => return RuleVerdict::Drop,
        }
    }
    RuleVerdict::Pass
}

/// One rule for one packet: 1 if the packet is to be dropped (a global BPF function).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_rule(index: u64, rl: *mut RuleLoop) -> u64 {
    if rl.is_null() || index >= MAX_RULES as u64 {
        return 0;
    }
    // SAFETY: non-null pointer to this CPU's scratch record.
    let rl = unsafe { &mut *rl };
    let i = index as u32;
    let Some(rule) = policy::rule(i) else {
        return 0;
    };
    if !matches(rule, &rl.pkt) {
        return RULE_NO_MATCH;
    }
    if rule.flags & RULE_SRC_MATCH != 0 {
        if rl.src_mask_known == 0 {
            rl.src_mask = policy::sources(&rl.pkt.src).1;
            rl.src_mask_known = 1;
        }
        if rl.src_mask & (1 << i) == 0 {
            return RULE_NO_MATCH;
        }
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
        RuleVerdict::Drop => RULE_DROP,
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

/// Take the new-source admission budget for one new state. `coarse_now`: the packet's coarse
/// time (the budget is shared by every rule, so it is metered on one clock whatever the
/// rule's).
#[inline(always)]
fn admit_new_source(env: &Env, coarse_now: u64) -> bool {
    env.admission_inc_ns == 0
        || rl_admit(
            coarse_now,
            env.admission_inc_ns,
            env.admission_burst_ns,
            env.admission_fine as u64,
        ) != 0
}

/// The admission budget's GCRA meter (a global BPF function: verified once). On the coarse
/// clock (`now`) unless `fine`: in a random-source flood every packet is a new source, and
/// reading the clock source would cost each of them more than the meter itself.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_admit(now: u64, inc: u64, burst_ns: u64, fine: u64) -> u64 {
    if inc == 0 {
        return 1;
    }
    let now = if fine != 0 {
        // SAFETY: a helper without arguments that reads the clock.
        unsafe { bpf_ktime_get_ns() }
    } else {
        now
    };
    let Some(a) = ADMISSION.get_ptr_mut(0) else {
        return 1;
    };
    // SAFETY: the address of a field of a live array value (no read).
    let tat = unsafe { &raw mut (*a).tat_ns };
    for _ in 0..CAS_RETRIES {
        // SAFETY: an aligned word of a live array value.
        let old = unsafe { atomic::load(tat) };
        match limiter::gcra_admit(old, now, inc, burst_ns) {
            None => return 0,
            Some(new) => {
                // SAFETY: as for the load.
                if unsafe { atomic::cas(tat, old, new) } {
                    return 1;
                }
            }
        }
    }
    0
}

/// Initial state of a new shared key. A static, so the map update reads it from .rodata
/// instead of a stack copy the compiler would zero with a byte-wise memset loop.
static ZERO_SHARED: SharedState = SharedState {
    state: ClientState {
        stamp: 0,
        cur: 0,
        prev: 0,
        ban_stamp: 0,
        seen_cur: 0,
        seen_prev: 0,
        last_ns: 0,
        last_exceed_ns: 0,
        packets: 0,
        bytes: 0,
        drops: 0,
    },
    banned_until_ns: 0,
};

/// What [`state_for`] found.
enum Got {
    /// The client's own state (found or created).
    State(*mut ClientState),
    /// A shared key's state (found or created).
    Shared(*mut SharedState),
    /// A new source the admission budget refused: the rule's overflow state.
    Refused(*mut ClientState),
    /// A new source refused in a tick whose overflow state already refused one
    /// (`fast::overflow_closed`): counted, to be dropped.
    Closed,
    /// The map refused even the aggregate state.
    Nothing,
}

/// The state for `key`, creating it if the admission budget allows; otherwise (or if the
/// store refuses) the rule's aggregate overflow state, and `key` is rewritten to say so.
#[inline(always)]
fn state_for(
    env: &Env,
    key: &mut ClientKey,
    coarse_now: u64,
    tick: u64,
    inserts: &mut TickInserts,
    scan: *mut store::Scan,
) -> Got {
    if key.kind != KEY_IP {
        return shared_state(env, key);
    }
    let (hash, tag, sets) = store::place(key, env.store_sets);
    // A source the known-sources filter has never seen has no state: skip the lookup (in a
    // random-source flood, a look at a set no cache holds, for nearly every packet).
    if !known::may_be_tracked(hash) {
        stats::add(env.slot, global::LOOKUP_SKIPPED, env.len);
    } else if let Some(p) = store::lookup(key, tag, sets) {
        return Got::State(p);
    }
    if fast::overflow_closed(key.rule as u32, env, tick) {
        stats::add(env.slot, global::ADMISSION_REFUSED, env.len);
        overflow(key);
        return Got::Closed;
    }
    if env.admission_tick_cap != 0 && inserts.tick != tick {
        inserts.tick = tick;
        inserts.count = 0;
    }
    // This CPU's share of the tick is spent (a burst spread over ticks), or the budget is.
    if (env.admission_tick_cap != 0 && inserts.count >= env.admission_tick_cap as u64)
        || !admit_new_source(env, coarse_now)
    {
        stats::add(env.slot, global::ADMISSION_REFUSED, env.len);
        return refused(key);
    }
    inserts.count += 1;
    // Before the insert, so no CPU can find the state while the filter denies it.
    known::note(hash);
    let i = if env.store_sets == 0 {
        NONE
    } else {
        store::insert(key, tag, sets, env.slot, env.now, scan)
    };
    match store::state(i) {
        Some(p) => Got::State(p),
        _ => {
            // All its candidates protected: counted by the store (`STATE_PROTECTED`).
            if i != store::PROTECTED {
                stats::add(env.slot, global::STATE_INSERT_FAILED, env.len);
            }
            refused(key)
        }
    }
}

/// The state of a shared key, created on its first packet.
#[inline(always)]
fn shared_state(env: &Env, key: &mut ClientKey) -> Got {
    let key = &on_stack(key);
    if let Some(p) = SHARED.get_ptr_mut(key) {
        return Got::Shared(p);
    }
    #[expect(
        clippy::needless_borrows_for_generic_args,
        reason = "by value would copy the static onto the 512-byte BPF stack"
    )]
    let inserted = SHARED.insert(key, &ZERO_SHARED, BPF_NOEXIST as u64);
    match inserted {
        Ok(()) => stats::add(env.slot, global::STATE_CREATED, 0),
        Err(EEXIST) => {}
        Err(_) => {
            stats::add(env.slot, global::STATE_INSERT_FAILED, env.len);
            return Got::Nothing;
        }
    }
    match SHARED.get_ptr_mut(key) {
        Some(p) => Got::Shared(p),
        None => Got::Nothing,
    }
}

/// A source refused a state of its own: the rule's overflow state.
#[inline(always)]
fn refused(key: &mut ClientKey) -> Got {
    match overflow_state(key) {
        Some(p) => Got::Refused(p),
        None => Got::Nothing,
    }
}

/// The rule's overflow state, for the fast-drop table's flush.
#[inline(always)]
pub fn overflow_of(rule: u32) -> Option<*mut ClientState> {
    OVERFLOW.get_ptr_mut(rule)
}

/// The rule's aggregate overflow state (`key.rule`), with `key` rewritten to say so.
#[inline(always)]
fn overflow_state(key: &mut ClientKey) -> Option<*mut ClientState> {
    overflow(key);
    OVERFLOW.get_ptr_mut(key.rule as u32)
}

#[inline(always)]
fn overflow(key: &mut ClientKey) {
    key.kind = KEY_OVERFLOW;
    key.prefix_len = 0;
    zero_addr(&mut key.addr);
}

/// Builds a key with explicit stores. A struct literal with zeroed fields becomes a call to
/// the byte-wise `memset`, whose loop the verifier walks byte by byte at every call site.
#[inline(always)]
fn client_key(rule: u8, kind: u8, prefix_len: u32, addr: [u8; 16]) -> ClientKey {
    let mut k = core::mem::MaybeUninit::<ClientKey>::uninit();
    let p = k.as_mut_ptr();
    // SAFETY: every field (and the padding bytes) is written before `assume_init`.
    unsafe {
        core::ptr::write_volatile(p as *mut u32, u32::from_ne_bytes([rule, kind, 0, 0]));
        core::ptr::write_volatile(&raw mut (*p).prefix_len, prefix_len);
        let a = &raw mut (*p).addr as *mut u32;
        let w = |i: usize| u32::from_ne_bytes([addr[i], addr[i + 1], addr[i + 2], addr[i + 3]]);
        core::ptr::write_volatile(a, w(0));
        core::ptr::write_volatile(a.add(1), w(4));
        core::ptr::write_volatile(a.add(2), w(8));
        core::ptr::write_volatile(a.add(3), w(12));
        k.assume_init()
    }
}

/// A copy of `key` on the stack, for a map helper. Inside a global BPF function every pointer
/// argument (and what is derived from it) is untyped memory, which 6.1's verifier does not
/// take as a map key: only the stack, a packet or a map ("R2 type=mem expected=fp, pkt,
/// pkt_meta, map_key, map_value"; 6.12 takes it). Six word stores: no memcpy, no byte loop.
#[inline(always)]
fn on_stack(key: &ClientKey) -> ClientKey {
    client_key(key.rule, key.kind, key.prefix_len, key.addr)
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

#[inline(always)]
fn zero_addr(addr: &mut [u8; 16]) {
    let a = addr as *mut [u8; 16] as *mut u32;
    // SAFETY: 16 bytes, written as four (possibly unaligned-free: the field is 4-aligned) words.
    unsafe {
        core::ptr::write_volatile(a, 0);
        core::ptr::write_volatile(a.add(1), 0);
        core::ptr::write_volatile(a.add(2), 0);
        core::ptr::write_volatile(a.add(3), 0);
    }
}

/// Per-packet facts the verifier-isolated stages below share. Lives on the caller's stack and
/// is passed by pointer (global BPF functions take scalars or pointers to plain memory).
#[repr(C)]
pub struct Judge {
    pub now: u64,
    pub cost: u64,
    /// Limiter usage after this packet, and what it is measured against.
    pub usage: u64,
    pub capacity: u64,
    /// Ban meter estimate.
    pub seen: u64,
    pub slot: u32,
    pub rule: u32,
    pub algorithm: u32,
    pub soft_permille: u32,
    /// `BAN_PREVIEW` / `BAN_EXCEED_PASS` for bans this rule issues.
    pub ban_flags: u32,
    /// Non-zero when the limiter refused because it lost every compare-and-swap retry.
    pub contended: u32,
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
    key._pad = [0; 2];
    key.prefix_len = 0;
    zero_addr(&mut key.addr);
    let mut limit = &rule.limit;
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
            limit = &o.limit;
        }
    } else if rule.key == KEY_REGION {
        let region = policy::region_of(&pkt.src);
        key.addr[0] = region[0];
        key.addr[1] = region[1];
        if rule.flags & RULE_REGION_OVERRIDES != 0
            && let Some(o) = policy::region_override(i, region)
        {
            limit = &o.limit;
        }
    } else if rule.flags & RULE_CIDR_OVERRIDES != 0
        && let Some(o) = policy::cidr_override(i, &pkt.src)
    {
        // key = all with per-CIDR overrides: the override's threshold for the shared bucket.
        limit = &o.limit;
    }
    let preview = env.preview_all != 0 || rule.flags & RULE_PREVIEW != 0;
    let exceed_pass = rule.flags & RULE_EXCEED_PASS != 0;
    let mut until = &raw mut rl.no_ban;
    let scan = &raw mut rl.scan;
    let (st, refused_admission) =
        match state_for(env, key, rl.coarse_now, rl.tick, &mut rl.inserts, scan) {
            Got::State(p) => (p, false),
            Got::Shared(p) => {
                // SAFETY: addresses of fields of a live map value (no read).
                until = unsafe { &raw mut (*p).banned_until_ns };
                // SAFETY: as above.
                (unsafe { &raw mut (*p).state }, false)
            }
            Got::Refused(p) => (p, true),
            Got::Closed => return exceeded(env, i, preview, exceed_pass, rc::DROPPED),
            Got::Nothing => {
                // The map refused even the aggregate state: fail open, counted.
                stats::add(env.slot, global::STATE_INSERT_FAILED, 0);
                return RuleVerdict::Pass;
            }
        };
    let j = &mut rl.judge;
    j.now = env.now;
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
    if is_ban && key.kind != KEY_IP && rl_aggregate_ban(until, st, key, j) != 0 {
        return exceeded(env, i, preview, exceed_pass, rc::BANNED_DROPPED);
    }
    if is_ban && key.kind == KEY_IP {
        match rl_ban_meter(st, lim, key, j) {
            BAN_HELD => return exceeded(env, i, preview, exceed_pass, rc::BANNED_DROPPED),
            // Banned only if the ban is in force (in a ban table, or held in the client's
            // state when the table is full): on any other failure the client is throttled
            // by the rule instead of losing all its traffic with no expiry.
            1 if rl_ban(st, until, lim, key, j) != 0 => {
                return exceeded(env, i, preview, exceed_pass, rc::DROPPED);
            }
            _ => {}
        }
    } else if is_ban && rl_ban_meter(st, lim, key, j) == 1 && rl_ban(st, until, lim, key, j) != 0 {
        return exceeded(env, i, preview, exceed_pass, rc::DROPPED);
    }
    let admitted = rl_limit(st, lim, j);
    rl_after(st, lim, key, j, admitted);
    if admitted == 1 {
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
        v => v,
    }
}

/// Aggregate (key all/region) bans live in the state itself: 1 if banned now. Clears an
/// expired one and reports the unban.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_aggregate_ban(
    until: *mut u64,
    st: *mut ClientState,
    key: *const ClientKey,
    j: *mut Judge,
) -> u64 {
    if until.is_null() || st.is_null() || key.is_null() || j.is_null() {
        return 0;
    }
    // SAFETY: non-null pointers to a live map value and to the caller's stack.
    unsafe {
        let u = atomic::load(until);
        if u == 0 {
            return 0;
        }
        if (*j).now < u {
            atomic::add(&raw mut (*st).drops, 1);
            return 1;
        }
        if atomic::cas(until, u, 0) {
            events::emit((*j).slot, EV_UNBAN, &*key, (*j).now, 0, 0, u);
        }
    }
    0
}

/// [`rl_ban_meter`]: the client is banned by a ban held in its own state.
const BAN_HELD: u64 = 2;

/// Offered-rate meter of rate_based_ban (every matched packet counts): 1 if the client is now
/// above its ban threshold, [`BAN_HELD`] if a ban held in its state (`BAN_HELD_MARK`) is in
/// force. A held ban that has ended is cleared (and its unban reported) on the way.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_ban_meter(
    st: *mut ClientState,
    lim: *const Limit,
    key: *const ClientKey,
    j: *mut Judge,
) -> u64 {
    if st.is_null() || lim.is_null() || key.is_null() || j.is_null() {
        return 0;
    }
    // SAFETY: non-null pointers to live map values and the caller's stack.
    unsafe {
        let stamp = &raw mut (*st).ban_stamp;
        if atomic::load(stamp) == BAN_HELD_MARK {
            let end = atomic::load(&raw mut (*st).seen_prev);
            if (*j).now < end {
                atomic::add(&raw mut (*st).drops, 1);
                return BAN_HELD;
            }
            // Ended: the client starts clean. The swap back decides who reports it.
            if atomic::cas(stamp, BAN_HELD_MARK, 0) {
                atomic::store(&raw mut (*st).seen_cur, 0);
                atomic::store(&raw mut (*st).seen_prev, 0);
                events::emit((*j).slot, EV_UNBAN, &*key, (*j).now, 0, 0, end);
            }
        }
        let interval = (*lim).ban_interval_ns;
        if interval == 0 {
            return 0;
        }
        let seen = meter(
            stamp,
            &raw mut (*st).seen_cur,
            &raw mut (*st).seen_prev,
            (*j).now,
            interval,
            (*j).cost,
        );
        (*j).seen = seen;
        (seen > (*lim).ban_threshold) as u64
    }
}

/// The limiter: 1 if the packet is within the threshold, 0 if not, [`REFUSED_STARTS`] if not
/// and the refusal starts a throttle episode. Sets `usage` and `capacity`.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_limit(st: *mut ClientState, lim: *const Limit, j: *mut Judge) -> u64 {
    if st.is_null() || lim.is_null() || j.is_null() {
        return 1;
    }
    // SAFETY: non-null pointers to live map values and the caller's stack.
    unsafe {
        let (admitted, usage, capacity, contended) = limit_check(
            (*j).slot,
            st,
            (*j).algorithm as u8,
            &*lim,
            (*j).now,
            (*j).cost,
        );
        (*j).usage = usage;
        (*j).capacity = capacity;
        (*j).contended = contended as u32;
        if !admitted {
            atomic::add(&raw mut (*st).drops, 1);
            // The refusal that starts an episode swaps `last_exceed_ns` away from 0.
            if atomic::swap(&raw mut (*st).last_exceed_ns, (*j).now) == 0 {
                return REFUSED_STARTS;
            }
        }
        admitted as u64
    }
}

/// [`rl_limit`]: refused, and the refusal starts a throttle episode.
const REFUSED_STARTS: u64 = 2;

/// Throttle and soft-limit episodes, one event at each edge: a throttle episode runs while
/// `last_exceed_ns` is not 0 (see [`ClientState::last_exceed_ns`]); the soft-limit episode
/// flag is [`DROPS_SOFT_REPORTED`]. `admitted` is [`rl_limit`]'s answer.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_after(
    st: *mut ClientState,
    lim: *const Limit,
    key: *const ClientKey,
    j: *mut Judge,
    admitted: u64,
) -> u64 {
    if st.is_null() || lim.is_null() || key.is_null() || j.is_null() {
        return 0;
    }
    // SAFETY: non-null pointers to live map values and the caller's stack.
    unsafe {
        let j = &*j;
        let lim = &*lim;
        let key = &*key;
        let drops = &raw mut (*st).drops;
        let soft = atomic::load(drops) & DROPS_SOFT_REPORTED != 0;
        // Token bucket usage is in ns of bucket time; events report units.
        let usage_units = || {
            if j.algorithm == ALG_TOKEN_BUCKET as u32 {
                let inc = lim.gcra_inc_ns;
                j.usage / if inc == 0 { 1 } else { inc }
            } else {
                j.usage
            }
        };
        if admitted == 0 {
            return 0;
        }
        if admitted == REFUSED_STARTS {
            if !soft {
                atomic::fetch_or(drops, DROPS_SOFT_REPORTED);
            }
            events::emit(
                j.slot,
                EV_THROTTLE_START,
                key,
                j.now,
                usage_units(),
                lim.threshold,
                0,
            );
            return 0;
        }
        let exceed = &raw mut (*st).last_exceed_ns;
        let last = atomic::load(exceed);
        let throttling = last != 0;
        // A refusal on another CPU since the load fails the swap back to 0.
        if throttling
            && j.now.saturating_sub(last) >= lim.interval_ns
            && atomic::cas(exceed, last, 0)
        {
            events::emit(
                j.slot,
                EV_THROTTLE_END,
                key,
                j.now,
                usage_units(),
                lim.threshold,
                0,
            );
        }
        if limiter::above_share(j.usage, j.capacity, j.soft_permille) {
            if !soft && atomic::fetch_or(drops, DROPS_SOFT_REPORTED) & DROPS_SOFT_REPORTED == 0 {
                events::emit(
                    j.slot,
                    EV_SOFT_LIMIT,
                    key,
                    j.now,
                    usage_units(),
                    lim.threshold,
                    0,
                );
            }
        } else if soft && !throttling {
            atomic::fetch_and(drops, !DROPS_SOFT_REPORTED);
        }
    }
    0
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

/// Rotate a window meter to `now` (compare-and-swap on the window index).
///
/// # Safety
/// `stamp`, `cur` and `prev` are aligned words of one live map value.
#[inline(always)]
unsafe fn rotate(stamp: *mut u64, cur: *mut u64, prev: *mut u64, now: u64, interval: u64) -> u64 {
    let w = limiter::window_of(now, interval);
    // SAFETY: the caller's contract.
    let s = unsafe { atomic::load(stamp) };
    // Forward only: a CPU whose `now` was read just before another CPU rotated must not
    // rotate back (that would reset the window). A jump far backwards means the interval
    // changed: start clean. A ban meter holding a ban (`BAN_HELD_MARK`, set by another CPU
    // since this one looked) is not a window: leave it.
    if (w > s || w.wrapping_add(1) < s)
        && s != BAN_HELD_MARK
        // SAFETY: the caller's contract.
        && unsafe { atomic::cas(stamp, s, w) }
    {
        // SAFETY: the caller's contract.
        let c = unsafe { atomic::swap(cur, 0) };
        let (_, p) = limiter::rotate(s, w, c, 0);
        // SAFETY: the caller's contract.
        unsafe { atomic::store(prev, p) };
    }
    w
}

/// Count `cost` into a sliding-window meter and return its estimate.
///
/// # Safety
/// `stamp`, `cur` and `prev` are aligned words of one live map value.
#[inline(always)]
unsafe fn meter(
    stamp: *mut u64,
    cur: *mut u64,
    prev: *mut u64,
    now: u64,
    interval: u64,
    cost: u64,
) -> u64 {
    // SAFETY: the caller's contract, passed on.
    let w = unsafe { rotate(stamp, cur, prev, now, interval) };
    // SAFETY: the caller's contract.
    let c = unsafe { atomic::fetch_add(cur, cost) } + cost;
    limiter::sliding_estimate(
        // SAFETY: the caller's contract.
        unsafe { atomic::load(prev) },
        c,
        limiter::prev_weight_in(now, interval, w),
    )
}

/// The rule's algorithm: (admitted, usage after this packet, the capacity usage is measured
/// against: the threshold for windows, the burst for the token bucket, whether it refused
/// for losing every compare-and-swap retry).
///
/// # Safety
/// `st` points to a live map value.
#[inline(always)]
unsafe fn limit_check(
    slot: Slot,
    st: *mut ClientState,
    algorithm: u8,
    limit: &Limit,
    now: u64,
    cost: u64,
) -> (bool, u64, u64, bool) {
    let interval = limit.interval_ns;
    let threshold = limit.threshold;
    if interval == 0 || threshold == 0 {
        return (true, 0, threshold, false);
    }
    // SAFETY: addresses of fields of the live map value `st` (no read).
    let (stamp, cur, prev) = unsafe {
        (
            &raw mut (*st).stamp,
            &raw mut (*st).cur,
            &raw mut (*st).prev,
        )
    };
    if algorithm == ALG_TOKEN_BUCKET {
        // Usage and capacity in ns of bucket time (no division per packet); `rl_after`
        // converts to units for the events it emits.
        let inc = if cost == 1 {
            limit.gcra_inc_ns
        } else {
            limiter::gcra_increment(cost, threshold, interval)
        };
        let burst_ns = limit.gcra_burst_ns;
        let tat = stamp;
        for _ in 0..CAS_RETRIES {
            // SAFETY: an aligned word of the live map value `st`.
            let old = unsafe { atomic::load(tat) };
            match limiter::gcra_admit(old, now, inc, burst_ns) {
                None => {
                    // Left over from a stricter limit: store the horizon instead (best effort;
                    // a lost race leaves it for the next packet).
                    if let Some(c) = limiter::gcra_clamp(old, now, burst_ns) {
                        // SAFETY: as for the load.
                        unsafe { atomic::cas(tat, old, c) };
                    }
                    return (false, burst_ns, burst_ns, false);
                }
                Some(new) => {
                    // SAFETY: as for the load.
                    if unsafe { atomic::cas(tat, old, new) } {
                        return (true, new - now, burst_ns, false);
                    }
                }
            }
        }
        stats::add(slot, global::CONTENDED, 0);
        return (false, burst_ns, burst_ns, true);
    }
    // SAFETY: three aligned words of the live map value `st`.
    let w = unsafe { rotate(stamp, cur, prev, now, interval) };
    let weight = if algorithm == ALG_FIXED_WINDOW {
        0
    } else {
        limiter::prev_weight_in(now, interval, w)
    };
    // Admit by compare-and-swap on `cur`: read, decide, and commit only if no other CPU
    // counted in between. (Reserving with fetch-add and giving back on overshoot would race
    // with window rotation: a give-back landing after the rotation zeroed `cur` would wrap it
    // and shut the client out for two windows.)
    // SAFETY: an aligned word of the live map value `st`.
    let prev_w = unsafe { atomic::load(prev) };
    for _ in 0..CAS_RETRIES {
        // SAFETY: as above.
        let c = unsafe { atomic::load(cur) };
        let est = limiter::sliding_estimate(prev_w, c, weight);
        if !limiter::sliding_admits(est, cost, threshold) {
            return (false, est + cost, threshold, false);
        }
        // SAFETY: as above.
        if unsafe { atomic::cas(cur, c, c + cost) } {
            return (true, est + cost, threshold, false);
        }
    }
    stats::add(slot, global::CONTENDED, 0);
    (false, threshold, threshold, true)
}

/// Issue a ban for `key` (rate_based_ban crossed `ban_threshold`): 1 if this call issued it,
/// 2 if it was already there (another CPU, or another rule of the same kind), 0 if it could
/// not be recorded (then the client is throttled by its rule, not banned). A full table holds
/// the ban in the client's state instead ([`BAN_HELD_MARK`]).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_ban(
    st: *mut ClientState,
    until: *mut u64,
    lim: *const Limit,
    key: *const ClientKey,
    j: *mut Judge,
) -> u64 {
    if st.is_null() || until.is_null() || lim.is_null() || key.is_null() || j.is_null() {
        return 0;
    }
    // SAFETY: non-null pointers to live map values and the caller's stack.
    unsafe {
        let j = &*j;
        let key = &*key;
        let now = j.now;
        let expires = limiter::ban_expiry(now, (*lim).ban_duration_ns);
        let mut held = false;
        let issued = if key.kind == KEY_IP {
            // The entry and its key in this CPU's scratch record (a map value, which every
            // kernel accepts as a helper's key and value).
            let Some(rl) = SCRATCH.get_ptr_mut(0) else {
                return 0;
            };
            let entry = &raw mut (*rl).ban_entry;
            (*entry).expires_ns = expires;
            (*entry).since_ns = now;
            (*entry).rule = j.rule;
            (*entry).flags = j.ban_flags;
            (*entry).prefix_len = key.prefix_len;
            (*entry)._pad = 0;
            (*entry).addr = key.addr;
            let lpm = &raw mut (*rl).ban_key;
            let family = if (IpKey { addr: key.addr }).is_v4() {
                FAMILY_V4
            } else {
                FAMILY_V6
            };
            core::ptr::write_unaligned(
                lpm,
                Key::new(
                    lpm_prefix(key.prefix_len),
                    LpmAddr {
                        family,
                        addr: key.addr,
                    },
                ),
            );
            let table = ban_table(j.ban_flags);
            #[expect(
                clippy::needless_borrows_for_generic_args,
                reason = "the entry lives in the scratch map: by value would copy it onto the \
                          512-byte BPF stack, which this call chain has little of"
            )]
            let inserted = if table == BAN_TABLE_PASSING {
                PASSING_BANS.insert(&*lpm, &*entry, BPF_NOEXIST as u64)
            } else {
                BANS.insert(&*lpm, &*entry, BPF_NOEXIST as u64)
            };
            match inserted {
                Ok(()) => {
                    if let Some(p) = BANS_PRESENT.get_ptr_mut(table)
                        && atomic::load(p) == 0
                    {
                        atomic::store(p, 1);
                    }
                    if let Some(p) = BAN_EPOCH.get_ptr_mut(0) {
                        atomic::add(p, 1);
                    }
                    true
                }
                Err(EEXIST) => return 2,
                // The rules' table is full: hold the ban in the client's own state, which
                // this rule checks before its meter ([`rl_ban_meter`]).
                Err(ENOSPC) => {
                    held = true;
                    true
                }
                Err(_) => {
                    stats::add(j.slot, global::BAN_INSERT_FAILED, 0);
                    return 0;
                }
            }
        } else {
            atomic::cas(until, 0, if expires == 0 { u64::MAX } else { expires })
        };
        if !issued {
            return 2;
        }
        if held {
            // The end first, then the mark that makes it read (a CPU that sees the mark
            // sees the end); the swap tells a second CPU holding the same ban that it was
            // not the one to issue it. The ban ends on its own (`rl_ban_meter`).
            atomic::store(
                &raw mut (*st).seen_prev,
                if expires == 0 { u64::MAX } else { expires },
            );
            atomic::store(&raw mut (*st).seen_cur, 0);
            if atomic::swap(&raw mut (*st).ban_stamp, BAN_HELD_MARK) == BAN_HELD_MARK {
                return 2;
            }
            stats::add(j.slot, global::BAN_HELD_IN_STATE, 0);
        } else {
            atomic::store(&raw mut (*st).seen_cur, 0);
            atomic::store(&raw mut (*st).seen_prev, 0);
        }
        // The client starts clean when the ban ends.
        atomic::store(&raw mut (*st).cur, 0);
        atomic::store(&raw mut (*st).prev, 0);
        if j.algorithm == ALG_TOKEN_BUCKET as u32 {
            atomic::store(&raw mut (*st).stamp, 0);
        }
        atomic::add(&raw mut (*st).drops, 1);
        stats::add(j.slot, global::BANS_ISSUED, 0);
        stats::add_rule(j.slot, j.rule, rc::BANS, 0);
        events::emit(
            j.slot,
            EV_BAN,
            key,
            now,
            j.seen,
            (*lim).ban_threshold,
            expires,
        );
    }
    1
}

/// The state of `key`, if it has one (no admission, no insert), in a store of `sets` sets.
#[inline(always)]
pub fn client_state(key: &ClientKey, sets: u32) -> Option<*mut ClientState> {
    if key.kind == KEY_IP {
        let (_, tag, sets) = store::place(key, sets);
        store::lookup(key, tag, sets)
    } else {
        let p = SHARED.get_ptr_mut(on_stack(key))?;
        // SAFETY: a field of a live map value.
        Some(unsafe { &raw mut (*p).state })
    }
}

/// The floor reference (`bench` feature): the `cur` counter of rule 0's state of `src` as a
/// /32 (/128) key, the lookup every per-client design makes.
#[cfg(feature = "bench")]
#[inline(always)]
pub fn bench_client_counter(src: &IpKey) -> Option<*mut u64> {
    let key = client_key(0, KEY_IP, 128, src.addr);
    let sets = policy::global().store_sets;
    let st = store::bench_lookup(&key, sets)?;
    // SAFETY: a live map value.
    Some(unsafe { &raw mut (*st).cur })
}
