use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ipnet::IpNet;
use ratelimit_common::caps;

use super::*;

/// The example from SPEC.md, "Config file (TOML)", verbatim.
const SPEC_EXAMPLE: &str = r#"[daemon]
interfaces = ["eth0"]
xdp_mode = "auto"                      # auto = native, falling back to generic
control_socket = "/run/ratelimit/control.sock"   # root-only (0600)
http_listen = "127.0.0.1:9477"         # GET /metrics (Prometheus) and read-only JSON /v1/...
state_dir = "/var/lib/ratelimit"       # bans survive restarts here
events = "/var/log/ratelimit/events.jsonl"       # optional; "-" = stdout

[tracking]
max_sources = 1_000_000                # bound on per-client state, whatever the flood

[lists]
allow = ["10.0.0.0/8", "2001:db8:1::/48"]   # never limited, never banned
deny  = ["203.0.113.0/24"]                   # always dropped

[geoip]
database = "/usr/share/GeoIP/GeoLite2-Country.mmdb"  # MaxMind format; needed for key = "region"

[[rule]]
name = "syn-per-client"
match = { protocol = "tcp", tcp_flags = "syn", dst_ports = ["80", "443", "8000-8100"] }
key = "ip"                 # "all" | "ip" | "region"
ipv4_prefix = 32           # key = ip: aggregate clients per prefix (IPv6 default 64)
ipv6_prefix = 64
action = "rate_based_ban"  # "throttle" | "rate_based_ban"
threshold = { count = 2000, interval = "20m" }      # or { bytes = "10MiB", interval = "1s" }
algorithm = "sliding_window"                        # | "token_bucket" (+ burst) | "fixed_window"
ban_threshold = { count = 3000, interval = "20m" }  # default: the threshold
ban_duration = "1h"
exceed_action = "drop"     # | "pass" (count and report only)
preview = false            # true: never drop for this rule, report what would have been dropped
soft_limit = 0.8           # clients above this share of the threshold are reported as offenders

[[rule.override]]          # per-client thresholds; the most specific prefix wins
cidr = "192.168.11.3/32"
threshold = { count = 100000, interval = "20m" }

[[rule.override]]          # with key = "region"
region = "ZZ"              # ISO country code; ZZ = unknown
threshold = { count = 10, interval = "1s" }
"#;

/// The example with its region override moved to a rule of its own with `key = "region"`
/// (the example puts both kinds of override in one `key = "ip"` rule, which is rejected).
fn spec_example_fixed() -> String {
    let (head, region_override) = SPEC_EXAMPLE
        .split_once("[[rule.override]]          # with key = \"region\"\n")
        .unwrap();
    format!(
        "{head}[[rule]]\nname = \"per-country\"\nkey = \"region\"\n\
         threshold = {{ bytes = \"10MiB\", interval = \"1s\" }}\n\
         [[rule.override]]\n{}",
        region_override.replace("count = 10,", "bytes = 100000,")
    )
}

const FILE: &str = "t.toml";

/// Every error as `file:line:col: message`.
pub(super) fn errors(text: &str) -> Vec<String> {
    match parse(FILE, text) {
        Ok(_) => Vec::new(),
        Err(e) => e.0.iter().map(ToString::to_string).collect(),
    }
}

/// The single error `text` produces.
#[track_caller]
pub(super) fn error(text: &str) -> String {
    let errors = errors(text);
    assert_eq!(errors.len(), 1, "expected one error, got {errors:#?}");
    errors.into_iter().next().unwrap()
}

/// `t.toml:L:C: message` where L:C is the start of the `nth` (0-based) occurrence of `needle`.
#[track_caller]
pub(super) fn at(text: &str, needle: &str, nth: usize, message: &str) -> String {
    let offset = text
        .match_indices(needle)
        .nth(nth)
        .unwrap_or_else(|| panic!("{needle:?} #{nth} not in text"))
        .0;
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let col = before[before.rfind('\n').map_or(0, |i| i + 1)..]
        .chars()
        .count()
        + 1;
    format!("{FILE}:{line}:{col}: {message}")
}

#[track_caller]
pub(super) fn ok(text: &str) -> Config {
    parse(FILE, text).unwrap_or_else(|e| panic!("unexpected errors:\n{e}"))
}

/// A valid rule named `name` followed by `extra` lines.
pub(super) fn rule(name: &str, extra: &str) -> String {
    format!("[[rule]]\nname = \"{name}\"\nthreshold = {{ count = 10, interval = \"1s\" }}\n{extra}")
}

pub(super) fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn pkts(amount: u64, secs: u64) -> Threshold {
    Threshold {
        amount,
        unit: Unit::Packets,
        interval: Duration::from_secs(secs),
    }
}

// ---------------------------------------------------------------------------------------------
// The SPEC example and defaults

#[test]
fn spec_example_verbatim_only_rejects_region_override_on_ip_rule() {
    assert_eq!(
        errors(SPEC_EXAMPLE),
        [at(
            SPEC_EXAMPLE,
            "region = \"ZZ\"",
            0,
            "rule \"syn-per-client\": override #2: region overrides need key = \"region\" \
             (this rule has key = \"ip\")"
        )]
    );
}

#[test]
fn spec_example_parses() {
    let c = ok(&spec_example_fixed());
    assert_eq!(
        c.daemon,
        Daemon {
            interfaces: vec!["eth0".into()],
            xdp_mode: XdpMode::Auto,
            control_socket: "/run/ratelimit/control.sock".into(),
            http_listen: Some("127.0.0.1:9477".parse().unwrap()),
            state_dir: "/var/lib/ratelimit".into(),
            events: Some(EventsSink::File("/var/log/ratelimit/events.jsonl".into())),
            events_per_sec: 1000,
            bpffs_dir: "/sys/fs/bpf/ratelimit".into(),
        }
    );
    assert_eq!(
        c.tracking,
        Tracking {
            max_sources: 1_000_000,
            new_sources_per_sec: 16_667,
            new_sources_auto: true,
            new_sources_burst: 16_667,
            syn_cookies: true,
        }
    );
    assert_eq!(c.lists.allow, [net("10.0.0.0/8"), net("2001:db8:1::/48")]);
    assert_eq!(c.lists.deny, [net("203.0.113.0/24")]);
    assert_eq!(
        c.geoip,
        Some(GeoIp {
            database: "/usr/share/GeoIP/GeoLite2-Country.mmdb".into()
        })
    );
    assert_eq!(c.rules.len(), 2);

    let r = &c.rules[0];
    assert_eq!(r.name, "syn-per-client");
    assert_eq!(
        r.matcher,
        Match {
            protocol: Some(Protocol::Tcp),
            tcp_flags: Some(TcpFlags {
                mask: TcpFlags::SYN | TcpFlags::ACK,
                value: TcpFlags::SYN
            }),
            dst_ports: vec![(80, 80), (443, 443), (8000, 8100)],
            ..Match::default()
        }
    );
    assert_eq!(r.key, KeyKind::Ip);
    assert_eq!((r.ipv4_prefix, r.ipv6_prefix), (32, 64));
    assert_eq!(r.action, Action::RateBasedBan);
    assert_eq!(r.threshold, pkts(2000, 20 * 60));
    assert_eq!(r.algorithm, Algorithm::SlidingWindow);
    assert_eq!(r.burst, 2000);
    assert_eq!(r.ban_threshold, pkts(3000, 20 * 60));
    assert_eq!(r.ban_duration, Duration::from_secs(3600));
    assert_eq!(r.exceed_action, ExceedAction::Drop);
    assert!(!r.preview);
    assert_eq!(r.soft_limit, 0.8);
    assert_eq!(
        r.overrides,
        [Override {
            target: OverrideTarget::Cidr(net("192.168.11.3/32")),
            threshold: pkts(100_000, 20 * 60),
            burst: None,
            ban_threshold: None,
            elastic: None,
        }]
    );

    let r = &c.rules[1];
    assert_eq!(r.name, "per-country");
    assert_eq!(r.key, KeyKind::Region);
    assert_eq!(
        r.threshold,
        Threshold {
            amount: 10 << 20,
            unit: Unit::Bytes,
            interval: Duration::from_secs(1)
        }
    );
    assert_eq!(
        r.overrides,
        [Override {
            target: OverrideTarget::Region(*b"ZZ"),
            threshold: Threshold {
                amount: 100_000,
                unit: Unit::Bytes,
                interval: Duration::from_secs(1)
            },
            burst: None,
            ban_threshold: None,
            elastic: None,
        }]
    );
}

#[test]
fn empty_config_is_all_defaults() {
    let c = ok("");
    assert_eq!(c, Config::default());
    assert!(c.rules.is_empty() && c.geoip.is_none());
    assert_eq!(c.lists, Lists::default());
    let d = Daemon::default();
    assert!(d.interfaces.is_empty());
    assert_eq!(d.xdp_mode, XdpMode::Auto);
    assert_eq!(d.control_socket, Path::new("/run/ratelimit/control.sock"));
    assert_eq!(
        d.http_listen,
        Some("127.0.0.1:9477".parse::<SocketAddr>().unwrap())
    );
    assert_eq!(d.state_dir, Path::new("/var/lib/ratelimit"));
    assert_eq!(d.events, None);
    assert_eq!(d.events_per_sec, 1000);
    assert_eq!(d.bpffs_dir, Path::new("/sys/fs/bpf/ratelimit"));
    let t = Tracking::default();
    assert_eq!(t.max_sources, caps::DEFAULT_MAX_SOURCES);
    assert_eq!(
        (
            t.new_sources_per_sec,
            t.new_sources_burst,
            t.new_sources_auto
        ),
        (16_667, 16_667, true)
    );
}

#[test]
fn rule_defaults() {
    let c = ok(&rule("r", ""));
    assert_eq!(
        c.rules,
        [Rule {
            name: "r".into(),
            matcher: Match::default(),
            key: KeyKind::Ip,
            ipv4_prefix: 32,
            ipv6_prefix: 64,
            action: Action::Throttle,
            threshold: pkts(10, 1),
            algorithm: Algorithm::SlidingWindow,
            burst: 10,
            ban_threshold: pkts(10, 1),
            ban_duration: Duration::ZERO,
            exceed_action: ExceedAction::Drop,
            preview: false,
            soft_limit: 0.8,
            elastic: None,
            scope: Scope::Local,
            overrides: vec![],
        }]
    );
}

