//! The routes: `/metrics` and the read-only reports under `/v1/`, their queries and bounds,
//! and the answers to what is not a route.

use std::sync::Arc;

use axum::{
    Json, Router,
    extract::{Query, State},
    http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header},
    response::{IntoResponse, Response},
    routing::get,
};
use serde::Deserialize;
use tracing::warn;

use super::{
    Backend, DEFAULT_TOP_N, ENDPOINTS, MAX_LIST, MAX_TOP_N,
    conns::Conns,
    metrics::{classic, render_metrics},
};
use crate::api::{Answer, Request, TopBy};

/// The router's state: the daemon, and the listener's counts for `/metrics`.
#[derive(Clone)]
pub(super) struct App<B> {
    pub(super) backend: B,
    pub(super) conns: Arc<Conns>,
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
pub(super) fn parse_top(uri: &Uri) -> Result<Request, String> {
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
pub(super) fn parse_key(uri: &Uri) -> Result<Request, String> {
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

pub(super) fn error(status: StatusCode, msg: impl Into<String>) -> Response {
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

/// `/metrics`, in the format the scraper prefers (see [`classic`]).
async fn metrics<B: Backend>(State(app): State<App<B>>, headers: HeaderMap) -> Response {
    let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
    match app.backend.snapshot().await {
        Ok((stats, mut gauges)) => {
            gauges.http = app.conns.counts();
            let text = render_metrics(&stats, &gauges);
            if classic::wants_openmetrics(accept) {
                ([(header::CONTENT_TYPE, classic::OPENMETRICS)], text).into_response()
            } else {
                let text = classic::to_classic(&text);
                ([(header::CONTENT_TYPE, classic::CLASSIC)], text).into_response()
            }
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

pub(super) fn router<B: Backend>(app: App<B>) -> Router {
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
