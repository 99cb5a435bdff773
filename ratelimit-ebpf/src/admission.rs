//! Admission: which state a packet is counted in. A known source's own state; a new source
//! gets one only if the new-source admission budget (a GCRA meter shared by all CPUs) and
//! this CPU's share of the tick allow, else the rule's overflow state. See the glossary in
//! `rules.rs`.

use aya_ebpf::{helpers::bpf_ktime_get_ns, macros::map, maps::Array};
use ratelimit_common::{addr::IpKey, limiter, maps::*, stats::global};

use crate::{
    atomic::{self, CAS_RETRIES},
    cookies, fast, known, rare,
    scratch::{Env, TickInserts},
    state::{StateFor, overflow, refused, shared_state},
    stats,
    store::{self, NONE},
};

/// `[0]`: GCRA meter of the new-source admission budget, shared by all CPUs.
#[map(name = "RL_ADMISSION")]
static ADMISSION: Array<Admission> = Array::pinned(1, 0);

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
        ) == ADMIT
}

/// [`rl_admit`]: the budget refused a new state.
pub const REFUSE: u64 = 0;
/// [`rl_admit`]: the budget admitted a new state.
pub const ADMIT: u64 = 1;

/// The admission budget's GCRA meter (a global BPF function: verified once): [`ADMIT`] or
/// [`REFUSE`]. On the coarse
/// clock (`now`) unless `fine`: in a random-source flood every packet is a new source, and
/// reading the clock source would cost each of them more than the meter itself.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_admit(now: u64, inc: u64, burst_ns: u64, fine: u64) -> u64 {
    if inc == 0 {
        return ADMIT;
    }
    let now = if fine != 0 {
        // SAFETY: a helper without arguments that reads the clock.
        unsafe { bpf_ktime_get_ns() }
    } else {
        now
    };
    let Some(a) = ADMISSION.get_ptr_mut(0) else {
        return ADMIT;
    };
    // SAFETY: the address of a field of a live array value (no read).
    let tat = unsafe { &raw mut (*a).tat_ns };
    for _ in 0..CAS_RETRIES {
        // SAFETY: an aligned word of a live array value.
        let old = unsafe { atomic::load(tat) };
        match limiter::gcra_admit(old, now, inc, burst_ns) {
            None => return REFUSE,
            Some(new) => {
                // SAFETY: as for the load.
                if unsafe { atomic::cas(tat, old, new) } {
                    return ADMIT;
                }
            }
        }
    }
    REFUSE
}

/// The state for `key`, creating it if the admission budget allows; otherwise (or if the
/// store refuses) the rule's aggregate overflow state, and `key` is rewritten to say so.
/// `proven`: the packet's source if it may have proven itself by a handshake (a TCP packet,
/// SYN cookies on), else null; a proven source skips the budget (`cookies.rs`).
#[inline(always)]
pub fn state_for(
    env: &Env,
    key: &mut ClientKey,
    coarse_now: u64,
    tick: u64,
    inserts: &mut TickInserts,
    scan: *mut store::Scan,
    proven: *const IpKey,
) -> StateFor {
    if key.kind != KEY_IP {
        return shared_state(env, key);
    }
    let (hash, tag, sets) = store::place(key, env.store_sets);
    // A source the known-sources filter has never seen has no state: skip the lookup (in a
    // random-source flood, a look at a set no cache holds, for nearly every packet).
    if !known::may_be_tracked(hash) {
        stats::add(env.slot, global::LOOKUP_SKIPPED, env.len);
    } else if let Some(p) = store::lookup(key, tag, sets) {
        return StateFor::State(p);
    }
    // A proven source skips the budget (and the overflow state's closing, which follows from
    // it), not this CPU's share of the tick, which keeps the receive ring from stalling on
    // inserts whoever asks.
    // SAFETY: `proven` is null or points at the packet's source in the scratch record.
    let proven = !proven.is_null() && cookies::is_proven(unsafe { &*proven }, coarse_now);
    if !proven && fast::overflow_closed(key.rule as u32, env, tick) {
        stats::add(env.slot, global::ADMISSION_REFUSED, env.len);
        overflow(key);
        return StateFor::Closed;
    }
    if env.admission_tick_cap != 0 && inserts.tick != tick {
        inserts.tick = tick;
        inserts.count = 0;
    }
    // This CPU's share of the tick is spent (a burst spread over ticks), or the budget is.
    if (env.admission_tick_cap != 0 && inserts.count >= env.admission_tick_cap as u64)
        || (!proven && !admit_new_source(env, coarse_now))
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
        Some(p) => {
            if proven {
                stats::add(env.slot, global::PROVEN_ADMITTED, env.len);
            }
            StateFor::State(p)
        }
        _ => {
            // All its candidates protected: counted by the store (`STATE_PROTECTED`).
            if i != store::PROTECTED {
                stats::add(env.slot, global::STATE_INSERT_FAILED, env.len);
                let family = rare::family_of(&key.addr);
                rare::note(rare::STATE_NOT_PLACED, key.rule as u32, family, env.now);
            }
            refused(key)
        }
    }
}
