//! The meters of a rule: the limiter (sliding window, fixed window, token bucket), the ban
//! meter of `rate_based_ban`, and the throttle and soft-limit episodes they report.
//!
//! Concurrency: a state is one shared entry per client, not per-CPU (see `state.rs`), updated
//! with atomic instructions only (BPF_ATOMIC: add, xchg, cmpxchg, or), never a lock:
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

use ratelimit_common::{
    event::{EV_SOFT_LIMIT, EV_THROTTLE_END, EV_THROTTLE_START, EV_UNBAN},
    limiter,
    maps::*,
    stats::global,
};

use crate::{
    atomic::{self, CAS_RETRIES},
    events,
    scratch::Judge,
    stats,
};

/// [`rl_ban_meter`]: the client is at or below its ban threshold.
pub const BELOW_BAN_THRESHOLD: u64 = 0;
/// [`rl_ban_meter`]: the client is now above its ban threshold.
pub const ABOVE_BAN_THRESHOLD: u64 = 1;
/// [`rl_ban_meter`]: the client is banned by a ban held in its own state.
pub const BAN_HELD: u64 = 2;

/// Offered-rate meter of rate_based_ban (every matched packet counts): [`ABOVE_BAN_THRESHOLD`]
/// if the client is now above its ban threshold, [`BAN_HELD`] if a ban held in its state
/// (`BAN_HELD_MARK`) is in force, else [`BELOW_BAN_THRESHOLD`]. A held ban that has ended is
/// cleared (and its unban reported) on the way.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_ban_meter(
    st: *mut ClientState,
    lim: *const Limit,
    key: *const ClientKey,
    j: *mut Judge,
) -> u64 {
    if st.is_null() || lim.is_null() || key.is_null() || j.is_null() {
        return BELOW_BAN_THRESHOLD;
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
            return BELOW_BAN_THRESHOLD;
        }
        let seen = meter(
            stamp,
            &raw mut (*st).seen_cur,
            &raw mut (*st).seen_prev,
            (*j).wnow,
            interval,
            (*j).cost,
            &*j,
        );
        (*j).seen = seen;
        // BELOW_BAN_THRESHOLD (0) or ABOVE_BAN_THRESHOLD (1).
        (seen > (*lim).ban_threshold) as u64
    }
}

/// [`rl_limit`]: refused.
pub const REFUSED: u64 = 0;
/// [`rl_limit`]: within the threshold.
pub const ADMITTED: u64 = 1;
/// [`rl_limit`]: refused, and the refusal starts a throttle episode.
pub const REFUSED_STARTS: u64 = 2;

/// The limiter: [`ADMITTED`] if the packet is within the threshold, [`REFUSED`] if not,
/// [`REFUSED_STARTS`] if not and the refusal starts a throttle episode. Sets `usage` and
/// `capacity`.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_limit(st: *mut ClientState, lim: *const Limit, j: *mut Judge) -> u64 {
    if st.is_null() || lim.is_null() || j.is_null() {
        return ADMITTED;
    }
    // SAFETY: non-null pointers to live map values and the caller's stack.
    unsafe {
        let (admitted, usage, capacity, contended) = limit_check(st, &*lim, &*j);
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
        // ADMITTED (1) or REFUSED (0).
        admitted as u64
    }
}

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
        if admitted == REFUSED {
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

/// Count `cost` into the ban meter's sliding window and return its estimate (with, for a
/// shared key of a global rule, the other hosts' offered counts: `j.add`).
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
    j: &Judge,
) -> u64 {
    // SAFETY: the caller's contract, passed on.
    let w = unsafe { rotate(stamp, cur, prev, now, interval) };
    // SAFETY: the caller's contract.
    let c = unsafe { atomic::fetch_add(cur, cost) } + cost;
    let (xc, xp) = if j.fleet != 0 {
        FleetAdd::counts_in(j.add.ban_window, j.add.seen_cur, j.add.seen_prev, w)
    } else {
        (0, 0)
    };
    limiter::sliding_estimate(
        // SAFETY: the caller's contract.
        unsafe { atomic::load(prev) }.saturating_add(xp),
        c.saturating_add(xc),
        limiter::prev_weight_in(now, interval, w),
    )
}

