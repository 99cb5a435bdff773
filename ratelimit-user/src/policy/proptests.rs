//! No input panics the config parser or a value parser: arbitrary strings, and structured
//! near-valid mutations of valid input (the inputs that reach deep into validation). What
//! they accept keeps the invariants the daemon relies on, and plans without failing (so these
//! tests sit above both the config and its plan).

use std::time::Duration;

use proptest::prelude::*;

use crate::config::*;

/// Valid configs the mutations start from: every section, every kind of threshold.
const BASES: [&str; 3] = [
    r#"[daemon]
interfaces = ["eth0"]
events = "-"
[tracking]
max_sources = 1000
new_sources_per_sec = 100
[lists]
allow = ["10.0.0.0/8", "2001:db8:1::/48"]
deny = ["203.0.113.0/24"]
[[rule]]
name = "syn"
match = { protocol = "tcp", tcp_flags = "syn", dst_ports = ["80", "8000-8100"] }
action = "rate_based_ban"
threshold = { count = 2000, interval = "20m" }
ban_threshold = { count = 3000, interval = "20m" }
ban_duration = "1h"
soft_limit = 0.8
[[rule.override]]
cidr = "192.168.11.3/32"
threshold = { count = 100000, interval = "20m" }
"#,
    r#"[[rule]]
name = "bytes"
key = "all"
algorithm = "token_bucket"
threshold = { bytes = "10MiB", interval = "1s" }
burst = "20MiB"
"#,
    r#"[[rule]]
name = "udp"
match = { protocol = "udp" }
key = "ip"
ipv4_prefix = 24
ipv6_prefix = 48
algorithm = "fixed_window"
threshold = { count = 5, interval = "500ms" }
exceed_action = "pass"
preview = true
"#,
];

/// Fragments that push a parser toward its edges: huge and negative numbers, zero and
/// enormous durations, malformed addresses, TOML punctuation, multi-byte characters.
const FRAGMENTS: [&str; 32] = [
    "0",
    "-1",
    "18446744073709551616",
    "9223372036854775807",
    "1e999",
    "\"0s\"",
    "\"1000y\"",
    "\"3651d\"",
    "\"1ns\"",
    "\"10MiB\"",
    "\"1B\"",
    "\"99999999999GiB\"",
    "\"300.1.1.1/8\"",
    "\"::ffff:1.2.3.4/200\"",
    "\"1.2.3.4/33\"",
    "\"10.0.0.1/8\"",
    "[",
    "]",
    "{",
    "}",
    "=",
    ",",
    "\"",
    "\n",
    "#",
    ".",
    "[[rule]]\n",
    "inf",
    "nan",
    "\u{e9}",
    "\u{1F600}",
    "\"\"",
];

