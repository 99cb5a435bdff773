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
/// Counts above this are clamped before weighting, so `count * weight` cannot overflow.
const COUNT_CLAMP: u64 = 1 << (64 - WEIGHT_BITS - 1);

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
#[allow(
    clippy::manual_div_ceil,
    reason = "div_ceil is a division and a remainder on BPF"
)]
pub fn prev_weight_in(now_ns: u64, interval_ns: u64, window: u64) -> u64 {
    let elapsed = now_ns - window * interval_ns;
    // Rounded up without a second division (`div_ceil` is a division and a remainder on
    // BPF); no overflow: (interval << 16) + interval < 2^64 for interval < 2^47.
    (((interval_ns - elapsed) << WEIGHT_BITS) + interval_ns - 1) / interval_ns
}

/// Sliding-window estimate of the cost in the interval ending now (rounded up).
#[inline(always)]
pub fn sliding_estimate(prev: u64, cur: u64, weight: u64) -> u64 {
    let prev = if prev > COUNT_CLAMP {
        COUNT_CLAMP
    } else {
        prev
    };
    ((prev * weight + (WEIGHT_ONE - 1)) >> WEIGHT_BITS).saturating_add(cur)
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

/// Emission interval of `cost` units at `threshold` per `interval_ns` (GCRA increment).
#[inline(always)]
pub fn gcra_increment(cost: u64, threshold: u64, interval_ns: u64) -> u64 {
    // cost is a frame length or 1 (< 2^16) and interval <= MAX_INTERVAL_NS (< 2^47).
    let cost = if cost > 0xffff { 0xffff } else { cost };
    cost * interval_ns / threshold
}

/// Burst tolerance in ns for a bucket of `burst` units; computed once by the daemon in
/// 128 bits and stored in the rule (`Limit::burst` holds units, the program gets this value
/// through `gcra_burst_ns`).
#[inline(always)]
pub fn gcra_burst_ns(burst: u64, threshold: u64, interval_ns: u64) -> u64 {
    // burst * interval / threshold without 128-bit math (the BPF target has none): split burst
    // into whole thresholds and the rest. interval <= MAX_INTERVAL_NS < 2^47, so
    // rest * (interval / threshold) < interval, and a burst of 2^16 thresholds or more is
    // effectively unlimited.
    let whole = burst / threshold;
    let rest = burst % threshold;
    let per = interval_ns / threshold;
    let per_rem = interval_ns % threshold;
    let rest_ns = if threshold < (1 << 32) {
        rest * per + rest * per_rem / threshold
    } else {
        rest * per
    };
    if whole >= (1 << 16) {
        u64::MAX
    } else {
        (whole * interval_ns).saturating_add(rest_ns)
    }
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
