//! What `fleet status`, `/v1/fleet` and `/metrics` show of the fleet: the report, this
//! host's clock, the peers' heartbeats, the store's latency.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};

use super::{PEER_STALE, Shared, dup, global, resync, unix_ms};

/// What `fleet status` and `/v1/fleet` answer.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Report {
    pub store: String,
    pub host_id: String,
    pub share_bans: bool,
    /// The reader is connected and caught up with the store.
    pub connected: bool,
    /// RFC 3339: since when connected, or since when degraded (cut off from the store).
    pub connected_since: Option<String>,
    pub degraded_since: Option<String>,
    /// Why the store was last unreachable.
    pub last_error: Option<String>,
    /// The last stream entry applied.
    pub cursor: Option<String>,
    /// Time from a record's issue to its receipt here, for the last record received (ms).
    pub lag_ms: Option<u64>,
    /// Outgoing records waiting for the store.
    pub outbox: usize,
    /// Outgoing records dropped because the outbox was full.
    pub outbox_dropped: u64,
    pub bans_published: u64,
    pub unbans_published: u64,
    /// Records of other hosts received, and what became of them.
    pub bans_received: u64,
    pub unbans_received: u64,
    /// Received bans not installed: expired already, or a ban here ends later.
    pub bans_skipped: u64,
    pub resyncs: u64,
    /// The store's round trip for the last command (ms).
    pub store_rtt_ms: Option<f64>,
    /// The hosts that wrote a heartbeat to the store (this one included), by host id, as last
    /// read.
    #[serde(default)]
    pub peers: Vec<Peer>,
    /// Global thresholds (`scope = "global"` rules): what is shared.
    #[serde(default)]
    pub global: global::GlobalReport,
    /// This host's clock against the store's.
    #[serde(default)]
    pub clock: ClockReport,
    /// `fleet.name`.
    #[serde(default)]
    pub fleet_name: String,
    /// Records and counts are authenticated with the fleet key (`fleet.key_file`); without
    /// it the store is trusted.
    #[serde(default)]
    pub authenticated: bool,
    /// Stream records and snapshot entries dropped, by reason (`crate::fleet::trust::Reject`).
    #[serde(default)]
    pub records_rejected: BTreeMap<String, u64>,
    /// Other hosts' counts of global rules dropped, by reason.
    #[serde(default)]
    pub counts_rejected: BTreeMap<String, u64>,
    /// Remote bans whose end was later than `fleet.remote_ban_max_duration` (or never):
    /// clamped to it.
    #[serde(default)]
    pub bans_clamped: u64,
    /// The peers in the store (the peers hash's length as last read; `peers` shows at most
    /// `peers::PEERS_MAX` of them).
    #[serde(default)]
    pub peers_total: u64,
    /// A resync from the snapshot under way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resync: Option<resync::Progress>,
    /// Whether another process writes this host id's heartbeat.
    #[serde(default)]
    pub duplicate_id: dup::DuplicateReport,
}

/// This host's wall clock against the store's, as `fleet status` and `/v1/fleet` show it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct ClockReport {
    /// This host's clock minus the store's (ms; negative: this host is behind), as last
    /// measured; `None` until measured.
    pub offset_ms: Option<f64>,
    /// The round trip of the sample that gave it (ms).
    pub rtt_ms: Option<f64>,
    /// `fleet.max_clock_skew` (ms).
    pub max_skew_ms: u64,
    /// The offset is beyond the bound: this host takes no part in global counting.
    pub over_bound: bool,
    /// This host takes part in global counting (measured, and within the bound).
    pub counting: bool,
    /// RFC 3339: the last trusted measurement.
    pub measured_at: Option<String>,
    /// RFC 3339: since when over the bound.
    pub over_since: Option<String>,
    /// Why the last measurement failed or was not trusted, if it was.
    pub last_error: Option<String>,
}

/// What each host writes into [`PEERS_KEY`] every [`HEARTBEAT`].
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Heartbeat {
    pub host_id: String,
    pub version: String,
    /// Unix ms, by the host's own clock.
    pub seen_ms: u64,
    #[serde(default)]
    pub bans_published: u64,
    #[serde(default)]
    pub bans_received: u64,
    #[serde(default)]
    pub cursor: Option<String>,
    /// Its clock minus the store's (ms), as it last measured it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_offset_ms: Option<f64>,
    /// A random nonce of the process that wrote it ([`dup`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nonce: Option<String>,
}

/// A peer as `fleet peers` and `/v1/fleet` show it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Peer {
    pub host_id: String,
    pub version: String,
    /// RFC 3339: its last heartbeat.
    pub last_seen: String,
    /// How long ago that was (ms, this host's clock against the peer's).
    pub age_ms: u64,
    /// Not seen for [`PEER_STALE`] or more (stopped, cut off from the store, or this host
    /// is).
    pub stale: bool,
    /// This host.
    pub this_host: bool,
    pub bans_published: u64,
    pub bans_received: u64,
    /// The last stream entry it applied.
    pub cursor: Option<String>,
    /// Its clock minus the store's (ms), as it last measured it.
    #[serde(default)]
    pub clock_offset_ms: Option<f64>,
}

