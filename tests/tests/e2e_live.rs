//! Live changes as operators make them: `ratelimit override add|del` and `ratelimit rule set`
//! change thresholds in a running daemon without resetting a counter, and are kept, by rule
//! name, across a restart, a reboot (the pinned maps gone) and a reload. Bad input is refused
//! with exit 1 and a message, and changes nothing. The limiter is exact within one interval of
//! a fixed window: intervals of an hour keep the clock out of the counts.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    process::Output,
    time::Duration,
};

use ratelimit_tests::{Scenario, UdpSink, kernel_test, mmdb::write_country_db};
use ratelimit_user::api::Reloaded;
use serde_json::json;

const PORT: u16 = 9000;

const RULE: &str = r#"
[[rule]]
name = "udp"
match = { protocol = "udp", dst_ports = ["9000"] }
threshold = { count = 100, interval = "1h" }
algorithm = "fixed_window"
"#;

fn ip4(c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(198, 19, c, d))
}

fn ip6(s: &str) -> IpAddr {
    IpAddr::V6(s.parse::<Ipv6Addr>().unwrap())
}

/// Send `n` frames from `src` and return how many more of `src`'s the receiver got.
fn delivered(s: &Scenario, sink: &UdpSink, src: IpAddr, n: u64) -> u64 {
    let before = sink.snapshot().from(src);
    s.sender()
        .send_n(std::iter::repeat(s.udp(src, PORT)), n, None);
    sink.wait_quiet(Duration::from_millis(300));
    sink.snapshot().from(src) - before
}

/// The CLI's exit 1 with `want` in its message.
fn refused(out: &Output, want: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "exit status; stderr: {err}");
    assert!(err.contains(want), "expected {want:?} in: {err}");
}

#[test]
fn a_live_override_raises_or_lowers_one_clients_threshold_and_keeps_its_count() {
    kernel_test!();
    let mut s = Scenario::new("rlo1");
    s.start(RULE);
    let sink = s.sink(PORT);
    let (raised, lowered, other) = (ip4(50, 1), ip4(50, 2), ip4(50, 3));
    let (v6a, v6b) = (ip6("2001:db8:50::1"), ip6("2001:db8:50::2"));
    // Under the rule's 100 in this hour.
    assert_eq!(delivered(&s, &sink, raised, 80), 80);
    assert_eq!(delivered(&s, &sink, lowered, 60), 60);
    assert_eq!(delivered(&s, &sink, v6a, 80), 80);

    let d = s.daemon();
    d.cli_ok(&[
        "override",
        "add",
        "udp",
        "198.19.50.1",
        "--threshold",
        "150/1h",
    ]);
    d.cli_ok(&[
        "override",
        "add",
        "udp",
        "198.19.50.2/32",
        "--threshold",
        "50/1h",
    ]);
    // The /64 both IPv6 hosts share (the rule's IPv6 prefix): one bucket, one override.
    d.cli_ok(&[
        "override",
        "add",
        "udp",
        "2001:db8:50::/64",
        "--threshold",
        "150/1h",
    ]);

    // The 80 already counted stay counted: 70 more up to 150 (a reset would let 100 through).
    assert_eq!(
        delivered(&s, &sink, raised, 100),
        70,
        "raised to 150 from 80"
    );
    // 60 counted is above the new 50: nothing more (a reset would let 50 through).
    assert_eq!(
        delivered(&s, &sink, lowered, 10),
        0,
        "lowered to 50 under 60"
    );
    // The other host of the /64 shares its 80: 70 more.
    assert_eq!(delivered(&s, &sink, v6b, 100), 70, "the /64 raised to 150");
    // Everyone else keeps the rule's 100.
    assert_eq!(delivered(&s, &sink, other, 120), 100, "others unaffected");
    assert_eq!(
        delivered(&s, &sink, ip6("2001:db8:51::1"), 120),
        100,
        "another /64 unaffected"
    );

    let listed = s.daemon().cli_json(&["overrides"]);
    assert_eq!(
        listed,
        json!([
            {"rule": "udp", "cidr": "198.19.50.1/32", "threshold": "150/1h", "source": "live", "replaces_config": false},
            {"rule": "udp", "cidr": "198.19.50.2/32", "threshold": "50/1h", "source": "live", "replaces_config": false},
            {"rule": "udp", "cidr": "2001:db8:50::/64", "threshold": "150/1h", "source": "live", "replaces_config": false},
        ])
    );
    // The data plane's own counts agree: 80 + 100 packets of the raised client, 150 admitted.
    let top = s.daemon().cli_json(&["top", "-n", "10"]);
    let raised_row = top
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["client"] == "198.19.50.1/32")
        .unwrap_or_else(|| panic!("{top}"));
    assert_eq!(raised_row["packets"], 180, "{raised_row}");
    assert_eq!(raised_row["drops"], 30, "{raised_row}");
}

