use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use ratelimit_common::caps;

use super::*;
use crate::config::{OverrideTarget, Rule};

/// A config whose state directory is `dir`, with `rules` (TOML `[[rule]]` tables).
fn config(dir: &Path, rules: &str) -> Config {
    let text = format!(
        "[daemon]\nstate_dir = {:?}\n[geoip]\ndatabase = \"/nonexistent.mmdb\"\n{rules}",
        dir.display().to_string()
    );
    config::parse("t.toml", &text).unwrap_or_else(|e| panic!("{e}\n{text}"))
}

const RULES: &str = r#"
[[rule]]
name = "udp"
match = { protocol = "udp" }
threshold = { count = 100, interval = "1h" }
algorithm = "fixed_window"

[[rule.override]]
cidr = "198.51.100.7/32"
threshold = { count = 200, interval = "1h" }

[[rule]]
name = "geo"
key = "region"
threshold = { count = 10, interval = "1s" }

[[rule]]
name = "bucket"
action = "rate_based_ban"
ban_duration = "1h"
threshold = { bytes = "1MiB", interval = "1s" }
algorithm = "token_bucket"
"#;

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "ratelimit-live-{tag}-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn spec(rule: &str, cidr: Option<&str>, region: Option<&str>, threshold: &str) -> OverrideSpec {
    OverrideSpec {
        at: OverrideAt {
            rule: rule.into(),
            cidr: cidr.map(Into::into),
            region: region.map(Into::into),
        },
        threshold: threshold.into(),
        burst: None,
        ban_threshold: None,
        elastic: None,
    }
}

fn rule<'a>(cfg: &'a Config, name: &str) -> &'a Rule {
    cfg.rules.iter().find(|r| r.name == name).unwrap()
}

/// Every bad input is refused with the config's reason, naming what to fix.
#[test]
fn overrides_are_checked_as_the_config_checks_them() {
    let cfg = config(Path::new("/nonexistent"), RULES);
    let err = |s: OverrideSpec| check(&s, rule(&cfg, &s.at.rule.clone())).unwrap_err();
    assert_eq!(
        err(spec("udp", None, Some("NL"), "5/1s")),
        "rule \"udp\": --region: overrides need key = \"region\" (this rule has key = \"ip\")"
    );
    assert_eq!(
        err(spec("geo", Some("10.0.0.0/8"), None, "5/1s")),
        "rule \"geo\": 10.0.0.0/8: overrides need key = \"ip\" or \"all\" (this rule has key = \
         \"region\")"
    );
    assert_eq!(
        err(spec("udp", Some("10.0.0.300"), None, "5/1s")),
        "\"10.0.0.300\" is not an IP address or CIDR"
    );
    assert_eq!(
        err(spec("udp", Some("10.0.0.1/8"), None, "5/1s")),
        "10.0.0.1/8 has host bits set; did you mean 10.0.0.0/8?"
    );
    assert_eq!(
        err(spec("udp", Some("10.0.0.1"), None, "5/0s")),
        "--threshold: \"5/0s\": the interval must be greater than 0"
    );
    assert_eq!(
        err(spec("udp", Some("10.0.0.1"), None, "0/1s")),
        "--threshold: \"0/1s\": the threshold amount must be at least 1"
    );
    assert_eq!(
        err(spec("udp", Some("10.0.0.1"), None, "1MiB/1s")),
        "--threshold: 1MiB/1s counts bytes but the rule's threshold counts packets; both must \
         count the same"
    );
    assert_eq!(
        err(spec("geo", None, Some("nl"), "5/1s")),
        "--region: \"nl\" must be uppercase; did you mean \"NL\"?"
    );
    assert_eq!(
        err(spec("udp", Some("10.0.0.1"), Some("NL"), "5/1s")),
        "give a CIDR or --region CC, not both: an override is for a network or a region"
    );
    let mut s = spec("udp", Some("10.0.0.1"), None, "5/1s");
    s.burst = Some("10".into());
    assert_eq!(
        err(s.clone()),
        "--burst only applies to algorithm = \"token_bucket\" (rule \"udp\" uses \"fixed_window\")"
    );
    s.burst = None;
    s.ban_threshold = Some("10/1s".into());
    assert_eq!(
        err(s),
        "--ban-threshold only applies to action = \"rate_based_ban\" (rule \"udp\" has action = \
         \"throttle\")"
    );
    // A byte rule's burst is a byte size, at least 64 KiB.
    let mut s = spec("bucket", Some("2001:db8::/64"), None, "2MiB/1s");
    s.burst = Some("1500".into());
    assert!(err(s.clone()).starts_with("--burst: 1500 B is below the minimum of 64KiB"));
    s.burst = Some("4MiB".into());
    s.ban_threshold = Some("8MiB/1s".into());
    let o = check(&s, rule(&cfg, "bucket")).unwrap();
    assert_eq!(o.burst, Some(4 << 20));
    assert_eq!(o.ban_threshold.unwrap().amount, 8 << 20);
    // IPv4 and IPv6 stay apart: an IPv6 /64 is an IPv6 prefix.
    assert!(matches!(
        o.target,
        OverrideTarget::Cidr(ipnet::IpNet::V6(_))
    ));
}