impl Peer {
    fn of(h: &Heartbeat, me: &str, now_ms: u64) -> Peer {
        let age_ms = now_ms.saturating_sub(h.seen_ms);
        Peer {
            host_id: h.host_id.clone(),
            version: h.version.clone(),
            last_seen: crate::clock::rfc3339(UNIX_EPOCH + Duration::from_millis(h.seen_ms)),
            age_ms,
            stale: age_ms >= PEER_STALE.as_millis() as u64,
            this_host: h.host_id == me,
            bans_published: h.bans_published,
            bans_received: h.bans_received,
            cursor: h.cursor.clone(),
            clock_offset_ms: h.clock_offset_ms,
        }
    }
}

/// Buckets (seconds) of `ratelimit_fleet_store_latency_seconds`.
pub const LATENCY_BUCKETS: [f64; 10] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// The store's round trips, for `/metrics`: the count in each bucket (not cumulative; the
/// last is above every bound, `+Inf`), their sum and count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Latency {
    pub buckets: [u64; LATENCY_BUCKETS.len() + 1],
    pub sum: f64,
    pub count: u64,
}

impl Latency {
    pub fn observe(&mut self, secs: f64) {
        let i = LATENCY_BUCKETS
            .iter()
            .position(|le| secs <= *le)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[i] += 1;
        self.sum += secs;
        self.count += 1;
    }

    /// (upper bound, count in that bucket alone), `+Inf` last, as the encoder takes them.
    pub fn series(&self) -> Vec<(f64, u64)> {
        LATENCY_BUCKETS
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(self.buckets)
            .collect()
    }
}

impl Shared {
    pub fn report(&self) -> Report {
        let (mut r, peers) = {
            let i = self.lock();
            (i.report.clone(), i.peers.clone())
        };
        r.outbox = self.outbox().len();
        r.global = self.global.report();
        r.fleet_name = self.trust.name.clone();
        r.authenticated = self.trust.authenticated();
        r.records_rejected = self.trust.rejects.records_by_reason();
        r.counts_rejected = self.trust.rejects.counts_by_reason();
        r.bans_clamped = self.trust.rejects.clamped_total();
        let now_ms = unix_ms(SystemTime::now());
        r.peers = peers
            .iter()
            .map(|h| Peer::of(h, &r.host_id, now_ms))
            .collect();
        r
    }

    /// This host's heartbeat now, with its process's `nonce`.
    pub(super) fn heartbeat(&self, nonce: &str) -> Heartbeat {
        let i = self.lock();
        Heartbeat {
            host_id: i.report.host_id.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            seen_ms: unix_ms(SystemTime::now()),
            bans_published: i.report.bans_published,
            bans_received: i.report.bans_received,
            cursor: i.report.cursor.clone(),
            clock_offset_ms: i.report.clock.offset_ms,
            nonce: Some(nonce.to_string()),
        }
    }

    pub fn latency(&self) -> Latency {
        self.lock().latency.clone()
    }

    pub(super) fn rtt(&self, t0: Instant) {
        let secs = t0.elapsed().as_secs_f64();
        let mut i = self.lock();
        i.latency.observe(secs);
        i.report.store_rtt_ms = Some(secs * 1e3);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_lands_in_one_bucket_each() {
        let mut l = Latency::default();
        l.observe(0.0001);
        l.observe(0.003);
        l.observe(5.0);
        let s = l.series();
        assert_eq!(s.len(), LATENCY_BUCKETS.len() + 1);
        assert_eq!(s[0], (0.0005, 1));
        assert_eq!(s[3], (0.005, 1));
        assert_eq!(s.last(), Some(&(f64::INFINITY, 1)));
        assert_eq!(l.count, 3);
    }

    #[test]
    fn peers_are_stale_after_ten_seconds_unseen() {
        let h = Heartbeat {
            host_id: "b".into(),
            version: "0.1.0".into(),
            seen_ms: 1_000_000,
            bans_published: 3,
            bans_received: 4,
            cursor: Some("5-0".into()),
            clock_offset_ms: Some(-2.5),
            nonce: Some("0123456789abcdef".into()),
        };
        let p = Peer::of(&h, "a", 1_009_999);
        assert!(!p.stale && !p.this_host && p.age_ms == 9_999, "{p:?}");
        assert_eq!(p.last_seen, "1970-01-01T00:16:40.000Z");
        let p = Peer::of(&h, "b", 1_010_000);
        assert!(p.stale && p.this_host, "{p:?}");
        // A peer's clock ahead of ours: age 0, not stale.
        assert_eq!(Peer::of(&h, "a", 999_000).age_ms, 0);
        let back: Heartbeat = serde_json::from_str(&serde_json::to_string(&h).unwrap()).unwrap();
        assert_eq!(back, h);
    }
}
