//! A real Prometheus server scrapes the real daemon while real packets cross the veth pair,
//! and PromQL over what it stored agrees exactly with what was sent and with what the
//! independent receivers saw: `sum(ratelimit_packets_total)` is every frame once (no
//! `interface="all"` series beside the interfaces' to count it twice), and the sums by
//! verdict, rule outcome and bytes come out as the traffic says.
//!
//! The server runs in the protected namespace beside the daemon and scrapes its HTTP listener
//! there every second; the test reads the server's API from the same namespace. It needs
//! the `prometheus` binary (Debian package prometheus, installed by `cargo xtask setup`).

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::{Duration, SystemTime},
};

use ratelimit_tests::{kernel_test, prometheus::Prometheus, scenario::Scenario, silence};

/// The daemon's HTTP listener and the Prometheus server, on 127.0.0.1 in the protected
/// namespace (a namespace of the test's own: no port of the host is used).
const HTTP_PORT: u16 = 19477;
const PROMETHEUS_PORT: u16 = 9090;
const PORT: u16 = 9000;
/// The longest wait for a scrape of the counters as they are after the traffic: several
/// scrape intervals, for a loaded machine.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(30);

fn ip4(c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(198, 19, c, d))
}

const POLICY: &str = r#"
[lists]
deny = ["198.19.60.0/24"]

[[rule]]
name = "udp"
match = { protocol = "udp", dst_ports = ["9000"] }
threshold = { count = 100, interval = "1h" }
algorithm = "fixed_window"
"#;

/// `sum by (label) (...)` as a map from the label's value to the sum.
fn by(prom: &Prometheus, label: &str, promql: &str) -> Vec<(String, f64)> {
    let mut v: Vec<(String, f64)> = prom
        .query(&format!("sum by ({label}) ({promql})"))
        .into_iter()
        .map(|s| (s.labels.get(label).cloned().unwrap_or_default(), s.value))
        .filter(|(_, v)| *v != 0.0)
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn prometheus_sums_agree_with_the_packets_sent_and_received() {
    kernel_test!();
    // Before anything is set up: without the binary there is nothing to test.
    ratelimit_tests::prometheus::binary();
    let mut s = Scenario::new("rlprom").with_http(HTTP_PORT);
    // Only the test's frames cross the link, so every frame counted is one the test sent.
    silence(&s.client, &s.pair.a().name);
    s.start(POLICY);
    let localhost = |port| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let prom = Prometheus::start(
        &s.server,
        localhost(PROMETHEUS_PORT),
        &[localhost(HTTP_PORT)],
    );
    // A scrape before any traffic: the server reads the daemon, and nothing was counted.
    prom.wait_for_scrape_after("ratelimit_up", SystemTime::now(), SCRAPE_TIMEOUT);
    assert_eq!(prom.value("sum(ratelimit_packets_total)"), Some(0.0));
    assert_eq!(prom.value("up{job=\"ratelimit\"}"), Some(1.0));

    let (denied, limited, light) = (ip4(60, 1), ip4(61, 1), ip4(62, 1));
    let (n_denied, n_limited, n_light) = (40u64, 250u64, 30u64);
    let sent = n_denied + n_limited + n_light;
    let sink = s.sink(PORT);
    let tap = s.tap();
    let mut tx = s.sender();
    for (src, n) in [(denied, n_denied), (limited, n_limited), (light, n_light)] {
        let stats = tx.send_n(std::iter::repeat(s.udp(src, PORT)), n, None);
        assert_eq!(stats.sent, n, "{src}");
    }
    sink.wait_quiet(Duration::from_millis(300));
    tap.wait_quiet(Duration::from_millis(300));
    let traffic_done = SystemTime::now();
    let got = sink.stop();
    let frames = tap.stop();
    assert_eq!(
        (got.socket_drops, frames.socket_drops),
        (0, 0),
        "the receivers kept up"
    );
    // What the receivers saw: the deny list took one source whole, the rule cut one to its
    // threshold, the light one went through.
    assert_eq!(got.from(denied), 0);
    assert_eq!(got.from(limited), 100);
    assert_eq!(got.from(light), n_light);
    let received = got.total;
    assert_eq!(frames.total, received, "the tap saw only the test's frames");
    let dropped_by_rule = n_limited - got.from(limited);

    prom.wait_for_scrape_after("ratelimit_up", traffic_done, SCRAPE_TIMEOUT);
    let v = |q: &str| prom.value(q).unwrap_or_else(|| panic!("{q}: no result"));
    let n = |x: u64| x as f64;

    // Every frame once: the sum over verdicts and interfaces is what was sent.
    assert_eq!(v("sum(ratelimit_packets_total)"), n(sent));
    assert_eq!(v("sum(ratelimit_bytes_total)"), n(sent * 60));
    assert_eq!(
        by(&prom, "verdict", "ratelimit_packets_total"),
        [
            ("drop_deny".to_string(), n(n_denied)),
            ("drop_rule".to_string(), n(dropped_by_rule)),
            ("pass".to_string(), n(received)),
        ]
    );
    assert_eq!(
        v(r#"sum(ratelimit_packets_total{verdict=~"pass.*"})"#),
        n(frames.total),
        "passed = what the tap on the protected interface saw"
    );
    // One interface, and no aggregate series beside it.
    assert_eq!(
        by(&prom, "interface", "ratelimit_packets_total"),
        [(s.pair.b().name.clone(), n(sent))]
    );
    assert_eq!(
        prom.query(r#"ratelimit_packets_total{interface="all"}"#),
        []
    );
    // The rule saw the two sources the deny list let through, and did one thing with each
    // packet.
    let to_rule = n_limited + n_light;
    assert_eq!(
        v(r#"sum(ratelimit_rule_matched_packets_total{rule="udp"})"#),
        n(to_rule)
    );
    assert_eq!(
        v(r#"sum(ratelimit_rule_packets_total{rule="udp"})"#),
        n(to_rule)
    );
    assert_eq!(
        by(
            &prom,
            "outcome",
            r#"ratelimit_rule_packets_total{rule="udp"}"#
        ),
        [
            ("admitted".to_string(), n(received)),
            ("dropped".to_string(), n(dropped_by_rule)),
        ]
    );
    assert_eq!(
        v(r#"sum(ratelimit_rule_bytes_total{rule="udp"})"#),
        n(to_rule * 60)
    );
    // Not packets, so not in a packet family: the two per-client states are counted as
    // states.
    assert_eq!(v("ratelimit_client_states_created_total"), 2.0);
    assert_eq!(
        prom.query(r#"ratelimit_reason_packets_total{reason="state_created"}"#),
        []
    );
    assert_eq!(v("ratelimit_build_info"), 1.0);

    // Prometheus asked for OpenMetrics; a scraper that does not gets the classic text format,
    // which promtool (Debian 12's 2.42: a classic parser) checks without a complaint.
    let (code, head, body) = s.http_request("/metrics", "");
    assert_eq!(code, 200);
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{head}"
    );
    assert!(!body.contains("# EOF"), "{body}");
    let file = s.daemon().config_dir().join("metrics.txt");
    std::fs::write(&file, &body).unwrap();
    let check = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::fs::File::open(&file).unwrap())
        .output()
        .expect("running promtool");
    assert!(
        check.status.success(),
        "promtool check metrics: {}\n{}{}",
        check.status,
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let (code, head, body) = s.http_request(
        "/metrics",
        "Accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n",
    );
    assert_eq!(code, 200);
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text"),
        "{head}"
    );
    assert!(body.ends_with("# EOF\n"), "{body}");
}
