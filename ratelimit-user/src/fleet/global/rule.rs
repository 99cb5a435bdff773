//! A global rule as the data plane holds it, and what its meters' counts mean: their windows,
//! limits, and when a client's count is worth sharing or near its limit.

use ratelimit_common::{
    limiter,
    maps::{
        ACTION_BAN, ALG_TOKEN_BUCKET, BAN_HELD_MARK, ClientState, GLOBAL_TB_WINDOW_NS, KEY_ALL,
        KEY_IP, KEY_REGION, RULE_GLOBAL, RuleConfig,
    },
};

use super::{
    BUCKETS, NEAR_LIMIT_PERMILLE, PUBLISH_ABOVE_PERMILLE,
    keys::{announce_set, fnv32},
};
use crate::kernel::clients::Meter;

/// A global rule as the data plane holds it.
#[derive(Clone, Debug, PartialEq)]
pub struct GlobalRule {
    pub index: u8,
    pub name: String,
    /// The rule's id in the store: its name and what its counts mean (interval, algorithm,
    /// prefixes, ban interval), so rules of the same name that count differently never mix.
    pub rid: String,
    pub interval_ns: u64,
    pub threshold: u64,
    /// The ban meter's interval and threshold; 0 for a rule that does not ban.
    pub ban_interval_ns: u64,
    pub ban_threshold: u64,
    /// A token bucket's burst (units); `None` for the window algorithms. A global token
    /// bucket counts its admissions in wall-clock windows of [`GLOBAL_TB_WINDOW_NS`]
    /// (`cur`, its window in `prev`), and the other hosts' admissions are taken out of it by
    /// moving its TAT on ([`SlotStates::charge_bucket`]).
    pub burst: Option<u64>,
    /// A token bucket's burst tolerance (ns), the program's `Limit::gcra_burst_ns`; 0 for
    /// the window algorithms.
    pub burst_ns: u64,
    /// The rule's key: `KEY_IP` (per-source states, synced by [`round`]), or `KEY_ALL` /
    /// `KEY_REGION` (shared states, synced by [`shared_round`]).
    pub kind: u8,
}

impl GlobalRule {
    /// The global rules among `rules` (name and configuration, in data-plane order).
    pub fn of(rules: &[(String, RuleConfig)]) -> Vec<GlobalRule> {
        rules
            .iter()
            .enumerate()
            .filter(|(_, (_, r))| {
                r.flags & RULE_GLOBAL != 0 && matches!(r.key, KEY_IP | KEY_ALL | KEY_REGION)
            })
            .map(|(i, (name, r))| {
                let bans = r.action == ACTION_BAN;
                let l = &r.limit;
                let mut what = format!(
                    "{}|{}|{}|{}|{}|{}",
                    l.interval_ns,
                    r.algorithm,
                    r.v4_prefix,
                    r.v6_prefix,
                    if bans { l.ban_interval_ns } else { 0 },
                    r.flags & ratelimit_common::maps::RULE_BYTES
                );
                if r.key != KEY_IP {
                    what.push_str(&format!("|k{}", r.key));
                }
                GlobalRule {
                    index: i as u8,
                    name: name.clone(),
                    rid: format!("{}#{:08x}", name, fnv32(what.as_bytes())),
                    interval_ns: l.interval_ns,
                    threshold: l.threshold,
                    ban_interval_ns: if bans { l.ban_interval_ns } else { 0 },
                    ban_threshold: if bans { l.ban_threshold } else { 0 },
                    burst: (r.algorithm == ALG_TOKEN_BUCKET).then_some(l.burst),
                    burst_ns: if r.algorithm == ALG_TOKEN_BUCKET {
                        l.gcra_burst_ns
                    } else {
                        0
                    },
                    kind: r.key,
                }
            })
            .collect()
    }