#[test]
fn a_live_region_override_changes_one_regions_threshold_and_keeps_its_count() {
    kernel_test!();
    let mut s = Scenario::new("rlo2");
    let db = std::env::temp_dir().join(format!("rl-live-geo-{}.mmdb", std::process::id()));
    write_country_db(&db, &[("198.19.60.0/24", "DE"), ("198.19.61.0/24", "FR")]).unwrap();
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
"#,
        db.display()
    ));
    let sink = s.sink(PORT);
    assert_eq!(delivered(&s, &sink, ip4(61, 1), 60), 60);
    // A region on a rule keyed by region; a CIDR is refused there.
    refused(
        &s.daemon().cli(&[
            "override",
            "add",
            "per-country",
            "198.19.61.0/24",
            "--threshold",
            "5/1h",
        ]),
        "overrides need key = \"ip\" or \"all\" (this rule has key = \"region\")",
    );
    s.daemon().cli_ok(&[
        "override",
        "add",
        "per-country",
        "--region",
        "FR",
        "--threshold",
        "80/1h",
    ]);
    assert_eq!(
        delivered(&s, &sink, ip4(61, 2), 40),
        20,
        "FR's 60 stay counted: 20 more up to 80"
    );
    assert_eq!(delivered(&s, &sink, ip4(60, 1), 120), 100, "DE keeps 100");
    assert_eq!(
        s.daemon().cli_json(&["overrides"]),
        json!([{"rule": "per-country", "region": "FR", "threshold": "80/1h", "source": "live", "replaces_config": false}])
    );
    s.daemon()
        .cli_ok(&["override", "del", "per-country", "--region", "FR"]);
    assert_eq!(
        delivered(&s, &sink, ip4(61, 3), 40),
        20,
        "FR back to the rule's 100, its 80 counted"
    );
    let _ = std::fs::remove_file(&db);
}

/// The defect this fixes: `rule set` changes were lost on a restart and on a reload.
#[test]
fn rule_set_changes_survive_a_restart_a_reboot_and_a_reload() {
    kernel_test!();
    let mut s = Scenario::new("rlo3");
    s.start(RULE);
    s.daemon()
        .cli_ok(&["rule", "set", "udp", "--threshold", "120/1h"]);
    let sink = s.sink(PORT);
    assert_eq!(delivered(&s, &sink, ip4(53, 1), 130), 120, "live");
    s.daemon_mut().restart();
    assert_eq!(
        delivered(&s, &sink, ip4(53, 2), 130),
        120,
        "after a restart"
    );
    s.daemon().cli_ok(&["reload"]);
    assert_eq!(delivered(&s, &sink, ip4(53, 3), 130), 120, "after a reload");
    // A reboot: no pinned maps, only the state directory.
    s.daemon_mut().stop();
    assert!(s.daemon().detach().status.success());
    s.daemon_mut().restart();
    assert_eq!(delivered(&s, &sink, ip4(53, 4), 130), 120, "after a reboot");
    // And back to the config's value, counters kept: 53.4 has 120 of 130 counted.
    s.daemon().cli_ok(&["rule", "reset", "udp"]);
    assert_eq!(delivered(&s, &sink, ip4(53, 4), 5), 0, "over the 100");
    assert_eq!(
        delivered(&s, &sink, ip4(53, 5), 130),
        100,
        "the config's 100"
    );
    s.daemon_mut().restart();
    assert_eq!(
        delivered(&s, &sink, ip4(53, 6), 130),
        100,
        "the reset is kept too"
    );
}