fn check_config(text: &str) -> Result<(), TestCaseError> {
    if let Ok(cfg) = parse("t.toml", text) {
        for r in &cfg.rules {
            for t in [r.threshold, r.ban_threshold] {
                prop_assert!(t.amount >= 1);
                prop_assert!(values::check_interval(t.interval).is_ok());
                prop_assert!(values::check_amount(t.amount, t.unit, t.interval).is_ok());
            }
            if r.action == Action::RateBasedBan {
                prop_assert!(check_ban_duration(r.ban_duration).is_ok());
            }
            // Planning a parsed config never fails or panics.
            let _ = super::apply::rule_config(r, &super::matching::payload_reads(&cfg.rules));
        }
        let _ = super::apply::plan(&cfg, false);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn arbitrary_text_never_panics_the_config_parser(text in "\\PC{0,200}") {
        check_config(&text)?;
    }

    /// A valid config with a slice cut out and a fragment put in its place.
    #[test]
    fn near_valid_configs_never_panic_the_config_parser(
        base in 0..BASES.len(),
        at in any::<prop::sample::Index>(),
        cut in 0usize..12,
        fragment in 0..FRAGMENTS.len(),
    ) {
        let chars: Vec<char> = BASES[base].chars().collect();
        let at = at.index(chars.len());
        let end = (at + cut).min(chars.len());
        let text: String = chars[..at]
            .iter()
            .chain(FRAGMENTS[fragment].chars().collect::<Vec<_>>().iter())
            .chain(chars[end..].iter())
            .collect();
        check_config(&text)?;
    }

    #[test]
    fn arbitrary_values_never_panic_the_value_parsers(s in "\\PC{0,40}") {
        value_invariants(&s)?;
    }

    /// Values near the grammar: digits, units, separators and address characters.
    #[test]
    fn near_valid_values_never_panic_the_value_parsers(
        s in "[0-9]{0,22}( |\\.|:|/|-)?[0-9a-fA-F.:]{0,20}(/[0-9]{0,4})?(ns|us|ms|s|m|h|d|w|y|B|KB|kB|KiB|MiB|GiB|x)?(/[0-9]{0,22}(ms|s|m|h|d|y)?)?"
    ) {
        value_invariants(&s)?;
    }
}

fn value_invariants(s: &str) -> Result<(), TestCaseError> {
    if let Ok(net) = parse_net(s) {
        prop_assert_eq!(net.trunc(), net);
    }
    if let Ok(d) = parse_ban_duration(s) {
        prop_assert!(d >= Duration::from_millis(1) && d <= MAX_BAN_DURATION);
    }
    let _ = parse_duration(s);
    let _ = parse_bytes(s);
    if let Ok(t) = s.parse::<Threshold>() {
        prop_assert!(t.amount >= 1);
        prop_assert!(values::check_amount(t.amount, t.unit, t.interval).is_ok());
        // And what it prints parses back to itself.
        prop_assert_eq!(t.to_string().parse::<Threshold>(), Ok(t));
    }
    if let Ok((lo, hi)) = parse_port_range(s) {
        prop_assert!(lo >= 1 && lo <= hi);
    }
    if let Ok(f) = parse_tcp_flags(s) {
        prop_assert_eq!(f.value & !f.mask, 0);
    }
    Ok(())
}

/// A config with one value in place: `{value}` in `template` is replaced by `s`, quoted.
fn with_value(template: &str, s: &str) -> Result<Config, String> {
    parse("t.toml", &template.replace("{value}", &format!("\"{s}\""))).map_err(|e| e.to_string())
}

/// One reading of `s` by the command line (`cli`, its error after `flag`) and by the config
/// file (`file`, the config's value or its error after `field`): both accept it as the same
/// value, or both refuse it in the same words.
fn read_alike<T: PartialEq + std::fmt::Debug>(
    s: &str,
    cli: Result<T, String>,
    flag: &str,
    file: Result<T, String>,
    field: &str,
) -> Result<(), TestCaseError> {
    match (cli, file) {
        (Ok(a), Ok(b)) => prop_assert_eq!(a, b, "{:?}", s),
        (Err(cli), Err(file)) => {
            let said = cli.replacen(flag, field, 1);
            prop_assert!(file.contains(&said), "{s:?}: {cli:?} vs {file:?}");
        }
        (cli, file) => prop_assert!(
            false,
            "{s:?}: the command line says {cli:?}, the file {file:?}"
        ),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// `ban add --for` and `rule set --ban-duration` read a duration as a rule's `ban_duration`
    /// does: one parser, one set of bounds, one wording.
    #[test]
    fn ban_durations_read_alike_on_the_command_line_and_in_the_config(
        s in "[0-9]{0,12}(ns|us|ms|s|m|h|d|w|y| |x)?([0-9]{0,4}(ms|s|m|h|d|y))?"
    ) {
        let template = "[[rule]]\nname = \"r\"\nthreshold = { count = 10, interval = \"1s\" }\n\
                        action = \"rate_based_ban\"\nban_duration = {value}\n";
        let file = with_value(template, &s).map(|c| c.rules[0].ban_duration);
        let cli = parse_ban_duration(&s).map_err(|e| labelled("--for", &e));
        read_alike(&s, cli, "--for", file, "ban_duration")?;
    }

    /// `ban add CIDR`, `ban del CIDR` (the daemon reads each entry with [`parse_net`]) and
    /// `override add RULE CIDR` read an address or network as `deny` and an override's `cidr`
    /// do: the same host-bit, prefix-length and IPv4-mapped rules, the same wording.
    #[test]
    fn cidrs_read_alike_on_the_command_line_and_in_the_config(
        s in "(([0-9]{1,3}\\.){0,3}[0-9]{0,3}|[0-9a-f:]{0,12}|::ffff:[0-9.]{0,15})(/[0-9]{0,4})? ?"
    ) {
        let deny = with_value("[lists]\ndeny = [{value}]\n", &s).map(|c| c.lists.deny[0]);
        let ban = parse_net(&s).map_err(|e| labelled("entry 1", &e));
        read_alike(&s, ban.clone(), "entry 1", deny, "lists.deny")?;
        let at = super::live::OverrideAt {
            rule: "r".into(),
            cidr: Some(s.clone()),
            region: None,
        };
        let live = at.target().map_err(|e| labelled("cidr", &e));
        let template = "[[rule]]\nname = \"r\"\nthreshold = { count = 10, interval = \"1s\" }\n\
                        [[rule.override]]\ncidr = {value}\n\
                        threshold = { count = 20, interval = \"1s\" }\n";
        let file = with_value(template, &s).map(|c| c.rules[0].overrides[0].target);
        read_alike(&s, live, "cidr", file, "cidr")?;
        prop_assert_eq!(ban.is_ok(), at.target().is_ok());
    }
}
