//! The limiter functions against straightforward reference models computed in 128-bit or
//! rational arithmetic.
extern crate std;
use super::*;
use proptest::prelude::*;
use std::vec::Vec;

/// Sliding-window limiter driven by the pure functions, as the XDP program drives it.
struct Sliding {
    stamp: u64,
    cur: u64,
    prev: u64,
}

impl Sliding {
    fn offer(&mut self, now: u64, cost: u64, threshold: u64, interval: u64) -> bool {
        let w = window_of(now, interval);
        let (cur, prev) = rotate(self.stamp, w, self.cur, self.prev);
        self.stamp = w;
        self.cur = cur;
        self.prev = prev;
        let est = sliding_estimate(prev, cur, prev_weight(now, interval));
        if sliding_admits(est, cost, threshold) {
            self.cur += cost;
            true
        } else {
            false
        }
    }
}

/// Reference sliding window: admitted cost per window index kept in a list, estimate in
/// exact rationals: admit iff prev*(interval-elapsed)/interval + cur + cost <= threshold.
struct RefSliding {
    admitted: Vec<(u64, u64)>,
}

impl RefSliding {
    fn offer(&mut self, now: u64, cost: u64, threshold: u64, interval: u64) -> bool {
        let w = now / interval;
        let sum = |idx: u64| -> u128 {
            self.admitted
                .iter()
                .filter(|(i, _)| *i == idx)
                .map(|(_, c)| *c as u128)
                .sum()
        };
        let cur = sum(w);
        let prev = if w == 0 { 0 } else { sum(w - 1) };
        let remaining = (interval - now % interval) as u128;
        // estimate*interval, exact.
        let est_scaled = prev * remaining + (cur + cost as u128) * interval as u128;
        let ok = est_scaled <= threshold as u128 * interval as u128;
        if ok {
            self.admitted.push((w, cost));
        }
        ok
    }
}

#[test]
fn sliding_steady_overload_loses_the_excess_share() {
    // 2500 packets per 1 s interval against a threshold of 2000, evenly spaced, 20 intervals.
    let interval = 1_000_000_000u64;
    let mut s = Sliding {
        stamp: 0,
        cur: 0,
        prev: 0,
    };
    let (mut sent, mut passed) = (0u64, 0u64);
    for i in 0..(2500 * 20u64) {
        let now = interval * 5 + i * (interval / 2500);
        sent += 1;
        passed += s.offer(now, 1, 2000, interval) as u64;
    }
    // Exactly the threshold rate gets through after the first interval's full allowance.
    let loss = 1.0 - passed as f64 / sent as f64;
    assert!((loss - 0.20).abs() < 0.005, "loss {loss}");
}

#[test]
fn sliding_under_threshold_loses_nothing() {
    let interval = 1_000_000_000u64;
    let mut s = Sliding {
        stamp: 0,
        cur: 0,
        prev: 0,
    };
    for i in 0..(1980 * 10u64) {
        let now = interval + i * (interval / 1980);
        assert!(s.offer(now, 1, 2000, interval), "packet {i} refused");
    }
}

#[test]
fn fixed_window_resets_at_boundaries() {
    let interval = 100u64;
    let (mut stamp, mut cur) = (0u64, 0u64);
    let mut admitted = [0u64; 3];
    for now in 100..400u64 {
        for _ in 0..2 {
            let w = window_of(now, interval);
            if w != stamp {
                stamp = w;
                cur = 0;
            }
            if cur < 50 {
                cur += 1;
                admitted[(w - 1) as usize] += 1;
            }
        }
    }
    assert_eq!(admitted, [50, 50, 50]);
}

