//! A rule's match as the program reads it: the fields of `RuleConfig::more` and the flags
//! that go with them, the payload reads all rules share (`GlobalConfig::fetches`), the
//! destinations trie (`RL_DESTS`), and how many leading rules a fast-drop entry may stand
//! for (`GlobalConfig::narrow_rules`).

use std::collections::BTreeMap;

use ratelimit_common::{
    caps::{MAX_LENGTH_RANGES, MAX_PAYLOAD_FETCHES, MAX_PAYLOAD_MATCHES, MAX_SRC_PORT_RANGES},
    maps::*,
};

use crate::config::{Fragment, Match, PayloadFrom, Rule, TcpState};

use super::prefixes::{Prefix, close_over_covering, prefix};

/// One payload read: where it counts from, the offset, the length.
pub type Read = (PayloadFrom, u16, u8);

/// The distinct payload reads of all rules, in the order rules first name them: what
/// `GlobalConfig::fetches` holds (validation keeps them within `MAX_PAYLOAD_FETCHES`).
pub fn payload_reads(rules: &[Rule]) -> Vec<Read> {
    let mut reads: Vec<Read> = Vec::new();
    for p in rules.iter().flat_map(|r| &r.matcher.payload) {
        if !reads.contains(&p.read()) {
            reads.push(p.read());
        }
    }
    reads
}

/// `GlobalConfig::fetch_count` and `fetches` of `reads`.
pub fn fetches(reads: &[Read]) -> (u32, Fetches) {
    let mut out = Fetches::default();
    for (slot, (from, offset, len)) in out.iter_mut().zip(reads) {
        *slot = PayloadFetch {
            from: match from {
                PayloadFrom::L4 => FROM_L4,
                PayloadFrom::L4Payload => FROM_L4_PAYLOAD,
            },
            len: *len,
            offset: *offset,
        };
    }
    (reads.len().min(MAX_PAYLOAD_FETCHES) as u32, out)
}

fn ranges<T: Copy + Into<u16>>(out: &mut [PortRange], v: &[(T, T)]) -> u8 {
    for (slot, (lo, hi)) in out.iter_mut().zip(v) {
        *slot = PortRange {
            lo: (*lo).into(),
            hi: (*hi).into(),
        };
    }
    v.len().min(out.len()) as u8
}

fn bits(v: &[u8]) -> [u32; 8] {
    let mut set = [0u32; 8];
    for t in v {
        set[(*t >> 5) as usize] |= 1 << (*t & 31);
    }
    set
}

/// The flags (`RULE_MORE_MATCH`, `RULE_ICMP_*`, `RULE_DST_MATCH`, `RULE_EXCEPT`,
/// `RULE_TCP_STATE`) and `RuleConfig::more` of a match; its payload conditions point into
/// `reads` ([`payload_reads`]).
pub fn more_match(m: &Match, reads: &[Read]) -> (u32, MoreMatch) {
    let mut more = MoreMatch::default();
    let mut flags = 0;
    debug_assert!(m.src_ports.len() <= MAX_SRC_PORT_RANGES);
    debug_assert!(m.length.len() <= MAX_LENGTH_RANGES && m.ttl.len() <= MAX_LENGTH_RANGES);
    more.src_port_count = ranges(&mut more.src_ports, &m.src_ports);
    more.length_count = ranges(&mut more.lengths, &m.length);
    more.ttl_count = ranges(&mut more.ttls, &m.ttl);
    more.fragment = match m.fragment {
        None => FRAGMENT_ANY_PACKET,
        Some(Fragment::Any) => FRAGMENT_ANY,
        Some(Fragment::Later) => FRAGMENT_LATER,
        Some(Fragment::None) => FRAGMENT_NONE,
    };
    if !m.icmp_types.is_empty() {
        flags |= RULE_ICMP_TYPES;
        more.icmp_types = bits(&m.icmp_types);
    }
    if !m.icmp_codes.is_empty() {
        flags |= RULE_ICMP_CODES;
        more.icmp_codes = bits(&m.icmp_codes);
    }
    for (slot, p) in more
        .payload
        .iter_mut()
        .zip(&m.payload)
        .take(MAX_PAYLOAD_MATCHES)
    {
        let at = reads.iter().position(|r| *r == p.read());
        *slot = PayloadMatch {
            fetch: at.map_or(0, |j| j as u8 + 1),
            _pad: [0; 3],
            mask: p.mask,
            value: p.value,
        };
    }
    if more != MoreMatch::default() || flags != 0 {
        flags |= RULE_MORE_MATCH;
    }
    if !m.dst.is_empty() {
        flags |= RULE_DST_MATCH;
    }
    if !m.except.is_empty() {
        flags |= RULE_EXCEPT;
    }
    if m.tcp_state == Some(TcpState::NoConnection) {
        flags |= RULE_TCP_STATE;
    }
    (flags, more)
}

