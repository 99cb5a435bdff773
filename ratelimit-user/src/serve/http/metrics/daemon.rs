//! The daemon's own workings: the events writer, the HTTP listener, the background tasks,
//! and that it is up (and its version).

use prometheus_client::metrics::MetricType::{Counter, Gauge, Info};
use ratelimit_common::stats::global;

use super::{
    Gauges,
    counters::reason,
    openmetrics::{Family, Value},
};
use crate::policy::report::Stats;

/// `ratelimit_events_*`: events lost (by stage), suppressed, written and queued.
pub(super) fn events(stats: &Stats, gauges: &Gauges) -> Vec<Family> {
    vec![
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
    ]
}

/// `ratelimit_http_*`: the listener's connections and timeouts.
pub(super) fn http(gauges: &Gauges) -> Vec<Family> {
    vec![
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
    ]
}

/// `ratelimit_task_*`: each background task's state and restarts.
pub(super) fn tasks(gauges: &Gauges) -> Vec<Family> {
    vec![
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
    ]
}

/// `ratelimit_up` and `ratelimit_build_info`, last.
pub(super) fn up() -> Vec<Family> {
    vec![
        Family::new("ratelimit_up", Gauge, "1 while the daemon answers")
            .with(vec![], Value::Gauge(1)),
        Family::new("ratelimit_build", Info, "The daemon's version").with(
            vec![("version", env!("CARGO_PKG_VERSION").into())],
            Value::Info,
        ),
    ]
}
