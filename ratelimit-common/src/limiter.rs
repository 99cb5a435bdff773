//! Limiter arithmetic as pure integer functions of (state, now, parameters).
//!
//! The XDP program reads state from a map shared by all CPUs, calls these functions, and writes
//! the result back with atomic instructions; host tests compare them with reference models.
//! Everything is `u64` with no division by values the caller has not validated
//! (`interval_ns > 0`, `threshold > 0`, `interval_ns <= caps::MAX_INTERVAL_NS`), because the
//! BPF target has no 128-bit arithmetic and the verifier rejects division by a possibly-zero
//! register.
//!
//! * Sliding window counter: the estimate is the current window's count plus the previous
//!   window's count weighted by the share of the previous window still inside the sliding
//!   interval. Only *admitted* cost is added, so a client offering 1.25x the threshold keeps
//!   being admitted at exactly the threshold rate (and loses 20%), instead of being starved by
//!   its own rejected packets.
//! * Fixed window: the count resets at every multiple of the interval.
//! * Token bucket, implemented as GCRA (the generic cell rate algorithm, a.k.a. the leaky
//!   bucket as a meter): one timestamp, the theoretical arrival time (TAT), replaces the token
//!   count. A bucket of capacity `burst` refilled at `threshold / interval` holds
//!   `(burst_ns - (tat - now)) / T` tokens, `T = interval / threshold`, so admitting "when
//!   tokens >= cost" is admitting "when `max(tat, now) + cost*T - now <= burst_ns`". The leaky
//!   bucket as a meter is the same test, which is why it is not offered separately. One word of
//!   state means one compare-and-swap updates it.

/// Fraction bits of the sliding-window weight.
pub const WEIGHT_BITS: u32 = 16;
const WEIGHT_ONE: u64 = 1 << WEIGHT_BITS;

/// Index of the window containing `now_ns`.
#[inline(always)]
pub fn window_of(now_ns: u64, interval_ns: u64) -> u64 {
    now_ns / interval_ns
}

/// Weight of the previous window, in units of 2^-16: the share of it still inside a sliding
/// interval ending at `now_ns`. Rounded up, like the estimate, so that rounding can only ever
/// refuse a packet at the edge, never admit one over the threshold.
#[inline(always)]
pub fn prev_weight(now_ns: u64, interval_ns: u64) -> u64 {
    let elapsed = now_ns % interval_ns;
    ((interval_ns - elapsed) << WEIGHT_BITS).div_ceil(interval_ns)
}

/// [`prev_weight`] given the window index `window = window_of(now_ns, interval_ns)` the
/// caller already has: one division instead of three.
#[inline(always)]
#[expect(
    clippy::manual_div_ceil,
    reason = "div_ceil is a division and a remainder on BPF"
)]
pub fn prev_weight_in(now_ns: u64, interval_ns: u64, window: u64) -> u64 {
    let elapsed = now_ns - window * interval_ns;
    // Rounded up without a second division (`div_ceil` is a division and a remainder on
    // BPF); no overflow: (interval << 16) + interval < 2^64 for interval < 2^47.
    (((interval_ns - elapsed) << WEIGHT_BITS) + interval_ns - 1) / interval_ns
}

/// Sliding-window estimate of the cost in the interval ending now: exactly
/// `ceil(prev * weight / 2^16) + cur`, saturated. `weight <= 2^16`. `prev` is split at bit 16 so
/// neither product can overflow ((2^48 - 1) * 2^16 < 2^64): clamping `prev` instead would
/// under-estimate a ban meter's long byte window and let its client escape the ban.
#[inline(always)]
pub fn sliding_estimate(prev: u64, cur: u64, weight: u64) -> u64 {
    let weight = if weight > WEIGHT_ONE {
        WEIGHT_ONE
    } else {
        weight
    };
    let high = (prev >> WEIGHT_BITS) * weight;
    let low = ((prev & (WEIGHT_ONE - 1)) * weight + (WEIGHT_ONE - 1)) >> WEIGHT_BITS;
    high.saturating_add(low).saturating_add(cur)
}

/// Window counters after moving from window `stamp` to window `window`: `(cur, prev)`.
#[inline(always)]
pub fn rotate(stamp: u64, window: u64, cur: u64, prev: u64) -> (u64, u64) {
    if window == stamp {
        (cur, prev)
    } else if window == stamp.wrapping_add(1) {
        (0, cur)
    } else {
        (0, 0)
    }
}

/// Sliding window: may `cost` more be admitted on top of the estimate?
#[inline(always)]
pub fn sliding_admits(estimate: u64, cost: u64, threshold: u64) -> bool {
    estimate.saturating_add(cost) <= threshold
}