/// `--elastic` is checked as the config's `elastic`: a number above 1, on a rule that drops,
/// and the override's counts times F (its own or its rule's) still meterable.
#[test]
fn live_override_elastic_is_checked() {
    let cfg = config(
        Path::new("/nonexistent"),
        &format!(
            "{RULES}\n[[rule]]\nname = \"pass\"\nthreshold = {{ count = 10, interval = \"1s\" }}\n\
             exceed_action = \"pass\"\n[[rule]]\nname = \"el\"\n\
             threshold = {{ count = 10, interval = \"1s\" }}\nelastic = 2\n"
        ),
    );
    let with = |r: &str, e: Option<&str>, t: &str| {
        let mut s = spec(r, Some("192.0.2.0/24"), None, t);
        s.elastic = e.map(Into::into);
        check(&s, rule(&cfg, r))
    };
    assert!(
        with("udp", Some("1"), "5/1h")
            .unwrap_err()
            .starts_with("--elastic must be greater than 1 and at most 100 (got 1)")
    );
    assert!(
        with("udp", Some("x"), "5/1h")
            .unwrap_err()
            .contains("is not a number")
    );
    assert!(
        with("pass", Some("2"), "5/1s")
            .unwrap_err()
            .contains("--elastic has no effect with exceed_action = \"pass\"")
    );
    // The rule's factor makes this override's threshold too fast to meter exactly.
    assert!(
        with("el", None, "600000000/1s")
            .unwrap_err()
            .contains("--elastic (the rule's) = 2 makes the threshold 1200000000/1s")
    );
    // An override without a ban threshold of its own is banned at its rule's larger one,
    // and that is what its factor scales.
    let cfg2 = config(
        Path::new("/nonexistent"),
        "[[rule]]\nname = \"ban\"\nthreshold = { count = 10, interval = \"1s\" }\n\
         action = \"rate_based_ban\"\nban_duration = \"1m\"\n\
         ban_threshold = { count = 600000000, interval = \"1s\" }\n",
    );
    let mut s = spec("ban", Some("192.0.2.0/24"), None, "100/1s");
    s.elastic = Some("2".into());
    let e = check(&s, rule(&cfg2, "ban")).unwrap_err();
    assert!(
        e.contains("--elastic = 2 makes the ban_threshold 1200000000/1s"),
        "{e}"
    );
    let o = with("udp", Some("1.5"), "5/1h").unwrap();
    assert_eq!(o.elastic.unwrap().milli(), 1500);
    // Listed and saved in its command-line spelling.
    assert_eq!(OverrideSpec::of("udp", &o).elastic.as_deref(), Some("1.5"));
    assert_eq!(with("el", None, "5/1s").unwrap().elastic, None);
}

