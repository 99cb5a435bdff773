//! The read-only HTTP listener (`daemon.http_listen`): `GET /metrics` for Prometheus (OpenMetrics
//! text format) and the control API's reports as JSON under `/v1/`. Nothing here changes the
//! daemon's state: bans, rules and reloads stay on the root-only control socket.
//!
//! Every value is read from the maps when it is asked for: `/metrics` builds a fresh registry
//! per scrape from one pass over the counters, and `/v1/...` answers exactly what the control
//! API answers for the same request, cut to a bounded length.
//!
//! Any local user can connect, so no client may hold the daemon's resources: at most
//! [`MAX_CONNECTIONS`] connections are served at once (more are closed as soon as they are
//! accepted, and counted), at most [`crate::serve::http_slots::MAX_PER_PEER`] of them from one peer,
//! and [`crate::serve::http_slots::METRICS_SLOTS`] of them kept for `/metrics` (see
//! [`crate::serve::http_slots`]), a client has [`HEADER_READ_TIMEOUT`] to send a request's headers
//! (idle keep-alive connections included), a request that waits [`REQUEST_TIMEOUT`] for the
//! daemon gets a 503, a connection is closed after [`MAX_CONNECTION_AGE`], and every answer
//! is bounded ([`MAX_TOP_N`], [`MAX_LIST`]). A thousand idle connections cost the daemon at most
//! [`MAX_CONNECTIONS`] file descriptors, well under the 1,024 a systemd service gets by default.

use std::{
    convert::Infallible,
    future::Future,
    io::ErrorKind,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::anyhow;
use axum::{
    Json, Router,
    extract::{Query, State},
    http::{HeaderValue, Method, StatusCode, Uri, header},
    response::{IntoResponse, Response},
    routing::get,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _, MetricEncoder},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
    registry::Registry,
};
use ratelimit_common::stats::{global, rule};
use serde::Deserialize;
use tokio::net::TcpListener;
use tower::ServiceExt as _;
use tracing::{info, warn};

use crate::{
    api::{self, Answer, Request, TopBy},
    events,
    policy::report::{self, Pb, RuleCounters, Stats},
    serve::http_slots::Slots,
    serve::reader::Reports,
};

/// Content type of `/metrics`: the OpenMetrics text format, which Prometheus negotiates by
/// default (and which reads as plain text with `curl`).
pub const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Default `n` of `/v1/top`, as for `ratelimit top`.
const DEFAULT_TOP_N: usize = 10;
/// Largest `n` of `/v1/top`; above it the request is a 400.
pub const MAX_TOP_N: usize = 10_000;
/// Largest (and default) `limit` of `/v1/bans` and `/v1/offenders`: a longer list is cut to
/// it, and the answer says so with an `X-Truncated: true` header.
pub const MAX_LIST: usize = 10_000;
/// Connections served at once; more are closed as soon as they are accepted
/// (`ratelimit_http_connections_rejected_total`).
pub const MAX_CONNECTIONS: usize = 64;
/// Time a client has to send a request's headers, from the connection's start or the end of
/// its previous request. Prometheus sends its scrape at once; a client that does not is
/// disconnected.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a request may wait for the daemon (Prometheus' own default scrape timeout); after it,
/// a 503. It bounds the wait for the state lock; a report that has the lock already runs
/// synchronously to its end, and the 503 follows then.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection is closed (after the request in progress, if any) once it is this old, so a
/// client that stops reading its answer holds a slot for a bounded time.
pub const MAX_CONNECTION_AGE: Duration = Duration::from_secs(60);
/// How often a failing `accept` (out of file descriptors) is logged.
const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(10);

const ENDPOINTS: &str = "/metrics, /v1/status, /v1/stats, /v1/top?n=N&by=packets|bytes|drops, \
     /v1/bans?limit=N, /v1/offenders?limit=N, /v1/pressure, /v1/fleet, /v1/fleet/key?addr=A&rule=R";

/// Bind `daemon.http_listen`, with an error an operator can act on.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|e| match e.kind() {
        ErrorKind::AddrInUse => anyhow!(
            "http_listen {addr}: address in use; set [daemon] http_listen to another address or \"off\""
        ),
        ErrorKind::AddrNotAvailable => anyhow!(
            "http_listen {addr}: no local interface has this address; set [daemon] http_listen to another address or \"off\""
        ),
        ErrorKind::PermissionDenied => anyhow!(
            "http_listen {addr}: permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)"
        ),
        _ => anyhow!("http_listen {addr}: {e}"),
    })
}

/// Serve the listener until the task is dropped.
pub async fn serve<B: Backend>(listener: TcpListener, state: B) -> anyhow::Result<()> {
    serve_with(listener, state, Limits::DEFAULT).await
}

/// The listener's bounds (the constants above; shorter in tests).
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_connections: usize,
    /// Of `max_connections`, kept for `/metrics`.
    metrics_slots: usize,
    max_per_peer: usize,
    header_read_timeout: Duration,
    request_timeout: Duration,
    max_connection_age: Duration,
}

impl Limits {
    const DEFAULT: Limits = Limits {
        max_connections: MAX_CONNECTIONS,
        metrics_slots: crate::serve::http_slots::METRICS_SLOTS,
        max_per_peer: crate::serve::http_slots::MAX_PER_PEER,
        header_read_timeout: HEADER_READ_TIMEOUT,
        request_timeout: REQUEST_TIMEOUT,
        max_connection_age: MAX_CONNECTION_AGE,
    };
}

/// The listener's own counts, for `/metrics`.
#[derive(Default)]
struct Conns {
    open: AtomicU64,
    rejected: AtomicU64,
    header_timeouts: AtomicU64,
    request_timeouts: AtomicU64,
}

impl Conns {
    fn counts(&self) -> HttpCounts {
        HttpCounts {
            open: self.open.load(Ordering::Relaxed),
            rejected: self.rejected.load(Ordering::Relaxed),
            header_timeouts: self.header_timeouts.load(Ordering::Relaxed),
            request_timeouts: self.request_timeouts.load(Ordering::Relaxed),
        }
    }
}

/// A reading of the listener's counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HttpCounts {
    /// Connections being served now.
    pub open: u64,
    /// Connections closed at once because [`MAX_CONNECTIONS`] were open, or their peer held
    /// [`crate::serve::http_slots::MAX_PER_PEER`].
    pub rejected: u64,
    /// Connections closed because the headers did not arrive within [`HEADER_READ_TIMEOUT`].
    pub header_timeouts: u64,
    /// Requests answered 503 after [`REQUEST_TIMEOUT`].
    pub request_timeouts: u64,
}

/// One served connection, counted in `open` while it lives.
struct Served(Arc<Conns>);

impl Served {
    fn new(conns: Arc<Conns>) -> Self {
        conns.open.fetch_add(1, Ordering::Relaxed);
        Served(conns)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn serve_with<B: Backend>(
    listener: TcpListener,
    backend: B,
    limits: Limits,
) -> anyhow::Result<()> {
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "HTTP listener ready (GET /metrics, /v1/...)");
    }
    let conns = Arc::new(Conns::default());
    let app = router(App {
        backend,
        conns: conns.clone(),
    });
    let slots = Slots::new(
        limits.max_connections,
        limits.metrics_slots,
        limits.max_per_peer,
    );
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let mut last_warn: Option<Instant> = None;
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, say: keep serving once it passes.
                if last_warn.is_none_or(|t| t.elapsed() >= ACCEPT_WARN_EVERY) {
                    warn!("HTTP listener: accept failed: {e}");
                    last_warn = Some(Instant::now());
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = slots.admit(peer.ip()) else {
            // Closed as soon as accepted: a connection over the caps costs one descriptor for
            // an instant, never a task.
            conns.rejected.fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        };
        let served = Served::new(conns.clone());
        let metrics_only = slot.metrics_only;
        let service = {
            let (app, conns) = (app.clone(), conns.clone());
            hyper::service::service_fn(move |req| {
                let (app, conns) = (app.clone(), conns.clone());
                let timeout = limits.request_timeout;
                async move {
                    if metrics_only && req.uri().path() != "/metrics" {
                        return Ok::<_, Infallible>(error(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "every connection slot is taken; this connection serves only /metrics; \
                             try again"
                                .to_string(),
                        ));
                    }
                    Ok(answer_in_time(app, &conns, req, timeout).await)
                }
            })
        };
        let conn = http.serve_connection(TokioIo::new(stream), service);
        tokio::spawn(async move {
            let _slot = slot;
            let mut conn = std::pin::pin!(conn);
            let res = tokio::select! {
                res = conn.as_mut() => res,
                () = tokio::time::sleep(limits.max_connection_age) => {
                    conn.as_mut().graceful_shutdown();
                    tokio::time::timeout(limits.request_timeout, conn).await.unwrap_or(Ok(()))
                }
            };
            if let Err(e) = res
                && e.is_timeout()
            {
                served.0.header_timeouts.fetch_add(1, Ordering::Relaxed);
            }
            drop(served);
        });
    }
}

