//! The rules' counters: what each rule matched, what it did with it, the bans it issued.

use prometheus_client::metrics::MetricType::Counter;
use ratelimit_common::stats::rule;

use super::openmetrics::{Family, Value};
use crate::policy::report::{Pb, RuleCounters, Stats};

/// What a rule did with the packets it matched (`stats::rule`): each matched packet has at
/// most one of these outcomes, so they are the series of one family, beside `matched` (their
/// sum) and `bans` (not packets), which have families of their own.
const RULE_OUTCOMES: [u32; 5] = [
    rule::ADMITTED,
    rule::DROPPED,
    rule::BANNED_DROPPED,
    rule::WOULD_DROP,
    rule::EXCEED_PASSED,
];

fn rule_counter(r: &RuleCounters, counter: u32) -> Pb {
    r.counters
        .get(rule::NAMES[counter as usize])
        .copied()
        .unwrap_or_default()
}

/// `ratelimit_rule_*`: a series per rule (and outcome) of each family.
pub(super) fn families(stats: &Stats) -> Vec<Family> {
    let mut rule_matched_packets = Family::new(
        "ratelimit_rule_matched_packets",
        Counter,
        "Packets each rule matched (and so counted); a packet that several rules matched is counted by each",
    );
    let mut rule_matched_bytes = Family::new(
        "ratelimit_rule_matched_bytes",
        Counter,
        "Bytes of the packets each rule matched",
    );
    let mut rule_packets = Family::new(
        "ratelimit_rule_packets",
        Counter,
        "Packets each rule matched, by what it did with them (outcome): admitted (within the threshold), dropped (over it, the packet that gets its client banned included), banned_dropped (dropped by a ban of the rule that the rule enforces itself: of a key = all or region, or held in the client's state), would_drop (over it, passed: preview), exceed_passed (over it, passed: exceed_action = pass). They add up to ratelimit_rule_matched_packets_total but for packets let through unmetered because no state could be had for them (reason state_insert_failed)",
    );
    let mut rule_bytes = Family::new(
        "ratelimit_rule_bytes",
        Counter,
        "Bytes of the packets each rule matched, by outcome (as ratelimit_rule_packets_total)",
    );
    let mut rule_bans = Family::new(
        "ratelimit_rule_bans_issued",
        Counter,
        "Bans each rate_based_ban rule issued",
    );
    for r in &stats.rules {
        let name = || vec![("rule", r.name.clone())];
        let matched = rule_counter(r, rule::MATCHED);
        rule_matched_packets = rule_matched_packets.with(name(), Value::Counter(matched.packets));
        rule_matched_bytes = rule_matched_bytes.with(name(), Value::Counter(matched.bytes));
        for outcome in RULE_OUTCOMES {
            let labels = || {
                vec![
                    ("rule", r.name.clone()),
                    ("outcome", rule::NAMES[outcome as usize].into()),
                ]
            };
            let Pb { packets, bytes } = rule_counter(r, outcome);
            rule_packets = rule_packets.with(labels(), Value::Counter(packets));
            rule_bytes = rule_bytes.with(labels(), Value::Counter(bytes));
        }
        rule_bans = rule_bans.with(name(), Value::Counter(rule_counter(r, rule::BANS).packets));
    }
    vec![
        rule_matched_packets,
        rule_matched_bytes,
        rule_packets,
        rule_bytes,
        rule_bans,
    ]
}