/// Live changes apply by rule name: a rule that moved keeps them, one that is gone or no longer
/// takes them drops them, each named with why.
#[test]
fn changes_follow_their_rule_by_name_and_drop_when_it_no_longer_fits() {
    let dir = Path::new("/nonexistent");
    let changes = Changes {
        rules: BTreeMap::from([(
            "udp".to_string(),
            RuleChanges {
                threshold: Some("150/1h".into()),
                ..RuleChanges::default()
            },
        )]),
        overrides: vec![
            spec("udp", Some("198.51.100.9"), None, "300/1h"),
            spec("geo", None, Some("DE"), "30/1s"),
        ],
    };
    let r = resolve(config(dir, RULES), &changes);
    assert!(r.dropped.is_empty(), "{:?}", r.dropped);
    assert_eq!(r.kept, changes.canonical());
    let udp = rule(&r.config, "udp");
    assert_eq!(udp.threshold.to_string(), "150/1h");
    assert_eq!(udp.overrides.len(), 2);
    assert_eq!(rule(&r.config, "geo").overrides.len(), 1);

    // The rules reordered: the changes follow the names.
    let moved = format!(
        "{}\n{}",
        RULES
            .split("[[rule]]\nname = \"geo\"")
            .nth(1)
            .map_or(String::new(), |rest| format!(
                "[[rule]]\nname = \"geo\"{rest}"
            )),
        RULES.split("[[rule]]\nname = \"geo\"").next().unwrap()
    );
    let r = resolve(config(dir, &moved), &changes);
    assert!(r.dropped.is_empty(), "{:?}", r.dropped);
    assert_eq!(r.config.rules[2].name, "udp");
    assert_eq!(r.config.rules[2].threshold.to_string(), "150/1h");

    // udp gone; geo keyed by ip now.
    let other = RULES
        .replace("name = \"udp\"", "name = \"udp2\"")
        .replace("key = \"region\"", "key = \"ip\"");
    let r = resolve(config(dir, &other), &changes);
    assert_eq!(
        r.dropped,
        [
            "live changes to rule \"udp\" (--threshold 150/1h): the config has no rule named \
             \"udp\"",
            "live override cidr 198.51.100.9 of rule \"udp\": the config has no rule named \
             \"udp\"",
            "live override region DE of rule \"geo\": rule \"geo\": --region: overrides need key \
             = \"region\" (this rule has key = \"ip\")",
        ]
    );
    assert!(r.kept.is_empty());
    assert_eq!(r.config, config(dir, &other), "nothing of them applies");

    // A change that the changed rule no longer takes: a burst for a rule that is no longer a
    // token bucket.
    let changes = Changes {
        rules: BTreeMap::from([(
            "bucket".to_string(),
            RuleChanges {
                burst: Some(1 << 20),
                ..RuleChanges::default()
            },
        )]),
        overrides: Vec::new(),
    };
    let r = resolve(
        config(dir, &RULES.replace("token_bucket", "sliding_window")),
        &changes,
    );
    assert_eq!(
        r.dropped,
        [
            "live changes to rule \"bucket\" (--burst 1048576): --burst applies to token_bucket \
          rules only"
        ]
    );
}

impl Changes {
    /// As `resolve` keeps them: each override in its canonical spelling.
    fn canonical(&self) -> Changes {
        let mut c = self.clone();
        for s in &mut c.overrides {
            if let Some(n) = &mut s.at.cidr {
                *n = config::parse_net(n).unwrap().to_string();
            }
        }
        c
    }
}