/// The router's answer to `req`, or a 503 once `timeout` ([`REQUEST_TIMEOUT`]) has passed
/// (the daemon is busy: a report over millions of clients holds the state).
async fn answer_in_time(
    app: Router,
    conns: &Conns,
    req: axum::http::Request<hyper::body::Incoming>,
    timeout: Duration,
) -> Response {
    match tokio::time::timeout(timeout, app.oneshot(req)).await {
        Ok(Ok(resp)) => resp,
        Ok(Err(never)) => match never {},
        Err(_) => {
            conns.request_timeouts.fetch_add(1, Ordering::Relaxed);
            error(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the daemon did not answer within {timeout:?}; try again"),
            )
        }
    }
}

/// What the routes need from the daemon. A trait so the routing can be tested without maps.
pub trait Backend: Clone + Send + Sync + 'static {
    /// The control API's answer to a (read-only) request.
    fn request(&self, req: Request) -> impl Future<Output = api::Response> + Send;
    /// What `/metrics` shows, read from the maps now (the listener's own counts aside).
    fn snapshot(&self) -> impl Future<Output = anyhow::Result<(Stats, Gauges)>> + Send;
}

/// The router's state: the daemon, and the listener's counts for `/metrics`.
#[derive(Clone)]
struct App<B> {
    backend: B,
    conns: Arc<Conns>,
}

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

#[derive(Debug)]
enum Value {
    Counter(u64),
    Gauge(u64),
    /// A gauge that is not a whole number (nor a 0-to-1 ratio).
    Float(f64),
    Ratio(f64),
    /// An OpenMetrics info metric (a family's only series): value 1, the labels carry the
    /// information.
    Info,
    /// A histogram: sum, count, (upper bound, count in that bucket alone) with `+Inf` last.
    Histogram(f64, u64, Vec<(f64, u64)>),
}

type Labels = Vec<(&'static str, String)>;

/// One metric family, with its series in the order they are exposed.
#[derive(Debug)]
struct Family {
    /// Without the `_total` (counter) or `_info` (info) suffix the encoder adds.
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    series: Vec<(Labels, Value)>,
}

impl Family {
    fn new(name: &'static str, kind: MetricType, help: &'static str) -> Self {
        Self {
            name,
            help,
            kind,
            series: Vec::new(),
        }
    }

    fn with(mut self, labels: Labels, value: Value) -> Self {
        self.series.push((labels, value));
        self
    }

    fn with_some(self, series: Option<(Labels, Value)>) -> Self {
        match series {
            Some((labels, value)) => self.with(labels, value),
            None => self,
        }
    }
}

/// A snapshot of every family, encoded by the official client's OpenMetrics text encoder.
#[derive(Debug)]
struct Snapshot(Vec<Family>);

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for f in &self.0 {
            let mut metric = encoder.encode_descriptor(f.name, f.help, None, f.kind)?;
            match f.series.as_slice() {
                // The labels of an info are its own: `name_info{labels} 1`.
                [(labels, Value::Info)] => metric.encode_info(labels)?,
                // No labels: `name 1`, not `name{} 1`.
                [(labels, value)] if labels.is_empty() => encode_value(metric, value)?,
                series => {
                    for (labels, value) in series {
                        encode_value(metric.encode_family(labels)?, value)?;
                    }
                }
            }
        }
        Ok(())
    }
}

fn encode_value(metric: MetricEncoder, value: &Value) -> Result<(), std::fmt::Error> {
    match value {
        Value::Counter(v) => ConstCounter::new(*v).encode(metric),
        Value::Gauge(v) => ConstGauge::new(*v).encode(metric),
        Value::Ratio(v) | Value::Float(v) => ConstGauge::new(*v).encode(metric),
        Value::Histogram(sum, count, buckets) => {
            let mut metric = metric;
            metric.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                *sum, *count, buckets, None,
            )
        }
        Value::Info => {
            debug_assert!(false, "an info metric has exactly one series");
            Ok(())
        }
    }
}

/// The detail counters (`stats::global`, after the verdicts) that count packets: each is a
/// series of `ratelimit_reason_packets_total{reason}`. The others count something else (bans,
/// states, events) and have families of their own ([`NON_PACKET_REASONS`]).
/// `http_metrics_export_every_counter_once` checks that every counter is in one list.
const PACKET_REASONS: [u32; 19] = [
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
const NON_PACKET_REASONS: [(u32, &str, &str); 6] = [
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

fn reason(stats: &Stats, counter: u32) -> u64 {
    stats
        .all
        .reasons
        .get(global::NAMES[counter as usize])
        .map_or(0, |pb| pb.packets)
}

fn rule_counter(r: &RuleCounters, counter: u32) -> Pb {
    r.counters
        .get(rule::NAMES[counter as usize])
        .copied()
        .unwrap_or_default()
}

/// The `/metrics` exposition (OpenMetrics text, `# EOF` included) of one reading of the maps.
///
/// Prometheus' conventions, which the tests hold it to: no series is the sum of others of its
/// family (totals are what `sum()` gives: there is no `interface="all"` series), a
/// `_packets_total` family counts packets and nothing else, counters end in `_total`, units
/// (packets, bytes) are in the names, and a ratio is a `_ratio` gauge from 0 to 1.
pub fn render_metrics(stats: &Stats, gauges: &Gauges) -> String {
    use MetricType::{Counter, Gauge, Info};

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
    let non_packet_reasons = NON_PACKET_REASONS.iter().map(|&(r, name, help)| {
        Family::new(name, Counter, help).with(vec![], Value::Counter(reason(stats, r)))
    });

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

    let tracked = gauges.tracked_clients;
    let capacity = gauges.tracked_clients_capacity;
    let fill = if capacity == 0 {
        0.0
    } else {
        tracked as f64 / capacity as f64
    };

    let mut families = vec![
        packets,
        bytes,
        reasons,
        rule_matched_packets,
        rule_matched_bytes,
        rule_packets,
        rule_bytes,
        rule_bans,
        Family::new(
            "ratelimit_active_bans",
            Gauge,
            "Bans in force now (operator- and rule-issued)",
        )
        .with(vec![], Value::Gauge(gauges.active_bans)),
    ];
    families.extend(non_packet_reasons);
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
        Family::new(
            "ratelimit_events_lost",
            Counter,
            "Events that never became a line, by where they were lost: the program found the ring buffer full, the daemon's queue to the events writer was full, or writing the line failed",
        )
        .with(
            vec![("stage", "ring_buffer".into())],
            Value::Counter(reason(stats, global::EVENTS_LOST)),
        )
        .with(
            vec![("stage", "queue".into())],
            Value::Counter(gauges.events.lost_queue),
        )
        .with(
            vec![("stage", "write".into())],
            Value::Counter(gauges.events.lost_write),
        ),
        Family::new(
            "ratelimit_events_suppressed",
            Counter,
            "Events over daemon.events_per_sec, not written as lines but counted in the per-second summary lines (event \"suppressed\")",
        )
        .with(vec![], Value::Counter(gauges.events.suppressed)),
        Family::new(
            "ratelimit_events_written",
            Counter,
            "Event lines written (summary lines not included)",
        )
        .with(vec![], Value::Counter(gauges.events.written)),
        Family::new(
            "ratelimit_events_queued",
            Gauge,
            "Events waiting for the events writer",
        )
        .with(vec![], Value::Gauge(gauges.events.queued)),
        Family::new(
            "ratelimit_http_connections_open",
            Gauge,
            "Connections the HTTP listener serves now",
        )
        .with(vec![], Value::Gauge(gauges.http.open)),
        Family::new(
            "ratelimit_http_connections_rejected",
            Counter,
            "HTTP connections closed as soon as accepted because the listener served its maximum already",
        )
        .with(vec![], Value::Counter(gauges.http.rejected)),
        Family::new(
            "ratelimit_http_timeouts",
            Counter,
            "HTTP clients that ran out of time: headers not sent within the header timeout (the connection is closed), or a request not answered within the request timeout (a 503)",
        )
        .with(
            vec![("phase", "headers".into())],
            Value::Counter(gauges.http.header_timeouts),
        )
        .with(
            vec![("phase", "request".into())],
            Value::Counter(gauges.http.request_timeouts),
        ),
        gauges.tasks.iter().fold(
            Family::new(
                "ratelimit_task_up",
                Gauge,
                "1 while a background task of the daemon runs, 0 while it waits to be restarted after a failure",
            ),
            |f, (name, up, _)| f.with(vec![("task", name.to_string())], Value::Gauge(u64::from(*up))),
        ),
        gauges.tasks.iter().fold(
            Family::new(
                "ratelimit_task_restarts",
                Counter,
                "Times a background task of the daemon failed and was restarted (with backoff)",
            ),
            |f, (name, _, restarts)| {
                f.with(vec![("task", name.to_string())], Value::Counter(*restarts))
            },
        ),
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
        Family::new(
            "ratelimit_pressure_high",
            Gauge,
            "1 while the pressure level is high (a signal above its mark within the hold, or forced by `ratelimit pressure set high`), else 0",
        )
        .with(vec![], Value::Gauge(u64::from(gauges.pressure_high))),
        gauges.pressure_signals.iter().fold(
            Family::new(
                "ratelimit_pressure_signal",
                Gauge,
                "Each pressure signal over the last sampling interval: cpu_busy (busy share of the watched CPUs, 0 to 1), listen_overflows_per_sec (TcpExt ListenDrops a second); no series until it has a value",
            ),
            |f, (name, value, _)| {
                f.with_some(value.map(|v| (vec![("signal", name.to_string())], Value::Float(v))))
            },
        ),
        gauges.pressure_signals.iter().fold(
            Family::new(
                "ratelimit_pressure_mark",
                Gauge,
                "Each pressure signal's mark ([pressure]): above it, the level is high",
            ),
            |f, (name, _, mark)| f.with(vec![("signal", name.to_string())], Value::Float(*mark)),
        ),
        Family::new(
            "ratelimit_pressure_transitions",
            Counter,
            "Changes of the pressure level (to high or to low) since the daemon started",
        )
        .with(vec![], Value::Counter(gauges.pressure_transitions)),
    ]);
    if let Some(f) = &gauges.fleet {
        families.extend(fleet_families(f));
    }
    families.extend([
        Family::new("ratelimit_up", Gauge, "1 while the daemon answers")
            .with(vec![], Value::Gauge(1)),
        Family::new("ratelimit_build", Info, "The daemon's version").with(
            vec![("version", env!("CARGO_PKG_VERSION").into())],
            Value::Info,
        ),
    ]);

    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot(families)));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .expect("writing to a String does not fail");
    out
}