#[test]
fn live_overrides_survive_a_restart_a_reboot_and_a_reload_and_follow_their_rule_by_name() {
    kernel_test!();
    let mut s = Scenario::new("rlo4");
    let config_override = r#"
[[rule.override]]
cidr = "198.19.54.9/32"
threshold = { count = 200, interval = "1h" }
"#;
    s.start(&format!("{RULE}{config_override}"));
    let d = s.daemon();
    d.cli_ok(&["rule", "set", "udp", "--threshold", "120/1h"]);
    for c in ["198.19.54.1", "198.19.54.2", "198.19.54.3"] {
        d.cli_ok(&["override", "add", "udp", c, "--threshold", "150/1h"]);
    }
    // At the config's key: replaces it while it exists.
    d.cli_ok(&[
        "override",
        "add",
        "udp",
        "198.19.54.9",
        "--threshold",
        "40/1h",
    ]);
    let expected = json!([
        {"rule": "udp", "cidr": "198.19.54.9/32", "threshold": "40/1h", "source": "live", "replaces_config": true},
        {"rule": "udp", "cidr": "198.19.54.1/32", "threshold": "150/1h", "source": "live", "replaces_config": false},
        {"rule": "udp", "cidr": "198.19.54.2/32", "threshold": "150/1h", "source": "live", "replaces_config": false},
        {"rule": "udp", "cidr": "198.19.54.3/32", "threshold": "150/1h", "source": "live", "replaces_config": false},
    ]);
    assert_eq!(d.cli_json(&["overrides"]), expected);
    let sink = s.sink(PORT);

    s.daemon_mut().restart();
    assert_eq!(s.daemon().cli_json(&["overrides"]), expected, "restart");
    assert_eq!(delivered(&s, &sink, ip4(54, 1), 200), 150, "restart");
    assert_eq!(delivered(&s, &sink, ip4(54, 9), 100), 40, "restart");
    assert_eq!(delivered(&s, &sink, ip4(54, 20), 130), 120, "restart");

    // A reboot: the pinned maps are gone, the state directory stays.
    s.daemon_mut().stop();
    assert!(s.daemon().detach().status.success());
    s.daemon_mut().restart();
    assert_eq!(s.daemon().cli_json(&["overrides"]), expected, "reboot");
    assert_eq!(delivered(&s, &sink, ip4(54, 2), 200), 150, "reboot");
    assert_eq!(delivered(&s, &sink, ip4(54, 21), 130), 120, "reboot");

    // A reload that puts a new rule first: the changes follow "udp" by name to position 1.
    let file = std::fs::read_to_string(s.daemon().config_path()).unwrap();
    let (head, rules) = file.split_at(file.find("[[rule]]").unwrap());
    s.daemon_mut().write_config(&format!(
        "{head}[[rule]]\nname = \"first\"\nmatch = {{ protocol = \"udp\", dst_ports = [\"9999\"] }}\nthreshold = {{ count = 1, interval = \"1h\" }}\n\n{rules}"
    ));
    s.daemon().cli_ok(&["reload"]);
    assert_eq!(s.daemon().cli_json(&["overrides"]), expected, "reload");
    assert_eq!(delivered(&s, &sink, ip4(54, 3), 200), 150, "reload");
    assert_eq!(delivered(&s, &sink, ip4(54, 22), 130), 120, "reload");
    let rules = s.daemon().cli_json(&["rules"]);
    assert_eq!(rules[0]["name"], "first");
    assert_eq!(rules[0]["source"], "config");
    assert_eq!(rules[1]["name"], "udp");
    assert_eq!(rules[1]["source"], "live");
    assert_eq!(rules[1]["threshold"], "120/1h");
    assert_eq!(rules[1]["live"], json!({"threshold": "120/1h"}));
    assert_eq!(rules[1]["overrides"], 4);

    // A reload without the rule: its changes are dropped, named and counted, and a copy of the
    // file as it was is kept.
    s.daemon_mut().write_config(&format!(
        "{head}[[rule]]\nname = \"other\"\nmatch = {{ protocol = \"udp\", dst_ports = [\"9000\"] }}\nthreshold = {{ count = 100, interval = \"1h\" }}\nalgorithm = \"fixed_window\"\n"
    ));
    let reloaded: Reloaded = s.daemon().cli_as(&["reload"]);
    assert_eq!(reloaded.live_changes_dropped.len(), 5, "{reloaded:?}");
    assert_eq!(s.daemon().cli_json(&["overrides"]), json!([]));
    let live = s.daemon().status().live_changes;
    assert_eq!(
        (live.dropped, live.rules_changed, live.overrides),
        (5, 0, 0),
        "{live:?}"
    );
    assert!(
        live.drops[0].contains("live changes to rule \"udp\" (--threshold 120/1h): the config has no rule named \"udp\""),
        "{live:?}"
    );
    let kept = live.kept_copy.as_deref().expect("a copy of the file");
    let copy: serde_json::Value = serde_json::from_slice(&std::fs::read(kept).unwrap()).unwrap();
    assert_eq!(
        copy["overrides"].as_array().map(Vec::len),
        Some(4),
        "{copy}"
    );
    assert!(
        s.daemon()
            .logs()
            .contains("live changes to rule \\\"udp\\\"")
            || s.daemon().logs().contains("live changes to rule \"udp\""),
        "a warning names it"
    );
}

