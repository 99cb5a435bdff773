//! The fast-drop table (see `ratelimit_common::maps::FastEntry`).
//!
//! Rules judged on the coarse clock see one `now` for a whole timer tick. A packet refused by
//! a throttle rule would be refused again by every like packet (same source, protocol, port,
//! flags, interface) until the tick ends or the policy changes: the token bucket's horizon,
//! a window's count and a sliding window's previous count only move against the packet while
//! `now` stands still. So the first refusal of a tick is remembered here, per CPU, and the
//! tick's other like packets are dropped with the per-CPU counters the slow path would have
//! bumped, without a lookup of their client. Their per-client totals wait in the entry
//! (`pending_*`) until it goes stale — the next tick, a new policy generation, or another
//! packet taking the slot — and are then added to the client's state; the daemon adds what
//! is still pending when it reports clients, and clears it with the rule's clients when a
//! rule's position changes hands.
//!
//! The table is checked before the lists and bans: an entry is made only for a packet that
//! no list and no ban matched (`ban_matched`), lists change only with the policy generation,
//! and every ban insert moves `RL_BAN_EPOCH`, which voids the entries made before it.
//!
//! Not remembered: refusals by ban rules (their ban meter counts every packet), of byte
//! thresholds (a smaller packet may fit), on the precise clock, in preview or with
//! `exceed_action = "pass"`, of the overflow state (admission is judged per packet), lost
//! compare-and-swap races, and refusals by a rule that was not the first the packet matched
//! (an earlier rule counts the packet).

//!
//! The same holds for new sources in a random-source flood: once the admission budget has
//! refused a new source state in this tick and the rule's overflow state has refused the
//! packet, every new source of that rule is refused both until the tick ends. Per rule and
//! CPU, `RL_OVF_TICK` remembers that (`overflow_close`), and the tick's other new sources of
//! the rule are dropped with the same counters, their totals pending for the overflow state
//! (`overflow_closed`). Not for byte thresholds, the precise clock (the rule's or the
//! budget's), preview, `exceed_action = "pass"`, rules with per-CIDR overrides (sources
//! sharing the overflow state may have different thresholds) or lost races.

use aya_ebpf::{macros::map, maps::PerCpuArray};
use ratelimit_common::{
    caps::MAX_RULES,
    maps::{ClientState, FAST_ENTRIES, FAST_FRAGMENT, FAST_L4, FAST_L4_CUT, FAST_V4, FastEntry},
    stats::rule as rc,
};

use crate::{
    atomic,
    parse::Parsed,
    scratch::{Env, RuleLoop},
    state,
    stats::{self, Slot},
};

#[map(name = "RL_FAST")]
static FAST: PerCpuArray<FastEntry> = PerCpuArray::pinned(FAST_ENTRIES, 0);

/// Per rule: the tick in which its overflow state is closed to new sources (`jiffies`,
/// `generation`, `now_ns`), and the overflow state's pending totals (`pending_*`).
#[map(name = "RL_OVF_TICK")]
static OVF_TICK: PerCpuArray<FastEntry> = PerCpuArray::pinned(MAX_RULES, 0);

/// Whether rule `rule`'s overflow state is closed to new sources in this tick; if so the
/// packet is counted as pending for it and the caller drops it.
#[inline(always)]
pub fn overflow_closed(rule: u32, env: &Env, tick: u64) -> bool {
    let Some(e) = OVF_TICK.get_ptr_mut(rule) else {
        return false;
    };
    // SAFETY: this CPU's entry; an XDP program runs to completion on its CPU.
    let e = unsafe { &mut *e };
    if e.jiffies == tick && e.generation == env.generation {
        e.pending_packets += 1;
        e.pending_bytes += env.len;
        return true;
    }
    if e.pending_packets != 0 {
        rl_ovf_flush(e, rule as u64);
    }
    false
}

/// Close rule `rule`'s overflow state to new sources for the rest of this tick.
#[inline(always)]
pub fn overflow_close(rule: u32, env: &Env, tick: u64, now: u64) {
    let Some(e) = OVF_TICK.get_ptr_mut(rule) else {
        return;
    };
    // SAFETY: this CPU's entry.
    let e = unsafe { &mut *e };
    if e.pending_packets != 0 {
        rl_ovf_flush(e, rule as u64);
    }
    e.rule = rule as u8;
    e.generation = env.generation;
    e.jiffies = tick;
    e.now_ns = now;
}

/// Add the overflow state's pending totals to it and clear them, whatever the generation
/// (a global BPF function).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_ovf_flush(e: *mut FastEntry, rule: u64) -> u64 {
    if e.is_null() {
        return 0;
    }
    // SAFETY: non-null pointer to this CPU's entry.
    let e = unsafe { &mut *e };
    let packets = e.pending_packets;
    if packets == 0 {
        return 0;
    }
    if let Some(st) = state::overflow_of(rule as u32) {
        add_pending(st, packets, e.pending_bytes, e.now_ns);
    }
    e.pending_packets = 0;
    e.pending_bytes = 0;
    1
}