#[test]
fn gcra_admits_exactly_burst_then_rate() {
    // 1000 per second, burst 100: at t=10s 100 back-to-back admits, then one per ms.
    let (thr, iv, burst) = (1000u64, 1_000_000_000u64, 100u64);
    let inc = gcra_increment(1, thr, iv);
    let bns = gcra_burst_ns(burst, thr, iv);
    assert_eq!(inc, 1_000_000);
    assert_eq!(bns, 100_000_000);
    let now = 10 * iv;
    let mut tat = 0;
    let mut n = 0;
    while let Some(t) = gcra_admit(tat, now, inc, bns) {
        tat = t;
        n += 1;
        assert!(n <= burst);
    }
    assert_eq!(n, burst);
    assert_eq!(gcra_admit(tat, now + 999_999, inc, bns), None);
    assert!(gcra_admit(tat, now + 1_000_000, inc, bns).is_some());
    assert_eq!(gcra_tokens(tat, now + 50_000_000, bns, thr, iv), 50);
}

#[test]
fn gcra_loosened_limit_takes_effect_at_once() {
    // Under 10 per day a throttled client's TAT is nearly a day ahead; after a change to
    // 10 per second (burst 10), it must wait at most one new emission interval.
    let day = 86_400_000_000_000u64;
    let now = 5 * day;
    let stale_tat = now + day - 1;
    let (inc, bns) = (
        gcra_increment(1, 10, 1_000_000_000),
        gcra_burst_ns(10, 10, 1_000_000_000),
    );
    assert_eq!(gcra_admit(stale_tat, now, inc, bns), None);
    let stored = gcra_clamp(stale_tat, now, bns).expect("stale TAT is clamped");
    assert_eq!(stored, now + bns);
    assert_eq!(gcra_admit(stored, now + inc - 1, inc, bns), None);
    assert!(gcra_admit(stored, now + inc, inc, bns).is_some());
    // Never in steady state: a TAT the bucket itself produced is within the horizon.
    let t = gcra_admit(0, now, inc, bns).unwrap();
    assert_eq!(gcra_clamp(t, now, bns), None);
}

#[test]
fn burst_ns_matches_128_bit_math() {
    for &(b, t, i) in &[
        (100u64, 1000u64, 1_000_000_000u64),
        (10 << 20, 10 << 20, 1_000_000_000),
        (3000, 2000, 1_200_000_000_000),
        (7, 3, 1_000_000_000),
        (u32::MAX as u64 * 3, u32::MAX as u64 - 1, MAX_INTERVAL_NS),
    ] {
        let exact = (b as u128 * i as u128 / t as u128) as u64;
        assert_eq!(gcra_burst_ns(b, t, i), exact, "{b} {t} {i}");
    }
}

#[test]
fn shares_and_bans() {
    assert!(above_share(800, 1000, 800));
    assert!(!above_share(799, 1000, 800));
    assert!(!above_share(5000, 1000, 0));
    assert!(above_share(2000, 2000, 1000));
    assert_eq!(ban_expiry(10, 0), 0);
    assert_eq!(ban_expiry(10, 5), 15);
    assert!(ban_active(0, u64::MAX));
    assert!(ban_active(15, 14));
    assert!(!ban_active(15, 15));
}

use crate::caps::MAX_INTERVAL_NS;

