//! The data plane's counters: frames and bytes by verdict and interface, and the detail
//! counters (reasons), of packets or not.

use prometheus_client::metrics::MetricType::Counter;
use ratelimit_common::stats::global;

use super::openmetrics::{Family, Value};
use crate::policy::report::Stats;

/// The detail counters (`stats::global`, after the verdicts) that count packets: each is a
/// series of `ratelimit_reason_packets_total{reason}`. The others count something else (bans,
/// states, events) and have families of their own ([`NON_PACKET_REASONS`]).
/// `http_metrics_export_every_counter_once` checks that every counter is in one list.
pub(in crate::serve::http) const PACKET_REASONS: [u32; 19] = [
    global::PREVIEW_WOULD_DROP,
    global::EXCEED_PASS,
    global::BAN_PASS,
    global::FRAGMENTS,
    global::MALFORMED_L2,
    global::MALFORMED_IPV4,
    global::MALFORMED_IPV6,
    global::MALFORMED_L4,
    global::IPV6_EXT_LIMIT,
    global::LOOKUP_SKIPPED,
    global::ADMISSION_REFUSED,
    global::STATE_PROTECTED,
    global::STATE_INSERT_FAILED,
    global::CONTENDED,
    global::SYN_COOKIES_SENT,
    global::SYN_TO_LISTENER,
    global::SOURCES_PROVEN,
    global::PROVEN_ADMITTED,
    global::CONNECTION_PASSED,
];

/// The detail counters that count no packets, each a family of its own: (counter, family
/// name without `_total`, help). The ring buffer's lost events are a series of
/// `ratelimit_events_lost_total`, beside the daemon's own.
pub(in crate::serve::http) const NON_PACKET_REASONS: [(u32, &str, &str); 6] = [
    (
        global::BANS_ISSUED,
        "ratelimit_bans_issued",
        "Bans issued by rate_based_ban rules (by rule: ratelimit_rule_bans_issued_total)",
    ),
    (
        global::BANS_EXPIRED,
        "ratelimit_bans_expired",
        "Expired bans the XDP program removed from its ban tables when it met them",
    ),
    (
        global::BAN_HELD_IN_STATE,
        "ratelimit_bans_held_in_state",
        "Rule bans issued while the rules' ban table was full, held in the client's own state instead (they drop as any ban does)",
    ),
    (
        global::BAN_INSERT_FAILED,
        "ratelimit_ban_insert_failures",
        "Rule bans that could not be recorded (the ban table refused them for another reason than being full); the client is throttled instead",
    ),
    (
        global::STATE_CREATED,
        "ratelimit_client_states_created",
        "Per-client states created in the per-source store",
    ),
    (
        global::STATE_EVICTED,
        "ratelimit_client_states_evicted",
        "Per-client states evicted: a new source took the slot of the state idle longest in its set of the full per-source store",
    ),
];

pub(super) fn reason(stats: &Stats, counter: u32) -> u64 {
    stats
        .all
        .reasons
        .get(global::NAMES[counter as usize])
        .map_or(0, |pb| pb.packets)
}

/// `ratelimit_packets_total` and `ratelimit_bytes_total` (by verdict and interface), and
/// `ratelimit_reason_packets_total` (by reason).
pub(super) fn traffic(stats: &Stats) -> Vec<Family> {
    let mut packets = Family::new(
        "ratelimit_packets",
        Counter,
        "Frames seen by the XDP program, by verdict and by the interface that received them: each frame has one verdict and one interface, so a sum counts every frame once. An empty interface label stands for the interfaces beyond the per-interface counter slots (from their first frame on). A detached interface's series ends with it",
    );
    let mut bytes = Family::new(
        "ratelimit_bytes",
        Counter,
        "Bytes of the frames seen by the XDP program, by verdict and by the interface that received them (as ratelimit_packets_total)",
    );
    // The unlisted interfaces' series only once one of them received a frame: in most setups
    // there are none.
    let unlisted = (stats.unlisted.total.packets != 0).then_some(("", &stats.unlisted));
    let by_iface = stats
        .interfaces
        .iter()
        .map(|i| (i.iface.as_str(), &i.counters))
        .chain(unlisted);
    for (iface, counters) in by_iface {
        for (verdict, pb) in &counters.verdicts {
            let labels = || {
                vec![
                    ("verdict", verdict.to_string()),
                    ("interface", iface.into()),
                ]
            };
            packets = packets.with(labels(), Value::Counter(pb.packets));
            bytes = bytes.with(labels(), Value::Counter(pb.bytes));
        }
    }

    let reasons = PACKET_REASONS.iter().fold(
        Family::new(
            "ratelimit_reason_packets",
            Counter,
            "Packets by a detail of how they were handled, beside their verdict (reason): a packet has none, one or several, so a sum over reasons is not a count of packets",
        ),
        |f, &r| {
            f.with(
                vec![("reason", global::NAMES[r as usize].into())],
                Value::Counter(reason(stats, r)),
            )
        },
    );
    vec![packets, bytes, reasons]
}

/// A family for each detail counter that counts no packets ([`NON_PACKET_REASONS`]).
pub(super) fn non_packet_reasons(stats: &Stats) -> impl Iterator<Item = Family> + '_ {
    NON_PACKET_REASONS.iter().map(|&(r, name, help)| {
        Family::new(name, Counter, help).with(vec![], Value::Counter(reason(stats, r)))
    })
}
