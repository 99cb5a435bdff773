//! `fleet key`: two daemons, each in its own namespace with its own veth to a sender, share a
//! global rule's counts through a real `redis-server` in a "store" namespace. One source sends
//! 100 packets to host 0 and 50 to host 1; once the counts are synced, `fleet key` on host 0
//! shows the fleet's total (150) and each host's own count as the store holds them, this
//! host's state with the other host's count added in, and the global thresholds' metrics and
//! status. With the store gone, it still shows this host's part, with a note.

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use ratelimit_tests::{
    fleet_lab::{FleetLab, Setup, fleet_section, udp_rule},
    kernel_test,
    scenario::{metric_sum, rule_counter},
};
use ratelimit_user::fleet::key::KeyReport;

const PORT: u16 = 9000;
const HTTP_PORT: u16 = 19478;
/// The threshold: `L` packets a window of `T_SECS` (nothing sent here reaches it).
const L: u64 = 300;
const T_SECS: u64 = 3;
const SENT: [u64; 2] = [100, 50];
const SRC: Ipv4Addr = Ipv4Addr::new(198, 18, 9, 9);

fn policy(url: &str, host: usize) -> String {
    let (fleet, rule) = (
        fleet_section(url, host),
        udp_rule("udp-global", PORT, L, T_SECS, "global"),
    );
    format!(
        r#"{fleet}
{rule}
[[rule]]
name = "udp-local"
match = {{ protocol = "udp", dst_ports = ["9001"] }}
action = "throttle"
threshold = {{ count = 10, interval = "1s" }}
"#
    )
}

type Fleet = FleetLab;

/// Two hosts, each with [`policy`], on one store.
fn start_fleet(tag: &str) -> Fleet {
    Setup::new(tag)
        .hosts(2)
        .http(HTTP_PORT)
        .start(|i, url| policy(url, i))
}

/// `fleet key` of [`SRC`] on host `i`.
fn key(f: &Fleet, i: usize) -> KeyReport {
    f.hosts[i]
        .daemon()
        .cli_as(&["fleet", "key", &SRC.to_string()])
}

/// The fleet's counts of the key's current and previous window, summed: (total, h0, h1).
fn fleet_counts(k: &KeyReport) -> Option<(u64, u64, u64)> {
    let windows = k.rules.first()?.fleet.as_ref()?;
    let sum = |f: &dyn Fn(&ratelimit_user::fleet::key::WindowCounts) -> u64| {
        windows.iter().map(f).sum::<u64>()
    };
    Some((
        sum(&|w| w.total),
        sum(&|w| w.hosts.get("h0").copied().unwrap_or(0)),
        sum(&|w| w.hosts.get("h1").copied().unwrap_or(0)),
    ))
}

/// This host's admitted counts of the key (current and previous window).
fn local_count(k: &KeyReport) -> u64 {
    k.rules
        .first()
        .and_then(|r| r.local.as_ref())
        .map_or(0, |l| l.cur + l.prev)
}

