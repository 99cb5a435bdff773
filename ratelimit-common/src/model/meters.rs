//! The meters (`ratelimit-ebpf/src/meters.rs`, one CPU): window rotation, the ban rule's
//! offered-rate meter, the rule's algorithm.

use crate::{limiter, maps::*};

/// Rotate a window meter to `now` (`meters::rotate`, one CPU): the window index.
fn rotate(stamp: &mut u64, cur: &mut u64, prev: &mut u64, now: u64, interval: u64) -> u64 {
    let w = limiter::window_of(now, interval);
    let s = *stamp;
    if w > s || w.wrapping_add(1) < s {
        *stamp = w;
        let c = core::mem::take(cur);
        *prev = limiter::rotate(s, w, c, 0).1;
    }
    w
}

/// The offered-rate meter of a ban rule (`meters::rl_ban_meter`): over the ban threshold?
pub(super) fn ban_meter(st: &mut ClientState, limit: &Limit, now: u64, cost: u64) -> bool {
    let interval = limit.ban_interval_ns;
    if interval == 0 {
        return false;
    }
    let w = rotate(
        &mut st.ban_stamp,
        &mut st.seen_cur,
        &mut st.seen_prev,
        now,
        interval,
    );
    st.seen_cur += cost;
    let seen = limiter::sliding_estimate(
        st.seen_prev,
        st.seen_cur,
        limiter::prev_weight_in(now, interval, w),
    );
    seen > limit.ban_threshold
}

/// The rule's algorithm (`meters::limit_check`, one CPU): admitted?
pub fn limit_check(
    st: &mut ClientState,
    algorithm: u8,
    limit: &Limit,
    now: u64,
    cost: u64,
) -> bool {
    let interval = limit.interval_ns;
    let threshold = limit.threshold;
    if interval == 0 || threshold == 0 {
        return true;
    }
    if algorithm == ALG_TOKEN_BUCKET {
        let inc = if cost == 1 {
            limit.gcra_inc_ns
        } else {
            limiter::gcra_increment(cost, threshold, interval)
        };
        return match limiter::gcra_admit(st.stamp, now, inc, limit.gcra_burst_ns) {
            None => {
                if let Some(c) = limiter::gcra_clamp(st.stamp, now, limit.gcra_burst_ns) {
                    st.stamp = c;
                }
                false
            }
            Some(new) => {
                st.stamp = new;
                true
            }
        };
    }
    let w = rotate(&mut st.stamp, &mut st.cur, &mut st.prev, now, interval);
    let weight = if algorithm == ALG_FIXED_WINDOW {
        0
    } else {
        limiter::prev_weight_in(now, interval, w)
    };
    let est = limiter::sliding_estimate(st.prev, st.cur, weight);
    if !limiter::sliding_admits(est, cost, threshold) {
        return false;
    }
    st.cur += cost;
    true
}
