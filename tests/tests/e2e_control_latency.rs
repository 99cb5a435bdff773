//! The control plane under load: `ratelimit status` answers within 100 ms (p99) while a
//! million clients are tracked, `/metrics` is scraped every 100 ms, a thousand idle HTTP
//! connections are open, and new sources keep arriving (so no count the reports keep can be
//! reused for long). The load is `control_load`'s, which the benchmark measures too; the
//! figures are printed for BENCHMARKS.md.

use std::time::Duration;

use ratelimit_tests::{
    control_load::{self, Load},
    kernel_test,
    scenario::Scenario,
};

const HTTP_PORT: u16 = 9478;
/// The bound on the 99th percentile of `status`.
const P99_BOUND: Duration = Duration::from_millis(100);

#[test]
fn status_answers_within_100ms_p99_over_a_million_clients_while_metrics_are_scraped() {
    kernel_test!();
    let load = Load::FULL;
    let mut s = Scenario::new("rlcl").with_http(HTTP_PORT);
    s.start(&load.config());
    let f = control_load::measure(&s, HTTP_PORT, load);
    println!(
        "{} clients tracked after {:.1} s; {} idle HTTP connections opened",
        f.tracked, f.fill_secs, f.idle_connections
    );
    println!("{}", f.summary());
    assert!(
        f.metrics_us.len() >= 10,
        "{} scrapes answered, {} turned away",
        f.metrics_us.len(),
        f.metrics_failed
    );
    assert!(
        f.status_p99_ms < P99_BOUND.as_secs_f64() * 1000.0,
        "status p99 {:.2} ms over {P99_BOUND:?}",
        f.status_p99_ms
    );
}
