//! `key`: the keywords, lists of packet fields, and what they are refused with.

use super::{KeyField, KeyFields, KeyKind};
use crate::config::tests::{at, error, errors, ok, rule};
use ratelimit_common::maps::{
    KEY_FIELD_DST, KEY_FIELD_DST_PORT, KEY_FIELD_PROTOCOL, KEY_FIELD_SRC, KEY_FIELD_SRC_PORT,
};

fn key_of(line: &str) -> KeyKind {
    ok(&rule("r", line)).rules[0].key
}

#[test]
fn keys_read_as_keywords_and_as_lists_of_fields() {
    assert_eq!(key_of(""), KeyKind::Ip);
    assert_eq!(key_of("key = \"all\""), KeyKind::All);
    assert_eq!(key_of("key = \"dst\""), KeyKind::DST);
    assert_eq!(key_of("key = [\"dst\"]"), KeyKind::DST);
    assert_eq!(key_of("key = [\"ip\"]"), KeyKind::Ip);
    let k = key_of("key = [\"dst_port\", \"dst\"]");
    assert_eq!(
        k,
        KeyKind::Fields(KeyFields(KEY_FIELD_DST | KEY_FIELD_DST_PORT))
    );
    let k = key_of("key = [\"protocol\", \"src_port\", \"dst_port\"]");
    let all_ports = KEY_FIELD_DST_PORT | KEY_FIELD_SRC_PORT | KEY_FIELD_PROTOCOL;
    assert_eq!(k, KeyKind::Fields(KeyFields(all_ports)));
    // Written back as the config spells it, reported by name.
    assert_eq!(k.toml(), "[\"dst_port\", \"src_port\", \"protocol\"]");
    assert_eq!(k.to_string(), "dst_port+src_port+protocol");
    assert_eq!(KeyKind::DST.toml(), "\"dst\"");
    assert_eq!(KeyKind::DST.to_string(), "dst");
    assert_eq!(KeyKind::Ip.toml(), "\"ip\"");
    assert!(KeyFields(KEY_FIELD_DST).has(KeyField::Dst));
    assert!(!KeyFields(KEY_FIELD_DST).has(KeyField::Ip));
    // With the source: its prefixes apply.
    let text = rule(
        "r",
        "key = [\"dst_port\", \"ip\"]\nipv4_prefix = 24\nipv6_prefix = 48",
    );
    let r = &ok(&text).rules[0];
    assert_eq!(
        r.key,
        KeyKind::Fields(KeyFields(KEY_FIELD_SRC | KEY_FIELD_DST_PORT))
    );
    assert_eq!((r.ipv4_prefix, r.ipv6_prefix), (24, 48));
    assert!(r.key.has_source() && KeyKind::Ip.has_source() && !KeyKind::DST.has_source());
    assert_eq!(r.key.toml(), "[\"ip\", \"dst_port\"]");
    assert_eq!(r.key.to_string(), "ip+dst_port");
    for k in ["\"all\"", "\"ip\"", "\"region\"", "\"dst\""] {
        assert_eq!(k.trim_matches('"').parse::<KeyKind>().unwrap().toml(), k);
    }
}

#[test]
fn bad_keys_are_refused_where_they_are_written() {
    let bad = |line: &str| error(&rule("r", line));
    let text = rule("r", "key = \"dest\"");
    assert_eq!(
        error(&text),
        at(
            &text,
            "\"dest\"",
            0,
            "rule \"r\": key must be one of \"all\", \"ip\", \"region\" or \"dst\", or a list of \
             up to three of \"ip\", \"dst\", \"dst_port\", \"src_port\" or \"protocol\" (got \"dest\")"
        )
    );
    let text = rule(
        "r",
        "key = [\"dst\", \"dst_port\", \"src_port\", \"protocol\"]",
    );
    assert_eq!(
        error(&text),
        at(
            &text,
            "[\"dst\", \"dst_port\"",
            0,
            "rule \"r\": key must list one to three of \"ip\", \"dst\", \"dst_port\", \"src_port\", \"protocol\""
        )
    );
    assert!(bad("key = []").ends_with(
        "key must list one to three of \"ip\", \"dst\", \"dst_port\", \"src_port\", \"protocol\""
    ));
    let text = rule("r", "key = [\"dst\", \"dst\"]");
    assert_eq!(
        error(&text),
        at(
            &text,
            "\"dst\"",
            1,
            "rule \"r\": key \"dst\" is listed twice"
        )
    );
    let text = rule("r", "key = [\"dst\", \"port\"]");
    assert_eq!(
        error(&text),
        at(
            &text,
            "\"port\"",
            0,
            "rule \"r\": key must be one of \"ip\", \"dst\", \"dst_port\", \"src_port\" or \"protocol\" (got \"port\")"
        )
    );
    assert!(bad("key = [\"ip\", \"ip\"]").contains("\"ip\" is listed twice"));
    assert!(bad("key = [1]").contains("key"), "{}", bad("key = [1]"));
    // What a key of fields does not take.
    assert!(
        bad("key = \"dst\"\nipv4_prefix = 24").ends_with(
            "ipv4_prefix only applies to a key with \"ip\" (this rule has key = \"dst\")"
        )
    );
    let text = rule(
        "r",
        "key = [\"dst\", \"dst_port\"]\n[[rule.override]]\ncidr = \"192.0.2.0/24\"\nthreshold = { count = 1, interval = \"1s\" }\n",
    );
    let e = errors(&text);
    assert!(
        e.iter().any(|e| e.contains(
            "overrides need key = \"ip\", \"all\" or \"region\" (this rule has key = [\"dst\", \"dst_port\"])"
        )),
        "{e:#?}"
    );
}