/// A live override at the key of the config's replaces it (whatever the spelling of the key),
/// and the config's is in force again without it.
#[test]
fn a_live_override_replaces_the_configs_at_its_key() {
    let dir = Path::new("/nonexistent");
    let file = config(dir, RULES);
    // An IPv4-mapped spelling is no key of an IPv4 client: a saved change that has one is
    // dropped, with the reason.
    let mapped = Changes {
        rules: BTreeMap::new(),
        overrides: vec![spec("udp", Some("::ffff:198.51.100.7/128"), None, "50/1h")],
    };
    let r = resolve(file.clone(), &mapped);
    assert!(
        r.dropped.len() == 1 && r.dropped[0].contains("IPv4-mapped"),
        "{:?}",
        r.dropped
    );
    for key in ["198.51.100.7", "198.51.100.7/32"] {
        let changes = Changes {
            rules: BTreeMap::new(),
            overrides: vec![spec("udp", Some(key), None, "50/1h")],
        };
        let r = resolve(file.clone(), &changes);
        assert!(r.dropped.is_empty(), "{:?}", r.dropped);
        let udp = rule(&r.config, "udp");
        assert_eq!(udp.overrides.len(), 1, "{key}");
        assert_eq!(udp.overrides[0].threshold.to_string(), "50/1h", "{key}");
        let live = Live {
            file: file.clone(),
            changes: r.kept.clone(),
            report: Report::default(),
        };
        let listed = live.overrides(&r.config);
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].source, Source::Live);
        assert!(listed[0].replaces_config, "{key}");
        assert_eq!(listed[0].values.threshold, "50/1h");
    }
    // Twice at one key in a hand-edited file: the last one stands, once.
    let changes = Changes {
        rules: BTreeMap::new(),
        overrides: vec![
            spec("udp", Some("198.51.100.8"), None, "50/1h"),
            spec("udp", Some("198.51.100.8/32"), None, "60/1h"),
        ],
    };
    let r = resolve(file.clone(), &changes);
    assert_eq!(r.kept.overrides.len(), 1);
    assert_eq!(r.kept.overrides[0].threshold, "60/1h");
    assert_eq!(rule(&r.config, "udp").overrides.len(), 2);
    // Without live changes, the config's own.
    let live = Live {
        file: file.clone(),
        changes: Changes::default(),
        report: Report::default(),
    };
    let listed = live.overrides(&file);
    assert_eq!(
        serde_json::to_value(&listed).unwrap(),
        serde_json::json!([{
            "rule": "udp", "cidr": "198.51.100.7/32", "threshold": "200/1h",
            "source": "config", "replaces_config": false
        }])
    );
}

/// The maps hold at most `MAX_OVERRIDES` CIDR overrides, the config's and the live ones
/// together: one more is refused with a message that says so; replacing one still fits.
#[test]
fn live_overrides_respect_the_maps_capacity() {
    let mut file = config(Path::new("/nonexistent"), RULES);
    let t: config::Threshold = "5/1s".parse().unwrap();
    let udp = &mut file.rules[0];
    udp.overrides.clear();
    for i in 0..caps::MAX_OVERRIDES {
        let net = ipnet::IpNet::from(std::net::IpAddr::from(std::net::Ipv4Addr::from(
            0x0a00_0000 | i,
        )));
        udp.overrides.push(Override {
            target: OverrideTarget::Cidr(net),
            threshold: t,
            burst: None,
            ban_threshold: None,
            elastic: None,
        });
    }
    let changes = Changes {
        rules: BTreeMap::new(),
        overrides: vec![
            spec("udp", Some("10.0.0.1"), None, "7/1s"),
            spec("udp", Some("192.0.2.1"), None, "7/1s"),
        ],
    };
    let r = resolve(file, &changes);
    assert_eq!(
        r.dropped,
        [format!(
            "live override cidr 192.0.2.1 of rule \"udp\": the override map is full: at most {} \
             CIDR overrides fit across all rules, the config's and the live ones; remove one with \
             `ratelimit override del`",
            caps::MAX_OVERRIDES
        )]
    );
    assert_eq!(r.kept.overrides.len(), 1, "the replacement fits");
    assert_eq!(
        r.config.rules[0].overrides.len(),
        caps::MAX_OVERRIDES as usize
    );
}

