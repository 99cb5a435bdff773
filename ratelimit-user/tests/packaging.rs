//! The files under `packaging/` agree with the code: the example config validates, the Grafana
//! dashboard only queries metrics that `/metrics` exposes, the systemd unit runs commands the
//! CLI accepts, and the completions and man page come out of the binary. Host-only: no root, no
//! kernel.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
};

use clap::{CommandFactory as _, Parser as _};
use ratelimit_common::{
    caps::{MAX_IFACES, UNLISTED_SLOT},
    stats::PER_IFACE,
};
use ratelimit_user::{
    cli::Cli,
    config::{self, KeyKind, OverrideTarget},
    policy::report::{self, Pb, Stats},
    serve::http::{Gauges, render_metrics},
};

fn packaging(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../packaging")
        .join(file)
}

fn read(file: &str) -> String {
    let path = packaging(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The example with its optional `#~ ` block (GeoIP regions) enabled.
fn uncomment_optional(text: &str) -> String {
    text.lines()
        .map(|l| {
            l.strip_prefix("#~ ")
                .or_else(|| l.strip_prefix("#~"))
                .unwrap_or(l)
        })
        .flat_map(|l| [l, "\n"])
        .collect()
}

#[test]
fn packaging_example_config_validates() {
    let path = packaging("ratelimit.example.toml");
    let cfg = config::load(&path).unwrap_or_else(|e| panic!("{e}"));
    assert!(cfg.rules.len() >= 3, "{} rules", cfg.rules.len());
    // The GeoIP part is off in the file as shipped (see its comment) ...
    assert!(cfg.geoip.is_none());
    assert!(cfg.fleet.is_none());
    assert!(cfg.rules.iter().all(|r| r.key != KeyKind::Region));

    // ... and valid once enabled: a region rule with a region override, and the database.
    let full = uncomment_optional(&read("ratelimit.example.toml"));
    let cfg = config::parse("ratelimit.example.toml (#~ enabled)", &full)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(cfg.geoip.is_some());
    assert!(cfg.fleet.is_some());
    let region = cfg
        .rules
        .iter()
        .find(|r| r.key == KeyKind::Region)
        .expect("a key = \"region\" rule");
    assert!(
        region
            .overrides
            .iter()
            .any(|o| matches!(o.target, OverrideTarget::Region(_)))
    );
}

#[test]
fn packaging_example_config_shows_every_key() {
    let text = uncomment_optional(&read("ratelimit.example.toml"));
    // Keys as written (`key =`), uncommented: every field of the config model.
    let set: BTreeSet<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .flat_map(|l| {
            l.split([',', '{'])
                .filter_map(|part| part.split_once('=').map(|(k, _)| k.trim()))
        })
        .collect();
    for key in [
        "interfaces",
        "xdp_mode",
        "control_socket",
        "http_listen",
        "state_dir",
        "events",
        "events_per_sec",
        "bpffs_dir",
        "max_sources",
        "new_sources_per_sec",
        "allow",
        "deny",
        "database",
        "name",
        "match",
        "protocol",
        "tcp_flags",
        "dst_ports",
        "src",
        "key",
        "ipv4_prefix",
        "ipv6_prefix",
        "action",
        "threshold",
        "count",
        "bytes",
        "interval",
        "algorithm",
        "burst",
        "ban_threshold",
        "ban_duration",
        "exceed_action",
        "preview",
        "soft_limit",
        "cidr",
        "region",
        "redis",
        "host_id",
        "password_file",
        "sync_interval",
        "share_bans",
    ] {
        assert!(set.contains(key), "the example does not set {key:?}");
    }
    // Only valid with an admission rate, so shown in a comment.
    assert!(text.contains("new_sources_burst"));
}

/// A reading of the counters with every verdict, reason and rule counter in it, on one
/// interface and on an unlisted one.
fn synthetic_stats() -> Stats {
    let mut slots = vec![vec![Pb::default(); PER_IFACE as usize]; MAX_IFACES as usize];
    for slot in [UNLISTED_SLOT as usize, 1] {
        for (i, pb) in slots[slot].iter_mut().enumerate() {
            *pb = Pb {
                packets: i as u64 + 1,
                bytes: 100 * (i as u64 + 1),
            };
        }
    }
    report::stats_of(&slots, &[(1, "eth0".into())], &["syn-per-client".into()])
}

/// Series name → label name → label values, from an OpenMetrics exposition.
type Series = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

fn exposed_series() -> Series {
    let text = render_metrics(
        &synthetic_stats(),
        &Gauges {
            active_bans: 1,
            tracked_clients: 10,
            tracked_clients_capacity: 100,
            known_filter: Some((1, 8)),
            tasks: vec![("ban_persistence", true, 0)],
            ..Gauges::default()
        },
    );
    let mut out = Series::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let end = line.find(['{', ' ']).expect(line);
        let labels = out.entry(line[..end].to_owned()).or_default();
        if line[end..].starts_with('{') {
            let close = line.find('}').expect(line);
            for (k, v) in parse_matchers(&line[end + 1..close]) {
                labels.entry(k).or_default().insert(v.1);
            }
        }
    }
    out
}

/// A label matcher: (label, (operator, value)).
type Matcher = (String, (String, String));

/// `a="x",b!~"y"` → [(a, ("=", x)), (b, ("!~", y))]. Values do not contain `"` here.
fn parse_matchers(s: &str) -> Vec<Matcher> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let name_end = rest.find(['=', '!']).expect(s);
        let name = rest[..name_end].trim().to_owned();
        let after = &rest[name_end..];
        let op_len =
            if after.starts_with("=~") || after.starts_with("!=") || after.starts_with("!~") {
                2
            } else {
                1
            };
        let op = after[..op_len].to_owned();
        let value = after[op_len..].trim_start();
        assert!(value.starts_with('"'), "unquoted value in {s:?}");
        let close = value[1..].find('"').expect(s) + 1;
        out.push((name, (op, value[1..close].to_owned())));
        rest = value[close + 1..]
            .trim_start()
            .trim_start_matches(',')
            .trim();
    }
    out
}

