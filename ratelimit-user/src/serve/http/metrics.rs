//! The exposition of `/metrics`: what it shows ([`Gauges`], read by [`snapshot`]) and its
//! families, a module per group of them, in the order they are exposed: the data plane's
//! counters ([`counters`]), the rules' ([`rules`]), the daemon's tables ([`state`]), its own
//! workings ([`daemon`]), pressure ([`pressure`]) and fleet mode ([`fleet`]); [`openmetrics`]
//! writes them as OpenMetrics text, which [`classic`] rewrites for a scraper that does not ask
//! for OpenMetrics.

pub mod classic;
mod counters;
mod daemon;
mod fleet;
mod openmetrics;
mod pressure;
mod rules;
mod state;

#[cfg(test)]
pub(super) use counters::{NON_PACKET_REASONS, PACKET_REASONS};

use super::conns::HttpCounts;
use crate::{
    events,
    policy::report::{self, Stats},
    serve::reader::Reports,
};

/// Read everything `/metrics` shows, in one go, on the reports' own map handles.
pub fn snapshot(s: &Reports) -> anyhow::Result<(Stats, Gauges)> {
    use anyhow::Context as _;
    let view = s.view();
    let stats =
        report::stats(s.maps(), &view.ifaces, &view.rule_names).context("reading counters")?;
    let census = s.census(&view);
    let gauges = Gauges {
        active_bans: census.active_bans,
        tracked_clients: census.tracked_clients,
        tracked_clients_capacity: u64::from(view.max_sources),
        known_filter: s
            .known_status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|r| (r.bits_set, r.bits)),
        events: s.events.counts(),
        http: HttpCounts::default(),
        tasks: s
            .tasks
            .snapshot()
            .into_iter()
            .map(|(name, h)| (name, h.up, h.restarts))
            .collect(),
        saved_bans: view.bans_restore.outcomes(),
        bans_files_set_aside: u64::from(view.bans_restore.set_aside.is_some()),
        remote_bans_spilled: view.remote_bans_spilled,
        pressure_high: view.pressure.level == crate::policy::pressure::Level::High,
        pressure_signals: view
            .pressure
            .signals
            .iter()
            .map(|r| (r.signal.name(), r.value, r.mark))
            .collect(),
        pressure_transitions: view.pressure.transitions,
        fleet: s.fleet.get().map(|f| {
            let r = f.report();
            FleetGauges {
                connected: r.connected,
                bans_published: r.bans_published,
                unbans_published: r.unbans_published,
                bans_received: r.bans_received,
                unbans_received: r.unbans_received,
                outbox: r.outbox as u64,
                resyncs: r.resyncs,
                peers: r.peers.iter().filter(|p| !p.stale).count() as u64,
                peers_stale: r.peers.iter().filter(|p| p.stale).count() as u64,
                latency: f.latency(),
                global: r.global.clone(),
                clock_offset_seconds: r.clock.offset_ms.map(|ms| ms / 1e3),
                clock_over_bound: r.clock.over_bound,
                authenticated: r.authenticated,
                records_rejected: r.records_rejected.clone(),
                counts_rejected: r.counts_rejected.clone(),
                bans_clamped: r.bans_clamped,
                duplicate_id: r.duplicate_id.active,
                peers_in_store: r.peers_total,
                key_reads: s.fleet_key_reads.stats(),
            }
        }),
    };
    Ok((stats, gauges))
}

/// The values of `/metrics` that are not counters of the `STATS` array.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Gauges {
    /// Bans in force now (`report::bans`).
    pub active_bans: u64,
    /// Entries in the per-client state map.
    pub tracked_clients: u64,
    /// `tracking.max_sources`.
    pub tracked_clients_capacity: u64,
    /// The known-sources filter's (bits set, bits) at its last rebuild; None while it is off.
    pub known_filter: Option<(u64, u64)>,
    /// The events sink's counts.
    pub events: events::Counts,
    /// The HTTP listener's counts.
    pub http: HttpCounts,
    /// Each background task: (name, running now, restarts).
    pub tasks: Vec<(&'static str, bool, u64)>,
    /// The saved bans read at start, by outcome (`bans::RestoreReport::outcomes`).
    pub saved_bans: [(&'static str, u64); 5],
    /// Bans files moved aside at start because they could not be read (0 or 1).
    pub bans_files_set_aside: u64,
    /// Remote bans that found the fleet's ban table full (`datapath::Maps`).
    pub remote_bans_spilled: u64,
    /// The pressure level is high.
    pub pressure_high: bool,
    /// Each pressure signal: (name, value over the last interval if any, mark).
    pub pressure_signals: Vec<(&'static str, Option<f64>, f64)>,
    /// Changes of the pressure level since the daemon started.
    pub pressure_transitions: u64,
    /// Fleet mode's counts; `None` without `[fleet]` (no `ratelimit_fleet_*` series).
    pub fleet: Option<FleetGauges>,
}

/// What `/metrics` shows of fleet mode (`ratelimit_fleet_*`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FleetGauges {
    pub connected: bool,
    pub bans_published: u64,
    pub unbans_published: u64,
    pub bans_received: u64,
    pub unbans_received: u64,
    pub outbox: u64,
    pub resyncs: u64,
    /// Hosts (this one included) whose heartbeat is fresh, and stale.
    pub peers: u64,
    pub peers_stale: u64,
    pub latency: crate::fleet::Latency,
    /// Global thresholds' counts (`ratelimit_fleet_global_*`).
    pub global: crate::fleet::global::GlobalReport,
    /// This host's clock minus the store's (seconds), once measured; and whether that is
    /// beyond `fleet.max_clock_skew`.
    pub clock_offset_seconds: Option<f64>,
    pub clock_over_bound: bool,
    /// Records and counts authenticated with the fleet key; what was rejected, by reason;
    /// remote bans clamped to `fleet.remote_ban_max_duration`.
    pub authenticated: bool,
    pub records_rejected: std::collections::BTreeMap<String, u64>,
    pub counts_rejected: std::collections::BTreeMap<String, u64>,
    pub bans_clamped: u64,
    /// Another process writes this host id's heartbeat (`fleet::dup`).
    pub duplicate_id: bool,
    /// The peers hash's length as last read.
    pub peers_in_store: u64,
    /// `fleet key`'s reads of the store.
    pub key_reads: crate::fleet::key_reads::Stats,
}

/// The `/metrics` exposition (OpenMetrics text, `# EOF` included) of one reading of the maps.
///
/// Prometheus' conventions, which the tests hold it to: no series is the sum of others of its
/// family (totals are what `sum()` gives: there is no `interface="all"` series), a
/// `_packets_total` family counts packets and nothing else, counters end in `_total`, units
/// (packets, bytes) are in the names, and a ratio is a `_ratio` gauge from 0 to 1.
pub fn render_metrics(stats: &Stats, gauges: &Gauges) -> String {
    let mut families = counters::traffic(stats);
    families.extend(rules::families(stats));
    families.extend(state::bans_and_client_states(stats, gauges));
    families.extend(daemon::events(stats, gauges));
    families.extend(daemon::http(gauges));
    families.extend(daemon::tasks(gauges));
    families.extend(state::saved_bans(gauges));
    families.extend(pressure::families(gauges));
    if let Some(f) = &gauges.fleet {
        families.extend(fleet::families(f));
    }
    families.extend(daemon::up());
    openmetrics::encode(families)
}