/// The `GLOBAL_*` flags the rules' matches ask for: a socket lookup (`tcp_state`), the
/// destinations trie (`dst`), the fields read from the frame (`RULE_MORE_MATCH`).
pub fn global_flags(rules: &[RuleConfig]) -> u32 {
    let any = |flag: u32| rules.iter().any(|r| r.flags & flag != 0);
    [
        (RULE_TCP_STATE, GLOBAL_TCP_STATE),
        (RULE_DST_MATCH, GLOBAL_DST_MATCH),
        (RULE_MORE_MATCH, GLOBAL_MORE_MATCH),
    ]
    .iter()
    .filter(|(rule, _)| any(*rule))
    .fold(0, |acc, (_, global)| acc | global)
        | if rules
            .iter()
            .any(|r| r.key == KEY_TUPLE && r.key_fields & (KEY_FIELD_DST | KEY_FIELD_SRC_PORT) != 0)
        {
            GLOBAL_KEY_TUPLE
        } else {
            0
        }
}

/// How many of the first rules a fast-drop entry may stand for: those whose match and key
/// read only what the entry keys on (source, protocol, destination port, TCP flags).
pub fn narrow_rules(rules: &[RuleConfig]) -> u32 {
    let wide = RULE_MORE_MATCH | RULE_DST_MATCH | RULE_TCP_STATE;
    let wide_key = KEY_FIELD_DST | KEY_FIELD_SRC_PORT;
    rules
        .iter()
        .take_while(|r| r.flags & wide == 0 && (r.key != KEY_TUPLE || r.key_fields & wide_key == 0))
        .count() as u32
}

/// The destinations trie: every rule's `dst` prefixes, each with the rules whose lists cover
/// it (closed over covering prefixes, as the sources trie is).
pub fn dests(rules: &[Rule]) -> BTreeMap<Prefix, u32> {
    let own: Vec<(Prefix, ListValue)> = rules
        .iter()
        .enumerate()
        .flat_map(|(i, r)| {
            r.matcher.dst.iter().map(move |n| {
                (
                    prefix(&n.trunc()),
                    ListValue {
                        rule_src_mask: 1 << i,
                        ..ListValue::default()
                    },
                )
            })
        })
        .collect();
    close_over_covering(&own)
        .into_iter()
        .map(|(p, v)| (p, v.rule_src_mask))
        .collect()
}