/// Emission interval of `cost` units at `threshold` per `interval_ns` (GCRA increment),
/// rounded up: rounding down admitted more than the limit (19% more at 10 GiB/s with 64-byte
/// frames, and no limit at all once a frame's increment fell below 1 ns). Validation keeps
/// rates at or below 64 units per ns, so rounding up costs at most 1 ns a frame.
#[inline(always)]
pub fn gcra_increment(cost: u64, threshold: u64, interval_ns: u64) -> u64 {
    // cost is a frame length or 1 (< 2^16) and interval <= MAX_INTERVAL_NS (< 2^47), so the
    // product fits; `(p - 1) / t + 1` is the ceiling with one division and no overflow.
    let cost = if cost > 0xffff { 0xffff } else { cost };
    let p = cost * interval_ns;
    if p == 0 { 0 } else { (p - 1) / threshold + 1 }
}

/// Burst tolerance in ns for a bucket of `burst` units, `burst * interval / threshold`
/// rounded down (a bucket never larger than asked) and saturated; computed once by the daemon
/// and stored in the rule (`Limit::burst` holds units, the program gets this value through
/// `gcra_burst_ns`).
pub fn gcra_burst_ns(burst: u64, threshold: u64, interval_ns: u64) -> u64 {
    mul_div_floor(burst, interval_ns, threshold)
}

/// `floor(a * b / d)` for `d > 0`, saturated at `u64::MAX`, exact, in u64 arithmetic only (the
/// BPF target has no 128-bit multiply or divide). For the daemon's once-per-rule constants:
/// a loop of 64 steps is no per-packet cost.
pub fn mul_div_floor(a: u64, b: u64, d: u64) -> u64 {
    let (q, r) = (a / d, a % d);
    if b != 0 && q > u64::MAX / b {
        return u64::MAX;
    }
    // r * b / d with r < d, by shift and add over b's bits: invariant fq * d + fr = r * (the
    // bits of b seen so far), fr < d; fq <= r * b / d < b, so it cannot overflow.
    let (mut fq, mut fr) = (0u64, 0u64);
    for i in (0..64).rev() {
        fq <<= 1;
        if fr >= d - fr {
            fr -= d - fr;
            fq += 1;
        } else {
            fr <<= 1;
        }
        if (b >> i) & 1 == 1 {
            if fr >= d - r {
                fr -= d - r;
                fq += 1;
            } else {
                fr += r;
            }
        }
    }
    (q * b).saturating_add(fq)
}

/// GCRA: the new TAT if `cost` is admitted at `now_ns`, `None` if it must be refused.
#[inline(always)]
pub fn gcra_admit(tat: u64, now_ns: u64, increment: u64, burst_ns: u64) -> Option<u64> {
    let base = if tat > now_ns { tat } else { now_ns };
    let new_tat = base.saturating_add(increment);
    if new_tat - now_ns <= burst_ns {
        Some(new_tat)
    } else {
        None
    }
}

/// A TAT beyond `now + burst_ns` can only be left over from a stricter limit (a live rule
/// change, a removed override); in steady state the TAT never passes that horizon. Returns
/// the TAT to store instead, so that loosening a limit takes effect within one emission
/// interval rather than after the old limit's horizon.
#[inline(always)]
pub fn gcra_clamp(tat: u64, now_ns: u64, burst_ns: u64) -> Option<u64> {
    let horizon = now_ns.saturating_add(burst_ns);
    if tat > horizon { Some(horizon) } else { None }
}

/// Tokens left in a GCRA bucket, in cost units, for reports (host only: uses 128-bit math).
#[cfg(not(target_arch = "bpf"))]
pub fn gcra_tokens(tat: u64, now_ns: u64, burst_ns: u64, threshold: u64, interval_ns: u64) -> u64 {
    let spare_ns = burst_ns.saturating_sub(tat.saturating_sub(now_ns));
    (spare_ns as u128 * threshold as u128 / interval_ns.max(1) as u128) as u64
}

/// Is `usage` at or above `permille` thousandths of `threshold`? (`permille = 0` disables.)
#[inline(always)]
pub fn above_share(usage: u64, threshold: u64, permille: u32) -> bool {
    if permille == 0 {
        return false;
    }
    let p = permille as u64;
    usage >= (threshold / 1000) * p + (threshold % 1000) * p / 1000
}

/// Ban end for a ban issued at `now_ns` lasting `duration_ns` (0 = until removed).
#[inline(always)]
pub fn ban_expiry(now_ns: u64, duration_ns: u64) -> u64 {
    if duration_ns == 0 {
        0
    } else {
        now_ns.saturating_add(duration_ns).max(1)
    }
}

/// Is a ban with this expiry still active at `now_ns`?
#[inline(always)]
pub fn ban_active(expires_ns: u64, now_ns: u64) -> bool {
    expires_ns == 0 || now_ns < expires_ns
}

#[cfg(test)]
mod tests;