    pub(super) fn meters(&self) -> impl Iterator<Item = (Meter, u64)> + '_ {
        [
            (Meter::Admitted, self.admitted_window_ns()),
            (Meter::Offered, self.ban_interval_ns),
        ]
        .into_iter()
        .filter(|&(_, t)| t > 0)
    }

    /// The window the admitted counts are shared in: the rule's interval, or for a token
    /// bucket [`GLOBAL_TB_WINDOW_NS`].
    pub fn admitted_window_ns(&self) -> u64 {
        if self.burst.is_some() {
            GLOBAL_TB_WINDOW_NS
        } else {
            self.interval_ns
        }
    }

    /// Whether `meter` is a token bucket's admitted count (not a window meter the other
    /// hosts' counts are added into).
    pub(super) fn is_bucket(&self, meter: Meter) -> bool {
        self.burst.is_some() && meter == Meter::Admitted
    }

    /// Whether a client whose state is `st` is worth syncing: this host's own count in a
    /// window of one of the rule's meters is worth sharing.
    pub fn wants(&self, st: &ClientState) -> bool {
        self.meters().any(|(m, _)| {
            let (cur, prev) = self.own_counts(st, m);
            self.worth(m, cur.max(prev))
        })
    }

    /// The count `meter` is measured against in one of its windows: the threshold, or the
    /// ban threshold; for a token bucket what it can admit in one: a window's refill and
    /// its burst.
    pub fn limit_of(&self, meter: Meter) -> u64 {
        match (meter, self.burst) {
            (Meter::Admitted, None) => self.threshold,
            (Meter::Admitted, Some(burst)) => {
                limiter::mul_div_floor(self.threshold, GLOBAL_TB_WINDOW_NS, self.interval_ns.max(1))
                    .saturating_add(burst)
            }
            (Meter::Offered, _) => self.ban_threshold,
        }
    }

    /// A meter's `(cur, prev)` in `st` (a ban held in the meter is no window: nothing; a
    /// token bucket's previous window is not kept: 0).
    pub fn own_counts(&self, st: &ClientState, m: Meter) -> (u64, u64) {
        match m {
            Meter::Admitted if self.burst.is_some() => (st.cur, 0),
            Meter::Admitted => (st.cur, st.prev),
            Meter::Offered if st.ban_stamp == BAN_HELD_MARK => (0, 0),
            Meter::Offered => (st.seen_cur, st.seen_prev),
        }
    }

    /// A meter's window in `st`.
    pub fn stamp_of(&self, st: &ClientState, m: Meter) -> u64 {
        match m {
            Meter::Admitted if self.burst.is_some() => st.prev,
            Meter::Admitted => st.stamp,
            Meter::Offered => st.ban_stamp,
        }
    }

    /// A token bucket's time (ns) for `units` (`units * interval / threshold`, rounded up as
    /// the program's increment is).
    pub fn bucket_ns(&self, units: u64) -> u64 {
        let t = self.threshold.max(1) as u128;
        let ns = (units as u128 * self.interval_ns as u128).div_ceil(t);
        u64::try_from(ns).unwrap_or(u64::MAX)
    }

    /// How far past now a token bucket's TAT may be moved: its burst tolerance (an empty
    /// bucket) and an interval of debt, which the program
    /// keeps for a global bucket. Without the debt, what the other hosts admitted while this
    /// host's own packets emptied its bucket would be forgiven, and each host would admit
    /// the rate on its own.
    pub fn charge_cap_ns(&self) -> u64 {
        self.burst_ns.saturating_add(self.interval_ns)
    }

    /// Whether `own` (this host's count in a window of `meter`) is worth sharing.
    pub(super) fn worth(&self, meter: Meter, own: u64) -> bool {
        let l = self.limit_of(meter);
        own > 0 && own.saturating_mul(1000) >= l.saturating_mul(PUBLISH_ABOVE_PERMILLE)
    }

    /// Whether a fleet total of `total` in a window of `meter` is near the limit.
    pub(super) fn near(&self, meter: Meter, total: u64) -> bool {
        total > 0
            && total.saturating_mul(1000)
                >= self.limit_of(meter).saturating_mul(NEAR_LIMIT_PERMILLE)
    }
}

/// The announcement sets of every global rule's meters for the windows in force at wall
/// time `unix_ns`: `(rule, set)`.
pub fn announce_sets_now(rules: &[GlobalRule], unix_ns: u64) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (ri, g) in rules.iter().enumerate() {
        if g.kind != KEY_IP {
            continue;
        }
        for (m, interval) in g.meters() {
            let w = unix_ns / interval;
            for b in 0..BUCKETS {
                out.push((ri, announce_set(&g.rid, m, b, w)));
            }
        }
    }
    out
}