/// Every `ratelimit_*` name in a PromQL expression, with its label matchers if it has any.
fn selectors(expr: &str) -> Vec<(String, Vec<Matcher>)> {
    let mut out = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(off) = expr[i..].find("ratelimit_") {
        let start = i + off;
        let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
        if start > 0 && (ident(bytes[start - 1]) || bytes[start - 1] == b'$') {
            i = start + 1;
            continue;
        }
        let mut end = start;
        while end < bytes.len() && ident(bytes[end]) {
            end += 1;
        }
        let name = expr[start..end].to_owned();
        let mut matchers = Vec::new();
        if expr[end..].starts_with('{') {
            let close = end + expr[end..].find('}').expect(expr);
            matchers = parse_matchers(&expr[end + 1..close]);
            end = close + 1;
        }
        out.push((name, matchers));
        i = end;
    }
    out
}

/// Every string under a key named `key`, anywhere in the document.
fn strings_under<'a>(v: &'a serde_json::Value, key: &str, out: &mut Vec<&'a str>) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match v {
                    serde_json::Value::String(s) if k == key => out.push(s),
                    _ => strings_under(v, key, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| strings_under(v, key, out)),
        _ => {}
    }
}

#[test]
fn packaging_grafana_dashboard_queries_only_exported_metrics() {
    let dash: serde_json::Value =
        serde_json::from_str(&read("grafana-dashboard.json")).expect("valid JSON");
    let series = exposed_series();
    // Labels Prometheus adds when it scrapes.
    let scrape_labels = ["instance", "job"];

    assert_eq!(dash["__inputs"][0]["name"], "DS_PROMETHEUS");
    assert_eq!(dash["__inputs"][0]["pluginId"], "prometheus");
    assert!(dash["schemaVersion"].as_u64().unwrap() >= 36);

    let mut exprs = Vec::new();
    strings_under(&dash, "expr", &mut exprs);
    // Template variable queries too.
    strings_under(&dash["templating"], "definition", &mut exprs);
    assert!(exprs.len() >= 12, "{exprs:?}");

    let mut queried = BTreeSet::new();
    for expr in &exprs {
        let sels = selectors(expr);
        assert!(!sels.is_empty(), "{expr:?} queries no ratelimit metric");
        for (name, matchers) in sels {
            let labels = series.get(&name).unwrap_or_else(|| {
                panic!(
                    "{expr:?} queries {name}, which /metrics does not export; it exports {:?}",
                    series.keys().collect::<Vec<_>>()
                )
            });
            for (label, (op, value)) in matchers {
                if scrape_labels.contains(&label.as_str()) {
                    continue;
                }
                let values = labels.get(&label).unwrap_or_else(|| {
                    panic!("{expr:?}: {name} has no label {label:?}; it has {labels:?}")
                });
                if op == "=" && !value.contains('$') {
                    assert!(
                        values.contains(&value),
                        "{expr:?}: {name}{{{label}=\"{value}\"}} matches nothing; values: {values:?}"
                    );
                }
            }
            queried.insert(name);
        }
    }
    for want in [
        "ratelimit_packets_total",
        "ratelimit_bytes_total",
        "ratelimit_reason_packets_total",
        "ratelimit_rule_packets_total",
        "ratelimit_rule_matched_packets_total",
        "ratelimit_rule_bans_issued_total",
        "ratelimit_active_bans",
        "ratelimit_bans_issued_total",
        "ratelimit_tracked_clients",
        "ratelimit_tracked_clients_capacity",
        "ratelimit_map_fill_ratio",
        "ratelimit_client_states_evicted_total",
        "ratelimit_events_lost_total",
    ] {
        assert!(queried.contains(want), "no panel shows {want}");
    }
    for outcome in ["dropped", "would_drop", "exceed_passed"] {
        assert!(
            exprs
                .iter()
                .any(|e| e.contains("ratelimit_rule_packets_total{")
                    && e.contains("outcome=")
                    && e.contains(outcome)),
            "no panel shows rule outcome {outcome}"
        );
    }
    assert!(
        exprs
            .iter()
            .any(|e| e.contains("reason=\"admission_refused\"")),
        "no panel shows admission refused"
    );
    // No query sums a family with a series that is the sum of others: there are none to
    // exclude, and a query that excludes one (interface!="all") is left from before.
    for expr in &exprs {
        assert!(!expr.contains("\"all\""), "{expr:?}");
    }

    // Every panel queries the imported data source.
    let panels = dash["panels"].as_array().unwrap();
    for p in panels.iter().filter(|p| p["type"] != "row") {
        assert_eq!(p["datasource"]["uid"], "${DS_PROMETHEUS}", "{}", p["title"]);
        for t in p["targets"].as_array().expect("targets") {
            assert_eq!(t["datasource"]["uid"], "${DS_PROMETHEUS}", "{}", p["title"]);
        }
    }
    let ids: BTreeSet<_> = panels.iter().map(|p| p["id"].as_u64().unwrap()).collect();
    assert_eq!(ids.len(), panels.len(), "panel ids are unique");
}