#[test]
fn explicit_values() {
    let c = ok(&format!(
        "[daemon]\nxdp_mode = \"generic\"\nhttp_listen = \"[::1]:9000\"\nevents = \"-\"\n\
         bpffs_dir = \"/sys/fs/bpf/rl2\"\n\
         [tracking]\nnew_sources_per_sec = 500\n\
         [lists]\nallow = [\"10.1.2.3\", \"2001:db8::1\"]\n{}",
        rule(
            "tb",
            "algorithm = \"token_bucket\"\nburst = 25\nkey = \"all\"\nexceed_action = \"pass\"\n\
             preview = true\nsoft_limit = 1\n\
             match = { protocol = \"udp\", dst_ports = [53, \"5353\"], \
             src = [\"192.0.2.0/24\", \"192.0.2.0/24\", \"2001:db8::/32\"] }\n\
             [[rule.override]]\ncidr = \"192.0.2.7\"\n\
             threshold = { count = 50, interval = \"1s\" }\nburst = 100\n"
        )
    ));
    assert_eq!(c.daemon.xdp_mode, XdpMode::Generic);
    assert_eq!(c.daemon.http_listen, Some("[::1]:9000".parse().unwrap()));
    assert_eq!(c.daemon.events, Some(EventsSink::Stdout));
    assert_eq!(c.daemon.bpffs_dir, PathBuf::from("/sys/fs/bpf/rl2"));
    assert_eq!(c.tracking.new_sources_per_sec, 500);
    assert_eq!(c.tracking.new_sources_burst, 500);
    assert_eq!(c.lists.allow, [net("10.1.2.3/32"), net("2001:db8::1/128")]);
    let r = &c.rules[0];
    assert_eq!(r.algorithm, Algorithm::TokenBucket);
    assert_eq!(r.burst, 25);
    assert_eq!(r.key, KeyKind::All);
    assert_eq!(r.exceed_action, ExceedAction::Pass);
    assert!(r.preview);
    assert_eq!(r.soft_limit, 1.0);
    assert_eq!(r.matcher.protocol, Some(Protocol::Udp));
    assert_eq!(r.matcher.dst_ports, [(53, 53), (5353, 5353)]);
    assert_eq!(
        r.matcher.src,
        [net("192.0.2.0/24"), net("2001:db8::/32")],
        "duplicates dropped"
    );
    assert_eq!(
        r.overrides[0].target,
        OverrideTarget::Cidr(net("192.0.2.7/32"))
    );
    assert_eq!(r.overrides[0].burst, Some(100));

    for off in ["\"off\"", "\"\""] {
        let c = ok(&format!("[daemon]\nhttp_listen = {off}\n"));
        assert_eq!(c.daemon.http_listen, None);
    }
    let c = ok("[tracking]\nnew_sources_per_sec = 100\nnew_sources_burst = 1000\n");
    assert_eq!(c.tracking.new_sources_burst, 1000);
    // Dotted keys and sub-tables work as well as inline tables.
    let c = ok(&format!(
        "daemon.xdp_mode = \"native\"\n{}[rule.match]\nprotocol = \"icmp\"\n",
        "[[rule]]\nname = \"r\"\n[rule.threshold]\nbytes = \"100 KB\"\ninterval = \"500ms\"\n"
    ));
    assert_eq!(c.daemon.xdp_mode, XdpMode::Native);
    assert_eq!(c.rules[0].matcher.protocol, Some(Protocol::Icmp));
    assert_eq!(
        c.rules[0].threshold,
        Threshold {
            amount: 100_000,
            unit: Unit::Bytes,
            interval: Duration::from_millis(500)
        }
    );
}

#[test]
fn bytes_burst_and_ban_threshold_in_bytes() {
    let c = ok(
        "[[rule]]\nname = \"b\"\nthreshold = { bytes = \"1MiB\", interval = \"1s\" }\n\
         algorithm = \"token_bucket\"\nburst = \"4MiB\"\naction = \"rate_based_ban\"\n\
         ban_threshold = { bytes = \"1GB\", interval = \"10s\" }\nban_duration = \"1d\"\n",
    );
    let r = &c.rules[0];
    assert_eq!(r.burst, 4 << 20);
    assert_eq!(r.ban_threshold.amount, 1_000_000_000);
    assert_eq!(r.ban_threshold.unit, Unit::Bytes);
    assert_eq!(r.ban_duration, Duration::from_secs(86_400));
}

#[test]
fn load_reads_files_and_reports_read_errors() {
    let path =
        std::env::temp_dir().join(format!("ratelimit-config-test-{}.toml", std::process::id()));
    std::fs::write(&path, spec_example_fixed()).unwrap();
    let c = load(&path).unwrap();
    assert_eq!(c.rules.len(), 2);
    std::fs::write(&path, "[daemon]\nxdp_mode = 1\n").unwrap();
    let e = load(&path).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}:2:12: daemon.xdp_mode must be a string, not an integer",
            path.display()
        )
    );
    std::fs::remove_file(&path).unwrap();

    let missing = Path::new("/nonexistent/ratelimit.toml");
    let e = load(missing).unwrap_err();
    assert_eq!(
        e.0,
        [ConfigError {
            file: "/nonexistent/ratelimit.toml".into(),
            line: 1,
            col: 1,
            // The OS's words, e.g. "No such file or directory (os error 2)".
            message: std::fs::read(missing).unwrap_err().to_string(),
        }]
    );
}

// ---------------------------------------------------------------------------------------------
// Errors: syntax, unknown keys, types

#[test]
fn syntax_errors() {
    assert_eq!(
        error("[daemon\n"),
        "t.toml:1:8: invalid TOML: invalid table header, expected `.`, `]`"
    );
    assert_eq!(
        error("a = 1\na = 2\n"),
        "t.toml:2:1: invalid TOML: duplicate key `a` in document root"
    );
    assert_eq!(
        error("[daemon]\nxdp_mode = \"auto\n"),
        "t.toml:2:17: invalid TOML: invalid basic string"
    );
}

#[test]
fn unknown_keys() {
    assert_eq!(
        error("[daemon]\nxdp_mod = \"auto\"\n"),
        "t.toml:2:1: daemon: unknown key \"xdp_mod\"; did you mean \"xdp_mode\"?"
    );
    assert_eq!(
        error("[[rules]]\nname = \"x\"\n"),
        "t.toml:1:3: unknown key \"rules\"; did you mean \"rule\"?"
    );
    assert_eq!(
        error("[daemon]\nfoo = 1\n"),
        "t.toml:2:1: daemon: unknown key \"foo\"; expected one of interfaces, xdp_mode, \
         control_socket, http_listen, state_dir, events, events_per_sec, bpffs_dir"
    );
    // In inline tables, sub-tables, dotted keys and overrides.
    let text = rule(
        "r",
        "match = { protocol = \"tcp\", port = 80 }\nban_treshold = 5\n\
         [[rule.override]]\ncidr = \"10.0.0.0/8\"\nthreshold = { count = 1, interval = \"1s\", x = 1 }\n\
         [tracking]\nmax_source = 5\n[geoip]\ndatabase = \"/x\"\nextra.y = 1\n",
    );
    assert_eq!(
        errors(&text),
        [
            at(
                &text,
                "port",
                0,
                "rule \"r\": match: unknown key \"port\"; expected one of protocol, tcp_flags, dst_ports, src_ports, src, dst, length, ttl, fragment, icmp_types, icmp_codes, payload, tcp_state"
            ),
            at(
                &text,
                "ban_treshold",
                0,
                "rule \"r\": unknown key \"ban_treshold\"; did you mean \"ban_threshold\"?"
            ),
            at(
                &text,
                "x = 1",
                0,
                "rule \"r\": override #1: threshold: unknown key \"x\"; expected one of count, bytes, interval"
            ),
            at(
                &text,
                "max_source",
                0,
                "tracking: unknown key \"max_source\"; did you mean \"max_sources\"?"
            ),
            at(
                &text,
                "extra",
                0,
                "geoip: unknown key \"extra\"; expected one of database"
            ),
        ]
    );
}

#[test]
fn wrong_types() {
    let text = "daemon = 1\nrule = 2\n";
    assert_eq!(
        errors(text),
        [
            "t.toml:1:10: daemon must be a table, not an integer",
            "t.toml:2:8: rule must be an array of tables (write [[rule]]), not an integer",
        ]
    );
    assert_eq!(
        error("[rule]\nname = \"x\"\n"),
        "t.toml:1:1: rule must be an array of tables (write [[rule]]), not a table"
    );
    let text = "[daemon]\ninterfaces = \"eth0\"\nxdp_mode = 1979-05-27\n\
                [tracking]\nmax_sources = \"big\"\n[lists]\nallow = [\"10.0.0.0/8\", 5]\n";
    assert_eq!(
        errors(text),
        [
            at(
                text,
                "\"eth0\"",
                0,
                "daemon.interfaces must be an array, not a string"
            ),
            at(
                text,
                "1979",
                0,
                "daemon.xdp_mode must be a string, not a date-time"
            ),
            at(
                text,
                "\"big\"",
                0,
                "tracking.max_sources must be an integer, not a string"
            ),
            at(
                text,
                "5]",
                0,
                "lists.allow: each entry must be a string, not an integer"
            ),
        ]
    );
    let text = rule(
        "r",
        "preview = \"yes\"\nsoft_limit = \"high\"\nmatch = \"tcp\"\n\
         [[rule.override]]\ncidr = 10\nthreshold = { count = \"5\", interval = 5 }\n",
    );
    assert_eq!(
        errors(&text),
        [
            at(
                &text,
                "\"yes\"",
                0,
                "rule \"r\": preview must be true or false, not a string"
            ),
            at(
                &text,
                "\"high\"",
                0,
                "rule \"r\": soft_limit must be a number, not a string"
            ),
            at(
                &text,
                "\"tcp\"",
                0,
                "rule \"r\": match must be a table, not a string"
            ),
            at(
                &text,
                "10\n",
                0,
                "rule \"r\": override #1: cidr must be a string, not an integer"
            ),
            at(
                &text,
                "\"5\"",
                0,
                "rule \"r\": override #1: threshold.count must be an integer, not a string"
            ),
            at(
                &text,
                "5 }",
                0,
                "rule \"r\": override #1: threshold.interval must be a duration string such as \"30s\", not an integer"
            ),
        ]
    );
}

// ---------------------------------------------------------------------------------------------
// Errors: values

#[test]
fn bad_addresses() {
    let text = "[lists]\nallow = [\"192.168.1.1/24\", \"10.0.0.256\", \"10.0.0.0/33\", \
                \"::1/64\", \"fe80::/x\"]\n";
    assert_eq!(
        errors(text),
        [
            "t.toml:2:10: lists.allow: 192.168.1.1/24 has host bits set; did you mean 192.168.1.0/24?".to_string(),
            at(text, "\"10.0.0.256", 0, "lists.allow: \"10.0.0.256\" is not an IP address or CIDR"),
            at(text, "\"10.0.0.0/33", 0, "lists.allow: 10.0.0.0/33: the prefix length must be a number from 0 to 32"),
            at(text, "\"::1/64", 0, "lists.allow: ::1/64 has host bits set; did you mean ::/64?"),
            at(text, "\"fe80", 0, "lists.allow: fe80::/x: the prefix length must be a number from 0 to 128"),
        ]
    );
    let text = rule("r", "match = { src = [\"1.2.3.4/8\"] }\n");
    assert_eq!(
        error(&text),
        at(
            &text,
            "\"1.2.3.4/8",
            0,
            "rule \"r\": match.src: 1.2.3.4/8 has host bits set; did you mean 1.0.0.0/8?"
        )
    );
}

