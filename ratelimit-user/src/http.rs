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
//! accepted, and counted), a client has [`HEADER_READ_TIMEOUT`] to send a request's headers
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
use serde::Deserialize;
use tokio::{net::TcpListener, sync::Semaphore};
use tower::ServiceExt as _;
use tracing::{info, warn};

use crate::{
    control::{self, Request, TopBy},
    daemon::Handle,
    events,
    reader::Reports,
    report::{self, Pb, Stats},
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
     /v1/bans?limit=N, /v1/offenders?limit=N";

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
pub async fn serve(listener: TcpListener, state: Handle) -> anyhow::Result<()> {
    serve_with(listener, state, Limits::DEFAULT).await
}

/// The listener's bounds (the constants above; shorter in tests).
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_connections: usize,
    header_read_timeout: Duration,
    request_timeout: Duration,
    max_connection_age: Duration,
}

impl Limits {
    const DEFAULT: Limits = Limits {
        max_connections: MAX_CONNECTIONS,
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
    /// Connections closed at once because [`MAX_CONNECTIONS`] were open.
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
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let mut last_warn: Option<Instant> = None;
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
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
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            // Closed as soon as accepted: a connection over the cap costs one descriptor for
            // an instant, never a task.
            conns.rejected.fetch_add(1, Ordering::Relaxed);
            drop(stream);
            continue;
        };
        let served = Served::new(conns.clone());
        let service = {
            let (app, conns) = (app.clone(), conns.clone());
            hyper::service::service_fn(move |req| {
                let (app, conns) = (app.clone(), conns.clone());
                let timeout = limits.request_timeout;
                async move { Ok::<_, Infallible>(answer_in_time(app, &conns, req, timeout).await) }
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
trait Backend: Clone + Send + Sync + 'static {
    /// The control API's answer to a (read-only) request.
    fn request(&self, req: Request) -> impl Future<Output = control::Response> + Send;
    /// What `/metrics` shows, read from the maps now (the listener's own counts aside).
    fn snapshot(&self) -> impl Future<Output = anyhow::Result<(Stats, Gauges)>> + Send;
}

impl Backend for Handle {
    async fn request(&self, req: Request) -> control::Response {
        Handle::request(self, req).await
    }

    async fn snapshot(&self) -> anyhow::Result<(Stats, Gauges)> {
        self.reports.with_turn(snapshot).await?
    }
}

/// The router's state: the daemon, and the listener's counts for `/metrics`.
#[derive(Clone)]
struct App<B> {
    backend: B,
    conns: Arc<Conns>,
}

/// Read everything `/metrics` shows, in one go, on the reports' own map handles.
fn snapshot(s: &Reports) -> anyhow::Result<(Stats, Gauges)> {
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
    };
    Ok((stats, gauges))
}

/// The values of `/metrics` that are not counters of the `STATS` array.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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
}

#[derive(Debug)]
enum Value {
    Counter(u64),
    Gauge(u64),
    Ratio(f64),
    /// An OpenMetrics info metric (a family's only series): value 1, the labels carry the
    /// information.
    Info,
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
        Value::Ratio(v) => ConstGauge::new(*v).encode(metric),
        Value::Info => {
            debug_assert!(false, "an info metric has exactly one series");
            Ok(())
        }
    }
}

fn reason(stats: &Stats, name: &str) -> u64 {
    stats.all.reasons.get(name).map_or(0, |pb| pb.packets)
}

