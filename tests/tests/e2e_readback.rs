//! What operators read back: Prometheus metrics and the read-only JSON API agree with the
//! lab's independent receiver, and the events file follows log rotation on SIGHUP.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use ratelimit_tests::{
    kernel_test,
    scenario::{Scenario, metric_sum, rule_counter, verdict},
};
use ratelimit_user::policy::report::{Client, Stats};

const PORT: u16 = 9000;

fn ip4(c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(198, 19, c, d))
}

/// The value of one series in Prometheus text output (labels in any order).
fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        let (n, rest) = series.split_once('{').unwrap_or((series, ""));
        if n != name {
            return None;
        }
        labels
            .iter()
            .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
            .then(|| value.parse().ok())?
    })
}

#[test]
fn metrics_and_json_agree_with_the_receiver() {
    kernel_test!();
    let mut s = Scenario::new("rlh").with_http(19477);
    // Only the test's frames cross the link: the totals below count every frame.
    ratelimit_tests::silence(&s.client, &s.pair.a().name);
    s.start(
        r#"
[lists]
deny = ["198.19.50.0/24"]

[[rule]]
name = "udp"
match = { protocol = "udp", dst_ports = ["9000"] }
threshold = { count = 100, interval = "1h" }
algorithm = "fixed_window"
"#,
    );
    let sink = s.sink(PORT);
    let mut tx = s.sender();
    tx.send_n(std::iter::repeat(s.udp(ip4(50, 1), PORT)), 40, None);
    tx.send_n(std::iter::repeat(s.udp(ip4(51, 1), PORT)), 250, None);
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop();
    assert_eq!(got.from(ip4(51, 1)), 100);
    assert_eq!(got.from(ip4(50, 1)), 0);

    // The counts that take a walk (tracked clients) are the reports' latest census, at most
    // a census period and a walk old: wait for the one that has the new state.
    let give_up = std::time::Instant::now() + Duration::from_secs(10);
    let (code, text) = loop {
        let (code, text) = s.http_get("/metrics");
        if metric(&text, "ratelimit_tracked_clients", &[]) == Some(1.0)
            || std::time::Instant::now() > give_up
        {
            break (code, text);
        }
        std::thread::sleep(ratelimit_user::serve::reader::CENSUS_PERIOD / 2);
    };
    assert_eq!(code, 200, "{text}");
    let m = |name: &str, labels: &[(&str, &str)]| {
        metric(&text, name, labels).unwrap_or_else(|| panic!("{name} {labels:?} missing:\n{text}"))
    };
    let iface = s.pair.b().name.as_str();
    assert_eq!(
        m(
            "ratelimit_packets_total",
            &[("verdict", "drop_deny"), ("interface", iface)]
        ),
        40.0
    );
    // Totals are sums: every frame sent is counted once, in one verdict of one interface.
    assert!(!text.contains("interface=\"all\""), "{text}");
    assert_eq!(metric_sum(&text, "ratelimit_packets_total", &[]), 290.0);
    assert_eq!(
        metric_sum(
            &text,
            "ratelimit_packets_total",
            &[("verdict", "drop_rule")]
        ),
        150.0
    );
    assert_eq!(
        metric_sum(&text, "ratelimit_bytes_total", &[]),
        290.0 * 60.0
    );
    assert_eq!(
        m(
            "ratelimit_packets_total",
            &[
                ("verdict", "drop_rule"),
                ("interface", s.pair.b().name.as_str())
            ]
        ),
        150.0
    );
    assert_eq!(
        m(
            "ratelimit_bytes_total",
            &[("verdict", "drop_deny"), ("interface", iface)]
        ),
        40.0 * 60.0
    );
    assert_eq!(
        m(
            "ratelimit_rule_packets_total",
            &[("rule", "udp"), ("outcome", "admitted")]
        ),
        got.from(ip4(51, 1)) as f64
    );
    assert_eq!(
        m(
            "ratelimit_rule_packets_total",
            &[("rule", "udp"), ("outcome", "dropped")]
        ),
        150.0
    );
    // The rule matched the 250 packets of 198.19.51.1 (the denied ones never reached it),
    // each with one outcome.
    assert_eq!(
        m("ratelimit_rule_matched_packets_total", &[("rule", "udp")]),
        250.0
    );
    assert_eq!(
        metric_sum(&text, "ratelimit_rule_packets_total", &[("rule", "udp")]),
        250.0
    );
    assert_eq!(m("ratelimit_tracked_clients", &[]), 1.0);
    assert_eq!(m("ratelimit_active_bans", &[]), 0.0);
    assert!(metric(&text, "ratelimit_events_lost_total", &[]).is_some());
    assert!(metric(&text, "ratelimit_client_states_evicted_total", &[]).is_some());
    // The known-sources filter was built at the daemon's start, from a map of at most the one
    // state: a few bits of 2^23.
    let fill = m("ratelimit_map_fill_ratio", &[("map", "known_filter")]);
    assert!((0.0..1e-5).contains(&fill), "known filter fill {fill}");

    // The JSON API serves what the CLI shows.
    let (code, body) = s.http_get("/v1/stats");
    assert_eq!(code, 200);
    let v: Stats = serde_json::from_str(&body).unwrap();
    let cli = s.stats();
    assert_eq!(verdict(&v, "drop_deny"), verdict(&cli, "drop_deny"));
    assert_eq!(
        rule_counter(&v, "udp", "dropped"),
        rule_counter(&cli, "udp", "dropped")
    );
    let (code, body) = s.http_get("/v1/top?n=1&by=drops");
    assert_eq!(code, 200);
    let top: Vec<Client> = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (top[0].client.as_str(), top[0].drops),
        ("198.19.51.1/32", 150)
    );
    assert_eq!(s.http_get("/v1/top?by=colour").0, 400);
    assert_eq!(s.http_get("/nope").0, 404);
    for path in ["/v1/status", "/v1/bans", "/v1/offenders"] {
        assert_eq!(s.http_get(path).0, 200, "{path}");
    }
}