#[test]
fn bad_thresholds_and_durations() {
    let text =
        "[[rule]]\nname = \"syn-per-client\"\nthreshold = { count = 5, interval = \"0s\" }\n";
    assert_eq!(
        error(text),
        "t.toml:3:37: rule \"syn-per-client\": threshold.interval must be greater than 0"
    );
    let text = "[[rule]]\nname = \"r\"\nthreshold = { count = 0, interval = \"25h\" }\n";
    assert_eq!(
        errors(text),
        [
            "t.toml:3:23: rule \"r\": threshold.count must be at least 1",
            "t.toml:3:37: rule \"r\": threshold.interval must be at most 1d",
        ]
    );
    let text = "[[rule]]\nname = \"r\"\nthreshold = { count = 1, interval = \"20x\" }\n";
    let e = error(text);
    assert!(
        e.starts_with("t.toml:3:37: rule \"r\": threshold.interval: \"20x\" is not a duration ("),
        "{e}"
    );
    let text = "[[rule]]\nname = \"r\"\nthreshold = { bytes = 0, interval = \"1s\" }\n";
    assert_eq!(
        error(text),
        "t.toml:3:23: rule \"r\": threshold.bytes must be at least 1"
    );
    let text =
        "[[rule]]\nname = \"r\"\nthreshold = { bytes = \"10 parsecs\", interval = \"1s\" }\n";
    assert!(error(text).starts_with(
        "t.toml:3:23: rule \"r\": threshold.bytes: \"10 parsecs\" is not a byte size"
    ));
    let text = "[[rule]]\nname = \"r\"\nthreshold = { count = 1, bytes = 5, interval = \"1s\" }\n";
    assert_eq!(
        error(text),
        "t.toml:3:26: rule \"r\": threshold.bytes cannot be combined with threshold.count: \
         a threshold counts packets or bytes"
    );
    let text = "[[rule]]\nname = \"r\"\nthreshold = { interval = \"1s\" }\n";
    assert_eq!(
        error(text),
        "t.toml:3:13: rule \"r\": threshold needs count (packets) or bytes"
    );
    let text = "[[rule]]\nname = \"r\"\nthreshold = { count = 1 }\n";
    assert_eq!(
        error(text),
        "t.toml:3:13: rule \"r\": threshold.interval is required"
    );
    let text = "[[rule]]\nname = \"r\"\n";
    assert_eq!(error(text), "t.toml:1:1: rule \"r\": threshold is required");
}

#[test]
fn rule_names() {
    let text = format!("{}{}", rule("a", ""), rule("a", ""));
    assert_eq!(
        error(&text),
        at(
            &text,
            "\"a\"",
            1,
            "rule \"a\": duplicate rule name; the rule at line 1 has the same name"
        )
    );
    let text = rule("", "");
    assert_eq!(error(&text), "t.toml:2:8: rule #1: name must not be empty");
    let text = "[[rule]]\nthreshold = { count = 1, interval = \"1s\" }\n";
    assert_eq!(error(text), "t.toml:1:1: rule #1: name is required");
}

#[test]
fn region_key_needs_geoip() {
    let text = rule("r", "key = \"region\"\n");
    assert_eq!(
        error(&text),
        "t.toml:4:1: rule \"r\": key = \"region\" needs a [geoip] database"
    );
    assert!(errors(&format!("[geoip]\ndatabase = \"/x.mmdb\"\n{text}")).is_empty());
    assert_eq!(error("[geoip]\n"), "t.toml:1:1: geoip.database is required");
}

#[test]
fn override_targets_must_fit_the_key() {
    let text = rule(
        "r",
        "[[rule.override]]\nregion = \"DE\"\nthreshold = { count = 1, interval = \"1s\" }\n",
    );
    assert_eq!(
        error(&text),
        "t.toml:5:1: rule \"r\": override #1: region overrides need key = \"region\" \
         (this rule has key = \"ip\")"
    );
    let text = format!(
        "[geoip]\ndatabase = \"/x\"\n{}",
        rule(
            "r",
            "key = \"region\"\n\
             [[rule.override]]\ncidr = \"10.0.0.0/8\"\nthreshold = { count = 1, interval = \"1s\" }\n\
             [[rule.override]]\nregion = \"de\"\nthreshold = { count = 1, interval = \"1s\" }\n\
             [[rule.override]]\nregion = \"DEU\"\nthreshold = { count = 1, interval = \"1s\" }\n\
             [[rule.override]]\nregion = \"FR\"\nthreshold = { bytes = 70000, interval = \"1s\" }\n\
             [[rule.override]]\nregion = \"FR\"\ncidr = \"10.0.0.0/8\"\nthreshold = { count = 1, interval = \"1s\" }\n\
             [[rule.override]]\nthreshold = { count = 1, interval = \"1s\" }\n\
             [[rule.override]]\nregion = \"FR\"\nthreshold = { count = 1, interval = \"1s\" }\n\
             [[rule.override]]\nregion = \"FR\"\nthreshold = { count = 1, interval = \"1s\" }\n"
        )
    );
    assert_eq!(
        errors(&text),
        [
            at(
                &text,
                "cidr",
                0,
                "rule \"r\": override #1: cidr overrides need key = \"ip\" or \"all\" (this rule has key = \"region\")"
            ),
            at(
                &text,
                "\"de\"",
                0,
                "rule \"r\": override #2: region: \"de\" must be uppercase; did you mean \"DE\"?"
            ),
            at(
                &text,
                "\"DEU\"",
                0,
                "rule \"r\": override #3: region: \"DEU\" is not a two-letter country code (ISO 3166 alpha-2; \"ZZ\" is unknown)"
            ),
            at(
                &text,
                "{ bytes",
                0,
                "rule \"r\": override #4: threshold counts bytes but the rule's threshold counts packets; both must count the same"
            ),
            at(
                &text,
                "region = \"FR\"\ncidr",
                0,
                "rule \"r\": override #5: region cannot be combined with cidr: an override is for a network or a region"
            ),
            at(
                &text,
                "[[rule.override]]\nthreshold",
                0,
                "rule \"r\": override #6: needs cidr or region"
            ),
            at(
                &text,
                "\"FR\"",
                2,
                "rule \"r\": override #7: region FR already has an override in this rule (line 17)"
            ),
            at(
                &text,
                "\"FR\"",
                3,
                "rule \"r\": override #8: region FR already has an override in this rule (line 17)"
            ),
        ]
    );
}

#[test]
fn action_and_algorithm_dependent_fields() {
    let text = rule(
        "r",
        "burst = 5\nban_threshold = { count = 20, interval = \"1s\" }\nban_duration = \"1h\"\n\
         ipv6_prefix = 48\n",
    );
    assert_eq!(
        errors(&text),
        [
            "t.toml:4:1: rule \"r\": burst only applies to algorithm = \"token_bucket\" (this rule uses \"sliding_window\")",
            "t.toml:5:1: rule \"r\": ban_threshold only applies to action = \"rate_based_ban\"",
            "t.toml:6:1: rule \"r\": ban_duration only applies to action = \"rate_based_ban\"",
        ]
    );
    let text = rule(
        "r",
        "action = \"rate_based_ban\"\nban_threshold = { bytes = 70000, interval = \"1s\" }\n",
    );
    assert_eq!(
        errors(&text),
        [
            "t.toml:4:1: rule \"r\": ban_duration is required with action = \"rate_based_ban\"",
            "t.toml:5:17: rule \"r\": ban_threshold counts bytes but the rule's threshold counts packets; both must count the same",
        ]
    );
    let text = rule("r", "action = \"rate_based_ban\"\nban_duration = \"0s\"\n");
    assert_eq!(
        error(&text),
        "t.toml:5:16: rule \"r\": ban_duration must be greater than 0"
    );
    let text = rule(
        "r",
        "key = \"all\"\nipv4_prefix = 24\nipv6_prefix = 129\nsoft_limit = 0\n",
    );
    assert_eq!(
        errors(&text),
        [
            "t.toml:5:1: rule \"r\": ipv4_prefix only applies to a key with \"ip\" (this rule has key = \"all\")",
            "t.toml:6:1: rule \"r\": ipv6_prefix only applies to a key with \"ip\" (this rule has key = \"all\")",
            "t.toml:6:15: rule \"r\": ipv6_prefix must be between 1 and 128",
            "t.toml:7:14: rule \"r\": soft_limit must be greater than 0 and at most 1",
        ]
    );
    let text = rule(
        "r",
        "ipv4_prefix = 0\nalgorithm = \"token_bucket\"\nburst = \"5MiB\"\n",
    );
    assert_eq!(
        errors(&text),
        [
            "t.toml:4:15: rule \"r\": ipv4_prefix must be between 1 and 32",
            "t.toml:6:9: rule \"r\": burst must be an integer: the threshold counts packets",
        ]
    );
    let text = rule("r", "action = \"ban\"\nexceed_action = \"reject\"\n");
    assert_eq!(
        errors(&text),
        [
            "t.toml:4:10: rule \"r\": action must be one of \"throttle\" or \"rate_based_ban\" (got \"ban\")",
            "t.toml:5:17: rule \"r\": exceed_action must be one of \"drop\" or \"pass\" (got \"reject\")",
        ]
    );
}

#[test]
fn match_errors() {
    let text = rule("r", "match = { tcp_flags = \"syn\", dst_ports = [80] }\n");
    assert_eq!(
        errors(&text),
        [
            at(
                &text,
                "tcp_flags",
                0,
                "rule \"r\": match.tcp_flags needs match.protocol = \"tcp\""
            ),
            at(
                &text,
                "dst_ports",
                0,
                "rule \"r\": match.dst_ports needs match.protocol = \"tcp\" or \"udp\""
            ),
        ]
    );
    let text = rule(
        "r",
        "match = { protocol = \"icmp\", tcp_flags = \"syn,bogus\", dst_ports = [] }\n",
    );
    assert_eq!(
        errors(&text),
        [
            at(
                &text,
                "tcp_flags",
                0,
                "rule \"r\": match.tcp_flags needs match.protocol = \"tcp\""
            ),
            at(
                &text,
                "\"syn,bogus\"",
                0,
                "rule \"r\": match.tcp_flags: unknown TCP flag \"bogus\"; use fin, syn, rst, psh, ack, urg, ece or cwr"
            ),
            at(
                &text,
                "dst_ports",
                0,
                "rule \"r\": match.dst_ports needs match.protocol = \"tcp\" or \"udp\""
            ),
            at(
                &text,
                "[]",
                0,
                "rule \"r\": match.dst_ports must not be empty; leave it out to match any port"
            ),
        ]
    );
    let text = rule(
        "r",
        "match = { protocol = \"udp\", dst_ports = [0, \"90-80\", 70000, true, 1, 2, 3, 4, 5, 6, 7, 8, 9], src = [] }\n",
    );
    assert_eq!(
        errors(&text),
        [
            at(
                &text,
                "0, \"90",
                0,
                "rule \"r\": match.dst_ports: port 0 is not allowed"
            ),
            at(
                &text,
                "\"90-80\"",
                0,
                "rule \"r\": match.dst_ports: port range 90-80 is reversed; did you mean 80-90?"
            ),
            at(
                &text,
                "70000",
                0,
                "rule \"r\": match.dst_ports: port 70000 is out of range (1-65535)"
            ),
            at(
                &text,
                "true",
                0,
                "rule \"r\": match.dst_ports: each entry must be a port number or a string such as \"8000-8100\", not a boolean"
            ),
            // The ninth entry, valid or not.
            at(
                &text,
                "5, 6",
                0,
                "rule \"r\": match.dst_ports: too many port ranges; at most 8 fit"
            ),
            at(
                &text,
                "[]",
                0,
                "rule \"r\": match.src must not be empty; leave it out to match any source"
            ),
        ]
    );
    let text = rule("r", "match = { protocol = \"sctp\", dst_ports = [80] }\n");
    assert_eq!(
        error(&text),
        at(
            &text,
            "\"sctp\"",
            0,
            "rule \"r\": match.protocol must be one of \"tcp\", \"udp\", \"icmp\" or \"icmpv6\" (got \"sctp\")"
        )
    );
}