#[test]
fn packaging_selector_parser() {
    let s = selectors(
        r#"sum by (rule) (rate(ratelimit_rule_packets_total{outcome="dropped",rule=~"$rule"}[5m])) / ratelimit_up"#,
    );
    assert_eq!(s.len(), 2);
    assert_eq!(s[0].0, "ratelimit_rule_packets_total");
    assert_eq!(
        s[0].1,
        [
            ("outcome".into(), ("=".into(), "dropped".into())),
            ("rule".into(), ("=~".into(), "$rule".into())),
        ]
    );
    assert_eq!(s[1], ("ratelimit_up".into(), vec![]));
    let series = exposed_series();
    assert_eq!(
        series["ratelimit_packets_total"]["interface"],
        ["", "eth0"].map(String::from).into()
    );
    assert!(series["ratelimit_rule_packets_total"]["outcome"].contains("would_drop"));
    assert!(!series["ratelimit_rule_packets_total"]["outcome"].contains("matched"));
    assert!(series.contains_key("ratelimit_build_info"));
}

#[test]
fn packaging_systemd_unit_and_logrotate() {
    let unit = read("ratelimit.service");
    let lines: Vec<&str> = unit.lines().map(str::trim).collect();
    for want in [
        "ExecStart=/usr/local/bin/ratelimit run --config /etc/ratelimit/ratelimit.toml",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "Restart=on-failure",
        "CapabilityBoundingSet=CAP_BPF CAP_NET_ADMIN CAP_PERFMON CAP_SYS_ADMIN",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ReadWritePaths=/sys/fs/bpf /run/ratelimit /var/lib/ratelimit /var/log/ratelimit",
        "RuntimeDirectory=ratelimit",
        "RuntimeDirectoryMode=0700",
        "StateDirectory=ratelimit",
        "LogsDirectory=ratelimit",
    ] {
        assert!(lines.contains(&want), "the unit lacks {want:?}");
    }
    // It must not make /sys (and so /sys/fs/bpf) read-only.
    assert!(
        !lines
            .iter()
            .any(|l| l.starts_with("ProtectKernelTunables="))
    );
    assert!(
        unit.contains("ratelimit detach"),
        "the unit explains detach"
    );

    // Every ratelimit command line in the unit is one the CLI accepts.
    let mut seen = 0;
    for l in &lines {
        let Some((key, cmd)) = l.split_once('=') else {
            continue;
        };
        if !key.starts_with("Exec") {
            continue;
        }
        let cmd = cmd.trim_start_matches(['+', '-', '@', '!', ':']);
        if let Some(args) = cmd.strip_prefix("/usr/local/bin/ratelimit ") {
            let argv = std::iter::once("ratelimit").chain(args.split_whitespace());
            Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("{l}: {e}"));
            seen += 1;
        }
    }
    assert!(seen >= 2, "{seen} ratelimit command lines");

    let rotate = read("ratelimit.logrotate");
    assert!(rotate.contains("/var/log/ratelimit/"));
    let post = rotate
        .split_once("postrotate")
        .and_then(|(_, rest)| rest.split_once("endscript"))
        .expect("a postrotate script")
        .0;
    assert!(post.contains("systemctl kill -s USR1 ratelimit"), "{post}");
}

