//! The families of `/metrics` as values, and their encoding by the official client's
//! OpenMetrics text encoder.

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _, MetricEncoder},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
    registry::Registry,
};

#[derive(Debug)]
pub(super) enum Value {
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

pub(super) type Labels = Vec<(&'static str, String)>;

/// One metric family, with its series in the order they are exposed.
#[derive(Debug)]
pub(super) struct Family {
    /// Without the `_total` (counter) or `_info` (info) suffix the encoder adds.
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    series: Vec<(Labels, Value)>,
}

impl Family {
    pub(super) fn new(name: &'static str, kind: MetricType, help: &'static str) -> Self {
        Self {
            name,
            help,
            kind,
            series: Vec::new(),
        }
    }

    pub(super) fn with(mut self, labels: Labels, value: Value) -> Self {
        self.series.push((labels, value));
        self
    }

    pub(super) fn with_some(self, series: Option<(Labels, Value)>) -> Self {
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

/// The exposition (OpenMetrics text, `# EOF` included) of `families`, in their order.
pub(super) fn encode(families: Vec<Family>) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Snapshot(families)));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .expect("writing to a String does not fail");
    out
}