proptest! {
    /// The sliding window never admits more than the threshold in any sliding estimate, and
    /// agrees with the exact rational model except within the 2^-16 weight rounding.
    #[test]
    fn sliding_matches_reference(
        threshold in 1u64..200,
        interval in 1_000u64..1_000_000,
        gaps in proptest::collection::vec(0u64..50_000, 1..400),
        costs in proptest::collection::vec(1u64..4, 400),
    ) {
        let mut s = Sliding { stamp: 0, cur: 0, prev: 0 };
        let mut r = RefSliding { admitted: Vec::new() };
        let mut now = 1_000_000u64;
        let mut disagreements = 0u32;
        for (i, gap) in gaps.iter().enumerate() {
            now += gap;
            let cost = costs[i];
            let a = s.offer(now, cost, threshold, interval);
            let b = r.offer(now, cost, threshold, interval);
            // Rounding is upwards: never admit what the exact model refuses.
            prop_assert!(!a || b, "over-admitted packet {} at {}", i, now);
            if a != b {
                disagreements += 1;
                // Keep the models in lockstep so one rounding does not cascade.
                r.admitted.pop();
            }
            // Whatever happened, the fixed part (current window) never exceeds the threshold.
            prop_assert!(s.cur <= threshold);
        }
        // Rounding up may refuse where the exact estimate lands exactly on the threshold; rare.
        prop_assert!(disagreements as usize <= gaps.len() / 20 + 1, "{} of {}", disagreements, gaps.len());
    }

    /// GCRA equals a token bucket with continuous refill, exactly, when interval/threshold is
    /// a whole number of ns.
    #[test]
    fn gcra_matches_token_bucket(
        threshold in 1u64..1000,
        per in 1u64..1_000_000,
        burst in 1u64..50,
        gaps in proptest::collection::vec(0u64..3_000_000, 1..300),
        costs in proptest::collection::vec(1u64..3, 300),
    ) {
        let interval = threshold * per;
        let inc1 = gcra_increment(1, threshold, interval);
        prop_assert_eq!(inc1, per);
        let bns = gcra_burst_ns(burst, threshold, interval);
        // Reference: tokens scaled by `interval` (exact integers): refill elapsed*threshold,
        // capacity burst*interval, a packet needs cost*interval.
        let mut tokens: u128 = burst as u128 * interval as u128;
        let cap = tokens;
        let mut last = 1_000_000_000u64;
        let mut now = last;
        let mut tat = 0u64;
        for (i, gap) in gaps.iter().enumerate() {
            now += gap;
            let cost = costs[i];
            tokens = (tokens + (now - last) as u128 * threshold as u128).min(cap);
            last = now;
            let need = cost as u128 * interval as u128;
            let reference = tokens >= need;
            if reference { tokens -= need; }
            let got = gcra_admit(tat, now, gcra_increment(cost, threshold, interval), bns);
            prop_assert_eq!(got.is_some(), reference, "packet {} at {}", i, now);
            if let Some(t) = got { tat = t; }
        }
    }

    #[test]
    fn weight_is_monotone_and_bounded(interval in 1u64..MAX_INTERVAL_NS, t in 0u64..u64::MAX / 2) {
        let w = prev_weight(t, interval);
        prop_assert!(w <= WEIGHT_ONE && w > 0);
        let est = sliding_estimate(u64::MAX, 5, w);
        prop_assert!(est >= 5);
    }

    #[test]
    fn weight_from_the_window_index_is_the_same(interval in 1u64..MAX_INTERVAL_NS, t in 0u64..u64::MAX / 2) {
        prop_assert_eq!(prev_weight_in(t, interval, window_of(t, interval)), prev_weight(t, interval));
    }
}

/// floor(a * b / d) in exact 128-bit arithmetic, saturated at u64::MAX.
fn exact_floor(a: u64, b: u64, d: u64) -> u64 {
    (a as u128 * b as u128 / d as u128).min(u64::MAX as u128) as u64
}

#[test]
fn gcra_increment_rounds_toward_the_limit() {
    // 10 GiB/s and 64-byte frames: 5.96 ns a frame. Rounding down to 5 ns admitted 12.8 B/ns,
    // 19% over the limit; rounding up admits 10.67 B/ns, under it.
    let gib10 = 10u64 << 30;
    assert_eq!(gcra_increment(64, gib10, 1_000_000_000), 6);
    // 100 GiB/s: 0.6 ns a frame rounded down to 0 was no limit at all.
    assert_eq!(gcra_increment(64, 100 * (1 << 30), 1_000_000_000), 1);
    // Exact division stays exact.
    assert_eq!(gcra_increment(1, 1000, 1_000_000_000), 1_000_000);
}

#[test]
fn sliding_estimate_is_exact_for_counts_above_2_pow_47() {
    // A ban meter counting bytes over a long interval can pass 2^47; clamping it before
    // weighting under-estimated (2^31 here instead of 2^34) and let the client escape its ban.
    assert_eq!(sliding_estimate(1 << 50, 0, 1), 1 << 34);
    assert_eq!(sliding_estimate(u64::MAX, 7, WEIGHT_ONE), u64::MAX);
}