#[test]
fn events_file_is_reopened_on_sigusr1() {
    kernel_test!();
    let mut s = Scenario::new("rle");
    s.start(
        r#"
[[rule]]
name = "udp"
match = { protocol = "udp" }
threshold = { count = 10, interval = "1h" }
algorithm = "fixed_window"
"#,
    );
    let mut tx = s.sender();
    tx.send_n(std::iter::repeat(s.udp(ip4(52, 1), PORT)), 20, None);
    std::thread::sleep(Duration::from_millis(500));
    let dir = s.daemon().config_dir().to_path_buf();
    let events = dir.join("events.jsonl");
    let rotated = dir.join("events.jsonl.1");
    std::fs::rename(&events, &rotated).unwrap();
    // SIGUSR1 reopens the events file without a reload (what logrotate sends).
    s.daemon().signal(libc::SIGUSR1);
    std::thread::sleep(Duration::from_millis(500));
    tx.send_n(std::iter::repeat(s.udp(ip4(52, 2), PORT)), 20, None);
    std::thread::sleep(Duration::from_millis(500));
    let old = std::fs::read_to_string(&rotated).unwrap();
    let new = std::fs::read_to_string(&events).unwrap_or_default();
    assert!(
        old.contains("198.19.52.1/32") && !old.contains("198.19.52.2/32"),
        "{old}"
    );
    assert!(
        new.contains("198.19.52.2/32") && !new.contains("198.19.52.1/32"),
        "{new}"
    );
    for line in new.lines() {
        let e: serde_json::Value = serde_json::from_str(line).unwrap();
        for k in [
            "time",
            "event",
            "rule",
            "key",
            "client",
            "count",
            "threshold",
        ] {
            assert!(!e[k].is_null(), "{k} missing in {line}");
        }
    }
}