#[test]
fn fleet_key_shows_the_fleet_s_counts_of_a_client() {
    kernel_test!();
    let mut f = start_fleet("rlfk");
    let give_up = Instant::now() + Duration::from_secs(10);
    while (0..2).any(|i| f.fleet(i).global.rules != ["udp-global"]) {
        assert!(
            Instant::now() < give_up,
            "the global rule is not synced: {:?}",
            (0..2).map(|i| f.fleet(i)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // Start just after a wall-clock window boundary: the packets land in one window, and the
    // counts are synced well before the window after the next.
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let next = Duration::from_secs((now.as_secs() / T_SECS + 1) * T_SECS);
    std::thread::sleep(next - now + Duration::from_millis(100));
    for (i, &n) in SENT.iter().enumerate() {
        let h = &f.hosts[i];
        let mut tx = h.sender();
        tx.send_n(std::iter::repeat(h.udp4(SRC, PORT)), n, None);
    }
    // Every packet judged, and admitted (the threshold is far).
    let give_up = Instant::now() + Duration::from_secs(5);
    let admitted = loop {
        let a: Vec<u64> = f
            .hosts
            .iter()
            .map(|h| {
                let st = h.stats();
                rule_counter(&st, "udp-global", "matched")
                    - rule_counter(&st, "udp-global", "dropped")
            })
            .collect();
        if a == SENT || Instant::now() > give_up {
            break a;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(admitted, SENT, "admitted on each host");

    // The store holds each host's own count and the total; host 0's state has host 1's added.
    let want = (SENT[0] + SENT[1], SENT[0], SENT[1]);
    let give_up = Instant::now() + Duration::from_secs(3);
    let k = loop {
        let k = key(&f, 0);
        if (fleet_counts(&k) == Some(want) && local_count(&k) == want.0) || Instant::now() > give_up
        {
            break k;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    println!(
        "fleet key on h0: {}",
        serde_json::to_string_pretty(&k).unwrap()
    );
    assert_eq!(k.host_id, "h0");
    assert_eq!(k.rules.len(), 1, "one global rule: {k:?}");
    let r = &k.rules[0];
    assert_eq!(
        (r.rule.as_str(), r.key.as_str()),
        ("udp-global", "198.18.9.9/32")
    );
    assert_eq!((r.threshold, r.interval_ms), (L, T_SECS * 1000));
    assert_eq!(fleet_counts(&k), Some(want), "the store's counts: {k:?}");
    assert_eq!(
        local_count(&k),
        want.0,
        "host 0's state, host 1's count added: {k:?}"
    );
    assert!(r.note.is_none(), "{k:?}");
    // Host 1 reads the same counts from the store.
    assert_eq!(fleet_counts(&key(&f, 1)), Some(want));

    // The text, and the same answer over HTTP.
    let d = f.hosts[0].daemon();
    let text = d.cli_ok(&["fleet", "key", &SRC.to_string(), "--rule", "udp-global"]);
    assert!(
        text.contains("rule udp-global: client 198.18.9.9/32"),
        "{text}"
    );
    assert!(text.contains("  fleet      window "), "{text}");
    assert!(text.contains("h0 100, h1 50"), "{text}");
    let (code, body) = f.hosts[0].http_get(&format!("/v1/fleet/key?addr={SRC}&rule=udp-global"));
    assert_eq!(code, 200, "{body}");
    let http: KeyReport = serde_json::from_str(&body).unwrap();
    assert_eq!(http.rules[0].key, "198.18.9.9/32");
    assert_eq!(fleet_counts(&http), Some(want), "{body}");

    // What is wrong is said.
    for (args, want) in [
        (vec!["fleet", "key", "198.18.9"], "is not an IP address"),
        (
            vec!["fleet", "key", "198.18.9.9", "--rule", "nope"],
            "no rule named nope",
        ),
        (
            vec!["fleet", "key", "198.18.9.9", "--rule", "udp-local"],
            "not a global rule",
        ),
    ] {
        let out = d.cli(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "{args:?}: {err}"
        );
    }

    // The status and the metrics.
    let status = d.cli_ok(&["fleet", "status"]);
    assert!(status.contains("global thresholds"), "{status}");
    assert!(status.contains("  rules        udp-global"), "{status}");
    let (_, text) = f.hosts[0].http_get("/metrics");
    let m = |name: &str| metric_sum(&text, name, &[]);
    assert_eq!(m("ratelimit_fleet_global_rules"), 1.0, "{text}");
    assert!(m("ratelimit_fleet_global_synced_keys") >= 1.0, "{text}");
    assert_eq!(m("ratelimit_fleet_global_capped_keys"), 0.0, "{text}");
    assert!(m("ratelimit_fleet_global_rounds_total") >= 1.0, "{text}");
    assert!(
        m("ratelimit_fleet_global_store_calls_total") >= m("ratelimit_fleet_global_rounds_total"),
        "{text}"
    );
    assert_eq!(
        m("ratelimit_fleet_global_store_errors_total"),
        0.0,
        "{text}"
    );
    assert!(
        m("ratelimit_fleet_global_added_total") >= SENT[1] as f64,
        "{text}"
    );
    let round = m("ratelimit_fleet_global_round_seconds");
    assert!(
        text.contains("\nratelimit_fleet_global_round_seconds ") && round > 0.0 && round < 1.0,
        "{text}"
    );

    // Without the store: this host's part, and why the rest is missing.
    f.redis.as_mut().expect("a single store").kill();
    // The answer read just before is served from the cache while it is fresh.
    std::thread::sleep(ratelimit_user::fleet::key_reads::FRESH + Duration::from_millis(100));
    let t0 = Instant::now();
    let k = key(&f, 0);
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    let r = &k.rules[0];
    assert!(r.fleet.is_none(), "{k:?}");
    assert!(
        r.note
            .as_deref()
            .is_some_and(|n| n.contains("the store could not be read")),
        "{k:?}"
    );
    assert_eq!(r.key, "198.18.9.9/32");
    let text = d.cli_ok(&["fleet", "key", &SRC.to_string()]);
    assert!(
        text.contains("note       the store could not be read"),
        "{text}"
    );
}