#[test]
fn burst_ns_saturates_instead_of_turning_unlimited() {
    // 65,536 thresholds of burst is a large bucket, not an infinite one.
    assert_eq!(
        gcra_burst_ns(65_536 * 1000, 1000, 1_000_000_000),
        65_536 * 1_000_000_000
    );
    // Above 2^32 the remainder was dropped: 1.5 thresholds came out as 1.
    assert_eq!(
        gcra_burst_ns((1 << 33) + (1 << 32), 1 << 33, 1_000_000_000),
        1_500_000_000
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// The sliding estimate is the exact ceiling of `prev * weight / 2^16` plus `cur`.
    #[test]
    fn sliding_estimate_matches_exact_math(prev in any::<u64>(), cur in any::<u64>(), weight in 0u64..=WEIGHT_ONE) {
        let exact = (prev as u128 * weight as u128).div_ceil(WEIGHT_ONE as u128) + cur as u128;
        prop_assert_eq!(sliding_estimate(prev, cur, weight) as u128, exact.min(u64::MAX as u128));
    }

    /// The burst tolerance is `burst * interval / threshold` rounded down (a smaller bucket,
    /// never a larger one), saturated.
    #[test]
    fn burst_ns_is_the_exact_floor(burst in any::<u64>(), threshold in 1u64.., interval in 1u64..=MAX_INTERVAL_NS) {
        prop_assert_eq!(gcra_burst_ns(burst, threshold, interval), exact_floor(burst, interval, threshold));
    }

    #[test]
    fn mul_div_floor_is_exact(a in any::<u64>(), b in any::<u64>(), d in 1u64..) {
        prop_assert_eq!(mul_div_floor(a, b, d), exact_floor(a, b, d));
    }

    /// The increment is the exact ceiling of `cost * interval / threshold`.
    #[test]
    fn increment_is_the_exact_ceiling(cost in 1u64..=0xffff, threshold in 1u64.., interval in 1u64..=MAX_INTERVAL_NS) {
        let exact = (cost as u128 * interval as u128).div_ceil(threshold as u128);
        prop_assert_eq!(gcra_increment(cost, threshold, interval) as u128, exact);
    }

    /// Whatever the rate (bytes or packets, up to the validated 64 units per ns) and however
    /// packets arrive, the token bucket admits over any span [a, b] at most
    /// `burst + threshold * (b - a) / interval` units, checked in exact arithmetic.
    #[test]
    fn gcra_never_admits_over_rate_plus_burst(
        interval in 1u64..=MAX_INTERVAL_NS,
        // threshold = interval * milli_per_ns / 1000: from 0.001 to 64 units per ns.
        milli_per_ns in 1u64..64_000,
        burst_extra in 0u64..3_000,
        // Gaps in thousandths of a 1500-unit packet's emission time: offered load about 1.7x.
        gap_permille in proptest::collection::vec(0u64..600, 1..300),
        costs in proptest::collection::vec(1u64..=1500, 300),
    ) {
        let threshold = ((interval as u128 * milli_per_ns as u128 / 1000) as u64).max(1);
        let burst = 1500 + burst_extra;
        let bns = gcra_burst_ns(burst, threshold, interval);
        let mut tat = 0u64;
        let mut now = 1_000_000_000u64;
        // (time, cost) of every admitted packet.
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for (i, permille) in gap_permille.iter().enumerate() {
            now += (1500 * *permille as u128 * interval as u128 / (1000 * threshold as u128)) as u64;
            if let Some(t) = gcra_admit(tat, now, gcra_increment(costs[i], threshold, interval), bns) {
                tat = t;
                admitted.push((now, costs[i]));
            }
        }
        for a in 0..admitted.len() {
            let mut sum = 0u128;
            for b in &admitted[a..] {
                sum += b.1 as u128;
                let span = (b.0 - admitted[a].0) as u128;
                // sum <= burst + threshold * span / interval, multiplied out.
                prop_assert!(
                    sum * interval as u128 <= burst as u128 * interval as u128 + threshold as u128 * span,
                    "{} units admitted in {} ns at {}/{} burst {}", sum, span, threshold, interval, burst
                );
            }
        }
    }
}