/// `ratelimit_fleet_*`: fleet mode's connection, bans shared, outbox and store latency.
fn fleet_families(f: &FleetGauges) -> Vec<Family> {
    use MetricType::{Counter, Gauge, Histogram};
    let by_reason = |name: &'static str,
                     help: &'static str,
                     m: &std::collections::BTreeMap<String, u64>| {
        crate::fleet::trust::Reject::ALL
            .iter()
            .fold(Family::new(name, Counter, help), |fam, r| {
                let n = m.get(r.as_str()).copied().unwrap_or(0);
                fam.with(vec![("reason", r.as_str().into())], Value::Counter(n))
            })
    };
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

/// Query of `/v1/top`.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct TopQuery {
    n: Option<usize>,
    by: Option<TopBy>,
}

/// The control request for `/v1/top?n=N&by=packets|bytes|drops` (both optional, `n` at most
/// [`MAX_TOP_N`]), or the message of a 400.
fn parse_top(uri: &Uri) -> Result<Request, String> {
    let Query(q) = Query::<TopQuery>::try_from_uri(uri).map_err(|e| {
        format!(
            "{}; expected /v1/top?n=N&by=packets|bytes|drops",
            e.body_text()
        )
    })?;
    let n = q.n.unwrap_or(DEFAULT_TOP_N);
    if n > MAX_TOP_N {
        return Err(format!(
            "n = {n} is more than the {MAX_TOP_N} clients /v1/top answers with; expected \
             /v1/top?n=N&by=packets|bytes|drops"
        ));
    }
    Ok(Request::Top {
        n,
        by: q.by.unwrap_or_default(),
    })
}

/// Query of `/v1/fleet/key`.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct KeyQuery {
    addr: String,
    rule: Option<String>,
}

/// The control request for `/v1/fleet/key?addr=A&rule=R` (`rule` optional), or the message
/// of a 400.
fn parse_key(uri: &Uri) -> Result<Request, String> {
    let Query(q) = Query::<KeyQuery>::try_from_uri(uri)
        .map_err(|e| format!("{}; expected /v1/fleet/key?addr=A&rule=R", e.body_text()))?;
    Ok(Request::FleetKey {
        addr: q.addr,
        rule: q.rule,
    })
}

/// Query of `/v1/bans` and `/v1/offenders`.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    limit: Option<usize>,
}

/// The `limit` of `/v1/bans?limit=N` or `/v1/offenders?limit=N` (optional, at most and by
/// default [`MAX_LIST`]), or the message of a 400.
fn parse_limit(uri: &Uri) -> Result<usize, String> {
    let expected = || format!("expected {}?limit=N", uri.path());
    let Query(q) = Query::<ListQuery>::try_from_uri(uri)
        .map_err(|e| format!("{}; {}", e.body_text(), expected()))?;
    let limit = q.limit.unwrap_or(MAX_LIST);
    if limit > MAX_LIST {
        return Err(format!(
            "limit = {limit} is more than the {MAX_LIST} entries {} answers with; {}",
            uri.path(),
            expected()
        ));
    }
    Ok(limit)
}

fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    (status, Json(serde_json::json!({ "error": msg.into() }))).into_response()
}

/// The daemon's answer to `req`, or the response that says it failed.
async fn ask<B: Backend>(backend: &B, req: Request) -> Result<Answer, Response> {
    backend.request(req).await.0.map_err(|msg| {
        warn!("HTTP read-only request failed: {msg}");
        error(StatusCode::INTERNAL_SERVER_ERROR, msg)
    })
}

async fn answer<B: Backend>(backend: &B, req: Request) -> Response {
    match ask(backend, req).await {
        Ok(data) => (StatusCode::OK, Json(data)).into_response(),
        Err(resp) => resp,
    }
}

/// A list answer cut to `limit` entries. The daemon is asked for one more than that, so a
/// list that was cut says so (`X-Truncated: true`) without anyone counting the rest.
async fn answer_list<B: Backend>(backend: &B, req: Request, limit: usize) -> Response {
    let mut data = match ask(backend, req).await {
        Ok(data) => data,
        Err(resp) => return resp,
    };
    let truncated = data.truncate(limit);
    let mut resp = (StatusCode::OK, Json(data)).into_response();
    if truncated {
        resp.headers_mut()
            .insert("x-truncated", HeaderValue::from_static("true"));
    }
    resp
}

async fn metrics<B: Backend>(State(app): State<App<B>>) -> Response {
    match app.backend.snapshot().await {
        Ok((stats, mut gauges)) => {
            gauges.http = app.conns.counts();
            (
                [(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)],
                render_metrics(&stats, &gauges),
            )
                .into_response()
        }
        Err(e) => {
            warn!("/metrics: {e:#}");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("reading the maps failed: {e:#}\n"),
            )
                .into_response()
        }
    }
}

async fn top<B: Backend>(State(app): State<App<B>>, uri: Uri) -> Response {
    match parse_top(&uri) {
        Ok(req) => answer(&app.backend, req).await,
        Err(msg) => error(StatusCode::BAD_REQUEST, msg),
    }
}

async fn bans<B: Backend>(State(app): State<App<B>>, uri: Uri) -> Response {
    match parse_limit(&uri) {
        Ok(limit) => {
            let req = Request::Bans {
                limit: Some(limit + 1),
            };
            answer_list(&app.backend, req, limit).await
        }
        Err(msg) => error(StatusCode::BAD_REQUEST, msg),
    }
}

async fn offenders<B: Backend>(State(app): State<App<B>>, uri: Uri) -> Response {
    match parse_limit(&uri) {
        Ok(limit) => {
            let req = Request::Offenders {
                limit: Some(limit + 1),
            };
            answer_list(&app.backend, req, limit).await
        }
        Err(msg) => error(StatusCode::BAD_REQUEST, msg),
    }
}

