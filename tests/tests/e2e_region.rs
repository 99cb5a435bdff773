//! key = "region": one bucket per country from a MaxMind-format database the test writes
//! itself, per-region overrides, `ZZ` for addresses the database does not know, and a reload
//! that brings a new database.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use ratelimit_tests::{kernel_test, mmdb::write_country_db, scenario::Scenario};
use ratelimit_user::policy::report::Key;

const PORT: u16 = 9000;

fn ip4(c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(198, 19, c, d))
}

#[test]
fn region_key_buckets_per_country_with_overrides() {
    kernel_test!();
    let mut s = Scenario::new("rlg2");
    let db = std::env::temp_dir().join(format!("rl-geo-{}.mmdb", std::process::id()));
    write_country_db(
        &db,
        &[
            ("198.19.60.0/24", "DE"),
            ("198.19.61.0/24", "FR"),
            ("2001:db8:62::/48", "FR"),
        ],
    )
    .unwrap();
    s.start(&format!(
        r#"
[geoip]
database = "{}"

[[rule]]
name = "per-country"
match = {{ protocol = "udp" }}
key = "region"
threshold = {{ count = 100, interval = "1h" }}
algorithm = "fixed_window"

[[rule.override]]
region = "DE"
threshold = {{ count = 30, interval = "1h" }}

[[rule.override]]
region = "ZZ"
threshold = {{ count = 10, interval = "1h" }}
"#,
        db.display()
    ));
    let sink = s.sink(PORT);
    let mut tx = s.sender();
    let mut send = |src: IpAddr, n: u64| tx.send_n(std::iter::repeat(s.udp(src, PORT)), n, None);
    send(ip4(60, 1), 50);
    send(ip4(61, 1), 60);
    send(ip4(61, 2), 60);
    send(IpAddr::V6("2001:db8:62::5".parse().unwrap()), 10);
    send(ip4(70, 1), 25);
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop();
    assert_eq!(got.from(ip4(60, 1)), 30, "DE override");
    assert_eq!(
        got.from(ip4(61, 1)) + got.from(ip4(61, 2)),
        100,
        "FR is one bucket for all its sources"
    );
    assert_eq!(
        got.from(IpAddr::V6("2001:db8:62::5".parse().unwrap())),
        0,
        "FR's IPv6 shares the spent bucket"
    );
    assert_eq!(got.from(ip4(70, 1)), 10, "unknown addresses are ZZ");
    let top = s.daemon().cli_json(&["top", "-n", "10"]);
    let regions: Vec<(&str, u64)> = top
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["client"].as_str().unwrap(),
                c["packets"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(
        regions.contains(&("FR", 130))
            && regions.contains(&("DE", 50))
            && regions.contains(&("ZZ", 25)),
        "{regions:?}"
    );

    // A reload with a database that moves 198.19.70.0/24 to DE.
    write_country_db(
        &db,
        &[
            ("198.19.60.0/24", "DE"),
            ("198.19.61.0/24", "FR"),
            ("198.19.70.0/24", "DE"),
        ],
    )
    .unwrap();
    s.daemon().cli_ok(&["reload"]);
    let sink = s.sink(PORT);
    let mut tx = s.sender();
    tx.send_n(std::iter::repeat(s.udp(ip4(70, 2), PORT)), 5, None);
    sink.wait_quiet(Duration::from_millis(300));
    assert_eq!(
        sink.stop().from(ip4(70, 2)),
        0,
        "now DE, whose 30 are spent"
    );
    // A broken database rejects the reload and keeps the old regions.
    std::fs::write(&db, b"not a database").unwrap();
    let out = s.daemon().cli(&["reload"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("MaxMind"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_file(&db);
}

/// A rate_based_ban rule keyed by region bans the whole region: every source in it is
/// dropped, other regions are not, and `bans` lists the ban by region (it lives in the
/// region's shared state, not in the ban map).
#[test]
fn region_ban_is_listed_and_covers_the_region() {
    kernel_test!();
    let mut s = Scenario::new("rlg3");
    let db = std::env::temp_dir().join(format!("rl-geo-ban-{}.mmdb", std::process::id()));
    write_country_db(&db, &[("198.19.63.0/24", "DE"), ("198.19.64.0/24", "FR")]).unwrap();
    s.start(&format!(
        r#"
[geoip]
database = "{}"

[[rule]]
name = "per-country-ban"
match = {{ protocol = "udp" }}
key = "region"
action = "rate_based_ban"
threshold = {{ count = 10, interval = "1h" }}
algorithm = "fixed_window"
ban_threshold = {{ count = 20, interval = "1h" }}
ban_duration = "1h"
"#,
        db.display()
    ));
    let sink = s.sink(PORT);
    let mut tx = s.sender();
    // 30 from one DE source: 10 admitted, banned past 20.
    tx.send_n(std::iter::repeat(s.udp(ip4(63, 1), PORT)), 30, None);
    // Another DE source is banned with it; a FR source is not.
    tx.send_n(std::iter::repeat(s.udp(ip4(63, 2), PORT)), 5, None);
    tx.send_n(std::iter::repeat(s.udp(ip4(64, 1), PORT)), 5, None);
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop();
    let _ = std::fs::remove_file(&db);
    assert_eq!(got.from(ip4(63, 1)), 10);
    assert_eq!(got.from(ip4(63, 2)), 0, "the region is banned");
    assert_eq!(got.from(ip4(64, 1)), 5, "other regions are not");
    let list = s.daemon().bans();
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0].key, Key::Region);
    assert_eq!(list[0].region.as_deref(), Some("DE"));
    assert_eq!(list[0].rule.as_deref(), Some("per-country-ban"));
    assert_eq!(list[0].cidr, None);
    let human = s.daemon().cli_ok(&["bans"]);
    assert!(human.contains("(region DE)"), "{human}");
    // Lifted by rule and region (any case): the region passes again under a clean meter.
    let out = s.daemon().cli(&["ban", "del", "--rule", "per-country-ban"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--region CC"),
        "{out:?}"
    );
    let out = s
        .daemon()
        .cli(&["ban", "del", "--rule", "per-country-ban", "--region", "FR"]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no ban in force"),
        "{out:?}"
    );
    let out = s
        .daemon()
        .cli_json(&["ban", "del", "--rule", "per-country-ban", "--region", "de"]);
    assert_eq!(out["region"], "DE", "{out}");
    assert_eq!(s.daemon().bans(), []);
    let sink = s.sink(PORT);
    tx.send_n(std::iter::repeat(s.udp(ip4(63, 2), PORT)), 15, None);
    sink.wait_quiet(Duration::from_millis(300));
    assert_eq!(sink.stop().from(ip4(63, 2)), 10);
}
