//! The pressure level, its signals and their marks.

use prometheus_client::metrics::MetricType::{Counter, Gauge};

use super::{
    Gauges,
    openmetrics::{Family, Value},
};

/// `ratelimit_pressure_*`: the level, each signal's value and mark, the changes of level.
pub(super) fn families(gauges: &Gauges) -> Vec<Family> {
    vec![
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
    ]
}
