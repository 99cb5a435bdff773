//! The match fields: read, refused where they could never match, and written back.

use super::super::tests::{at, errors, net, ok, rule};
use super::*;
use crate::config::{Fragment, PayloadFrom, Protocol, TcpState, parse};

#[test]
fn every_field_reads_back_and_writes_as_it_reads() {
    let text = rule(
        "refl",
        r#"match = { protocol = "udp", src_ports = ["53", "1024-65535"], dst = ["192.0.2.0/24", "2001:db8::/32"], length = ["400-65535", 28], ttl = ["0-64"], fragment = "none", payload = [{ from = "l4_payload", offset = 2, value = "0x8000", mask = "0x8000" }, { from = "l4", offset = 0, value = "0x0035" }] }
except = ["192.0.2.53", "2001:db8::53/128"]
"#,
    );
    let c = ok(&text);
    let m = &c.rules[0].matcher;
    assert_eq!(
        *m,
        Match {
            protocol: Some(Protocol::Udp),
            src_ports: vec![(53, 53), (1024, 65535)],
            dst: vec![net("192.0.2.0/24"), net("2001:db8::/32")],
            except: vec![net("192.0.2.53/32"), net("2001:db8::53/128")],
            length: vec![(400, 65535), (28, 28)],
            ttl: vec![(0, 64)],
            fragment: Some(Fragment::None),
            payload: vec![
                Payload {
                    from: PayloadFrom::L4Payload,
                    offset: 2,
                    len: 2,
                    value: 0x8000,
                    mask: 0x8000
                },
                Payload {
                    from: PayloadFrom::L4,
                    offset: 0,
                    len: 2,
                    value: 0x0035,
                    mask: 0xffff
                },
            ],
            ..Match::default()
        }
    );
    // What `ratelimit rules` shows reads back as the same match.
    let shown = m.to_string();
    assert_eq!(
        shown,
        r#"{ protocol = "udp", src_ports = ["53", "1024-65535"], dst = ["192.0.2.0/24", "2001:db8::/32"], length = ["400-65535", "28"], ttl = ["0-64"], fragment = "none", payload = [{ from = "l4_payload", offset = 2, value = "0x8000", mask = "0x8000" }, { from = "l4", offset = 0, value = "0x0035", mask = "0xffff" }] }"#
    );
    let again = ok(&rule("refl", &format!("match = {shown}\n")));
    assert_eq!(
        again.rules[0].matcher,
        Match {
            except: vec![],
            ..m.clone()
        }
    );

    let icmp = ok(&rule(
        "icmp",
        "match = { protocol = \"icmpv6\", icmp_types = [128, 129, 128], icmp_codes = [0] }\n",
    ));
    assert_eq!(icmp.rules[0].matcher.icmp_types, [128, 129]);
    assert_eq!(icmp.rules[0].matcher.icmp_codes, [0]);
    let tcp = ok(&rule(
        "oos",
        "match = { protocol = \"tcp\", tcp_flags = \"!syn\", tcp_state = \"no_connection\" }\n",
    ));
    assert_eq!(tcp.rules[0].matcher.tcp_state, Some(TcpState::NoConnection));
    assert_eq!(
        tcp.rules[0].matcher.to_string(),
        r#"{ protocol = "tcp", tcp_flags = "!syn", tcp_state = "no_connection" }"#
    );
    assert_eq!(Match::default().to_string(), "{}");
}

