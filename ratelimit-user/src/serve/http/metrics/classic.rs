//! The format `/metrics` answers in, chosen from the scraper's `Accept` header as the official
//! client libraries choose it (Go's `promhttp`): OpenMetrics text when the scraper prefers it,
//! Prometheus' classic text format (0.0.4) otherwise, and [`to_classic`], which rewrites the
//! OpenMetrics exposition into the classic one.
//!
//! The two differ in how a family is named, not in its samples: an OpenMetrics counter family
//! `x` has samples `x_total` and an info family `x` a sample `x_info`, where the classic format
//! names the family by its sample (`# TYPE x_total counter`; an info is a gauge `x_info`);
//! the classic format has no `# UNIT` and no `# EOF`. A classic parser that meets OpenMetrics
//! text instead (promtool 2.42's `check metrics`) refuses the info type and finds no help
//! text for every counter.

/// OpenMetrics text's content type.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The classic text format's content type.
pub const CLASSIC: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether a scraper that sent `accept` (if any) gets OpenMetrics: the media type of highest
/// quality it accepts, the first written among equals, decides; one without the header, or
/// that accepts neither, gets the classic format.
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    let Some(accept) = accept else {
        return false;
    };
    let mut best: Option<(f64, bool)> = None;
    for range in accept.split(',') {
        let mut parts = range.split(';').map(str::trim);
        let media = parts.next().unwrap_or("").to_ascii_lowercase();
        let q = parts
            .filter_map(|p| p.split_once('='))
            .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
            .map_or(1.0, |(_, v)| v.trim().parse::<f64>().unwrap_or(0.0));
        let openmetrics = match media.as_str() {
            "application/openmetrics-text" => true,
            "text/plain" | "text/*" | "*/*" => false,
            _ => continue,
        };
        if q > 0.0 && best.is_none_or(|(b, _)| q > b) {
            best = Some((q, openmetrics));
        }
    }
    best.is_some_and(|(_, openmetrics)| openmetrics)
}

/// The classic text format of the OpenMetrics exposition `om` (as `openmetrics::encode`
/// writes it: `# HELP`, then `# TYPE`, then any `# UNIT`, then the samples, per family).
pub fn to_classic(om: &str) -> String {
    let mut out = String::with_capacity(om.len());
    let mut help: Option<(&str, &str)> = None;
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = Some(rest.split_once(' ').unwrap_or((rest, "")));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (name, kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "info" => (format!("{name}_info"), "gauge"),
                "unknown" => (name.to_string(), "untyped"),
                k => (name.to_string(), k),
            };
            if let Some((_, text)) = help.take() {
                out.push_str(&format!("# HELP {name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
            continue;
        }
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scrapers_preference_decides_the_format() {
        // Prometheus 2.x's header, then promtool's and curl's (none, or */*).
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(Some(prometheus)));
        assert!(!wants_openmetrics(None));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(Some("text/plain;version=0.0.4")));
        assert!(wants_openmetrics(Some(
            "Application/OpenMetrics-Text; version=1.0.0"
        )));
        assert!(!wants_openmetrics(Some(
            "application/openmetrics-text;q=0.5,text/plain"
        )));
        assert!(wants_openmetrics(Some(
            "text/plain;q=0.5,application/openmetrics-text"
        )));
        assert!(!wants_openmetrics(Some("application/openmetrics-text;q=0")));
        assert!(!wants_openmetrics(Some("application/json")));
        // Equal quality: the first written.
        assert!(!wants_openmetrics(Some(
            "text/plain,application/openmetrics-text"
        )));
        assert!(!wants_openmetrics(Some(
            "application/openmetrics-text;q=abc,text/plain;q=0.1"
        )));
    }

    #[test]
    fn families_are_named_by_their_samples() {
        let om = "\
# HELP ratelimit_packets Packets seen.
# TYPE ratelimit_packets counter
ratelimit_packets_total{reason=\"pass\"} 3
# HELP ratelimit_build Build information.
# TYPE ratelimit_build info
ratelimit_build_info{version=\"0.1.0\"} 1
# HELP ratelimit_age_seconds Age.
# TYPE ratelimit_age_seconds gauge
# UNIT ratelimit_age_seconds seconds
ratelimit_age_seconds 1.5
# HELP ratelimit_lat_seconds Latency.
# TYPE ratelimit_lat_seconds histogram
ratelimit_lat_seconds_sum 0.5
ratelimit_lat_seconds_count 1
ratelimit_lat_seconds_bucket{le=\"+Inf\"} 1
# EOF
";
        assert_eq!(
            to_classic(om),
            "\
# HELP ratelimit_packets_total Packets seen.
# TYPE ratelimit_packets_total counter
ratelimit_packets_total{reason=\"pass\"} 3
# HELP ratelimit_build_info Build information.
# TYPE ratelimit_build_info gauge
ratelimit_build_info{version=\"0.1.0\"} 1
# HELP ratelimit_age_seconds Age.
# TYPE ratelimit_age_seconds gauge
ratelimit_age_seconds 1.5
# HELP ratelimit_lat_seconds Latency.
# TYPE ratelimit_lat_seconds histogram
ratelimit_lat_seconds_sum 0.5
ratelimit_lat_seconds_count 1
ratelimit_lat_seconds_bucket{le=\"+Inf\"} 1
"
        );
    }
}