/// A global token bucket's admission, counted for the fleet: `cur` is the admitted cost in
/// the wall-clock window `window` of [`GLOBAL_TB_WINDOW_NS`] (the bucket itself uses neither
/// word). The CPU that moves the window on zeroes the count; a packet another CPU counts
/// between the two is lost to the fleet's count (bounded by the packets in flight at a
/// window edge, once in ten seconds).
///
/// # Safety
/// `cur` and `window` are aligned words of one live map value.
#[inline(always)]
unsafe fn count_for_fleet(cur: *mut u64, window: *mut u64, wnow: u64, cost: u64) {
    let w = wnow / GLOBAL_TB_WINDOW_NS;
    // SAFETY: the caller's contract.
    unsafe {
        let s = atomic::load(window);
        // Forward, or far back (the wall clock stepped back): start the window's count.
        if (w > s || w.wrapping_add(1) < s) && atomic::cas(window, s, w) {
            atomic::store(cur, 0);
        }
        atomic::add(cur, cost);
    }
}

/// The rule's algorithm: (admitted, usage after this packet, the capacity usage is measured
/// against: the threshold for windows, the burst for the token bucket, whether it refused
/// for losing every compare-and-swap retry).
///
/// # Safety
/// `st` points to a live map value.
#[inline(always)]
unsafe fn limit_check(st: *mut ClientState, limit: &Limit, j: &Judge) -> (bool, u64, u64, bool) {
    let (slot, algorithm, now, wnow, cost, global) = (
        j.slot,
        j.algorithm as u8,
        j.now,
        j.wnow,
        j.cost,
        j.global != 0,
    );
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
                    // a lost race leaves it for the next packet). A global bucket keeps up to
                    // an interval of debt beyond it: the other hosts' admissions, charged by
                    // the daemon, whatever this host's own packets took meanwhile.
                    let horizon_ns = if global {
                        burst_ns.saturating_add(interval)
                    } else {
                        burst_ns
                    };
                    if let Some(c) = limiter::gcra_clamp(old, now, horizon_ns) {
                        // SAFETY: as for the load.
                        unsafe { atomic::cas(tat, old, c) };
                    }
                    return (false, burst_ns, burst_ns, false);
                }
                Some(new) => {
                    // SAFETY: as for the load.
                    if unsafe { atomic::cas(tat, old, new) } {
                        if global {
                            // SAFETY: aligned words of the live map value `st`.
                            unsafe { count_for_fleet(cur, prev, wnow, cost) };
                        }
                        return (true, new - now, burst_ns, false);
                    }
                }
            }
        }
        stats::add(slot, global::CONTENDED, 0);
        return (false, burst_ns, burst_ns, true);
    }
    // SAFETY: three aligned words of the live map value `st`.
    // Windows on the window clock (the wall clock's for a global rule).
    let w = unsafe { rotate(stamp, cur, prev, wnow, interval) };
    let weight = if algorithm == ALG_FIXED_WINDOW {
        0
    } else {
        limiter::prev_weight_in(wnow, interval, w)
    };
    // Admit by compare-and-swap on `cur`: read, decide, and commit only if no other CPU
    // counted in between. (Reserving with fetch-add and giving back on overshoot would race
    // with window rotation: a give-back landing after the rotation zeroed `cur` would wrap it
    // and shut the client out for two windows.)
    // A shared key of a global rule: the other hosts' counts of these windows too.
    let (xc, xp) = if j.fleet != 0 {
        FleetAdd::counts_in(j.add.window, j.add.cur, j.add.prev, w)
    } else {
        (0, 0)
    };
    // SAFETY: an aligned word of the live map value `st`.
    let prev_w = unsafe { atomic::load(prev) }.saturating_add(xp);
    for _ in 0..CAS_RETRIES {
        // SAFETY: as above.
        let c = unsafe { atomic::load(cur) };
        let est = limiter::sliding_estimate(prev_w, c.saturating_add(xc), weight);
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
