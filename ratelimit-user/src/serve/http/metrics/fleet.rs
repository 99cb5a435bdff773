//! Fleet mode (`ratelimit_fleet_*`): trust in the store, the ban stream, the host's standing
//! among its peers, `fleet key`'s reads and the global rules' counts.

use std::collections::BTreeMap;

use prometheus_client::metrics::MetricType::{Counter, Gauge, Histogram};

use super::{
    FleetGauges,
    openmetrics::{Family, Value},
};

/// `ratelimit_fleet_*`: fleet mode's connection, bans shared, outbox and store latency.
pub(super) fn families(f: &FleetGauges) -> Vec<Family> {
    let mut families = trust(f);
    families.extend(stream(f));
    families.extend(standing(f));
    families.extend(key_reads(f));
    families.extend(global(f));
    families
}

/// A family of the records or counts rejected in `m`, a series for every reason (0 if absent).
fn by_reason(name: &'static str, help: &'static str, m: &BTreeMap<String, u64>) -> Family {
    crate::fleet::trust::Reject::ALL
        .iter()
        .fold(Family::new(name, Counter, help), |fam, r| {
            let n = m.get(r.as_str()).copied().unwrap_or(0);
            fam.with(vec![("reason", r.as_str().into())], Value::Counter(n))
        })
}

/// Whether the store is trusted or its records authenticated; what was rejected or clamped.
fn trust(f: &FleetGauges) -> Vec<Family> {
    vec![
        Family::new(
            "ratelimit_fleet_authenticated",
            Gauge,
            "1 when the fleet's records and counts are authenticated with the fleet key (fleet.key_file); 0: the store is trusted",
        )
        .with(vec![], Value::Gauge(u64::from(f.authenticated))),
        by_reason(
            "ratelimit_fleet_records_rejected",
            "Ban records and snapshot entries read from the fleet store and dropped, by reason (unauthenticated, bad_mac, malformed, out_of_bounds, too_wide)",
            &f.records_rejected,
        ),
        by_reason(
            "ratelimit_fleet_counts_rejected",
            "Other hosts' counts of global rules read from the fleet store and ignored, by reason (unauthenticated, bad_mac, out_of_bounds)",
            &f.counts_rejected,
        ),
        Family::new(
            "ratelimit_fleet_bans_clamped",
            Counter,
            "Bans received from the fleet that ended later than fleet.remote_ban_max_duration (or never): clamped to it",
        )
        .with(vec![], Value::Counter(f.bans_clamped)),
    ]
}

/// The connection, the ban records published and received, the outbox, the resyncs, the
/// peers, the store's latency.
fn stream(f: &FleetGauges) -> Vec<Family> {
    vec![
        Family::new(
            "ratelimit_fleet_connected",
            Gauge,
            "1 while the fleet store is reachable and this host follows its ban stream; 0 while degraded (enforcing locally)",
        )
        .with(vec![], Value::Gauge(u64::from(f.connected))),
        Family::new(
            "ratelimit_fleet_records_published",
            Counter,
            "Ban records this host published to the fleet store, by op (ban, unban)",
        )
        .with(vec![("op", "ban".into())], Value::Counter(f.bans_published))
        .with(vec![("op", "unban".into())], Value::Counter(f.unbans_published)),
        Family::new(
            "ratelimit_fleet_records_received",
            Counter,
            "Ban records of other hosts this host received from the fleet store, by op (ban, unban)",
        )
        .with(vec![("op", "ban".into())], Value::Counter(f.bans_received))
        .with(vec![("op", "unban".into())], Value::Counter(f.unbans_received)),
        Family::new(
            "ratelimit_fleet_outbox_records",
            Gauge,
            "Ban records waiting in the outbox (state_dir/fleet-outbox.json) for the store",
        )
        .with(vec![], Value::Gauge(f.outbox)),
        Family::new(
            "ratelimit_fleet_resyncs",
            Counter,
            "Times this host read the fleet's ban snapshot whole (at its first start, after its cursor was trimmed away, after the store was unreachable)",
        )
        .with(vec![], Value::Counter(f.resyncs)),
        Family::new(
            "ratelimit_fleet_peers",
            Gauge,
            "Hosts of the fleet (this one included) by their heartbeat in the store: fresh, or stale (not seen for 10 s)",
        )
        .with(vec![("state", "fresh".into())], Value::Gauge(f.peers))
        .with(vec![("state", "stale".into())], Value::Gauge(f.peers_stale)),
        Family::new(
            "ratelimit_fleet_store_latency_seconds",
            Histogram,
            "Round trips to the fleet store: a publish (a batch of records), a cursor check, a snapshot read",
        )
        .with(
            vec![],
            Value::Histogram(f.latency.sum, f.latency.count, f.latency.series()),
        ),
    ]
}