/// `/v1/fleet/key`: the answer, or 429 (`Retry-After: 1`) when the rate bound of the store's
/// reads left nothing to answer with (`crate::fleet::key_reads`).
async fn fleet_key<B: Backend>(State(app): State<App<B>>, uri: Uri) -> Response {
    match parse_key(&uri) {
        Ok(req) => match ask(&app.backend, req).await {
            Ok(Answer::FleetKey(k)) if k.busy.is_some() => {
                let mut resp = error(StatusCode::TOO_MANY_REQUESTS, k.busy.unwrap_or_default());
                resp.headers_mut().insert(
                    axum::http::header::RETRY_AFTER,
                    axum::http::HeaderValue::from_static("1"),
                );
                resp
            }
            Ok(data) => (StatusCode::OK, Json(data)).into_response(),
            Err(resp) => resp,
        },
        Err(msg) => error(StatusCode::BAD_REQUEST, msg),
    }
}

async fn not_found(method: Method, uri: Uri) -> Response {
    error(
        StatusCode::NOT_FOUND,
        format!(
            "no such endpoint: {method} {}; endpoints: {ENDPOINTS}",
            uri.path()
        ),
    )
}

async fn method_not_allowed(method: Method) -> Response {
    error(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{method} is not allowed: this listener is read-only (GET)"),
    )
}

fn router<B: Backend>(app: App<B>) -> Router {
    let report = |req: Request| {
        get(move |State(app): State<App<B>>| {
            let req = req.clone();
            async move { answer(&app.backend, req).await }
        })
    };
    Router::new()
        .route("/metrics", get(metrics::<B>))
        .route("/v1/status", report(Request::Status))
        .route("/v1/stats", report(Request::Stats))
        .route("/v1/top", get(top::<B>))
        .route("/v1/bans", get(bans::<B>))
        .route("/v1/offenders", get(offenders::<B>))
        .route("/v1/pressure", report(Request::Pressure))
        .route("/v1/fleet", report(Request::Fleet))
        .route("/v1/fleet/key", get(fleet_key::<B>))
        .fallback(not_found)
        // After the routes: it applies to those registered before it.
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(app)
}

#[cfg(test)]
mod tests {
    use std::{
        collections::BTreeSet,
        sync::{Arc, Mutex},
    };

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use ratelimit_common::{
        caps::{MAX_IFACES, RETIRED_SLOT, UNLISTED_SLOT},
        stats::PER_IFACE,
    };

    use super::*;

    fn pb(packets: u64, bytes: u64) -> Pb {
        Pb { packets, bytes }
    }

    /// Raw counters as `report::read_all` gives them: `[slot][index]`, all zero.
    fn raw_slots() -> Vec<Vec<Pb>> {
        vec![vec![Pb::default(); PER_IFACE as usize]; MAX_IFACES as usize]
    }

    fn rule_index(rule: u32, counter: u32) -> usize {
        (global::COUNT + rule * rule::COUNT + counter) as usize
    }

    const IFACES: [(u32, &str); 2] = [(1, "eth0"), (2, "eth1")];

    fn stats_of(slots: &[Vec<Pb>], rules: &[&str]) -> Stats {
        let ifaces: Vec<(u32, String)> = IFACES.iter().map(|&(s, n)| (s, n.into())).collect();
        let rules: Vec<String> = rules.iter().map(|r| r.to_string()).collect();
        report::stats_of(slots, &ifaces, &rules)
    }

    /// Two interfaces (eth0, eth1), a frame's worth of an unlisted one, the counts of an
    /// interface gone (in the retired slot), and one rule.
    fn synthetic() -> Stats {
        let mut s = raw_slots();
        s[1][global::PASS as usize] = pb(20, 2000);
        s[1][global::DROP_RULE as usize] = pb(7, 700);
        s[2][global::PASS as usize] = pb(10, 1000);
        s[UNLISTED_SLOT as usize][global::PASS as usize] = pb(4, 400);
        s[RETIRED_SLOT as usize][global::PASS as usize] = pb(100, 10_000);
        s[1][global::STATE_CREATED as usize] = pb(12, 0);
        s[1][global::STATE_EVICTED as usize] = pb(7, 0);
        s[1][global::BANS_ISSUED as usize] = pb(2, 0);
        s[1][global::ADMISSION_REFUSED as usize] = pb(4, 240);
        s[1][global::EVENTS_LOST as usize] = pb(1, 0);
        s[1][rule_index(0, rule::MATCHED)] = pb(9, 900);
        s[1][rule_index(0, rule::ADMITTED)] = pb(2, 200);
        s[1][rule_index(0, rule::DROPPED)] = pb(7, 700);
        s[1][rule_index(0, rule::BANS)] = pb(2, 0);
        stats_of(&s, &["syn-per-client"])
    }

    const GAUGES: Gauges = Gauges {
        active_bans: 3,
        tracked_clients: 5,
        tracked_clients_capacity: 20,
        known_filter: Some((16, 64)),
        events: events::Counts {
            queued: 6,
            written: 100,
            suppressed: 40,
            lost_queue: 2,
            lost_write: 3,
        },
        http: HttpCounts {
            open: 1,
            rejected: 9,
            header_timeouts: 4,
            request_timeouts: 5,
        },
        tasks: Vec::new(),
        saved_bans: [
            ("restored", 2),
            ("pinned", 0),
            ("expired", 1),
            ("rule_gone", 0),
            ("failed", 1),
        ],
        bans_files_set_aside: 1,
        remote_bans_spilled: 0,
        pressure_high: false,
        pressure_signals: Vec::new(),
        pressure_transitions: 0,
        fleet: None,
    };