fn run(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ratelimit"))
        .args(args)
        .output()
        .expect("running ratelimit");
    assert!(
        out.status.success(),
        "ratelimit {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

#[test]
fn packaging_completions() {
    let bash = run(&["completions", "bash"]);
    assert!(bash.contains("_ratelimit()"), "{bash}");
    assert!(bash.contains("check-config"));
    // The packaging commands are hidden from completion.
    assert!(!bash.contains("manpage"));
    for shell in ["zsh", "fish", "elvish", "powershell"] {
        let script = run(&["completions", shell]);
        assert!(script.contains("ratelimit"), "{shell}: {script}");
    }
    let bad = Command::new(env!("CARGO_BIN_EXE_ratelimit"))
        .args(["completions", "tcsh"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
}

#[test]
fn packaging_manpage_covers_every_command() {
    let page = run(&["manpage"]);
    assert!(
        page.lines()
            .any(|l| l.starts_with(".TH RATELIMIT 8 ") && l.contains("System Administration")),
        "{page}"
    );
    // roff escapes '-' in text; undo it to search.
    let text = page.replace("\\-", "-");
    let sections: Vec<&str> = text.lines().filter(|l| l.starts_with(".SS ")).collect();
    let cmd = Cli::command();
    let mut visible = 0;
    for sub in cmd.get_subcommands() {
        let section = format!(".SS \"ratelimit {}\"", sub.get_name());
        if sub.is_hide_set() {
            assert!(!sections.contains(&section.as_str()), "{section}");
        } else {
            visible += 1;
            assert!(
                sections.contains(&section.as_str()),
                "no section for `ratelimit {}`; sections: {sections:?}",
                sub.get_name()
            );
        }
    }
    assert!(visible >= 11, "{visible}");
    for nested in [
        "ratelimit ban add",
        "ratelimit ban del",
        "ratelimit rule set",
        "ratelimit rule reset",
        "ratelimit override add",
        "ratelimit override del",
    ] {
        assert!(sections.contains(&format!(".SS \"{nested}\"").as_str()));
    }
    for section in [
        "SYNOPSIS",
        "DESCRIPTION",
        "OPTIONS",
        "COMMANDS",
        "FILES",
        "SIGNALS",
    ] {
        assert!(
            text.lines().any(|l| l == format!(".SH {section}")),
            "no {section}"
        );
    }
    // The exit status the CLI gives (tests/cli.rs checks them): 1 for an error, 2 for usage.
    let status = text
        .split(".SH \"EXIT STATUS\"")
        .nth(1)
        .and_then(|t| t.split(".SH ").next())
        .expect("an EXIT STATUS section");
    assert!(
        status.contains("1 on any error") && status.contains("2 for a usage error"),
        "{status}"
    );
    // Options of the commands, from the clap definitions.
    for opt in ["--xdp-mode", "--ban-threshold", "--bpffs-dir", "--for"] {
        assert!(text.contains(opt), "{opt}");
    }
    // One roff preamble, at the top.
    assert_eq!(page.matches(".ds Aq").count(), 2, "{page}");
    assert!(page.starts_with(".ie"));

    // Same page for the same SOURCE_DATE_EPOCH.
    let at = |epoch: &str| {
        Command::new(env!("CARGO_BIN_EXE_ratelimit"))
            .arg("manpage")
            .env("SOURCE_DATE_EPOCH", epoch)
            .output()
            .unwrap()
            .stdout
    };
    let page = String::from_utf8(at("86400")).unwrap();
    assert!(page.contains(".TH RATELIMIT 8 1970-01-02 "), "{page}");
    assert_eq!(at("86400"), at("86400"));
}