#[test]
fn override_del_restores_the_configs_value_and_bad_input_changes_nothing() {
    kernel_test!();
    let mut s = Scenario::new("rlo5");
    s.start(&format!(
        "{RULE}\n[[rule.override]]\ncidr = \"198.19.55.9/32\"\nthreshold = {{ count = 200, interval = \"1h\" }}\n"
    ));
    let sink = s.sink(PORT);
    let d = s.daemon();
    d.cli_ok(&[
        "override",
        "add",
        "udp",
        "198.19.55.9",
        "--threshold",
        "40/1h",
    ]);
    assert_eq!(delivered(&s, &sink, ip4(55, 9), 30), 30);
    let out = s
        .daemon()
        .cli_json(&["override", "del", "udp", "198.19.55.9/32"]);
    assert_eq!(out["restored"]["threshold"], "200/1h", "{out}");
    // The config's 200 again, the 30 counted: 170 more.
    assert_eq!(delivered(&s, &sink, ip4(55, 9), 200), 170);
    let config_only = json!([
        {"rule": "udp", "cidr": "198.19.55.9/32", "threshold": "200/1h", "source": "config", "replaces_config": false},
    ]);
    assert_eq!(s.daemon().cli_json(&["overrides"]), config_only);

    // One live override and one rule change in force, then bad inputs: none changes anything.
    let d = s.daemon();
    d.cli_ok(&[
        "override",
        "add",
        "udp",
        "198.19.55.1",
        "--threshold",
        "150/1h",
    ]);
    d.cli_ok(&["rule", "set", "udp", "--threshold", "120/1h"]);
    let overrides = d.cli_json(&["overrides"]);
    let rules = d.cli_json(&["rules"]);
    let file = d.config_dir().join("state/live.json");
    let saved = std::fs::read(&file).unwrap();
    let cases: [(&[&str], &str); 12] = [
        (
            &[
                "override",
                "add",
                "nope",
                "198.19.55.2",
                "--threshold",
                "5/1h",
            ],
            "no rule named \"nope\" (rules: udp)",
        ),
        (
            &[
                "override",
                "add",
                "udp",
                "--region",
                "NL",
                "--threshold",
                "5/1h",
            ],
            "rule \"udp\": --region: overrides need key = \"region\" (this rule has key = \"ip\")",
        ),
        (
            &[
                "override",
                "add",
                "udp",
                "198.19.55.300",
                "--threshold",
                "5/1h",
            ],
            "\"198.19.55.300\" is not an IP address or CIDR",
        ),
        (
            &[
                "override",
                "add",
                "udp",
                "198.19.55.1/24",
                "--threshold",
                "5/1h",
            ],
            "198.19.55.1/24 has host bits set; did you mean 198.19.55.0/24?",
        ),
        (
            &[
                "override",
                "add",
                "udp",
                "2001:db8::/129",
                "--threshold",
                "5/1h",
            ],
            "the prefix length must be a number from 0 to 128",
        ),
        (
            &[
                "override",
                "add",
                "udp",
                "198.19.55.1",
                "--threshold",
                "5/0s",
            ],
            "--threshold: \"5/0s\": the interval must be greater than 0",
        ),
        (
            &[
                "override",
                "add",
                "udp",
                "198.19.55.1",
                "--threshold",
                "5MiB/1s",
            ],
            "counts bytes but the rule's threshold counts packets",
        ),
        (
            &[
                "override",
                "add",
                "udp",
                "198.19.55.1",
                "--threshold",
                "5/1h",
                "--burst",
                "9",
            ],
            "--burst only applies to algorithm = \"token_bucket\"",
        ),
        (
            &["override", "del", "udp", "198.19.55.77"],
            "no override for cidr 198.19.55.77/32 in rule \"udp\"",
        ),
        (
            &["override", "del", "udp", "198.19.55.9"],
            "is the config file's, not a live one",
        ),
        (
            &["override", "del", "nope", "198.19.55.1"],
            "no rule named \"nope\"",
        ),
        (
            &["rule", "set", "udp", "--threshold", "0/1h"],
            "the threshold amount must be at least 1",
        ),
    ];
    for (args, want) in cases {
        refused(&s.daemon().cli(args), want);
    }
    assert_eq!(s.daemon().cli_json(&["overrides"]), overrides);
    assert_eq!(s.daemon().cli_json(&["rules"]), rules);
    assert_eq!(std::fs::read(&file).unwrap(), saved, "the saved file");
    // And the data plane: 150 for .1, 120 for the others.
    assert_eq!(delivered(&s, &sink, ip4(55, 1), 200), 150);
    assert_eq!(delivered(&s, &sink, ip4(55, 2), 200), 120);
    // `rule reset` of a rule without live changes is an error too.
    s.daemon().cli_ok(&["rule", "reset", "udp"]);
    refused(
        &s.daemon().cli(&["rule", "reset", "udp"]),
        "rule \"udp\" has no live changes",
    );
}