    /// Fleet mode's families, only with `[fleet]`; the latency histogram's buckets are
    /// cumulative, `+Inf` last, as Prometheus reads them.
    #[test]
    fn http_metrics_fleet_series() {
        let text = render_metrics(&synthetic(), &GAUGES);
        assert!(!text.contains("ratelimit_fleet_"), "{text}");
        let mut latency = crate::fleet::Latency::default();
        latency.observe(0.0002);
        latency.observe(0.003);
        latency.observe(2.0);
        let gauges = Gauges {
            fleet: Some(FleetGauges {
                connected: true,
                bans_published: 5,
                unbans_published: 1,
                bans_received: 7,
                unbans_received: 2,
                outbox: 3,
                resyncs: 1,
                peers: 2,
                peers_stale: 1,
                latency,
                global: crate::fleet::global::GlobalReport {
                    rules: vec!["udp-global".into()],
                    synced_keys: 4,
                    shared_keys: 1,
                    capped_keys: 2,
                    rounds: 90,
                    store_calls: 180,
                    store_errors: 1,
                    keys_published: 900,
                    added_total: 5000,
                    last_round_ms: Some(2.5),
                    last_error: None,
                },
                clock_offset_seconds: Some(-5.0025),
                clock_over_bound: true,
                authenticated: true,
                records_rejected: [("bad_mac".to_string(), 3)].into(),
                counts_rejected: Default::default(),
                bans_clamped: 2,
                duplicate_id: true,
                peers_in_store: 200_002,
                key_reads: crate::fleet::key_reads::Stats {
                    store_reads: 40,
                    cache_hits: 900,
                    busy: 7,
                    errors: 1,
                },
            }),
            ..GAUGES
        };
        let text = render_metrics(&synthetic(), &gauges);
        let l = lines(&text);
        for want in [
            "# TYPE ratelimit_fleet_connected gauge",
            "ratelimit_fleet_connected 1",
            "ratelimit_fleet_authenticated 1",
            "ratelimit_fleet_records_rejected_total{reason=\"bad_mac\"} 3",
            "ratelimit_fleet_records_rejected_total{reason=\"too_wide\"} 0",
            "ratelimit_fleet_counts_rejected_total{reason=\"unauthenticated\"} 0",
            "ratelimit_fleet_bans_clamped_total 2",
            "# TYPE ratelimit_fleet_records_published counter",
            "ratelimit_fleet_records_published_total{op=\"ban\"} 5",
            "ratelimit_fleet_records_published_total{op=\"unban\"} 1",
            "ratelimit_fleet_records_received_total{op=\"ban\"} 7",
            "ratelimit_fleet_records_received_total{op=\"unban\"} 2",
            "ratelimit_fleet_outbox_records 3",
            "ratelimit_fleet_resyncs_total 1",
            "# TYPE ratelimit_fleet_peers gauge",
            "ratelimit_fleet_peers{state=\"fresh\"} 2",
            "ratelimit_fleet_peers{state=\"stale\"} 1",
            "# TYPE ratelimit_fleet_store_latency_seconds histogram",
            "ratelimit_fleet_store_latency_seconds_count 3",
            "ratelimit_fleet_store_latency_seconds_bucket{le=\"0.0005\"} 1",
            "ratelimit_fleet_store_latency_seconds_bucket{le=\"0.005\"} 2",
            "ratelimit_fleet_store_latency_seconds_bucket{le=\"1.0\"} 2",
            "ratelimit_fleet_store_latency_seconds_bucket{le=\"+Inf\"} 3",
            "# TYPE ratelimit_fleet_global_rules gauge",
            "ratelimit_fleet_global_rules 1",
            "ratelimit_fleet_global_synced_keys 4",
            "ratelimit_fleet_global_shared_keys 1",
            "ratelimit_fleet_global_capped_keys 2",
            "# TYPE ratelimit_fleet_global_rounds counter",
            "ratelimit_fleet_global_rounds_total 90",
            "ratelimit_fleet_global_store_calls_total 180",
            "ratelimit_fleet_global_keys_published_total 900",
            "ratelimit_fleet_global_store_errors_total 1",
            "ratelimit_fleet_global_added_total 5000",
            "# TYPE ratelimit_fleet_global_round_seconds gauge",
            "ratelimit_fleet_global_round_seconds 0.0025",
            "# TYPE ratelimit_fleet_clock_offset_seconds gauge",
            "ratelimit_fleet_clock_offset_seconds -5.0025",
            "# TYPE ratelimit_fleet_clock_skewed gauge",
            "ratelimit_fleet_clock_skewed 1",
            "# TYPE ratelimit_fleet_duplicate_id gauge",
            "ratelimit_fleet_duplicate_id 1",
            "ratelimit_fleet_peers_in_store 200002",
            "# TYPE ratelimit_fleet_key_store_reads counter",
            "ratelimit_fleet_key_store_reads_total 40",
            "ratelimit_fleet_key_cache_hits_total 900",
            "ratelimit_fleet_key_busy_total 7",
            "ratelimit_fleet_key_store_errors_total 1",
        ] {
            assert!(l.contains(&want), "{want} missing from:\n{text}");
        }
        // Before the first round: no duration.
        let mut idle = gauges.clone();
        if let Some(f) = idle.fleet.as_mut() {
            f.global = crate::fleet::global::GlobalReport::default();
            (f.clock_offset_seconds, f.clock_over_bound) = (None, false);
        }
        let text = render_metrics(&synthetic(), &idle);
        let l = lines(&text);
        assert!(l.contains(&"ratelimit_fleet_global_rules 0"), "{text}");
        // The clock not measured yet: no offset.
        assert!(l.contains(&"ratelimit_fleet_clock_skewed 0"), "{text}");
        assert!(
            !l.iter()
                .any(|l| l.starts_with("ratelimit_fleet_clock_offset_seconds")),
            "{text}"
        );
        assert!(
            !l.iter()
                .any(|l| l.starts_with("ratelimit_fleet_global_round_seconds")),
            "{text}"
        );
    }

    #[test]
    fn http_fleet_key_query_parsing() {
        let key = |q: &str| {
            let uri: Uri = format!("/v1/fleet/key{q}").parse().unwrap();
            parse_key(&uri).map(|r| serde_json::to_value(r).unwrap())
        };
        assert_eq!(
            key("?addr=198.51.100.7"),
            Ok(serde_json::json!({"cmd": "fleet_key", "addr": "198.51.100.7"}))
        );
        assert_eq!(
            key("?addr=2001:db8::1&rule=udp-global"),
            Ok(
                serde_json::json!({"cmd": "fleet_key", "addr": "2001:db8::1", "rule": "udp-global"})
            )
        );
        for bad in ["", "?rule=r", "?addr=1.2.3.4&n=3"] {
            let e = key(bad).expect_err(bad);
            assert!(e.contains("expected /v1/fleet/key?addr=A&rule=R"), "{e}");
        }
    }

    fn lines(text: &str) -> Vec<&str> {
        text.lines().collect()
    }

    /// One sample of an exposition.
    #[derive(Debug, Clone)]
    struct Sample {
        /// The family's name (`# TYPE` line), and its type.
        family: String,
        kind: String,
        /// The sample's own name (`_total`, `_info` added).
        name: String,
        labels: Vec<(String, String)>,
        value: f64,
    }

