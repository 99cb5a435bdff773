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
//!
//! The listener and its bounds are in [`listener`], the connections' counts in [`conns`], the
//! routes and their handlers in [`routes`], and the exposition of `/metrics` in [`metrics`].

mod conns;
mod listener;
mod metrics;
mod routes;

use std::{future::Future, time::Duration};

use crate::{
    api::{self, Request},
    policy::report::Stats,
};

pub use conns::HttpCounts;
pub use listener::{bind, serve};
pub use metrics::{FleetGauges, Gauges, render_metrics, snapshot};

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

/// What the routes need from the daemon. A trait so the routing can be tested without maps.
pub trait Backend: Clone + Send + Sync + 'static {
    /// The control API's answer to a (read-only) request.
    fn request(&self, req: Request) -> impl Future<Output = api::Response> + Send;
    /// What `/metrics` shows, read from the maps now (the listener's own counts aside).
    fn snapshot(&self) -> impl Future<Output = anyhow::Result<(Stats, Gauges)>> + Send;
}

#[cfg(test)]
mod tests;