/// `rule set` checks the rule's overrides, the config's and the live ones, against the rule
/// as changed: a factor they inherit that makes one too fast to meter, or exceed_action =
/// "pass" under an override's own factor, is refused, and the running rule stays as it was.
#[test]
fn rule_set_is_refused_when_the_rules_overrides_would_not_fit() {
    kernel_test!();
    let mut s = Scenario::new("rlo6");
    s.start(&format!(
        "{RULE}\n[[rule.override]]\ncidr = \"198.19.56.9/32\"\nthreshold = {{ count = 600000000, interval = \"1s\" }}\n"
    ));
    let sink = s.sink(PORT);
    let d = s.daemon();
    d.cli_ok(&[
        "override",
        "add",
        "udp",
        "198.19.56.1",
        "--threshold",
        "150/1h",
        "--elastic",
        "2",
    ]);
    let overrides = d.cli_json(&["overrides"]);
    let rules = d.cli_json(&["rules"]);
    let file = d.config_dir().join("state/live.json");
    let saved = std::fs::read(&file).unwrap();
    refused(
        &d.cli(&["rule", "set", "udp", "--elastic", "2"]),
        "override cidr 198.19.56.9/32: elastic (the rule's) = 2 makes the threshold \
         1200000000/1s while the host has room",
    );
    refused(
        &d.cli(&["rule", "set", "udp", "--exceed-action", "pass"]),
        "live override cidr 198.19.56.1/32 of rule \"udp\" would not fit the rule as changed: \
         rule \"udp\": --elastic has no effect with exceed_action = \"pass\"",
    );
    assert_eq!(s.daemon().cli_json(&["overrides"]), overrides);
    assert_eq!(s.daemon().cli_json(&["rules"]), rules);
    assert_eq!(std::fs::read(&file).unwrap(), saved, "the saved file");
    // The data plane too: 100 for a client without an override, and drops past it.
    assert_eq!(delivered(&s, &sink, ip4(56, 2), 150), 100);
}