/// Saved changes come back at the start; those that no longer fit are dropped, counted, and
/// left out of the file, of which a copy is kept.
#[test]
fn saved_changes_are_restored_and_the_unfitting_dropped_with_a_copy_kept() {
    let dir = temp_dir("restore");
    let saved = serde_json::json!({
        "rules": { "udp": { "threshold": "150/1h" }, "gone": { "preview": true } },
        "overrides": [
            { "rule": "udp", "cidr": "198.51.100.9/32", "threshold": "300/1h" },
            { "rule": "udp", "region": "NL", "threshold": "3/1s" },
            { "rule": "udp", "threshold": 5 },
        ]
    });
    std::fs::write(dir.join(FILE), serde_json::to_vec(&saved).unwrap()).unwrap();
    let (live, cfg) = Live::load(config(&dir, RULES));
    assert_eq!(rule(&cfg, "udp").threshold.to_string(), "150/1h");
    assert_eq!(rule(&cfg, "udp").overrides.len(), 2);
    let r = &live.report;
    assert_eq!((r.rules_changed, r.overrides, r.dropped), (1, 1, 3));
    assert_eq!(r.drops.len(), 3);
    assert!(
        r.drops[0].starts_with("saved live override #3: not an override"),
        "{:?}",
        r.drops
    );
    assert!(r.drops[1].contains("rule \"gone\""), "{:?}", r.drops);
    assert!(
        r.drops[2].contains("region NL of rule \"udp\""),
        "{:?}",
        r.drops
    );
    // The file now holds what is in force; the old one is kept.
    let now: Changes = serde_json::from_slice(&std::fs::read(dir.join(FILE)).unwrap()).unwrap();
    assert_eq!(now, live.changes);
    assert_eq!(now.overrides.len(), 1);
    let copy = r.kept_copy.as_ref().expect("a copy");
    let old: serde_json::Value = serde_json::from_slice(&std::fs::read(copy).unwrap()).unwrap();
    assert_eq!(old, saved);
    // Read again: all of it fits now.
    let (again, cfg2) = Live::load(config(&dir, RULES));
    assert_eq!(again.report.dropped, 0);
    assert_eq!(cfg2, cfg);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A file that is not live changes is moved aside, never overwritten; one that cannot be read
/// at all refuses saving until it is moved away.
#[test]
fn an_unreadable_file_is_moved_aside_or_never_saved_over() {
    let dir = temp_dir("aside");
    std::fs::write(dir.join(FILE), "{ not json").unwrap();
    let (mut live, cfg) = Live::load(config(&dir, RULES));
    assert_eq!(cfg, config(&dir, RULES));
    let aside = live.report.set_aside.clone().expect("set aside");
    assert_eq!(std::fs::read_to_string(&aside).unwrap(), "{ not json");
    assert!(!dir.join(FILE).exists());
    live.save(&Changes::default()).unwrap();
    // A directory where the file should be: cannot be read, nor moved by a file rename.
    std::fs::create_dir_all(dir.join(FILE).join("x")).unwrap();
    let (mut live, _) = Live::load(config(&dir, RULES));
    let why = live.report.save_refused.clone().expect("refused");
    assert!(why.contains("could not be read"), "{why}");
    let e = format!("{:#}", live.save(&Changes::default()).unwrap_err());
    assert!(e.contains("cannot be saved"), "{e}");
    assert!(dir.join(FILE).join("x").exists());
    // Moved away by the operator: saving resumes.
    std::fs::remove_dir_all(dir.join(FILE)).unwrap();
    let changes = Changes {
        rules: BTreeMap::new(),
        overrides: vec![spec("udp", Some("198.51.100.9/32"), None, "300/1h")],
    };
    live.save(&changes).unwrap();
    assert!(live.report.save_refused.is_none());
    let (back, _) = Live::load(config(&dir, RULES));
    assert_eq!(back.changes, changes);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `rule set` changes merge field by field; explicit values stay, derived ones follow.
#[test]
fn rule_changes_merge_field_by_field() {
    let a = RuleChanges {
        threshold: Some("150/1h".into()),
        preview: Some(true),
        ..RuleChanges::default()
    };
    let b = RuleChanges {
        threshold: Some("170/1h".into()),
        soft_limit: Some(0.5),
        ..RuleChanges::default()
    };
    let m = a.merged(&b);
    assert_eq!(
        m.describe(),
        "--threshold 170/1h --preview true --soft-limit 0.5"
    );
    assert!(RuleChanges::default().is_empty());
}
