//! The listener: bind, accept within the connection caps, serve each connection within its
//! time bounds.

use std::{
    convert::Infallible,
    io::ErrorKind,
    net::SocketAddr,
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use anyhow::anyhow;
use axum::{Router, http::StatusCode, response::Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tower::ServiceExt as _;
use tracing::{info, warn};

use super::{
    ACCEPT_WARN_EVERY, Backend, HEADER_READ_TIMEOUT, MAX_CONNECTION_AGE, MAX_CONNECTIONS,
    REQUEST_TIMEOUT,
    conns::{Conns, Served},
    routes::{App, error, router},
};
use crate::serve::http_slots::Slots;

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
pub(super) struct Limits {
    pub(super) max_connections: usize,
    /// Of `max_connections`, kept for `/metrics`.
    pub(super) metrics_slots: usize,
    pub(super) max_per_peer: usize,
    pub(super) header_read_timeout: Duration,
    pub(super) request_timeout: Duration,
    pub(super) max_connection_age: Duration,
}

impl Limits {
    pub(super) const DEFAULT: Limits = Limits {
        max_connections: MAX_CONNECTIONS,
        metrics_slots: crate::serve::http_slots::METRICS_SLOTS,
        max_per_peer: crate::serve::http_slots::MAX_PER_PEER,
        header_read_timeout: HEADER_READ_TIMEOUT,
        request_timeout: REQUEST_TIMEOUT,
        max_connection_age: MAX_CONNECTION_AGE,
    };
}

pub(super) async fn serve_with<B: Backend>(
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