#[test]
fn lists_errors() {
    let text = "[lists]\nallow = [\"10.0.0.0/8\", \"192.0.2.1\"]\ndeny = [\"10.0.0.0/16\", \"192.0.2.1/32\", \"10.0.0.0/8\"]\n";
    assert_eq!(
        errors(text),
        [
            at(
                text,
                "\"192.0.2.1/32",
                0,
                "lists.deny: 192.0.2.1/32 is also in lists.allow (line 2); an address cannot be both allowed and denied"
            ),
            at(
                text,
                "\"10.0.0.0/8",
                1,
                "lists.deny: 10.0.0.0/8 is also in lists.allow (line 2); an address cannot be both allowed and denied"
            ),
        ]
    );
    // Duplicates within a list are dropped, not errors.
    let c = ok("[lists]\ndeny = [\"10.0.0.1\", \"10.0.0.1/32\"]\n");
    assert_eq!(c.lists.deny, [net("10.0.0.1/32")]);
}

#[test]
fn daemon_errors() {
    let text = "[daemon]\ninterfaces = [\"eth0\", \"\", \"eth0\", \"averyveryverylongname\", \"a/b\", \"a b\", \"lo:1\"]\n\
                xdp_mode = \"fast\"\nhttp_listen = \"localhost\"\nevents = \"\"\ncontrol_socket = \"\"\n";
    assert_eq!(
        errors(text),
        [
            "t.toml:2:23: daemon.interfaces: an interface name must not be empty",
            "t.toml:2:27: daemon.interfaces: \"eth0\" is listed twice",
            "t.toml:2:35: daemon.interfaces: \"averyveryverylongname\" is longer than 15 bytes, the longest interface name Linux allows",
            "t.toml:2:60: daemon.interfaces: \"a/b\" is not a valid interface name (no '/', ':' or whitespace)",
            "t.toml:2:67: daemon.interfaces: \"a b\" is not a valid interface name (no '/', ':' or whitespace)",
            "t.toml:2:74: daemon.interfaces: \"lo:1\" is not a valid interface name (no '/', ':' or whitespace)",
            "t.toml:3:12: daemon.xdp_mode must be one of \"auto\", \"native\" or \"generic\" (got \"fast\")",
            "t.toml:4:15: daemon.http_listen: \"localhost\" is not an address and port such as \"127.0.0.1:9477\" or \"[::1]:9477\"; \"off\" disables the listener",
            "t.toml:5:10: daemon.events must not be empty; \"-\" is stdout, and leaving it out disables events",
            "t.toml:6:18: daemon.control_socket must not be empty",
        ]
    );
    // 15 bytes is the limit.
    assert!(errors("[daemon]\ninterfaces = [\"abcdefghijklmno\"]\n").is_empty());
    assert_eq!(
        errors("[daemon]\nevents_per_sec = 0\n"),
        ["t.toml:2:18: daemon.events_per_sec must be between 1 and 1000000"]
    );
    assert_eq!(
        errors("[daemon]\nevents_per_sec = 1000001\n"),
        ["t.toml:2:18: daemon.events_per_sec must be between 1 and 1000000"]
    );
    assert_eq!(
        ok("[daemon]\nevents_per_sec = 50\n").daemon.events_per_sec,
        50
    );
}

#[test]
fn tracking_errors() {
    let text = "[tracking]\nmax_sources = 0\nnew_sources_burst = 5\nnew_sources_per_sec = -1\n";
    assert_eq!(
        errors(text),
        [
            "t.toml:2:15: tracking.max_sources must be between 1 and 4294967295",
            "t.toml:4:23: tracking.new_sources_per_sec must be between 0 and 1000000000",
        ]
    );
    let text = "[tracking]\nnew_sources_per_sec = 0\nnew_sources_burst = 5\n";
    assert_eq!(
        error(text),
        "t.toml:3:1: tracking.new_sources_burst only applies when tracking.new_sources_per_sec is not 0 (0 turns admission off)"
    );
    for bad in ["\"Auto\"", "\"\"", "\"10000\""] {
        assert_eq!(
            error(&format!("[tracking]\nnew_sources_per_sec = {bad}\n")),
            "t.toml:2:23: tracking.new_sources_per_sec must be \"auto\" or a number of new sources per second (0 turns admission off)"
        );
    }
    assert_eq!(
        error("[tracking]\nnew_sources_per_sec = 1.5\n"),
        "t.toml:2:23: tracking.new_sources_per_sec must be an integer, not a float"
    );
}

/// Admission is on by default: the whole store turns over at most once a minute.
#[test]
fn admission_is_automatic_by_default() {
    for text in [
        "",
        "[tracking]\n",
        "[tracking]\nnew_sources_per_sec = \"auto\"\n",
    ] {
        let t = ok(text).tracking;
        assert_eq!(
            t,
            Tracking {
                max_sources: 1_000_000,
                new_sources_per_sec: 16_667,
                new_sources_auto: true,
                new_sources_burst: 16_667,
                syn_cookies: true,
            },
            "{text:?}"
        );
    }
    // Derived from max_sources wherever the key stands, and at least one a second.
    let t = ok("[tracking]\nnew_sources_per_sec = \"auto\"\nmax_sources = 65536\n").tracking;
    assert_eq!((t.new_sources_per_sec, t.new_sources_burst), (1093, 1093));
    let t = ok("[tracking]\nmax_sources = 60\n").tracking;
    assert_eq!((t.new_sources_per_sec, t.new_sources_burst), (1, 1));
    let t = ok("[tracking]\nmax_sources = 61\n").tracking;
    assert_eq!((t.new_sources_per_sec, t.new_sources_burst), (2, 2));
    let t = ok("[tracking]\nmax_sources = 1\n").tracking;
    assert_eq!((t.new_sources_per_sec, t.new_sources_burst), (1, 1));
    // A burst of its own with the automatic rate.
    let t = ok("[tracking]\nnew_sources_burst = 50000\n").tracking;
    assert_eq!(
        (
            t.new_sources_per_sec,
            t.new_sources_burst,
            t.new_sources_auto
        ),
        (16_667, 50_000, true)
    );
    // 0 turns it off, explicitly; a number is taken as it is.
    let t = ok("[tracking]\nnew_sources_per_sec = 0\n").tracking;
    assert_eq!(
        (
            t.new_sources_per_sec,
            t.new_sources_burst,
            t.new_sources_auto
        ),
        (0, 1, false)
    );
    let t = ok("[tracking]\nnew_sources_per_sec = 250\n").tracking;
    assert_eq!(
        (
            t.new_sources_per_sec,
            t.new_sources_burst,
            t.new_sources_auto
        ),
        (250, 250, false)
    );
}

#[test]
fn errors_are_collected_and_sorted() {
    // The name is read first but comes last; every problem is reported, in file order.
    let text = "[[rule]]\nkey = \"bogus\"\nthreshold = { count = 0, interval = \"0s\" }\nname = \"\"\n\
                [daemon]\nxdp_mode = \"x\"\n";
    let e = parse(FILE, text).unwrap_err();
    let positions: Vec<(usize, usize)> = e.0.iter().map(|e| (e.line, e.col)).collect();
    assert_eq!(positions, [(2, 7), (3, 23), (3, 37), (4, 8), (6, 12)]);
    assert_eq!(
        e.to_string(),
        "t.toml:2:7: rule #1: key must be one of \"all\", \"ip\", \"region\" or \"dst\", or a list of up to three of \"ip\", \"dst\", \"dst_port\", \"src_port\" or \"protocol\" (got \"bogus\")\n\
         t.toml:3:23: rule #1: threshold.count must be at least 1\n\
         t.toml:3:37: rule #1: threshold.interval must be greater than 0\n\
         t.toml:4:8: rule #1: name must not be empty\n\
         t.toml:6:12: daemon.xdp_mode must be one of \"auto\", \"native\" or \"generic\" (got \"x\")"
    );
}

#[test]
fn columns_count_characters() {
    let text = "# é ü\n[daemon]\nxdp_mode = \"ñ\"  \ninterfaces = [\"é\", 1]\n";
    assert_eq!(
        errors(text),
        [
            "t.toml:3:12: daemon.xdp_mode must be one of \"auto\", \"native\" or \"generic\" (got \"ñ\")",
            "t.toml:4:20: daemon.interfaces: each entry must be a string, not an integer",
        ]
    );
}

// ---------------------------------------------------------------------------------------------
// Capacities

#[test]
fn too_many_rules() {
    let text: String = (0..=caps::MAX_RULES)
        .map(|i| rule(&format!("r{i}"), ""))
        .collect();
    assert_eq!(
        error(&text),
        at(
            &text,
            "[[rule]]",
            caps::MAX_RULES as usize,
            "rule \"r16\": too many rules; at most 16 fit"
        )
    );
    let text: String = (0..caps::MAX_RULES)
        .map(|i| rule(&format!("r{i}"), ""))
        .collect();
    assert_eq!(ok(&text).rules.len(), caps::MAX_RULES as usize);
}

/// `n` distinct /32 networks as TOML string literals.
fn nets(n: usize) -> String {
    let mut s = String::new();
    for i in 0..n {
        let _ = write!(s, "\"10.{}.{}.{}\",", i >> 16, (i >> 8) & 255, i & 255);
    }
    s
}

#[test]
fn too_many_list_entries() {
    let max = caps::MAX_LIST_ENTRIES as usize;
    let text = format!(
        "[lists]\ndeny = [{}\"10.0.0.0\", \"11.0.0.0\"]\n",
        nets(max)
    );
    assert_eq!(
        error(&text),
        at(
            &text,
            "\"11.0.0.0\"",
            0,
            "lists.deny: too many entries; at most 65536 fit"
        )
    );
}

#[test]
fn too_many_src_entries() {
    let max = caps::MAX_RULE_SRC_ENTRIES as usize;
    // Shared networks count once; the limit is on distinct networks across rules.
    let text = format!(
        "{}{}",
        rule("a", &format!("match = {{ src = [{}] }}\n", nets(max - 1))),
        rule(
            "b",
            "match = { src = [\"10.0.0.0\", \"11.0.0.0\", \"12.0.0.0\"] }\n"
        ),
    );
    assert_eq!(
        error(&text),
        at(
            &text,
            "\"12.0.0.0\"",
            0,
            "rule \"b\": match.src: too many source networks; at most 16384 fit across all rules"
        )
    );
}

#[test]
fn too_many_overrides() {
    let max = caps::MAX_OVERRIDES as usize;
    let mut text = rule("r", "");
    for i in 0..=max {
        let _ = write!(
            text,
            "[[rule.override]]\ncidr = \"10.{}.{}.{}\"\nthreshold = {{ count = 1, interval = \"1s\" }}\n",
            i >> 16,
            (i >> 8) & 255,
            i & 255
        );
    }
    assert_eq!(
        error(&text),
        at(
            &text,
            "\"10.1.0.0\"",
            0,
            "rule \"r\": override #65537: cidr: too many cidr overrides; at most 65536 fit across all rules"
        )
    );
}