/// Totals judged and counted elsewhere, added to a state.
#[inline(always)]
fn add_pending(st: *mut ClientState, packets: u64, bytes: u64, now_ns: u64) {
    // SAFETY: a live map value; totals by atomic add as everywhere else.
    unsafe {
        atomic::add(&raw mut (*st).packets, packets);
        atomic::add(&raw mut (*st).bytes, bytes);
        atomic::add(&raw mut (*st).drops, packets);
        if (*st).last_ns < now_ns {
            (*st).last_ns = now_ns;
        }
        // Only within an episode (0: none; the refusal that made the entry started one, and
        // an admitted packet may have ended it since): a lost race leaves the newer time.
        let le = atomic::load(&raw const (*st).last_exceed_ns);
        if le != 0 && le < now_ns {
            atomic::cas(&raw mut (*st).last_exceed_ns, le, now_ns);
        }
    }
}

/// The slot of `src`: its four words folded to `FAST_ENTRIES` (a power of two).
#[inline(always)]
fn index(src: &[u8; 16]) -> u32 {
    let w = src as *const [u8; 16] as *const u32;
    // SAFETY: four 4-byte reads inside a 16-byte array.
    let x = unsafe {
        core::ptr::read_unaligned(w)
            ^ core::ptr::read_unaligned(w.add(1))
            ^ core::ptr::read_unaligned(w.add(2))
            ^ core::ptr::read_unaligned(w.add(3))
    };
    let x = x ^ (x >> 16);
    (x ^ (x >> 8)) & (FAST_ENTRIES - 1)
}

#[inline(always)]
fn pkt_flags(p: &Parsed) -> u8 {
    (if p.v4 { FAST_V4 } else { 0 })
        | (if p.l4 { FAST_L4 } else { 0 })
        | (if p.fragment { FAST_FRAGMENT } else { 0 })
        | (if p.l4_cut { FAST_L4_CUT } else { 0 })
}

#[inline(always)]
fn words(a: &[u8; 16]) -> (u64, u64) {
    let p = a as *const [u8; 16] as *const u64;
    // SAFETY: two 8-byte reads inside a 16-byte array.
    unsafe {
        (
            core::ptr::read_unaligned(p),
            core::ptr::read_unaligned(p.add(1)),
        )
    }
}

/// Whether this tick's entry says `pkt` is to be dropped; if so it is counted (rule matched
/// and dropped, pending for the client) and the caller finishes it as a rule drop.
#[inline(always)]
pub fn check(
    slot: Slot,
    pkt: &Parsed,
    len: u64,
    generation: u32,
    tick: u64,
    ban_epoch: u64,
) -> bool {
    let Some(e) = FAST.get_ptr_mut(index(&pkt.src.addr)) else {
        return false;
    };
    // SAFETY: this CPU's entry; an XDP program runs to completion on its CPU.
    let e = unsafe { &mut *e };
    if e.jiffies == tick
        && e.generation == generation
        && e.ban_epoch == ban_epoch
        && e.slot == slot
        && words(&e.src) == words(&pkt.src.addr)
        && e.dport == pkt.dport
        && e.proto == pkt.proto
        && e.tcp_flags == pkt.tcp_flags
        && e.pkt_flags == pkt_flags(pkt)
    {
        e.pending_packets += 1;
        e.pending_bytes += len;
        let rule = e.rule as u32;
        stats::add_rule(slot, rule, rc::MATCHED, len);
        stats::add_rule(slot, rule, rc::DROPPED, len);
        return true;
    }
    if e.pending_packets != 0
        && (e.jiffies != tick || e.generation != generation || e.ban_epoch != ban_epoch)
    {
        rl_fast_flush(e);
    }
    false
}

/// Add an entry's pending counts to its client's state and clear them, whatever the policy
/// generation: they were judged and counted under the policy of their tick. (When a rule's
/// position changes hands the daemon clears that rule's clients and pending counts.) A
/// global BPF function.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_fast_flush(e: *mut FastEntry) -> u64 {
    if e.is_null() {
        return 0;
    }
    // SAFETY: non-null pointer to this CPU's entry.
    let e = unsafe { &mut *e };
    let packets = e.pending_packets;
    if packets == 0 {
        return 0;
    }
    if let Some(st) = state::client_state(&e.key, crate::policy::global().store_sets) {
        add_pending(st, packets, e.pending_bytes, e.now_ns);
    }
    e.pending_packets = 0;
    e.pending_bytes = 0;
    1
}

/// Remember for the rest of the tick that the packet in `rl` was refused by rule `rule`, the
/// first rule it matched (a global BPF function).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_fast_fill(rl: *mut RuleLoop, rule: u64) -> u64 {
    if rl.is_null() {
        return 0;
    }
    // SAFETY: non-null pointer to this CPU's scratch record.
    let rl = unsafe { &*rl };
    let Some(e) = FAST.get_ptr_mut(index(&rl.pkt.src.addr)) else {
        return 0;
    };
    // SAFETY: this CPU's entry.
    let e = unsafe { &mut *e };
    if e.pending_packets != 0 {
        rl_fast_flush(e);
    }
    e.src = rl.pkt.src.addr;
    e.dport = rl.pkt.dport;
    e.proto = rl.pkt.proto;
    e.tcp_flags = rl.pkt.tcp_flags;
    e.pkt_flags = pkt_flags(&rl.pkt);
    e.rule = rule as u8;
    e.slot = rl.env.slot;
    e.generation = rl.env.generation;
    e.ban_epoch = rl.ban_epoch;
    e.jiffies = rl.tick;
    e.key = rl.key;
    e.pending_packets = 0;
    e.pending_bytes = 0;
    e.now_ns = rl.coarse_now;
    1
}