#[test]
fn what_could_never_match_is_refused_where_it_is_written() {
    let cases: &[(&str, &str, &str)] = &[
        (
            r#"match = { protocol = "icmp", src_ports = ["53"] }"#,
            "src_ports",
            "match.src_ports needs match.protocol = \"tcp\" or \"udp\"",
        ),
        (
            r#"match = { icmp_types = [8] }"#,
            "icmp_types",
            "match.icmp_types needs match.protocol = \"icmp\" or \"icmpv6\"",
        ),
        (
            r#"match = { protocol = "udp", icmp_codes = [0] }"#,
            "icmp_codes",
            "match.icmp_codes needs match.protocol = \"icmp\" or \"icmpv6\"",
        ),
        (
            r#"match = { protocol = "udp", tcp_state = "no_connection" }"#,
            "tcp_state",
            "match.tcp_state needs match.protocol = \"tcp\"",
        ),
        (
            r#"match = { protocol = "tcp", tcp_flags = "syn", tcp_state = "no_connection" }"#,
            "tcp_state",
            "match.tcp_state = \"no_connection\" never matches a SYN (tcp_flags asks for one): a SYN opens a connection, it does not belong to one",
        ),
        (
            r#"match = { protocol = "tcp", tcp_flags = "ack", fragment = "later" }"#,
            "fragment",
            "match.fragment = \"later\" never matches with tcp_flags or tcp_state: a non-first fragment carries no TCP header",
        ),
        (
            r#"match = { length = ["1500-1000"] }"#,
            "\"1500-1000\"",
            "match.length: length range 1500-1000 is empty; did you mean 1000-1500?",
        ),
        (
            r#"match = { length = [19] }"#,
            "19",
            "match.length: length 19 is out of range (20-65535)",
        ),
        (
            r#"match = { ttl = ["64-300"] }"#,
            "\"64-300\"",
            "match.ttl: TTL 300 is out of range (0-255)",
        ),
        (
            r#"match = { ttl = [] }"#,
            "[]",
            "match.ttl must not be empty; leave it out to match any TTL",
        ),
        (
            r#"match = { length = [20, 30, 40, 50, 60] }"#,
            "60",
            "match.length: too many length ranges; at most 4 fit",
        ),
        (
            r#"match = { fragment = "first" }"#,
            "\"first\"",
            "match.fragment must be one of \"any\", \"later\" or \"none\" (got \"first\")",
        ),
        (
            r#"match = { protocol = "icmp", icmp_types = [256] }"#,
            "256",
            "match.icmp_types must be between 0 and 255",
        ),
        (
            r#"match = { dst = ["192.0.2.1/24"] }"#,
            "\"192.0.2.1/24\"",
            "match.dst",
        ),
        (
            r#"match = { protocol = "udp", payload = [{ from = "l4", offset = 0, value = "0x01", mask = "0x02" }] }"#,
            "\"0x01\"",
            "match.payload.value: has bits the mask clears, so it can never match; clear them or widen the mask",
        ),
        (
            r#"match = { protocol = "udp", payload = [{ from = "l4", value = "0x0100", mask = "0xff" }] }"#,
            "\"0xff\"",
            "match.payload.mask: has 1 bytes and the value 2: give both the same length",
        ),
        (
            r#"match = { protocol = "udp", payload = [{ from = "l4", value = "0x123" }] }"#,
            "\"0x123\"",
            "match.payload.value: \"0x123\" is not 1 to 4 whole bytes of hex; write e.g. \"0x00\" or \"0x0000ffff\"",
        ),
        (
            r#"match = { protocol = "udp", payload = [{ from = "l7", value = "0x12" }] }"#,
            "\"l7\"",
            "match.payload.from must be one of \"l4\" or \"l4_payload\" (got \"l7\")",
        ),
        (
            r#"match = { protocol = "udp", payload = [{ from = "l4", offset = 1501, value = "0x12" }] }"#,
            "1501",
            "match.payload.offset must be between 0 and 1500",
        ),
        (
            r#"match = { protocol = "udp", payload = [{ from = "l4", value = "0x1" }, { from = "l4", value = "0x2" }, { from = "l4", value = "0x3" }] }"#,
            "[{",
            "match.payload has 3 conditions; at most 2 fit",
        ),
    ];
    for (m, needle, message) in cases {
        let text = rule("r", &format!("{m}\n"));
        let got = errors(&text);
        assert_eq!(got.len(), 1, "{m}: {got:#?}");
        let want = at(&text, needle, 0, &format!("rule \"r\": {message}"));
        assert!(
            got[0].starts_with(&want),
            "{m}:\n got {}\nwant {want}",
            got[0]
        );
    }
}

#[test]
fn payload_reads_are_counted_across_rules() {
    // Four distinct reads fit; the same read in two rules counts once; a fifth is refused.
    let read = |off: u32| format!("{{ from = \"l4\", offset = {off}, value = \"0x00\" }}");
    let mut text = String::new();
    for (i, offs) in [[0, 1], [1, 2], [3, 3]].iter().enumerate() {
        let p = if offs[0] == offs[1] {
            read(offs[0])
        } else {
            format!("{}, {}", read(offs[0]), read(offs[1]))
        };
        text.push_str(&rule(
            &format!("r{i}"),
            &format!("match = {{ protocol = \"udp\", payload = [{p}] }}\n"),
        ));
    }
    let c = ok(&text);
    assert_eq!(c.rules.len(), 3);
    text.push_str(&rule(
        "r3",
        &format!(
            "match = {{ protocol = \"udp\", payload = [{}] }}\n",
            read(9)
        ),
    ));
    let got = errors(&text);
    assert_eq!(got.len(), 1, "{got:#?}");
    assert!(
        got[0].contains(
            "rule \"r3\": match.payload: too many distinct payload reads (from, offset, length); at most 4 fit across all rules"
        ),
        "{}",
        got[0]
    );
}

#[test]
fn except_is_a_list_of_sources() {
    let text = rule("r", "except = [\"::ffff:192.0.2.1\"]\n");
    let got = errors(&text);
    assert_eq!(got.len(), 1, "{got:#?}");
    assert!(
        got[0].contains("rule \"r\": except: ::ffff:192.0.2.1 is inside ::ffff:0:0/96"),
        "{}",
        got[0]
    );
    assert!(parse("t.toml", &rule("r", "except = []\n")).is_err());
}

#[test]
fn a_reflection_rule_names_up_to_sixteen_source_ports() {
    let ports = |n: u16| {
        (1..=n)
            .map(|p| format!("\"{}\"", p * 100))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let text = rule(
        "refl",
        &format!(
            "match = {{ protocol = \"udp\", src_ports = [{}], length = [\"400-65535\"] }}\n",
            ports(16)
        ),
    );
    assert_eq!(ok(&text).rules[0].matcher.src_ports.len(), 16);
    let text = rule(
        "refl",
        &format!(
            "match = {{ protocol = \"udp\", src_ports = [{}] }}\n",
            ports(17)
        ),
    );
    assert_eq!(
        errors(&text),
        [at(
            &text,
            "\"1700\"",
            0,
            "rule \"refl\": match.src_ports: too many port ranges; at most 16 fit"
        )]
    );
    // Destination ports keep their eight.
    let text = rule(
        "svc",
        &format!(
            "match = {{ protocol = \"udp\", dst_ports = [{}] }}\n",
            ports(9)
        ),
    );
    assert_eq!(
        errors(&text),
        [at(
            &text,
            "\"900\"",
            0,
            "rule \"svc\": match.dst_ports: too many port ranges; at most 8 fit"
        )]
    );
}