#[test]
fn too_many_region_overrides() {
    let max = caps::MAX_REGION_OVERRIDES as usize;
    let mut text = String::from("[geoip]\ndatabase = \"/x\"\n");
    let codes: Vec<String> = (b'A'..=b'Z')
        .flat_map(|a| (b'A'..=b'Z').map(move |b| format!("{}{}", a as char, b as char)))
        .collect();
    let mut n = 0;
    let mut rule_index = 0;
    while n <= max {
        text += &rule(&format!("r{rule_index}"), "key = \"region\"\n");
        for code in codes.iter().take((max + 1 - n).min(codes.len())) {
            let _ = write!(
                text,
                "[[rule.override]]\nregion = \"{code}\"\nthreshold = {{ count = 1, interval = \"1s\" }}\n"
            );
            n += 1;
        }
        rule_index += 1;
    }
    let last_rule = rule_index - 1;
    let nth_in_rule = max % codes.len();
    let e = error(&text);
    assert!(
        e.ends_with(&format!(
            ": rule \"r{last_rule}\": override #{}: region: too many region overrides; at most 4096 fit across all rules",
            nth_in_rule + 1
        )),
        "{e}"
    );
    let region = &codes[nth_in_rule];
    let line = text[..text.rfind(&format!("region = \"{region}\"")).unwrap()]
        .matches('\n')
        .count()
        + 1;
    assert!(e.starts_with(&format!("t.toml:{line}:10: ")), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Value syntax tables

#[test]
fn tcp_flags_table() {
    use TcpFlags as F;
    let cases: &[(&str, u8, u8)] = &[
        ("syn", F::SYN | F::ACK, F::SYN),
        ("SYN", F::SYN | F::ACK, F::SYN),
        (" syn ", F::SYN | F::ACK, F::SYN),
        ("syn,ack", F::SYN | F::ACK, F::SYN | F::ACK),
        ("syn|!ack", F::SYN | F::ACK, F::SYN),
        ("syn,!ack,!rst", F::SYN | F::ACK | F::RST, F::SYN),
        ("!syn", F::SYN, 0),
        ("ack", F::ACK, F::ACK),
        ("rst", F::RST, F::RST),
        ("fin | ack", F::FIN | F::ACK, F::FIN | F::ACK),
        ("fin,syn,rst,psh,ack,urg,ece,cwr", 0xff, 0xff),
        ("!fin,!syn,!rst,!psh,!ack,!urg,!ece,!cwr", 0xff, 0),
        ("ece|cwr", F::ECE | F::CWR, F::ECE | F::CWR),
        ("! urg", F::URG, 0),
    ];
    for &(s, mask, value) in cases {
        let flags = parse_tcp_flags(s).unwrap_or_else(|e| panic!("{s}: {e}"));
        assert_eq!(flags, TcpFlags { mask, value }, "{s}");
        // The canonical form parses back to the same flags.
        assert_eq!(
            parse_tcp_flags(&flags.to_string()),
            Ok(flags),
            "{s} -> {flags}"
        );
    }
    assert_eq!(parse_tcp_flags("syn").unwrap().to_string(), "syn,!ack");
    let syn = parse_tcp_flags("syn").unwrap();
    assert_eq!(F::SYN & syn.mask, syn.value, "a bare SYN matches");
    assert_ne!(
        (F::SYN | F::ACK) & syn.mask,
        syn.value,
        "a SYN-ACK does not"
    );
    let errors: &[(&str, &str)] = &[
        (
            "",
            "no flags given; use names fin, syn, rst, psh, ack, urg, ece, cwr",
        ),
        ("syn,,ack", "\"syn,,ack\" has an empty flag name"),
        ("!", "\"!\" has an empty flag name"),
        (
            "syn,foo",
            "unknown TCP flag \"foo\"; use fin, syn, rst, psh, ack, urg, ece or cwr",
        ),
        (
            "syn,!syn",
            "flag syn is given more than once in \"syn,!syn\"",
        ),
        ("ack,ACK", "flag ack is given more than once in \"ack,ACK\""),
    ];
    for &(s, msg) in errors {
        assert_eq!(parse_tcp_flags(s), Err(msg.to_string()), "{s}");
    }
}

#[test]
fn bytes_table() {
    let cases: &[(&str, u64)] = &[
        ("0", 0),
        ("1500", 1500),
        ("1500B", 1500),
        ("1500 B", 1500),
        ("1KB", 1000),
        ("1kB", 1000),
        ("1KiB", 1024),
        ("10MB", 10_000_000),
        ("10MiB", 10 << 20),
        ("10 MiB", 10 << 20),
        ("2GB", 2_000_000_000),
        ("2GiB", 2 << 30),
        (" 64KiB ", 64 << 10),
        ("18446744073709551615", u64::MAX),
    ];
    for &(s, n) in cases {
        assert_eq!(parse_bytes(s), Ok(n), "{s}");
    }
    for s in [
        "", "MiB", "1.5MiB", "10mib", "10 M", "-5", "10TB", "ten", "1_000",
    ] {
        let e = parse_bytes(s).unwrap_err();
        assert_eq!(
            e,
            format!(
                "{s:?} is not a byte size; use a whole number with an optional unit B, KB, KiB, MB, MiB, GB or GiB, e.g. \"10MiB\""
            )
        );
    }
    assert_eq!(
        parse_bytes("17179869184GiB"),
        Err("\"17179869184GiB\" is too large".into())
    );
    // In the file: integers or strings.
    for (value, n) in [
        ("65536", 65_536),
        ("\"64KiB\"", 65_536),
        ("\"66 kB\"", 66_000),
    ] {
        let c = ok(&format!(
            "[[rule]]\nname = \"r\"\nthreshold = {{ bytes = {value}, interval = \"1s\" }}\n"
        ));
        assert_eq!(c.rules[0].threshold.amount, n, "{value}");
        assert_eq!(c.rules[0].threshold.unit, Unit::Bytes);
    }
    let text = "[[rule]]\nname = \"r\"\nthreshold = { bytes = -1, interval = \"1s\" }\n";
    assert_eq!(
        error(text),
        "t.toml:3:23: rule \"r\": threshold.bytes must not be negative"
    );
}

#[test]
fn ports_table() {
    let cases: &[(&str, (u16, u16))] = &[
        ("80", (80, 80)),
        (" 443 ", (443, 443)),
        ("1", (1, 1)),
        ("65535", (65535, 65535)),
        ("8000-8100", (8000, 8100)),
        ("8000 - 8100", (8000, 8100)),
        ("22-22", (22, 22)),
        ("1-65535", (1, 65535)),
    ];
    for &(s, r) in cases {
        assert_eq!(parse_port_range(s), Ok(r), "{s}");
    }
    let errors: &[(&str, &str)] = &[
        ("0", "port 0 is not allowed"),
        ("0-80", "port 0 is not allowed"),
        ("65536", "port 65536 is out of range (1-65535)"),
        (
            "99999999999999999999",
            "port 9223372036854775807 is out of range (1-65535)",
        ),
        (
            "8100-8000",
            "port range 8100-8000 is reversed; did you mean 8000-8100?",
        ),
        (
            "",
            "\"\" is not a port or port range; write e.g. \"443\" or \"8000-8100\"",
        ),
        (
            "http",
            "\"http\" is not a port or port range; write e.g. \"443\" or \"8000-8100\"",
        ),
        (
            "80-",
            "\"80-\" is not a port or port range; write e.g. \"443\" or \"8000-8100\"",
        ),
        (
            "-80",
            "\"-80\" is not a port or port range; write e.g. \"443\" or \"8000-8100\"",
        ),
        (
            "1-2-3",
            "\"1-2-3\" is not a port or port range; write e.g. \"443\" or \"8000-8100\"",
        ),
        (
            "+80",
            "\"+80\" is not a port or port range; write e.g. \"443\" or \"8000-8100\"",
        ),
    ];
    for &(s, msg) in errors {
        assert_eq!(parse_port_range(s), Err(msg.to_string()), "{s}");
    }
    // In the file: integers and strings mixed.
    let c = ok(&rule(
        "r",
        "match = { protocol = \"tcp\", dst_ports = [22, \"80\", \"8000-8100\", 65535] }\n",
    ));
    assert_eq!(
        c.rules[0].matcher.dst_ports,
        [(22, 22), (80, 80), (8000, 8100), (65535, 65535)]
    );
    let text = rule("r", "match = { protocol = \"tcp\", dst_ports = [-1] }\n");
    assert_eq!(
        error(&text),
        at(
            &text,
            "-1",
            0,
            "rule \"r\": match.dst_ports: port -1 is out of range (1-65535)"
        )
    );
}

#[test]
fn net_table() {
    let cases: &[(&str, &str)] = &[
        ("10.0.0.1", "10.0.0.1/32"),
        ("10.0.0.0/8", "10.0.0.0/8"),
        (" 10.0.0.0/8 ", "10.0.0.0/8"),
        ("0.0.0.0/0", "0.0.0.0/0"),
        ("2001:db8::1", "2001:db8::1/128"),
        ("2001:db8::/32", "2001:db8::/32"),
        ("::/0", "::/0"),
        // Prefixes that hold the IPv4-mapped range without being inside it are IPv6 ones.
        ("::/64", "::/64"),
        ("::fffe:0:0/95", "::fffe:0:0/95"),
        ("64:ff9b::/96", "64:ff9b::/96"),
    ];
    for &(s, n) in cases {
        assert_eq!(parse_net(s), Ok(net(n)), "{s}");
    }
    let errors: &[(&str, &str)] = &[
        (
            "192.168.1.1/24",
            "192.168.1.1/24 has host bits set; did you mean 192.168.1.0/24?",
        ),
        (
            "2001:db8::1/32",
            "2001:db8::1/32 has host bits set; did you mean 2001:db8::/32?",
        ),
        (
            "10.0.0.0/33",
            "10.0.0.0/33: the prefix length must be a number from 0 to 32",
        ),
        (
            "10.0.0.0/",
            "10.0.0.0/: the prefix length must be a number from 0 to 32",
        ),
        (
            "10.0.0.0/+8",
            "10.0.0.0/+8: the prefix length must be a number from 0 to 32",
        ),
        (
            "::/129",
            "::/129: the prefix length must be a number from 0 to 128",
        ),
        ("10.0.0", "\"10.0.0\" is not an IP address or CIDR"),
        (
            "example.com",
            "\"example.com\" is not an IP address or CIDR",
        ),
        ("", "\"\" is not an IP address or CIDR"),
        (
            "::ffff:0.0.0.0/96",
            "::ffff:0.0.0.0/96 is inside ::ffff:0:0/96, the IPv4-mapped range: an IPv6 prefix \
             never covers IPv4 clients; write the IPv4 prefix (0.0.0.0/0) to mean those",
        ),
        (
            "::ffff:203.0.113.0/120",
            "::ffff:203.0.113.0/120 is inside ::ffff:0:0/96, the IPv4-mapped range: an IPv6 \
             prefix never covers IPv4 clients; write the IPv4 prefix (203.0.113.0/24) to mean \
             those",
        ),
        (
            "::ffff:192.0.2.1",
            "::ffff:192.0.2.1 is inside ::ffff:0:0/96, the IPv4-mapped range: an IPv6 prefix \
             never covers IPv4 clients; write the IPv4 prefix (192.0.2.1/32) to mean those",
        ),
        (
            "::/96",
            "::/96 is inside ::/96 (the unspecified, loopback and IPv4-compatible addresses): \
             no packet from it reaches the lists or rules (such sources are bogons), and an \
             IPv6 prefix never covers IPv4 clients",
        ),
        (
            "::1",
            "::1 is inside ::/96 (the unspecified, loopback and IPv4-compatible addresses): no \
             packet from it reaches the lists or rules (such sources are bogons), and an IPv6 \
             prefix never covers IPv4 clients",
        ),
    ];
    for &(s, msg) in errors {
        assert_eq!(parse_net(s), Err(msg.to_string()), "{s}");
    }
}

#[test]
fn durations_and_thresholds_from_strings() {
    assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
    assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
    assert_eq!(parse_duration("20m"), Ok(Duration::from_secs(1200)));
    assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
    assert_eq!(parse_duration("1d"), Ok(Duration::from_secs(86_400)));
    assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
    assert!(parse_duration("soon").is_err());
    for (d, s) in [
        (Duration::from_secs(86_400), "1d"),
        (Duration::from_secs(1200), "20m"),
        (Duration::from_millis(1500), "1500ms"),
        (Duration::from_micros(3), "3us"),
        (Duration::ZERO, "0s"),
    ] {
        assert_eq!(format_duration(d), s);
        assert_eq!(parse_duration(s), Ok(d), "{s}");
    }

    let t: Threshold = "2000/20m".parse().unwrap();
    assert_eq!(t, pkts(2000, 1200));
    assert_eq!(t.to_string(), "2000/20m");
    let t: Threshold = "10MiB/1s".parse().unwrap();
    assert_eq!((t.amount, t.unit), (10 << 20, Unit::Bytes));
    assert_eq!(t.to_string(), "10485760B/1s");
    assert_eq!(t.to_string().parse::<Threshold>(), Ok(t));
    assert_eq!(
        "0/1s".parse::<Threshold>(),
        Err("the threshold amount must be at least 1".into())
    );
    assert_eq!(
        "5/0s".parse::<Threshold>(),
        Err("the interval must be greater than 0".into())
    );
    assert_eq!(
        "5/2d".parse::<Threshold>(),
        Err("the interval must be at most 1d".into())
    );
    assert!("5".parse::<Threshold>().is_err());
}

#[test]
fn keywords_round_trip() {
    for m in [XdpMode::Auto, XdpMode::Native, XdpMode::Generic] {
        assert_eq!(m.as_str().parse::<XdpMode>(), Ok(m));
    }
    for k in [KeyKind::All, KeyKind::Ip, KeyKind::Region] {
        assert_eq!(k.to_string().parse::<KeyKind>(), Ok(k));
    }
    for p in [
        Protocol::Tcp,
        Protocol::Udp,
        Protocol::Icmp,
        Protocol::Icmpv6,
    ] {
        assert_eq!(p.as_str().parse::<Protocol>(), Ok(p));
    }
    assert_eq!("fixed_window".parse(), Ok(Algorithm::FixedWindow));
    assert_eq!("rate_based_ban".parse(), Ok(Action::RateBasedBan));
    assert_eq!("pass".parse(), Ok(ExceedAction::Pass));
    assert_eq!(
        "Auto".parse::<XdpMode>(),
        Err("must be one of \"auto\", \"native\" or \"generic\" (got \"Auto\")".into())
    );
    assert_eq!(XdpMode::default(), XdpMode::Auto);
    assert_eq!(Algorithm::default(), Algorithm::SlidingWindow);
}

#[test]
fn byte_thresholds_and_byte_bursts_below_the_largest_packet_are_rejected() {
    // A 1500 B threshold would drop every larger frame forever.
    let text = "[[rule]]\nname = \"r\"\nthreshold = { bytes = 1500, interval = \"1s\" }\n";
    assert_eq!(
        error(text),
        "t.toml:3:23: rule \"r\": threshold.bytes: 1500 B is below the minimum of 64KiB (65536 B): \
         a frame larger than a byte threshold is never admitted, and an IP packet may be up to 65,535 B"
    );
    let text = "[[rule]]\nname = \"r\"\nthreshold = { bytes = \"1MiB\", interval = \"1s\" }\n\
                algorithm = \"token_bucket\"\nburst = \"1500B\"\n";
    assert_eq!(
        error(text),
        "t.toml:5:9: rule \"r\": burst: 1500 B is below the minimum of 64KiB (65536 B) for a byte \
         threshold's bucket: a frame larger than the bucket is never admitted"
    );
    // The ban threshold and overrides are thresholds too.
    let text = "[[rule]]\nname = \"r\"\nthreshold = { bytes = \"1MiB\", interval = \"1s\" }\n\
                action = \"rate_based_ban\"\nban_duration = \"1h\"\n\
                ban_threshold = { bytes = 65535, interval = \"1s\" }\n";
    assert!(
        error(text).contains("ban_threshold.bytes: 65535 B is below the minimum"),
        "{}",
        error(text)
    );
    // Exactly the minimum is accepted.
    let text = "[[rule]]\nname = \"r\"\nthreshold = { bytes = \"64KiB\", interval = \"1s\" }\n\
                algorithm = \"token_bucket\"\nburst = \"64KiB\"\n";
    assert!(errors(text).is_empty(), "{:?}", errors(text));
}

#[test]
fn rates_faster_than_the_limiter_meters_are_rejected() {
    // More than one packet per ns: the token bucket's increment would be below 1 ns.
    let text = "[[rule]]\nname = \"r\"\nthreshold = { count = 1_000_000_001, interval = \"1s\" }\n";
    assert_eq!(
        error(text),
        "t.toml:3:23: rule \"r\": threshold.count: 1000000001 per 1s is faster than 1 packet per ns, \
         the fastest rate the limiter meters exactly; use a longer interval or a smaller amount"
    );
    let text = "[[rule]]\nname = \"r\"\nthreshold = { count = 1_000_000_000, interval = \"1s\" }\n";
    assert!(errors(text).is_empty());
    // 64 bytes per ns is the byte limit (512 Gbit/s).
    let text = "[[rule]]\nname = \"r\"\nthreshold = { bytes = \"64GB\", interval = \"1s\" }\n";
    assert!(errors(text).is_empty());
    let text = "[[rule]]\nname = \"r\"\nthreshold = { bytes = \"65GB\", interval = \"1s\" }\n";
    assert!(
        error(text).contains("is faster than 64 bytes per ns"),
        "{}",
        error(text)
    );
    // The same rules on the command line.
    assert!(
        "1000000001/1s"
            .parse::<Threshold>()
            .unwrap_err()
            .contains("faster than 1 packet per ns")
    );
    assert!(
        "1500B/1s"
            .parse::<Threshold>()
            .unwrap_err()
            .contains("below the minimum of 64KiB")
    );
    assert!("1000000000/1s".parse::<Threshold>().is_ok());
}

#[test]
fn admission_rates_faster_than_one_per_ns_are_rejected() {
    let text = "[tracking]\nnew_sources_per_sec = 1_000_000_001\n";
    assert!(
        error(text).contains("tracking.new_sources_per_sec"),
        "{}",
        error(text)
    );
    let text = "[tracking]\nnew_sources_per_sec = 1_000_000_000\n";
    assert!(errors(text).is_empty());
}

// [pressure]

#[test]
fn pressure_defaults_match_the_spec() {
    let p = ok("").pressure;
    assert_eq!(p.cpu_busy, 0.8);
    assert_eq!(p.listen_overflows_per_sec, 1.0);
    assert_eq!(p.hold, Duration::from_secs(10));
    assert!(p.cpus.is_empty(), "every online CPU");
    // The SPEC's example section, verbatim.
    let p = ok("[pressure]                      # when is the host \"under pressure\"? any signal above its mark\n\
                cpu_busy = 0.8                  # share of the receive CPUs busy (softirq + system + user)\n\
                listen_overflows_per_sec = 1    # the kernel's listen-queue overflows and drops (TcpExt)\n\
                hold = \"10s\"                    # stay under pressure this long after the last signal\n")
    .pressure;
    assert_eq!(p, Pressure::default());
}

#[test]
fn pressure_takes_its_values() {
    let p = ok(
        "[pressure]\ncpu_busy = 1\nlisten_overflows_per_sec = 0.5\nhold = \"1m30s\"\n\
                cpus = [3, 0, 1]\n",
    )
    .pressure;
    assert_eq!(p.cpu_busy, 1.0);
    assert_eq!(p.listen_overflows_per_sec, 0.5);
    assert_eq!(p.hold, Duration::from_secs(90));
    assert_eq!(p.cpus, [0, 1, 3], "sorted");
    let p =
        ok("[pressure]\ncpu_busy = 0.01\nlisten_overflows_per_sec = 0\nhold = \"0s\"\n").pressure;
    assert_eq!(p.cpu_busy, 0.01);
    assert_eq!(p.listen_overflows_per_sec, 0.0);
    assert_eq!(p.hold, Duration::ZERO);
}

#[test]
fn pressure_errors() {
    let text = "[pressure]\ncpu_busy = 0\nlisten_overflows_per_sec = -1\nhold = \"soon\"\n\
                cpus = [0, 0, -1, \"2\"]\n";
    let errs = errors(text);
    assert_eq!(errs.len(), 6, "{errs:#?}");
    assert_eq!(
        errs[0],
        "t.toml:2:12: pressure.cpu_busy must be greater than 0 and at most 1"
    );
    assert_eq!(
        errs[1],
        "t.toml:3:28: pressure.listen_overflows_per_sec must not be negative"
    );
    assert!(
        errs[2].starts_with("t.toml:4:8: pressure.hold: \"soon\" is not a duration ("),
        "{}",
        errs[2]
    );
    assert_eq!(errs[3], "t.toml:5:12: pressure.cpus: CPU 0 is listed twice");
    assert_eq!(
        errs[4],
        "t.toml:5:15: pressure.cpus must be between 0 and 8191"
    );
    assert_eq!(
        errs[5],
        "t.toml:5:19: pressure.cpus: each entry must be an integer, not a string"
    );
    assert_eq!(
        error("[pressure]\ncpu_busy = 1.5\n"),
        "t.toml:2:12: pressure.cpu_busy must be greater than 0 and at most 1"
    );
    assert_eq!(
        error("[pressure]\ncpu_busy = \"80%\"\n"),
        "t.toml:2:12: pressure.cpu_busy must be a number, not a string"
    );
    assert_eq!(
        error("[pressure]\nhold = \"2d\"\n"),
        "t.toml:2:8: pressure.hold must be at most 1d"
    );
    assert_eq!(
        error("[pressure]\nhold = 10\n"),
        "t.toml:2:8: pressure.hold must be a duration string such as \"30s\", not an integer"
    );
    assert!(
        error("[pressure]\nelastic = 2\n")
            .starts_with("t.toml:2:1: pressure: unknown key \"elastic\""),
    );
}

// [fleet]

#[test]
fn no_fleet_section_means_no_fleet() {
    assert_eq!(ok("").fleet, None);
}

#[test]
fn fleet_takes_its_values_and_defaults() {
    let f = ok("[fleet]\nredis = \"redis://10.1.0.5:6379\"\n")
        .fleet
        .unwrap();
    assert_eq!(f.redis, "redis://10.1.0.5:6379");
    assert_eq!(f.host_id, None);
    assert_eq!(f.password_file, None);
    assert_eq!(f.sync_interval, Duration::from_millis(100));
    assert!(f.share_bans);
    assert_eq!(f.max_clock_skew, Duration::from_millis(250));
    let f = ok(
        "[fleet]\nredis = \"unix:///run/redis/redis.sock\"\nhost_id = \"edge-fra-07\"\n\
                password_file = \"/etc/ratelimit/redis.pass\"\nsync_interval = \"250ms\"\n\
                share_bans = false\nmax_clock_skew = \"1s\"\n",
    )
    .fleet
    .unwrap();
    assert_eq!(f.max_clock_skew, Duration::from_secs(1));
    assert_eq!(f.redis, "unix:///run/redis/redis.sock");
    assert_eq!(f.host_id.as_deref(), Some("edge-fra-07"));
    assert_eq!(
        f.password_file.as_deref(),
        Some(std::path::Path::new("/etc/ratelimit/redis.pass"))
    );
    assert_eq!(f.sync_interval, Duration::from_millis(250));
    assert!(!f.share_bans);
}

#[test]
fn fleet_tls_takes_its_files() {
    let f = ok("[fleet]\nredis = \"rediss://10.1.0.5:6380\"\n")
        .fleet
        .unwrap();
    assert_eq!(f.redis, "rediss://10.1.0.5:6380");
    assert_eq!(
        (f.tls_ca_file, f.tls_cert_file, f.tls_key_file),
        (None, None, None)
    );
    let f = ok("[fleet]\nredis = \"rediss://10.1.0.5:6380\"\ntls_ca_file = \"/etc/ratelimit/ca.pem\"\n\
                tls_cert_file = \"/etc/ratelimit/host.pem\"\ntls_key_file = \"/etc/ratelimit/host.key\"\n")
    .fleet
    .unwrap();
    let p = |s: &str| Some(std::path::PathBuf::from(s));
    assert_eq!(f.tls_ca_file, p("/etc/ratelimit/ca.pem"));
    assert_eq!(f.tls_cert_file, p("/etc/ratelimit/host.pem"));
    assert_eq!(f.tls_key_file, p("/etc/ratelimit/host.key"));
    // A cluster over TLS: every node is a rediss:// node.
    let f = ok("[fleet]\nredis = \"rediss+cluster://a:7001,b:7002\"\ntls_ca_file = \"/ca.pem\"\n")
        .fleet
        .unwrap();
    assert_eq!(f.tls_ca_file, p("/ca.pem"));
    assert_eq!(
        super::cluster_nodes("rediss+cluster://u:pw@a:1,b:2").unwrap(),
        Ok(vec![
            "rediss://u:pw@a:1".to_string(),
            "rediss://u:pw@b:2".to_string()
        ])
    );
    assert!(super::is_tls_url("rediss://a:1") && super::is_tls_url("rediss+cluster://a:1"));
    assert!(!super::is_tls_url("redis://a:1") && !super::is_tls_url("unix:///r.sock"));
}

#[test]
fn fleet_through_sentinels() {
    let f = ok("[fleet]\nredis = \"redis+sentinel://10.1.0.5:26379,10.1.0.6:26379/fleet\"\n")
        .fleet
        .unwrap();
    assert_eq!(
        f.redis,
        "redis+sentinel://10.1.0.5:26379,10.1.0.6:26379/fleet"
    );
    assert_eq!(
        super::sentinel_nodes(&f.redis).unwrap(),
        Ok((
            vec![
                "redis://10.1.0.5:26379".to_string(),
                "redis://10.1.0.6:26379".to_string()
            ],
            "fleet".to_string()
        ))
    );
    assert_eq!(super::sentinel_nodes("redis://a:1"), None);
    for (url, what) in [
        ("redis+sentinel://a:1,b:2", "names no master"),
        ("redis+sentinel://a:1/", "is not a master name"),
        ("redis+sentinel://a:1,,b:2/m", "\"\" is not a sentinel"),
        (
            "redis+sentinel://u:pw@a:1/m",
            "no credentials in a sentinel address",
        ),
        (
            "rediss+sentinel://a:1",
            "expected rediss+sentinel://HOST:PORT",
        ),
    ] {
        let e = error(&format!("[fleet]\nredis = \"{url}\"\n"));
        assert!(
            e.starts_with("t.toml:2:9: fleet.redis: ") && e.contains(what),
            "{e}"
        );
        assert!(!e.contains("pw@"), "{e}");
    }
    let e = error("[fleet]\nredis = \"redis+sentinel://a:1/m\"\ntls_ca_file = \"/ca.pem\"\n");
    assert!(
        e.contains("fleet.tls_ca_file needs a TLS store address"),
        "{e}"
    );
    // Over TLS, with passwords for the master and for the sentinels.
    let f = ok(
        "[fleet]\nredis = \"rediss+sentinel://10.1.0.5:26379,10.1.0.6:26379/fleet\"\n\
         password_file = \"/etc/ratelimit/redis.pass\"\n\
         sentinel_password_file = \"/etc/ratelimit/sentinel.pass\"\n\
         tls_ca_file = \"/etc/ratelimit/ca.pem\"\ntls_cert_file = \"/c.pem\"\ntls_key_file = \"/k.pem\"\n",
    )
    .fleet
    .unwrap();
    assert_eq!(
        f.sentinel_password_file.as_deref(),
        Some(std::path::Path::new("/etc/ratelimit/sentinel.pass"))
    );
    assert_eq!(
        f.tls_ca_file.as_deref(),
        Some(std::path::Path::new("/etc/ratelimit/ca.pem"))
    );
    assert_eq!(
        super::sentinel_nodes(&f.redis).unwrap().unwrap().0,
        vec!["rediss://10.1.0.5:26379", "rediss://10.1.0.6:26379"]
    );
    assert!(super::is_tls_url(&f.redis) && super::is_sentinel_url(&f.redis));
    assert!(!super::is_sentinel_url("rediss://a:1"));
    // The sentinels' password goes only with sentinels.
    assert_eq!(
        error("[fleet]\nredis = \"redis://a:6379\"\nsentinel_password_file = \"/s.pass\"\n"),
        "t.toml:3:26: fleet.sentinel_password_file needs a Redis Sentinel address (fleet.redis = \
         \"redis+sentinel://...\" or \"rediss+sentinel://...\")"
    );
}

#[test]
fn fleet_tls_errors() {
    assert_eq!(
        error("[fleet]\nredis = \"redis://a:6379\"\ntls_ca_file = \"/ca.pem\"\n"),
        "t.toml:3:15: fleet.tls_ca_file needs a TLS store address (fleet.redis = \
         \"rediss://HOST:PORT\", \"rediss+cluster://...\" or \"rediss+sentinel://...\")"
    );
    let e = error("[fleet]\nredis = \"unix:///r.sock\"\ntls_key_file = \"/k\"\n");
    assert!(
        e.starts_with("t.toml:3:16: fleet.tls_key_file needs a TLS store address"),
        "{e}"
    );
    assert_eq!(
        error("[fleet]\nredis = \"rediss://a:6379\"\ntls_cert_file = \"/c.pem\"\n"),
        "t.toml:3:17: fleet.tls_cert_file needs fleet.tls_key_file (the certificate's private key)"
    );
    assert_eq!(
        error("[fleet]\nredis = \"rediss://a:6379\"\ntls_key_file = \"/k.pem\"\n"),
        "t.toml:3:16: fleet.tls_key_file needs fleet.tls_cert_file (the key's certificate)"
    );
    assert_eq!(
        error("[fleet]\nredis = \"rediss://a:6379\"\ntls_ca_file = \"\"\n"),
        "t.toml:3:15: fleet.tls_ca_file must not be empty"
    );
    let e = error("[fleet]\nredis = \"rediss+cluster://a:6379,,b:1\"\n");
    assert!(e.contains("expected rediss+cluster://HOST:PORT"), "{e}");
}

#[test]
fn fleet_errors() {
    assert_eq!(
        error("[fleet]\nhost_id = \"a\"\n"),
        "t.toml:1:1: fleet.redis is required (the store's address, e.g. \"redis://10.1.0.5:6379\")"
    );
    assert_eq!(
        error("[fleet]\nredis = \"http://10.1.0.5\"\n"),
        "t.toml:2:9: fleet.redis: \"http://10.1.0.5\" is not a store address (expected \
         redis://HOST:PORT, rediss://HOST:PORT (TLS), redis+cluster://HOST:PORT,HOST:PORT,..., \
         rediss+cluster://..., redis+sentinel://HOST:PORT,.../MASTER_NAME, \
         rediss+sentinel://... or unix:///PATH)"
    );
    let c = ok("[fleet]\nredis = \"redis+cluster://a:6379,b:6379,c:6379\"\n");
    assert_eq!(
        c.fleet.unwrap().redis,
        "redis+cluster://a:6379,b:6379,c:6379"
    );
    assert_eq!(
        super::cluster_nodes("redis+cluster://u:pw@a:1,b:2").unwrap(),
        Ok(vec![
            "redis://u:pw@a:1".to_string(),
            "redis://u:pw@b:2".to_string()
        ])
    );
    assert_eq!(super::cluster_nodes("redis://a:1"), None);
    assert_eq!(
        error("[fleet]\nredis = \"redis+cluster://a:6379,,b:6379\"\n"),
        "t.toml:2:9: fleet.redis: \"redis+cluster://a:6379,,b:6379\": \"\" is not a node \
         (expected redis+cluster://HOST:PORT,HOST:PORT,...)"
    );
    let e = error("[fleet]\nredis = \"redis+cluster://u:secret@\"\n");
    assert!(
        e.starts_with("t.toml:2:9: fleet.redis: ")
            && e.contains("names no node")
            && !e.contains("secret"),
        "{e}"
    );
    assert_eq!(
        error("[fleet]\nredis = \"redis://a:6379\"\nhost_id = \"edge 1\"\n"),
        "t.toml:3:11: fleet.host_id: \"edge 1\": ' ' is not allowed (letters, digits, '.', '-' \
         and '_' are)"
    );
    assert_eq!(
        error("[fleet]\nredis = \"redis://a:6379\"\nhost_id = \"\"\n"),
        "t.toml:3:11: fleet.host_id: must not be empty"
    );
    assert_eq!(
        error("[fleet]\nredis = \"redis://a:6379\"\nsync_interval = \"1ms\"\n"),
        "t.toml:3:17: fleet.sync_interval must be between 10ms and 1m"
    );
    assert_eq!(
        error("[fleet]\nredis = \"redis://a:6379\"\nmax_clock_skew = \"5ms\"\n"),
        "t.toml:3:18: fleet.max_clock_skew must be between 10ms and 1m"
    );
    assert_eq!(
        error("[fleet]\nredis = \"redis://a:6379\"\nmax_clock_skew = 250\n"),
        error("[fleet]\nredis = \"redis://a:6379\"\nsync_interval = 250\n")
            .replace("sync_interval", "max_clock_skew")
            .replace("3:17", "3:18")
    );
    assert_eq!(
        error("[fleet]\nredis = \"redis://a:6379\"\nshare_bans = \"yes\"\n"),
        "t.toml:3:14: fleet.share_bans must be true or false, not a string"
    );
    assert!(
        error("[fleet]\nredis = \"redis://a:6379\"\nbans = true\n")
            .starts_with("t.toml:3:1: fleet: unknown key \"bans\""),
    );
}

#[test]
fn rule_scope_global_needs_a_fleet_and_a_per_source_key() {
    let rule = "[[rule]]\nname = \"r\"\nthreshold = { count = 10, interval = \"1s\" }\n";
    let fleet = "[fleet]\nredis = \"redis://a:6379\"\n";
    assert_eq!(
        ok(&format!("{rule}scope = \"local\"\n")).rules[0].scope,
        Scope::Local
    );
    assert_eq!(ok(rule).rules[0].scope, Scope::Local, "local by default");
    assert_eq!(
        ok(&format!("{fleet}{rule}scope = \"global\"\n")).rules[0].scope,
        Scope::Global
    );
    let e = error(&format!("{rule}scope = \"global\"\n"));
    assert!(
        e.starts_with("t.toml:4:9: rule \"r\": scope: \"global\" needs a [fleet] section"),
        "{e}"
    );
    assert_eq!(
        ok(&format!("{fleet}{rule}key = \"all\"\nscope = \"global\"\n")).rules[0].scope,
        Scope::Global
    );
    let e = error(&format!(
        "{fleet}{rule}key = \"all\"\nalgorithm = \"token_bucket\"\nscope = \"global\"\n"
    ));
    assert!(
        e.contains("with key = \"all\" or \"region\" needs a window algorithm"),
        "{e}"
    );
    // A token bucket is global too; its overrides keep the rule's rate.
    let tb = format!("{fleet}{rule}algorithm = \"token_bucket\"\nburst = 20\nscope = \"global\"\n");
    assert_eq!(ok(&tb).rules[0].scope, Scope::Global);
    let tb_over = |count: u32| {
        format!(
            "{tb}[[rule.override]]\ncidr = \"10.0.0.0/8\"\n\
             threshold = {{ count = {count}, interval = \"1s\" }}\n"
        )
    };
    assert_eq!(ok(&tb_over(10)).rules[0].overrides.len(), 1);
    let e = error(&tb_over(50));
    assert!(
        e.contains(
            "with algorithm = \"token_bucket\" needs every override to keep the rule's threshold"
        ),
        "{e}"
    );
    // An override may change a client's counts, not the windows the fleet counts it in.
    let over = |interval: &str| {
        format!(
            "{fleet}{rule}scope = \"global\"\n[[rule.override]]\ncidr = \"10.0.0.0/8\"\n\
             threshold = {{ count = 50, interval = \"{interval}\" }}\n"
        )
    };
    assert_eq!(ok(&over("1s")).rules[0].overrides.len(), 1);
    let e = error(&over("1m"));
    assert!(
        e.contains(
            "rule \"r\": scope: \"global\" needs every override to keep the rule's intervals"
        ),
        "{e}"
    );
    let e = error(&format!("{fleet}{rule}scope = \"split\"\n"));
    assert!(e.contains("\"split\" is not yet supported"), "{e}");
    let e = error(&format!("{rule}scope = \"fleet\"\n"));
    assert!(e.contains("\"fleet\" is not a scope"), "{e}");
}

#[test]
fn elastic_on_rules_and_overrides() {
    let c = ok(&rule(
        "r",
        "algorithm = \"token_bucket\"\nburst = 40\nelastic = 1.5\n\
         [[rule.override]]\ncidr = \"192.0.2.0/24\"\nthreshold = { count = 100, interval = \"1s\" }\n\
         [[rule.override]]\ncidr = \"192.0.2.7/32\"\nthreshold = { count = 5, interval = \"1s\" }\n\
         elastic = 3\n",
    ));
    let r = &c.rules[0];
    let e = r.elastic.unwrap();
    assert_eq!((e.milli(), e.to_string()), (1500, "1.5".to_string()));
    assert_eq!(
        r.overrides[0].elastic, None,
        "inherits the rule's when applied"
    );
    assert_eq!(r.overrides[1].elastic.unwrap().to_string(), "3");
    assert_eq!(
        ok(&rule("r", "")).rules[0].elastic,
        None,
        "no elasticity by default"
    );
    assert_eq!(
        ok(&rule("r", "elastic = 100")).rules[0]
            .elastic
            .unwrap()
            .milli(),
        100_000
    );
}

#[test]
fn bad_elastic_is_refused_with_the_reason() {
    for (value, why) in [
        (
            "1",
            "must be greater than 1 and at most 100 (got 1): the factor by which clients may exceed their threshold while the host has room",
        ),
        (
            "0.5",
            "must be greater than 1 and at most 100 (got 0.5): the factor by which clients may exceed their threshold while the host has room",
        ),
        (
            "-2",
            "must be greater than 1 and at most 100 (got -2): the factor by which clients may exceed their threshold while the host has room",
        ),
        (
            "101",
            "must be greater than 1 and at most 100 (got 101): the factor by which clients may exceed their threshold while the host has room",
        ),
        ("1.0005", "must have at most three decimals (got 1.0005)"),
    ] {
        let text = rule("r", &format!("elastic = {value}\n"));
        assert_eq!(
            error(&text),
            format!("t.toml:4:11: rule \"r\": elastic {why}"),
            "{value}"
        );
    }
    let text = rule("r", "elastic = \"2\"\n");
    assert!(
        error(&text).contains("elastic must be a number"),
        "{}",
        error(&text)
    );
    // Where it has no meaning: a rule that never drops.
    let text = rule("r", "exceed_action = \"pass\"\nelastic = 2\n");
    assert_eq!(
        error(&text),
        at(
            &text,
            "elastic",
            0,
            "rule \"r\": elastic has no effect with exceed_action = \"pass\": elastic only \
             changes which packets are dropped, and this rule drops none"
        )
    );
    let text = rule(
        "r",
        "exceed_action = \"pass\"\n[[rule.override]]\ncidr = \"192.0.2.0/24\"\n\
         threshold = { count = 100, interval = \"1s\" }\nelastic = 2\n",
    );
    assert!(
        error(&text).contains("override #1: elastic has no effect with exceed_action"),
        "{}",
        error(&text)
    );
    // Scaled past the fastest rate the limiter meters exactly.
    let text = "[[rule]]\nname = \"r\"\nthreshold = { count = 600000000, interval = \"1s\" }\n\
                elastic = 2\n";
    let e = error(text);
    assert!(
        e.starts_with(&at(
            text,
            "elastic",
            0,
            "rule \"r\": elastic = 2 makes the threshold 1200000000/1s while the host has room, and"
        )),
        "{e}"
    );
    // An override's counts under the rule's factor are checked too.
    let text = "[[rule]]\nname = \"r\"\nthreshold = { count = 10, interval = \"1s\" }\n\
                elastic = 2\n[[rule.override]]\ncidr = \"192.0.2.0/24\"\n\
                threshold = { count = 600000000, interval = \"1s\" }\n";
    let e = error(text);
    assert!(
        e.contains("override #1: elastic (the rule's) = 2 makes the threshold"),
        "{e}"
    );
}

/// An override without a ban threshold of its own is banned at its rule's where that is the
/// larger (`apply::plan`); its elastic factor scales that one, so that is the one checked.
#[test]
fn an_overrides_inherited_ban_threshold_is_checked_as_scaled() {
    let text = "[[rule]]\nname = \"r\"\nthreshold = { count = 10, interval = \"1s\" }\n\
                action = \"rate_based_ban\"\n\
                ban_threshold = { count = 600000000, interval = \"1s\" }\nban_duration = \"1m\"\n\
                [[rule.override]]\ncidr = \"192.0.2.0/24\"\n\
                threshold = { count = 100, interval = \"1s\" }\nelastic = 2\n";
    let e = error(text);
    assert!(
        e.starts_with(&at(
            text,
            "elastic",
            0,
            "rule \"r\": override #1: elastic = 2 makes the ban_threshold 1200000000/1s while \
             the host has room, and"
        )),
        "{e}"
    );
    // With a ban threshold of its own, the override's is the one scaled (its plan:
    // `policy::apply`'s tests).
    let fits = text.replace(
        "elastic = 2\n",
        "ban_threshold = { count = 1000, interval = \"1s\" }\nelastic = 2\n",
    );
    ok(&fits);
}

#[test]
fn fleet_name_key_file_and_remote_ban_bounds_take_their_values_and_defaults() {
    let f = ok("[fleet]\nredis = \"redis://10.1.0.5:6379\"\n")
        .fleet
        .unwrap();
    assert_eq!(f.name, "default");
    assert_eq!(f.key_file, None);
    assert_eq!(
        (f.remote_ban_min_prefix_v4, f.remote_ban_min_prefix_v6),
        (16, 32)
    );
    assert_eq!(f.remote_ban_max_duration, Duration::from_secs(86_400));
    let f = ok(
        "[fleet]\nredis = \"redis://a:6379\"\nname = \"prod-eu.1\"\n\
                key_file = \"/etc/ratelimit/fleet.key\"\nremote_ban_min_prefix_v4 = 24\n\
                remote_ban_min_prefix_v6 = 48\nremote_ban_max_duration = \"6h\"\n",
    )
    .fleet
    .unwrap();
    assert_eq!(f.name, "prod-eu.1");
    assert_eq!(
        f.key_file.as_deref(),
        Some(std::path::Path::new("/etc/ratelimit/fleet.key"))
    );
    assert_eq!(
        (f.remote_ban_min_prefix_v4, f.remote_ban_min_prefix_v6),
        (24, 48)
    );
    assert_eq!(f.remote_ban_max_duration, Duration::from_secs(6 * 3600));
}

#[test]
fn fleet_name_and_remote_ban_bounds_are_refused_with_their_place() {
    assert_eq!(
        error("[fleet]\nredis = \"redis://a:6379\"\nname = \"a b\"\n"),
        "t.toml:3:8: fleet.name: \"a b\": ' ' is not allowed (letters, digits, '.', '-' and \
         '_' are)"
    );
    assert_eq!(
        error("[fleet]\nredis = \"redis://a:6379\"\nname = \"\"\n"),
        "t.toml:3:8: fleet.name: must not be empty"
    );
    assert!(
        error(&format!(
            "[fleet]\nredis = \"redis://a:6379\"\nname = \"{}\"\n",
            "n".repeat(65)
        ))
        .contains("fleet.name: must be at most 64 characters")
    );
    assert_eq!(
        error("[fleet]\nredis = \"redis://a:6379\"\nremote_ban_min_prefix_v4 = 33\n"),
        "t.toml:3:28: fleet.remote_ban_min_prefix_v4 must be between 0 and 32"
    );
    assert_eq!(
        error("[fleet]\nredis = \"redis://a:6379\"\nremote_ban_min_prefix_v6 = 129\n"),
        "t.toml:3:28: fleet.remote_ban_min_prefix_v6 must be between 0 and 128"
    );
    assert_eq!(
        error("[fleet]\nredis = \"redis://a:6379\"\nremote_ban_max_duration = \"0s\"\n"),
        "t.toml:3:27: fleet.remote_ban_max_duration must be between 1s and 365d"
    );
    assert!(
        error("[fleet]\nredis = \"redis://a:6379\"\nkey_file = 3\n").starts_with("t.toml:3:12:")
    );
}
