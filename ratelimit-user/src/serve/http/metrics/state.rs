//! The daemon's tables: bans in force, client states and how full their map is, and the bans
//! kept across restarts.

use prometheus_client::metrics::MetricType::{Counter, Gauge};

use super::{
    Gauges, counters,
    openmetrics::{Family, Value},
};
use crate::policy::report::Stats;

/// `ratelimit_active_bans`, the counters of bans and client states
/// ([`counters::non_packet_reasons`]), the client states tracked, their capacity and the
/// maps' fill.
pub(super) fn bans_and_client_states(stats: &Stats, gauges: &Gauges) -> Vec<Family> {
    let tracked = gauges.tracked_clients;
    let capacity = gauges.tracked_clients_capacity;
    let fill = if capacity == 0 {
        0.0
    } else {
        tracked as f64 / capacity as f64
    };

    let mut families = vec![
        Family::new(
            "ratelimit_active_bans",
            Gauge,
            "Bans in force now (operator- and rule-issued)",
        )
        .with(vec![], Value::Gauge(gauges.active_bans)),
    ];
    families.extend(counters::non_packet_reasons(stats));
    families.extend([
        Family::new(
            "ratelimit_tracked_clients",
            Gauge,
            "Entries in the per-client state map",
        )
        .with(vec![], Value::Gauge(tracked)),
        Family::new(
            "ratelimit_tracked_clients_capacity",
            Gauge,
            "Capacity of the per-client state map (tracking.max_sources)",
        )
        .with(vec![], Value::Gauge(capacity)),
        Family::new(
            "ratelimit_map_fill_ratio",
            Gauge,
            "Share of a bounded map in use (0 to 1)",
        )
        .with(vec![("map", "clients".into())], Value::Ratio(fill))
        .with_some(gauges.known_filter.map(|(set, bits)| {
            (
                vec![("map", "known_filter".into())],
                Value::Ratio(set as f64 / bits.max(1) as f64),
            )
        })),
    ]);
    families
}

/// The saved bans read at start by outcome, the bans files set aside, and the fleet's bans
/// that found their table full.
pub(super) fn saved_bans(gauges: &Gauges) -> Vec<Family> {
    vec![
        gauges.saved_bans.iter().fold(
            Family::new(
                "ratelimit_saved_bans",
                Counter,
                "Bans read from state_dir at start, by outcome (restored, pinned: still in the maps, expired, rule_gone: their rule was removed, failed)",
            ),
            |f, (outcome, n)| f.with(vec![("outcome", outcome.to_string())], Value::Counter(*n)),
        ),
        Family::new(
            "ratelimit_bans_files_set_aside",
            Counter,
            "Bans files found unreadable at start and moved aside (bans.json.bad-<unix time>)",
        )
        .with(vec![], Value::Counter(gauges.bans_files_set_aside)),
        Family::new(
            "ratelimit_remote_bans_spilled",
            Counter,
            "Bans received from the fleet that found its ban table full and went into the rules' table of bans that drop (enforced from there), since the daemon started",
        )
        .with(vec![], Value::Counter(gauges.remote_bans_spilled)),
    ]
}