    /// Every family of an exposition: (name, help lines, type lines), and every sample.
    fn parse(text: &str) -> (Vec<(String, usize, usize)>, Vec<Sample>) {
        let mut families: Vec<(String, usize, usize)> = Vec::new();
        let mut samples = Vec::new();
        let mut kind = String::new();
        let family_of = |families: &mut Vec<(String, usize, usize)>, name: &str| {
            if families.last().is_none_or(|f| f.0 != name) {
                families.push((name.into(), 0, 0));
            }
            families.len() - 1
        };
        for line in text.lines() {
            if line == "# EOF" {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').expect(line);
                assert!(!help.trim().is_empty(), "empty help: {line}");
                let i = family_of(&mut families, name);
                families[i].1 += 1;
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, k) = rest.split_once(' ').expect(line);
                let i = family_of(&mut families, name);
                families[i].2 += 1;
                kind = k.into();
                continue;
            }
            assert!(!line.starts_with('#'), "unexpected line {line:?}");
            let (series, value) = line.rsplit_once(' ').expect(line);
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => (name, parse_labels(rest.strip_suffix('}').expect(line))),
                None => (series, Vec::new()),
            };
            samples.push(Sample {
                family: families.last().expect("a sample after its TYPE").0.clone(),
                kind: kind.clone(),
                name: name.into(),
                labels,
                value: value.parse().expect(line),
            });
        }
        (families, samples)
    }

    /// `a="x",b="y\"z"` → [(a, x), (b, y"z)].
    fn parse_labels(s: &str) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let mut chars = s.chars().peekable();
        while chars.peek().is_some() {
            let name: String = chars.by_ref().take_while(|&c| c != '=').collect();
            assert_eq!(chars.next(), Some('"'), "{s}");
            let mut value = String::new();
            while let Some(c) = chars.next() {
                match c {
                    '"' => break,
                    '\\' => match chars.next() {
                        Some('n') => value.push('\n'),
                        Some(c) => value.push(c),
                        None => panic!("{s}"),
                    },
                    c => value.push(c),
                }
            }
            out.push((name, value));
            if chars.peek() == Some(&',') {
                chars.next();
            }
        }
        out
    }

    #[test]
    fn http_metrics_render_exact_series() {
        let gauges = Gauges {
            tasks: vec![("ban_persistence", true, 0), ("events", false, 3)],
            pressure_high: true,
            pressure_signals: vec![
                ("cpu_busy", Some(0.5), 0.8),
                ("listen_overflows_per_sec", None, 1.0),
            ],
            pressure_transitions: 3,
            ..GAUGES
        };
        let text = render_metrics(&synthetic(), &gauges);
        let l = lines(&text);
        for want in [
            "# HELP ratelimit_packets Frames seen by the XDP program, by verdict and by the interface that received them: each frame has one verdict and one interface, so a sum counts every frame once. An empty interface label stands for the interfaces beyond the per-interface counter slots (from their first frame on). A detached interface's series ends with it",
            "# TYPE ratelimit_packets counter",
            "ratelimit_bytes_total{verdict=\"drop_rule\",interface=\"eth0\"} 700",
            "ratelimit_bytes_total{verdict=\"pass\",interface=\"\"} 400",
            "# TYPE ratelimit_reason_packets counter",
            "ratelimit_reason_packets_total{reason=\"admission_refused\"} 4",
            "ratelimit_reason_packets_total{reason=\"contended\"} 0",
            "ratelimit_rule_matched_packets_total{rule=\"syn-per-client\"} 9",
            "ratelimit_rule_matched_bytes_total{rule=\"syn-per-client\"} 900",
            "ratelimit_rule_packets_total{rule=\"syn-per-client\",outcome=\"admitted\"} 2",
            "ratelimit_rule_packets_total{rule=\"syn-per-client\",outcome=\"dropped\"} 7",
            "ratelimit_rule_packets_total{rule=\"syn-per-client\",outcome=\"would_drop\"} 0",
            "ratelimit_rule_bytes_total{rule=\"syn-per-client\",outcome=\"dropped\"} 700",
            "ratelimit_rule_bans_issued_total{rule=\"syn-per-client\"} 2",
            "# TYPE ratelimit_active_bans gauge",
            "ratelimit_active_bans 3",
            "# TYPE ratelimit_bans_issued counter",
            "ratelimit_bans_issued_total 2",
            "ratelimit_bans_expired_total 0",
            "ratelimit_bans_held_in_state_total 0",
            "ratelimit_ban_insert_failures_total 0",
            "ratelimit_client_states_created_total 12",
            "ratelimit_client_states_evicted_total 7",
            "ratelimit_tracked_clients 5",
            "ratelimit_tracked_clients_capacity 20",
            "ratelimit_map_fill_ratio{map=\"clients\"} 0.25",
            "ratelimit_map_fill_ratio{map=\"known_filter\"} 0.25",
            "ratelimit_events_lost_total{stage=\"ring_buffer\"} 1",
            "ratelimit_events_lost_total{stage=\"queue\"} 2",
            "ratelimit_events_lost_total{stage=\"write\"} 3",
            "ratelimit_events_suppressed_total 40",
            "ratelimit_events_written_total 100",
            "ratelimit_events_queued 6",
            "ratelimit_http_connections_open 1",
            "ratelimit_http_connections_rejected_total 9",
            "ratelimit_http_timeouts_total{phase=\"headers\"} 4",
            "ratelimit_http_timeouts_total{phase=\"request\"} 5",
            "ratelimit_saved_bans_total{outcome=\"restored\"} 2",
            "ratelimit_saved_bans_total{outcome=\"failed\"} 1",
            "ratelimit_bans_files_set_aside_total 1",
            "ratelimit_task_up{task=\"events\"} 0",
            "# TYPE ratelimit_pressure_high gauge",
            "ratelimit_pressure_high 1",
            "ratelimit_pressure_signal{signal=\"cpu_busy\"} 0.5",
            "ratelimit_pressure_mark{signal=\"cpu_busy\"} 0.8",
            "ratelimit_pressure_mark{signal=\"listen_overflows_per_sec\"} 1.0",
            "ratelimit_pressure_transitions_total 3",
            "ratelimit_task_restarts_total{task=\"events\"} 3",
            "ratelimit_up 1",
            "# TYPE ratelimit_build info",
            &format!(
                "ratelimit_build_info{{version=\"{}\"}} 1",
                env!("CARGO_PKG_VERSION")
            ),
        ] {
            assert!(l.contains(&want), "missing {want:?} in:\n{text}");
        }
        assert!(text.ends_with("\n# EOF\n"), "{text}");
        // Per interface in slot order, then the unlisted ones; verdicts sorted by name. No
        // "all", and nothing of the interface gone (the retired slot's 100).
        let packets: Vec<_> = l
            .iter()
            .filter(|s| s.starts_with("ratelimit_packets_total") && !s.ends_with(" 0"))
            .collect();
        assert_eq!(
            packets,
            [
                &"ratelimit_packets_total{verdict=\"drop_rule\",interface=\"eth0\"} 7",
                &"ratelimit_packets_total{verdict=\"pass\",interface=\"eth0\"} 20",
                &"ratelimit_packets_total{verdict=\"pass\",interface=\"eth1\"} 10",
                &"ratelimit_packets_total{verdict=\"pass\",interface=\"\"} 4",
            ]
        );
        let verdicts = global::VERDICTS as usize;
        assert_eq!(
            l.iter()
                .filter(|s| s.starts_with("ratelimit_packets_total"))
                .count(),
            3 * verdicts,
            "every verdict of eth0, eth1 and the unlisted interfaces"
        );
        // Without a frame of an unlisted interface, no series of them.
        let mut stats = synthetic();
        stats.unlisted = report::Counters::default();
        let text = render_metrics(&stats, &gauges);
        assert_eq!(
            text.lines()
                .filter(|s| s.starts_with("ratelimit_packets_total"))
                .count(),
            2 * verdicts,
            "{text}"
        );
        assert!(
            !text
                .lines()
                .any(|l| !l.starts_with('#') && l.contains("interface=\"\"")),
            "{text}"
        );
    }

    /// Prometheus' conventions, for every family: one HELP and one TYPE line, a counter's
    /// samples end in `_total` (and only a counter's), an info's in `_info` with the value 1,
    /// a `_ratio` is a gauge from 0 to 1, names and label names in snake case, and no series
    /// twice.
    #[test]
    fn http_metrics_follow_prometheus_naming_conventions() {
        let gauges = Gauges {
            tasks: vec![("ban_persistence", true, 0), ("events", false, 3)],
            ..GAUGES
        };
        let text = render_metrics(&synthetic(), &gauges);
        let (families, samples) = parse(&text);
        let snake = |s: &str| {
            s.starts_with(|c: char| c.is_ascii_lowercase())
                && s.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                && !s.contains("__")
        };
        let mut names = BTreeSet::new();
        for (family, helps, types) in &families {
            assert!(names.insert(family), "{family} declared twice");
            assert_eq!((helps, types), (&1, &1), "{family}: HELP and TYPE lines");
            assert!(
                family.starts_with("ratelimit_") && snake(family),
                "{family}: not a snake-case name in the ratelimit_ namespace"
            );
            assert!(
                !family.ends_with("_total") && !family.ends_with("_info"),
                "{family}: the suffix belongs to the samples"
            );
        }
        let mut series = BTreeSet::new();
        for s in &samples {
            let want = match s.kind.as_str() {
                "counter" => format!("{}_total", s.family),
                "info" => format!("{}_info", s.family),
                "gauge" => s.family.clone(),
                k => panic!("{}: unexpected type {k}", s.family),
            };
            assert_eq!(s.name, want, "{s:?}");
            if s.kind == "gauge" {
                assert!(
                    !s.name.ends_with("_total"),
                    "a gauge named as a counter: {s:?}"
                );
            }
            if s.kind == "info" {
                assert_eq!(s.value, 1.0, "{s:?}");
            }
            if s.family.ends_with("_ratio") {
                assert_eq!(s.kind, "gauge", "{s:?}");
                assert!((0.0..=1.0).contains(&s.value), "{s:?}");
            }
            for (label, _) in &s.labels {
                assert!(snake(label), "{s:?}: label name {label}");
            }
            let mut labels = s.labels.clone();
            labels.sort();
            assert!(series.insert((s.name.clone(), labels)), "twice: {s:?}");
        }
        // Units in the names: what counts bytes says so, and only that.
        for s in &samples {
            let bytes = s.family.ends_with("_bytes");
            assert_eq!(
                bytes,
                [
                    "ratelimit_bytes",
                    "ratelimit_rule_matched_bytes",
                    "ratelimit_rule_bytes"
                ]
                .contains(&s.family.as_str()),
                "{s:?}"
            );
        }
    }

    /// Whether some two or more of `parts` add up to `total`.
    fn is_a_sum_of(total: f64, parts: &[f64]) -> Option<Vec<f64>> {
        let parts: Vec<f64> = parts.iter().copied().filter(|&p| p != 0.0).collect();
        assert!(
            parts.len() < 24,
            "too many series for the subset sums: {parts:?}"
        );
        (1u32..1 << parts.len())
            .filter(|m| m.count_ones() >= 2)
            .map(|m| {
                (0..parts.len())
                    .filter(|i| m & 1 << i != 0)
                    .map(|i| parts[i])
                    .collect::<Vec<_>>()
            })
            .find(|subset| subset.iter().sum::<f64>() == total)
    }

    /// A sum over a family's labels never counts anything twice: no series is the sum of
    /// others of its family that differ from it in one label (an `interface="all"` beside the
    /// interfaces, a rule's `matched` beside its outcomes). The counters are written as the
    /// program writes them (a frame in one verdict of its interface's slot, a rule's matched
    /// packet in `matched` and in one outcome), and every series that could be a part of
    /// another is a sum of powers of two no other series has, so no sum comes out equal by
    /// chance.
    #[test]
    fn http_metrics_no_series_is_the_sum_of_others_of_its_family() {
        let mut s = raw_slots();
        let power = |n: u32| pb(1 << n, 100 << n);
        // The verdicts (whose series are split by interface), then the reasons (whose
        // series are each a sum over the interfaces): each its own pair of powers.
        for k in 0..global::COUNT {
            let j = if k < global::VERDICTS {
                k
            } else {
                k - global::VERDICTS
            };
            s[1][k as usize] = power(2 * j);
            s[2][k as usize] = power(2 * j + 1);
        }
        // What the program does with a matched packet (`rules.rs`): `matched`, and one of
        // these (or none, when it passes the packet unmetered).
        let outcomes = [
            rule::ADMITTED,
            rule::DROPPED,
            rule::BANNED_DROPPED,
            rule::WOULD_DROP,
            rule::EXCEED_PASSED,
        ];
        for r in 0..2 {
            let mut matched = Pb::default();
            for (j, outcome) in (0..).zip(outcomes) {
                let p = power(r * 8 + j);
                s[1][rule_index(r, outcome)] = p;
                matched += p;
            }
            s[1][rule_index(r, rule::MATCHED)] = matched;
            s[1][rule_index(r, rule::BANS)] = power(r * 8 + 6);
        }
        // The daemon's own counters too, each a power of two of its own.
        let gauges = Gauges {
            events: events::Counts {
                lost_queue: 1 << 50,
                lost_write: 1 << 51,
                ..GAUGES.events
            },
            http: HttpCounts {
                header_timeouts: 1,
                request_timeouts: 2,
                ..GAUGES.http
            },
            tasks: vec![("a", true, 1), ("b", true, 2), ("c", false, 4)],
            saved_bans: [
                ("restored", 1),
                ("pinned", 2),
                ("expired", 4),
                ("rule_gone", 8),
                ("failed", 16),
            ],
            ..GAUGES
        };
        let text = render_metrics(&stats_of(&s, &["a", "b"]), &gauges);
        let (_, samples) = parse(&text);
        let mut checked = 0;
        for (i, sample) in samples.iter().enumerate() {
            if sample.kind != "counter" || sample.value == 0.0 {
                continue;
            }
            for (label, _) in &sample.labels {
                let rest = |x: &Sample| {
                    let mut l: Vec<(String, String)> = x
                        .labels
                        .iter()
                        .filter(|(k, _)| k != label)
                        .cloned()
                        .collect();
                    l.sort();
                    l
                };
                let siblings: Vec<f64> = samples
                    .iter()
                    .enumerate()
                    .filter(|(j, x)| *j != i && x.name == sample.name && rest(x) == rest(sample))
                    .map(|(_, x)| x.value)
                    .collect();
                if let Some(parts) = is_a_sum_of(sample.value, &siblings) {
                    panic!(
                        "{} {:?} = {} is the sum of others over {label}: {parts:?}\n{text}",
                        sample.name, sample.labels, sample.value
                    );
                }
                checked += 1;
            }
        }
        assert!(checked > 50, "{checked} series checked");
    }

    /// Every counter of the program is in `/metrics` exactly once: a verdict in
    /// `ratelimit_packets_total`, a packet reason in `ratelimit_reason_packets_total`, any
    /// other reason in a family of its own. A counter added to `stats::global` fails here
    /// until it is given its place.
    #[test]
    fn http_metrics_export_every_counter_once() {
        let classified: Vec<u32> = (0..global::VERDICTS)
            .chain(PACKET_REASONS)
            .chain(NON_PACKET_REASONS.iter().map(|r| r.0))
            .chain([global::EVENTS_LOST])
            .collect();
        let mut sorted = classified.clone();
        sorted.sort();
        assert_eq!(
            sorted,
            (0..global::COUNT).collect::<Vec<_>>(),
            "each counter of stats::global classified once"
        );
        // Each counter of one interface's slot a value of its own: each value is in exactly
        // one packet series.
        let mut s = raw_slots();
        let value = |k: u32| 1000 + u64::from(k);
        for k in 0..global::COUNT {
            s[1][k as usize] = pb(value(k), 0);
        }
        let text = render_metrics(&stats_of(&s, &[]), &GAUGES);
        let (_, samples) = parse(&text);
        for k in 0..global::COUNT {
            let found: Vec<_> = samples
                .iter()
                .filter(|x| x.value == value(k) as f64 && !x.family.ends_with("_bytes"))
                .collect();
            assert_eq!(found.len(), 1, "{}: {found:?}", global::NAMES[k as usize]);
            let in_packets = found[0].family.ends_with("_packets");
            assert_eq!(
                in_packets,
                k < global::VERDICTS || PACKET_REASONS.contains(&k),
                "{} in {}",
                global::NAMES[k as usize],
                found[0].family
            );
        }
    }

    #[test]
    fn http_metrics_evictions_and_empty_map() {
        let mut stats = synthetic();
        stats.all.reasons.insert("state_evicted".into(), pb(0, 0));
        let text = render_metrics(
            &stats,
            &Gauges {
                tracked_clients: 5,
                tracked_clients_capacity: 0,
                ..GAUGES
            },
        );
        let l = lines(&text);
        assert!(
            l.contains(&"ratelimit_client_states_evicted_total 0"),
            "{text}"
        );
        assert!(
            l.contains(&"ratelimit_map_fill_ratio{map=\"clients\"} 0.0"),
            "{text}"
        );
    }

    #[test]
    fn http_metrics_escape_label_values() {
        let mut stats = synthetic();
        stats.rules[0].name = "a\"b\\c".into();
        let text = render_metrics(&stats, &GAUGES);
        assert!(
            text.contains("ratelimit_rule_bans_issued_total{rule=\"a\\\"b\\\\c\"} 2"),
            "{text}"
        );
        let (_, samples) = parse(&text);
        assert!(
            samples
                .iter()
                .any(|s| s.labels.contains(&("rule".into(), "a\"b\\c".into()))),
            "{text}"
        );
    }

    fn top(q: &str) -> Result<serde_json::Value, String> {
        let uri: Uri = format!("/v1/top{q}").parse().unwrap();
        parse_top(&uri).map(|r| serde_json::to_value(r).unwrap())
    }

    #[test]
    fn http_top_query_parsing() {
        let want = |n: usize, by: &str| serde_json::json!({"cmd": "top", "n": n, "by": by});
        assert_eq!(top(""), Ok(want(10, "packets")));
        assert_eq!(top("?"), Ok(want(10, "packets")));
        assert_eq!(top("?n=5"), Ok(want(5, "packets")));
        assert_eq!(top("?by=drops"), Ok(want(10, "drops")));
        assert_eq!(top("?n=3&by=bytes"), Ok(want(3, "bytes")));
        assert_eq!(top("?by=packets&n=0"), Ok(want(0, "packets")));
        assert_eq!(top("?n=10000"), Ok(want(MAX_TOP_N, "packets")));
        for bad in [
            "?n=10001",
            "?n=18446744073709551615",
            "?n=-1",
            "?n=x",
            "?n=",
            "?by=rate",
            "?by=Bytes",
            "?limit=3",
            "?n=1&n=2",
        ] {
            let e = top(bad).expect_err(bad);
            assert!(
                e.contains("expected /v1/top?n=N&by=packets|bytes|drops"),
                "{e}"
            );
        }
        assert!(top("?by=rate").unwrap_err().contains("rate"));
    }

    /// A daemon stand-in: records the requests, answers with canned reports (`n` clients for
    /// `top`, 30 offenders), after `delay`.
    #[derive(Clone, Default)]
    struct Fake(Arc<Mutex<Vec<serde_json::Value>>>, Duration);

    impl Backend for Fake {
        async fn request(&self, req: Request) -> api::Response {
            use api::samples;
            tokio::time::sleep(self.1).await;
            self.0
                .lock()
                .unwrap()
                .push(serde_json::to_value(&req).unwrap());
            api::Response::ok(match req {
                Request::Bans { .. } => return api::Response::err("reading bans: boom"),
                Request::Offenders { limit } => Answer::Offenders(
                    (0..limit.unwrap_or(usize::MAX).min(30) as u64)
                        .map(samples::client)
                        .collect(),
                ),
                Request::Top { n, .. } => Answer::Top((0..n as u64).map(samples::client).collect()),
                Request::Status => Answer::Status(Box::new(samples::status())),
                Request::Stats => Answer::Stats(Box::new(samples::stats())),
                Request::FleetKey { addr, .. } => {
                    let mut k = crate::fleet::key::sample();
                    if addr == "192.0.2.99" {
                        k.busy = Some(crate::fleet::key_reads::busy_message());
                    }
                    Answer::FleetKey(Box::new(k))
                }
                other => panic!("not a report: {other:?}"),
            })
        }
        async fn snapshot(&self) -> anyhow::Result<(Stats, Gauges)> {
            Ok((synthetic(), GAUGES))
        }
    }

    fn serve_fake(
        listener: TcpListener,
        fake: Fake,
        limits: Limits,
    ) -> tokio::task::JoinHandle<anyhow::Result<()>> {
        tokio::spawn(serve_with(listener, fake, limits))
    }

    /// One HTTP/1.1 exchange: (status, head, body).
    async fn exchange(addr: SocketAddr, method: &str, target: &str) -> (u16, String, String) {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let req = format!(
            "{method} {target} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut raw = String::new();
        s.read_to_string(&mut raw).await.unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        let status = head.split(' ').nth(1).unwrap().parse().unwrap();
        (status, head.to_ascii_lowercase(), body.to_string())
    }

    #[tokio::test]
    async fn http_routes_status_codes_and_bodies() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let fake = Fake::default();
        let server = serve_fake(listener, fake.clone(), Limits::DEFAULT);

        let (st, head, body) = exchange(addr, "GET", "/metrics").await;
        assert_eq!(st, 200);
        assert!(
            head.contains("content-type: application/openmetrics-text; version=1.0.0"),
            "{head}"
        );
        assert!(body.contains("ratelimit_up 1\n") && body.ends_with("# EOF\n"));

        // The bodies are the control API's answers, read back as its types.
        use api::samples;
        for (path, req, want) in [
            (
                "/v1/status",
                Request::Status,
                Answer::Status(Box::new(samples::status())),
            ),
            (
                "/v1/stats",
                Request::Stats,
                Answer::Stats(Box::new(samples::stats())),
            ),
        ] {
            let (st, head, body) = exchange(addr, "GET", path).await;
            assert_eq!(st, 200, "{path}: {body}");
            assert!(head.contains("content-type: application/json"), "{head}");
            assert_eq!(Answer::decode(&req, &body).unwrap(), want);
        }

        let (st, _, body) = exchange(addr, "GET", "/v1/top?n=3&by=drops").await;
        assert_eq!(st, 200);
        let top: Vec<report::Client> = serde_json::from_str(&body).unwrap();
        assert_eq!(top, (0..3).map(samples::client).collect::<Vec<_>>());

        let (st, _, body) = exchange(addr, "GET", "/v1/top?by=rate").await;
        assert_eq!(st, 400);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(v["error"].as_str().unwrap().contains("rate"), "{body}");

        // Lists: cut to `limit` (default and most: MAX_LIST), and said so.
        let (st, head, body) = exchange(addr, "GET", "/v1/offenders").await;
        assert_eq!(st, 200, "{body}");
        let v: Vec<report::Client> = serde_json::from_str(&body).unwrap();
        assert_eq!(v.len(), 30);
        assert!(!head.contains("x-truncated"), "{head}");
        let (st, head, body) = exchange(addr, "GET", "/v1/offenders?limit=5").await;
        assert_eq!(st, 200, "{body}");
        let v: Vec<report::Client> = serde_json::from_str(&body).unwrap();
        assert_eq!(v, (0..5).map(samples::client).collect::<Vec<_>>());
        assert!(head.contains("x-truncated: true"), "{head}");
        for bad in [
            "/v1/offenders?limit=10001",
            "/v1/offenders?limit=x",
            "/v1/bans?n=3",
            "/v1/top?n=10001",
        ] {
            let (st, _, body) = exchange(addr, "GET", bad).await;
            assert_eq!(st, 400, "{bad}: {body}");
        }

        let (st, _, body) = exchange(addr, "GET", "/v1/bans").await;
        assert_eq!(st, 500);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v, serde_json::json!({"error": "reading bans: boom"}));

        let (st, _, body) = exchange(addr, "GET", "/v1/nope").await;
        assert_eq!(st, 404);
        assert!(body.contains("/v1/offenders"), "{body}");
        let (st, _, _) = exchange(addr, "GET", "/v1/stats/").await;
        assert_eq!(st, 404);

        for (method, path) in [
            ("POST", "/v1/bans"),
            ("DELETE", "/v1/bans"),
            ("PUT", "/metrics"),
        ] {
            let (st, head, body) = exchange(addr, method, path).await;
            assert_eq!(st, 405, "{method} {path}");
            assert!(head.contains("allow: get,head"), "{head}");
            assert!(body.contains("read-only"), "{body}");
        }

        // Only the GETs above reached the daemon: no 400/404/405 did.
        let seen: Vec<_> = fake.0.lock().unwrap().clone();
        let cmd = |c: &str| serde_json::json!({ "cmd": c });
        assert_eq!(
            seen,
            [
                cmd("status"),
                cmd("stats"),
                serde_json::json!({"cmd": "top", "n": 3, "by": "drops"}),
                serde_json::json!({"cmd": "offenders", "limit": MAX_LIST + 1}),
                serde_json::json!({"cmd": "offenders", "limit": 6}),
                serde_json::json!({"cmd": "bans", "limit": MAX_LIST + 1}),
            ]
        );
        server.abort();
    }

    /// Whether the server closed `s` within `within`, reading whatever it sent first.
    async fn closed_within(s: &mut tokio::net::TcpStream, within: Duration) -> bool {
        let mut buf = Vec::new();
        matches!(
            tokio::time::timeout(within, s.read_to_end(&mut buf)).await,
            Ok(Ok(_) | Err(_))
        )
    }

    const SHORT: Limits = Limits {
        max_connections: 2,
        metrics_slots: 0,
        max_per_peer: 2,
        header_read_timeout: Duration::from_millis(300),
        request_timeout: Duration::from_millis(300),
        max_connection_age: Duration::from_secs(60),
    };

    #[tokio::test]
    async fn http_fleet_key_beyond_the_store_s_read_bound_is_a_429_with_retry_after() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = serve_fake(listener, Fake::default(), Limits::DEFAULT);
        let (st, _, body) = exchange(addr, "GET", "/v1/fleet/key?addr=198.51.100.7").await;
        assert_eq!(st, 200, "{body}");
        let (st, head, body) = exchange(addr, "GET", "/v1/fleet/key?addr=192.0.2.99").await;
        assert_eq!(st, 429, "{body}");
        assert!(head.contains("retry-after: 1"), "{head}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(
            v["error"]
                .as_str()
                .is_some_and(|e| e.contains("at most 10 times a second")),
            "{body}"
        );
        server.abort();
    }

    #[tokio::test]
    async fn http_connections_over_the_cap_are_closed_at_once_and_idle_ones_in_time() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let conns = {
            let fake = Fake::default();
            serve_fake(listener, fake, SHORT)
        };
        let connect = || tokio::net::TcpStream::connect(addr);
        let start = Instant::now();
        let (mut a, mut b) = (connect().await.unwrap(), connect().await.unwrap());
        // Give the listener time to take both before the third arrives.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut c = connect().await.unwrap();
        assert!(
            closed_within(&mut c, Duration::from_millis(200)).await,
            "a third connection is closed at once"
        );
        // A slow client: half its headers, never the rest.
        b.write_all(b"GET /v1/status HTTP/1.1\r\nHo").await.unwrap();
        for s in [&mut a, &mut b] {
            assert!(closed_within(s, Duration::from_secs(5)).await);
        }
        let took = start.elapsed();
        assert!(
            took >= SHORT.header_read_timeout && took < Duration::from_secs(3),
            "closed after {took:?}"
        );
        // The slots are free again: a request is answered, and the counts say what happened.
        let (st, _, body) = exchange(addr, "GET", "/metrics").await;
        assert_eq!(st, 200);
        for want in [
            "ratelimit_http_connections_rejected_total 1",
            "ratelimit_http_timeouts_total{phase=\"headers\"} 2",
            "ratelimit_http_connections_open 1",
        ] {
            assert!(body.lines().any(|l| l == want), "{want} in\n{body}");
        }
        conns.abort();
    }

    #[tokio::test]
    async fn http_a_request_the_daemon_is_too_busy_for_is_a_503_in_time() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let fake = Fake(Arc::default(), Duration::from_secs(30));
        let server = serve_fake(listener, fake, SHORT);
        let start = Instant::now();
        let (st, _, body) = exchange(addr, "GET", "/v1/status").await;
        assert_eq!(st, 503, "{body}");
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(body.contains("did not answer within"), "{body}");
        server.abort();
    }

    #[tokio::test]
    async fn http_bind_address_in_use_is_explained() {
        let first = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = first.local_addr().unwrap();
        let e = bind(addr).await.unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "http_listen {addr}: address in use; set [daemon] http_listen to another address or \"off\""
            )
        );
    }
}