/// The sources trie's entries for the rules' `except` lists.
pub fn excepts(rules: &[Rule]) -> Vec<(Prefix, ListValue)> {
    rules
        .iter()
        .enumerate()
        .flat_map(|(i, r)| {
            r.matcher.except.iter().map(move |n| {
                (
                    prefix(&n.trunc()),
                    ListValue {
                        rule_except_mask: 1 << i,
                        ..ListValue::default()
                    },
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use ratelimit_common::addr::IpKey;

    use super::super::apply::plan;
    use super::*;

    fn config(rules: &str) -> crate::config::Config {
        crate::config::parse("t.toml", rules).unwrap_or_else(|e| panic!("{e}"))
    }

    fn rule(name: &str, lines: &str) -> String {
        format!(
            "[[rule]]\nname = \"{name}\"\nthreshold = {{ count = 10, interval = \"1s\" }}\n{lines}\n"
        )
    }

    #[test]
    fn a_match_becomes_the_fields_and_flags_the_program_reads() {
        let cfg = config(&[
            rule("syn", "match = { protocol = \"tcp\", tcp_flags = \"syn\", dst_ports = [80] }"),
            rule(
                "refl",
                "match = { protocol = \"udp\", src_ports = [\"53\", \"123\"], length = [\"400-65535\"], ttl = [\"1-64\"], fragment = \"none\", dst = [\"192.0.2.0/24\"], payload = [{ from = \"l4_payload\", offset = 2, value = \"0x8000\", mask = \"0x8000\" }] }\nexcept = [\"198.51.100.53\"]",
            ),
            rule(
                "ping",
                "match = { protocol = \"icmp\", icmp_types = [8, 13], icmp_codes = [0], payload = [{ from = \"l4_payload\", offset = 2, value = \"0x0000\", mask = \"0x8000\" }, { from = \"l4\", offset = 4, value = \"0x12\" }] }",
            ),
            rule("oos", "match = { protocol = \"tcp\", tcp_flags = \"!syn\", tcp_state = \"no_connection\" }"),
        ]
        .concat());
        let p = plan(&cfg, false);
        let [syn, refl, ping, oos] = [&p.rules[0], &p.rules[1], &p.rules[2], &p.rules[3]];
        assert_eq!(
            syn.flags & (RULE_MORE_MATCH | RULE_DST_MATCH | RULE_EXCEPT | RULE_TCP_STATE),
            0
        );
        assert_eq!(syn.more, MoreMatch::default());

        assert_eq!(
            refl.flags & (RULE_MORE_MATCH | RULE_DST_MATCH | RULE_EXCEPT | RULE_ICMP_TYPES),
            RULE_MORE_MATCH | RULE_DST_MATCH | RULE_EXCEPT
        );
        let m = &refl.more;
        assert_eq!((m.src_port_count, m.length_count, m.ttl_count), (2, 1, 1));
        assert_eq!(
            m.src_ports[..2],
            [PortRange { lo: 53, hi: 53 }, PortRange { lo: 123, hi: 123 }]
        );
        assert_eq!(m.lengths[0], PortRange { lo: 400, hi: 65535 });
        assert_eq!(m.ttls[0], PortRange { lo: 1, hi: 64 });
        assert_eq!(m.fragment, FRAGMENT_NONE);
        let p0 = PayloadMatch {
            fetch: 1,
            _pad: [0; 3],
            mask: 0x8000,
            value: 0x8000,
        };
        assert_eq!(m.payload, [p0, PayloadMatch::default()]);

        assert_eq!(
            ping.flags & (RULE_MORE_MATCH | RULE_ICMP_TYPES | RULE_ICMP_CODES),
            RULE_MORE_MATCH | RULE_ICMP_TYPES | RULE_ICMP_CODES
        );
        assert_eq!(
            ping.more.icmp_types,
            [(1 << 8) | (1 << 13), 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(ping.more.icmp_codes, [1, 0, 0, 0, 0, 0, 0, 0]);
        // The same read as `refl`'s shares its fetch; the new one is the second.
        assert_eq!(ping.more.payload[0].fetch, 1);
        assert_eq!(
            ping.more.payload[1],
            PayloadMatch {
                fetch: 2,
                _pad: [0; 3],
                mask: 0xff,
                value: 0x12
            }
        );
        assert_eq!(
            oos.flags & (RULE_TCP_STATE | RULE_MORE_MATCH),
            RULE_TCP_STATE
        );

        let g = &p.global;
        assert_eq!(g.fetch_count, 2);
        assert_eq!(
            g.fetches[..2],
            [
                PayloadFetch {
                    from: FROM_L4_PAYLOAD,
                    len: 2,
                    offset: 2
                },
                PayloadFetch {
                    from: FROM_L4,
                    len: 1,
                    offset: 4
                },
            ]
        );
        assert_eq!(
            g.flags & (GLOBAL_TCP_STATE | GLOBAL_DST_MATCH),
            GLOBAL_TCP_STATE | GLOBAL_DST_MATCH
        );
        // Only `syn` matches on what a fast-drop entry keys on; `refl` reads more.
        assert_eq!(g.narrow_rules, 1);
        // `except` goes to the sources trie under rule 1; `dst` to the destinations trie.
        let except = p
            .sources
            .iter()
            .find(|((_, k), _)| *k == IpKey::from_v4([198, 51, 100, 53]))
            .expect("the except entry");
        assert_eq!(
            (except.1.rule_except_mask, except.1.rule_src_mask),
            (1 << 1, 0)
        );
        assert_eq!(
            p.dests.iter().map(|(p, v)| (*p, *v)).collect::<Vec<_>>(),
            [((96 + 24, IpKey::from_v4([192, 0, 2, 0])), 1 << 1)]
        );
    }

    #[test]
    fn destination_lists_are_closed_over_covering_prefixes_per_family() {
        let cfg = config(
            &[
                rule("a", "match = { dst = [\"10.0.0.0/8\", \"2001:db8::/32\"] }"),
                rule("b", "match = { dst = [\"10.1.0.0/16\", \"::/0\"] }"),
            ]
            .concat(),
        );
        let d = dests(&cfg.rules);
        let at = |s: &str| {
            let n: ipnet::IpNet = s.parse().unwrap();
            d[&prefix(&n)]
        };
        assert_eq!(at("10.0.0.0/8"), 0b01);
        assert_eq!(at("10.1.0.0/16"), 0b11);
        assert_eq!(at("::/0"), 0b10);
        assert_eq!(at("2001:db8::/32"), 0b11);
        // `::/0` covers no IPv4 destination: 10/8 holds rule a's bit alone.
        assert_eq!(d.len(), 4);
    }
}