/// This host among its peers: its clock against the store's, a duplicate host id, the
/// heartbeats in the store.
fn standing(f: &FleetGauges) -> Vec<Family> {
    vec![
        Family::new(
            "ratelimit_fleet_clock_offset_seconds",
            Gauge,
            "This host's wall clock minus the fleet store's (TIME), as last measured; absent until measured",
        )
        .with_some(
            f.clock_offset_seconds
                .map(|s| (vec![], Value::Float(s))),
        ),
        Family::new(
            "ratelimit_fleet_clock_skewed",
            Gauge,
            "1 while this host's clock is off the store's by more than fleet.max_clock_skew (it takes no part in global counting: its global rules hold their threshold here alone)",
        )
        .with(vec![], Value::Gauge(u64::from(f.clock_over_bound))),
        Family::new(
            "ratelimit_fleet_duplicate_id",
            Gauge,
            "1 while another process writes this host id's heartbeat (two hosts with one fleet.host_id): this host takes no part in global counting",
        )
        .with(vec![], Value::Gauge(u64::from(f.duplicate_id))),
        Family::new(
            "ratelimit_fleet_peers_in_store",
            Gauge,
            "Heartbeats in the store's peers hash as last read (HLEN), this host's included; at most 256 are kept and shown",
        )
        .with(vec![], Value::Gauge(f.peers_in_store)),
    ]
}

/// `fleet key`'s reads of the store (`crate::fleet::key_reads`).
fn key_reads(f: &FleetGauges) -> Vec<Family> {
    vec![
        Family::new(
            "ratelimit_fleet_key_store_reads",
            Counter,
            "Reads of the store for fleet key (/v1/fleet/key): one HMGET per rule and window each, at most 10 a second",
        )
        .with(vec![], Value::Counter(f.key_reads.store_reads)),
        Family::new(
            "ratelimit_fleet_key_cache_hits",
            Counter,
            "fleet key answers served from the cache of the store's counts",
        )
        .with(vec![], Value::Counter(f.key_reads.cache_hits)),
        Family::new(
            "ratelimit_fleet_key_busy",
            Counter,
            "fleet key answers refused as busy (HTTP 429): the store's read rate bound reached, nothing recent enough cached",
        )
        .with(vec![], Value::Counter(f.key_reads.busy)),
        Family::new(
            "ratelimit_fleet_key_store_errors",
            Counter,
            "Failed connections and reads of the store for fleet key",
        )
        .with(vec![], Value::Counter(f.key_reads.errors)),
    ]
}

/// `ratelimit_fleet_global_*`: the global rules' shared counts.
fn global(f: &FleetGauges) -> Vec<Family> {
    vec![
        Family::new(
            "ratelimit_fleet_global_rules",
            Gauge,
            "Global rules (scope = \"global\") whose counts this host shares",
        )
        .with(vec![], Value::Gauge(f.global.rules.len() as u64)),
        Family::new(
            "ratelimit_fleet_global_synced_keys",
            Gauge,
            "Clients of global rules whose counts are shared now",
        )
        .with(vec![], Value::Gauge(f.global.synced_keys as u64)),
        Family::new(
            "ratelimit_fleet_global_shared_keys",
            Gauge,
            "Shared keys (key = \"all\" or \"region\") of global rules whose counts were shared in the last round",
        )
        .with(vec![], Value::Gauge(f.global.shared_keys as u64)),
        Family::new(
            "ratelimit_fleet_global_capped_keys",
            Gauge,
            "Clients of global rules left to this host's own count at the last walk: the most clients that are synced were",
        )
        .with(vec![], Value::Gauge(f.global.capped_keys)),
        Family::new(
            "ratelimit_fleet_global_rounds",
            Counter,
            "Sync rounds of global rules' counts done",
        )
        .with(vec![], Value::Counter(f.global.rounds)),
        Family::new(
            "ratelimit_fleet_global_store_calls",
            Counter,
            "Store calls (one script call each) made to sync global rules' counts",
        )
        .with(vec![], Value::Counter(f.global.store_calls)),
        Family::new(
            "ratelimit_fleet_global_keys_published",
            Counter,
            "Client counts the store calls of global rules carried (one key of a hash each)",
        )
        .with(vec![], Value::Counter(f.global.keys_published)),
        Family::new(
            "ratelimit_fleet_global_store_errors",
            Counter,
            "Failed connections and calls to the store while syncing global rules' counts",
        )
        .with(vec![], Value::Counter(f.global.store_errors)),
        Family::new(
            "ratelimit_fleet_global_added",
            Counter,
            "Counts of other hosts added into this host's client states (admitted and offered)",
        )
        .with(vec![], Value::Counter(f.global.added_total)),
        Family::new(
            "ratelimit_fleet_global_round_seconds",
            Gauge,
            "Duration of the last sync round of global rules' counts",
        )
        .with_some(
            f.global
                .last_round_ms
                .map(|ms| (vec![], Value::Float(ms / 1e3))),
        ),
    ]
}
