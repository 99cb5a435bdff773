//! Per-CPU packet and byte counters (`STATS`), and the interface slot map that keeps each
//! interface's counters apart.
//!
//! Per-CPU on purpose: counters are the one place where every packet writes, and per-CPU
//! values need no atomics and never bounce a cache line between cores. The daemon sums CPUs.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, PerCpuArray},
};
use ratelimit_common::{
    caps::{IFSLOT_ARRAY_LEN, MAX_IFACES},
    stats::{Counter, STATS_LEN, global_index, rule_index},
};

pub type Slot = u32;

/// Counters, indexed by `ratelimit_common::stats` indices. Written only here.
#[map(name = "RL_STATS")]
static STATS: PerCpuArray<Counter> = PerCpuArray::pinned(STATS_LEN, 0);

/// ifindex → counter slot (1..MAX_IFACES), filled by the daemon when it attaches. Interfaces
/// it does not list count in slot 0.
#[map(name = "RL_IFACES")]
static IFACES: HashMap<u32, u32> = HashMap::pinned(MAX_IFACES, 0);

/// The same for ifindex < `IFSLOT_ARRAY_LEN`, as an array: the common case costs one indexed
/// load instead of a hash lookup. 0 = not listed.
#[map(name = "RL_IFSLOTS")]
static IFSLOTS: Array<u32> = Array::pinned(IFSLOT_ARRAY_LEN, 0);

#[inline(always)]
pub fn slot(ifindex: u32) -> Slot {
    if ifindex < IFSLOT_ARRAY_LEN {
        return match IFSLOTS.get(ifindex) {
            Some(&s) if s < MAX_IFACES => s,
            _ => 0,
        };
    }
    // SAFETY: the value is copied out at once, and it stays allocated until then (the kernel
    // frees hash map values after an RCU grace period; XDP runs in an RCU read-side section).
    match unsafe { IFACES.get(ifindex) } {
        Some(&s) if s < MAX_IFACES => s,
        _ => 0,
    }
}

#[inline(always)]
fn bump(index: u32, len: u64) {
    if let Some(c) = STATS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot; nothing else runs on this CPU while the program does.
        unsafe {
            (*c).packets += 1;
            (*c).bytes += len;
        }
    }
}

#[inline(always)]
pub fn add(slot: Slot, counter: u32, len: u64) {
    bump(global_index(slot, counter), len);
}

#[inline(always)]
pub fn add_rule(slot: Slot, rule: u32, counter: u32, len: u64) {
    bump(rule_index(slot, rule, counter), len);
}