/// The `/metrics` exposition (OpenMetrics text, `# EOF` included) of one reading of the maps.
pub fn render_metrics(stats: &Stats, gauges: &Gauges) -> String {
    use MetricType::{Counter, Gauge, Info};

    let mut packets = Family::new(
        "ratelimit_packets",
        Counter,
        "Frames seen by the XDP program, by verdict and interface (interface=all: every interface); each frame has exactly one verdict",
    );
    let mut bytes = Family::new(
        "ratelimit_bytes",
        Counter,
        "Bytes of the frames seen by the XDP program, by verdict and interface (interface=all: every interface)",
    );
    let by_iface = stats
        .interfaces
        .iter()
        .map(|i| (i.iface.as_str(), &i.counters))
        .chain([("all", &stats.all)]);
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

    let mut reasons = Family::new(
        "ratelimit_reason_packets",
        Counter,
        "Detail counters beside the verdicts, by reason (a frame may be in several or none)",
    );
    for (name, pb) in &stats.all.reasons {
        reasons = reasons.with(
            vec![("reason", name.to_string())],
            Value::Counter(pb.packets),
        );
    }

    let mut rule_packets = Family::new(
        "ratelimit_rule_packets",
        Counter,
        "Packets counted by each rule, by counter (matched = admitted + dropped + would_drop + exceed_passed; bans = bans issued)",
    );
    let mut rule_bytes = Family::new(
        "ratelimit_rule_bytes",
        Counter,
        "Bytes counted by each rule, by counter",
    );
    for r in &stats.rules {
        for (counter, Pb { packets, bytes }) in &r.counters {
            let labels = || vec![("rule", r.name.clone()), ("counter", counter.to_string())];
            rule_packets = rule_packets.with(labels(), Value::Counter(*packets));
            rule_bytes = rule_bytes.with(labels(), Value::Counter(*bytes));
        }
    }

    let tracked = gauges.tracked_clients;
    let capacity = gauges.tracked_clients_capacity;
    let fill = if capacity == 0 {
        0.0
    } else {
        tracked as f64 / capacity as f64
    };
    // The program counts each state that took another's slot (the one idle longest in its
    // set of the per-source store).
    let evictions = reason(stats, "state_evicted");

    let families = vec![
        packets,
        bytes,
        reasons,
        rule_packets,
        rule_bytes,
        Family::new(
            "ratelimit_active_bans",
            Gauge,
            "Bans in force now (operator- and rule-issued)",
        )
        .with(vec![], Value::Gauge(gauges.active_bans)),
        Family::new(
            "ratelimit_bans_issued",
            Counter,
            "Bans issued by rate_based_ban rules",
        )
        .with(vec![], Value::Counter(reason(stats, "bans_issued"))),
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
            "ratelimit_evictions",
            Counter,
            "Per-client states evicted: a new source took the slot of the state idle longest in its set of the full per-source store",
        )
        .with(vec![], Value::Counter(evictions)),
        Family::new(
            "ratelimit_admission_refused",
            Counter,
            "Packets from new sources refused per-client state by the admission budget (tracking.new_sources_per_sec); they are limited in aggregate",
        )
        .with(vec![], Value::Counter(reason(stats, "admission_refused"))),
        Family::new(
            "ratelimit_events_lost",
            Counter,
            "Events that never became a line, by where they were lost: the program found the ring buffer full, the daemon's queue to the events writer was full, or writing the line failed",
        )
        .with(
            vec![("stage", "ring_buffer".into())],
            Value::Counter(reason(stats, "events_lost")),
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
        Family::new("ratelimit_up", Gauge, "1 while the daemon answers")
            .with(vec![], Value::Gauge(1)),
        Family::new("ratelimit_build", Info, "The daemon's version").with(
            vec![("version", env!("CARGO_PKG_VERSION").into())],
            Value::Info,
        ),
    ];

    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot(families)));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .expect("writing to a String does not fail");
    out
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
async fn ask<B: Backend>(
    backend: &B,
    req: Request,
) -> Result<Box<serde_json::value::RawValue>, Response> {
    let resp = backend.request(req).await;
    if resp.ok {
        Ok(resp.data)
    } else {
        let msg = resp.error.unwrap_or_else(|| "request failed".into());
        warn!("HTTP read-only request failed: {msg}");
        Err(error(StatusCode::INTERNAL_SERVER_ERROR, msg))
    }
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
    let data = match ask(backend, req).await {
        Ok(data) => data,
        Err(resp) => return resp,
    };
    let mut items: Vec<&serde_json::value::RawValue> = match serde_json::from_str(data.get()) {
        Ok(items) => items,
        Err(e) => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the daemon's answer is not a list: {e}"),
            );
        }
    };
    let truncated = items.len() > limit;
    items.truncate(limit);
    let mut resp = (StatusCode::OK, Json(items)).into_response();
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
        .fallback(not_found)
        // After the routes: it applies to those registered before it.
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(app)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;
    use crate::report::{Counters, IfaceCounters, RuleCounters};

    fn pb(packets: u64, bytes: u64) -> Pb {
        Pb { packets, bytes }
    }

    fn counters(pass: Pb, drop_rule: Pb) -> Counters {
        let mut c = Counters::default();
        c.verdicts.insert("pass", pass);
        c.verdicts.insert("drop_rule", drop_rule);
        c.total = pass;
        c.total += drop_rule;
        c
    }

    fn synthetic() -> Stats {
        let mut all = counters(pb(30, 3000), pb(7, 700));
        all.reasons.insert("state_created", pb(12, 0));
        all.reasons.insert("state_evicted", pb(7, 0));
        all.reasons.insert("bans_issued", pb(2, 0));
        all.reasons.insert("admission_refused", pb(4, 240));
        all.reasons.insert("events_lost", pb(1, 0));
        Stats {
            all,
            interfaces: vec![
                IfaceCounters {
                    iface: "eth0".into(),
                    slot: 1,
                    counters: counters(pb(20, 2000), pb(7, 700)),
                },
                IfaceCounters {
                    iface: "eth1".into(),
                    slot: 2,
                    counters: counters(pb(10, 1000), pb(0, 0)),
                },
            ],
            rules: vec![RuleCounters {
                name: "syn-per-client".into(),
                counters: [
                    ("matched", pb(9, 900)),
                    ("admitted", pb(2, 200)),
                    ("dropped", pb(7, 700)),
                    ("bans", pb(2, 0)),
                ]
                .into_iter()
                .collect(),
            }],
        }
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
    };

    fn lines(text: &str) -> Vec<&str> {
        text.lines().collect()
    }

    #[test]
    fn http_metrics_render_exact_series() {
        let gauges = Gauges {
            tasks: vec![("ban_persistence", true, 0), ("events", false, 3)],
            ..GAUGES
        };
        let text = render_metrics(&synthetic(), &gauges);
        let l = lines(&text);
        for want in [
            "# HELP ratelimit_packets Frames seen by the XDP program, by verdict and interface (interface=all: every interface); each frame has exactly one verdict",
            "# TYPE ratelimit_packets counter",
            "ratelimit_packets_total{verdict=\"drop_rule\",interface=\"eth0\"} 7",
            "ratelimit_packets_total{verdict=\"pass\",interface=\"eth1\"} 10",
            "ratelimit_packets_total{verdict=\"pass\",interface=\"all\"} 30",
            "ratelimit_bytes_total{verdict=\"drop_rule\",interface=\"all\"} 700",
            "ratelimit_reason_packets_total{reason=\"admission_refused\"} 4",
            "ratelimit_rule_packets_total{rule=\"syn-per-client\",counter=\"dropped\"} 7",
            "ratelimit_rule_bytes_total{rule=\"syn-per-client\",counter=\"matched\"} 900",
            "# TYPE ratelimit_active_bans gauge",
            "ratelimit_active_bans 3",
            "ratelimit_bans_issued_total 2",
            "ratelimit_tracked_clients 5",
            "ratelimit_tracked_clients_capacity 20",
            "ratelimit_map_fill_ratio{map=\"clients\"} 0.25",
            "ratelimit_map_fill_ratio{map=\"known_filter\"} 0.25",
            "ratelimit_evictions_total 7",
            "ratelimit_admission_refused_total 4",
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
        // Series in a stable order: per interface, then all; verdicts sorted by name.
        let packets: Vec<_> = l
            .iter()
            .filter(|s| s.starts_with("ratelimit_packets_total"))
            .collect();
        assert_eq!(
            packets,
            [
                &"ratelimit_packets_total{verdict=\"drop_rule\",interface=\"eth0\"} 7",
                &"ratelimit_packets_total{verdict=\"pass\",interface=\"eth0\"} 20",
                &"ratelimit_packets_total{verdict=\"drop_rule\",interface=\"eth1\"} 0",
                &"ratelimit_packets_total{verdict=\"pass\",interface=\"eth1\"} 10",
                &"ratelimit_packets_total{verdict=\"drop_rule\",interface=\"all\"} 7",
                &"ratelimit_packets_total{verdict=\"pass\",interface=\"all\"} 30",
            ]
        );
        // Every family has one HELP and one TYPE line.
        for f in [
            "ratelimit_packets ",
            "ratelimit_evictions ",
            "ratelimit_map_fill_ratio ",
        ] {
            assert_eq!(
                l.iter()
                    .filter(|s| s.starts_with(&format!("# TYPE {f}")))
                    .count(),
                1
            );
        }
    }

    #[test]
    fn http_metrics_evictions_and_empty_map() {
        let mut stats = synthetic();
        stats.all.reasons.insert("state_evicted", pb(0, 0));
        let text = render_metrics(
            &stats,
            &Gauges {
                tracked_clients: 5,
                tracked_clients_capacity: 0,
                ..GAUGES
            },
        );
        let l = lines(&text);
        assert!(l.contains(&"ratelimit_evictions_total 0"), "{text}");
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
            text.contains("ratelimit_rule_packets_total{rule=\"a\\\"b\\\\c\",counter=\"bans\"} 2"),
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

    /// A daemon stand-in: records the requests, answers with canned data (30 offenders), after
    /// `delay`.
    #[derive(Clone, Default)]
    struct Fake(Arc<Mutex<Vec<serde_json::Value>>>, Duration);

    impl Backend for Fake {
        async fn request(&self, req: Request) -> control::Response {
            tokio::time::sleep(self.1).await;
            let v = serde_json::to_value(&req).unwrap();
            self.0.lock().unwrap().push(v.clone());
            match req {
                Request::Bans { .. } => control::Response::err("reading bans: boom"),
                Request::Offenders { limit } => control::Response::ok(
                    (0..limit.unwrap_or(usize::MAX).min(30))
                        .map(|i| serde_json::json!({ "i": i }))
                        .collect::<Vec<_>>(),
                ),
                _ => control::Response::ok(serde_json::json!({ "echo": v })),
            }
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

        for (path, cmd) in [("/v1/status", "status"), ("/v1/stats", "stats")] {
            let (st, head, body) = exchange(addr, "GET", path).await;
            assert_eq!(st, 200, "{path}: {body}");
            assert!(head.contains("content-type: application/json"), "{head}");
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            assert_eq!(v, serde_json::json!({"echo": {"cmd": cmd}}));
        }

        let (st, _, body) = exchange(addr, "GET", "/v1/top?n=3&by=drops").await;
        assert_eq!(st, 200);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"echo": {"cmd": "top", "n": 3, "by": "drops"}})
        );

        let (st, _, body) = exchange(addr, "GET", "/v1/top?by=rate").await;
        assert_eq!(st, 400);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert!(v["error"].as_str().unwrap().contains("rate"), "{body}");

        // Lists: cut to `limit` (default and most: MAX_LIST), and said so.
        let (st, head, body) = exchange(addr, "GET", "/v1/offenders").await;
        assert_eq!(st, 200, "{body}");
        let v: Vec<serde_json::Value> = serde_json::from_str(&body).unwrap();
        assert_eq!(v.len(), 30);
        assert!(!head.contains("x-truncated"), "{head}");
        let (st, head, body) = exchange(addr, "GET", "/v1/offenders?limit=5").await;
        assert_eq!(st, 200, "{body}");
        let v: Vec<serde_json::Value> = serde_json::from_str(&body).unwrap();
        assert_eq!(
            v,
            (0..5)
                .map(|i| serde_json::json!({ "i": i }))
                .collect::<Vec<_>>()
        );
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
        header_read_timeout: Duration::from_millis(300),
        request_timeout: Duration::from_millis(300),
        max_connection_age: Duration::from_secs(60),
    };

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
