//! What each match field costs a packet that meets it: the bench's policy with its measured
//! rule (`udp-per-ip`) given one field (or a key of packet fields), and a frame that meets
//! it, each measured with its references like the program-cost cases, against the plain rule
//! (protocol and destination port only) measured before and after them.
//!
//! Each case's frame is then checked to meet its rule: with the rule's threshold at 1 the same
//! frame, from a source of its own, is dropped. The rule keeps its name, and so its slot and
//! states, across the cases; the other rule and the lists stay as in the bench's policy.
//!
//! `tcp_state = "no_connection"` under BPF_PROG_TEST_RUN: the frame arrives on the loopback
//! device of the test run's network namespace (the bench's), so the socket lookup searches
//! that namespace's sockets, and `bpf_fib_lookup` on loopback answers "forwarding disabled"
//! unless it forwards. The program then takes the segment as addressed to this host only if
//! its destination is in `RL_LOCAL_ADDRS`, which the bench fills with the frame's destination
//! for that case (the daemon writes the host's addresses there); without it the rule does not
//! meet the segment, which is checked too.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ratelimit_tests::packet::{Frame, tcp_flags};
use ratelimit_user::{config, kernel::datapath::Maps, kernel::local_addrs, policy::apply};

use super::{Bench, OURS, POLICY, Paired, XDP_DROP, XDP_PASS};

/// The plain rule's match in [`POLICY`], which each case replaces.
const PLAIN: &str = r#"match = { protocol = "udp", dst_ports = ["9000"] }"#;
/// The plain rule's threshold in [`POLICY`], never reached.
const UNDER: &str = r#"threshold = { count = 1000000000, interval = "1h" }"#;
/// The same at 1, for the check that a case's frame meets its rule.
const OVER: &str = r#"threshold = { count = 1, interval = "1h" }"#;

/// The plain rule's cases, before and after the fields (the first is the bench's own
/// "ours: pass (rule matched, under threshold)" frame and policy).
const PLAIN_BEFORE: &str = "match: plain rule (udp, dst_ports), before";
const PLAIN_AFTER: &str = "match: plain rule (udp, dst_ports), after";

/// Destination of every frame (an address of this host, for `tcp_state`).
const DST4: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
const DST6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);

/// Whose frame: the measured source, or the meeting check's (a state of its own, so the
/// check's drops leave the measured source's state under its threshold).
#[derive(Clone, Copy)]
enum Who {
    Measured,
    Check,
}

fn v4(who: Who) -> Frame {
    let src = match who {
        Who::Measured => Ipv4Addr::new(198, 18, 1, 1),
        Who::Check => Ipv4Addr::new(198, 18, 41, 1),
    };
    Frame::new([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]).ipv4(src, DST4)
}

fn v6(who: Who) -> Frame {
    let src: Ipv6Addr = match who {
        Who::Measured => "2001:db8:1::1",
        Who::Check => "2001:db8:41::1",
    }
    .parse()
    .unwrap();
    Frame::new([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]).ipv6(src, DST6)
}

/// A case: its name, the measured rule's match (and key) in place of [`PLAIN`], its frame.
struct Case {
    name: &'static str,
    rule: &'static str,
    frame: fn(Who) -> Vec<u8>,
}

#[rustfmt::skip]
fn cases() -> Vec<Case> {
    let c = |name, rule, frame| Case { name, rule, frame };
    vec![
        c(PLAIN_BEFORE, PLAIN,
          |w| v4(w).udp(40000, 9000).pad_to(64).build()),
        // Other protocols and IPv6 with the plain rule, for the fields that need them.
        c("match: plain rule, IPv6", PLAIN,
          |w| v6(w).udp(40000, 9000).pad_to(64).build()),
        c("match: plain rule, tcp (tcp_flags = \"!syn\"), an ACK",
          r#"match = { protocol = "tcp", dst_ports = ["9000"], tcp_flags = "!syn" }"#,
          |w| v4(w).tcp(40000, 9000, tcp_flags::ACK).pad_to(64).build()),
        c("match: plain rule, icmp", r#"match = { protocol = "icmp" }"#,
          |w| v4(w).icmp_echo(1, 1).pad_to(64).build()),
        // The fields, each added to the plain rule of its protocol.
        c("match: src_ports (9 services), source port 53",
          r#"match = { protocol = "udp", dst_ports = ["9000"], src_ports = ["19", "53", "123", "161", "389", "1900", "3702", "5353", "11211"] }"#,
          |w| v4(w).udp(53, 9000).pad_to(64).build()),
        c("match: src_ports, IPv6",
          r#"match = { protocol = "udp", dst_ports = ["9000"], src_ports = ["19", "53", "123", "161", "389", "1900", "3702", "5353", "11211"] }"#,
          |w| v6(w).udp(53, 9000).pad_to(64).build()),
        c("match: dst (3 networks)",
          r#"match = { protocol = "udp", dst_ports = ["9000"], dst = ["203.0.113.0/24", "198.18.0.0/24", "2001:db8::/32"] }"#,
          |w| v4(w).udp(40000, 9000).pad_to(64).build()),
        c("match: dst, IPv6",
          r#"match = { protocol = "udp", dst_ports = ["9000"], dst = ["203.0.113.0/24", "198.18.0.0/24", "2001:db8::/32"] }"#,
          |w| v6(w).udp(40000, 9000).pad_to(64).build()),
        c("match: except (a source not excepted)",
          "match = { protocol = \"udp\", dst_ports = [\"9000\"] }\nexcept = [\"192.0.2.53/32\"]",
          |w| v4(w).udp(40000, 9000).pad_to(64).build()),
        c("match: length",
          r#"match = { protocol = "udp", dst_ports = ["9000"], length = ["40-1500"] }"#,
          |w| v4(w).udp(40000, 9000).pad_to(64).build()),
        c("match: ttl, TTL 5",
          r#"match = { protocol = "udp", dst_ports = ["9000"], ttl = ["0-10"] }"#,
          |w| v4(w).ipv4_ttl(5).udp(40000, 9000).pad_to(64).build()),
        c("match: fragment = \"later\", a non-first fragment",
          r#"match = { protocol = "udp", dst_ports = ["9000"], fragment = "later" }"#,
          |w| v4(w).ipv4_fragment(false, 100).udp(40000, 9000).payload(&[0; 32]).build()),
        c("match: icmp_types, an echo request",
          r#"match = { protocol = "icmp", icmp_types = [8] }"#,
          |w| v4(w).icmp_echo(1, 1).pad_to(64).build()),
        c("match: payload (2 bytes from l4_payload)",
          r#"match = { protocol = "udp", dst_ports = ["9000"], payload = [{ from = "l4_payload", offset = 0, value = "0xabcd" }] }"#,
          |w| v4(w).udp(40000, 9000).payload(&[0xab, 0xcd, 0, 0]).pad_to(64).build()),
        c("match: tcp_state = \"no_connection\", an ACK",
          r#"match = { protocol = "tcp", dst_ports = ["9000"], tcp_flags = "!syn", tcp_state = "no_connection" }"#,
          |w| v4(w).tcp(40000, 9000, tcp_flags::ACK).pad_to(64).build()),
        c("key: \"dst\"", "match = { protocol = \"udp\", dst_ports = [\"9000\"] }\nkey = \"dst\"",
          |w| v4(w).udp(40000, 9000).pad_to(64).build()),
        c("key: [\"dst\", \"dst_port\"]",
          "match = { protocol = \"udp\", dst_ports = [\"9000\"] }\nkey = [\"dst\", \"dst_port\"]",
          |w| v4(w).udp(40000, 9000).pad_to(64).build()),
        c("key: [\"ip\", \"dst_port\"]",
          "match = { protocol = \"udp\", dst_ports = [\"9000\"] }\nkey = [\"ip\", \"dst_port\"]",
          |w| v4(w).udp(40000, 9000).pad_to(64).build()),
        c(PLAIN_AFTER, PLAIN,
          |w| v4(w).udp(40000, 9000).pad_to(64).build()),
    ]
}

const TCP_STATE: &str = "match: tcp_state = \"no_connection\", an ACK";

/// The bench's policy with its measured rule's match replaced by `rule`, under or over its
/// threshold.
fn policy(rule: &str, over: bool) -> config::Config {
    assert!(POLICY.contains(PLAIN) && POLICY.contains(UNDER));
    let mut text = POLICY.replacen(PLAIN, rule, 1);
    if over {
        text = text.replacen(UNDER, OVER, 1);
    }
    config::parse("bench.toml", &text).unwrap_or_else(|e| panic!("{rule}: {e:#}"))
}

fn apply(maps: &mut Maps, cfg: &config::Config) {
    apply::apply(maps, &apply::plan(cfg, false)).expect("apply");
}

/// Write `addrs` into `RL_LOCAL_ADDRS` (the addresses the program takes as this host's).
fn local(maps: &mut Maps, addrs: &[IpAddr]) {
    let set: BTreeSet<[u8; 16]> = addrs.iter().map(|a| local_addrs::key_of(*a)).collect();
    maps.local_addrs
        .as_mut()
        .expect("the loaded object's RL_LOCAL_ADDRS")
        .sync(&set);
}

/// The verdict of the last of three runs of `frame`.
fn verdict(b: &mut Bench, frame: &[u8]) -> u32 {
    b.dp.test_run_program(OURS, frame, 3)
        .unwrap_or_else(|e| panic!("{OURS}: {e:#}"))
        .0
}

/// Measure every case (each pushed through `push` like the program-cost cases), check that
/// each frame meets its rule, and print each case's cost against the plain rule's. Leaves the
/// maps with the bench's policy (`cfg`) and `RL_LOCAL_ADDRS` empty.
pub fn run(
    b: &mut Bench,
    maps: &mut Maps,
    cfg: &config::Config,
    push: &mut dyn FnMut(&str, &str, &'static str, Paired),
) {
    let cases = cases();
    let mut over = Vec::with_capacity(cases.len());
    for case in &cases {
        apply(maps, &policy(case.rule, false));
        let tcp_state = case.name == TCP_STATE;
        if tcp_state {
            local(maps, &[DST4.into()]);
        }
        let p = b.paired(OURS, &(case.frame)(Who::Measured), XDP_PASS);
        if tcp_state {
            local(maps, &[]);
        }
        over.push(p.over_pass);
        push(case.name, OURS, "pass", p);
    }
    // Each frame meets its rule: over a threshold of 1 it is dropped.
    for case in &cases {
        apply(maps, &policy(case.rule, true));
        let frame = (case.frame)(Who::Check);
        if case.name == TCP_STATE {
            // Not addressed to this host (forwarding off, the address not written): the
            // segment is none of the rule's business.
            assert_eq!(
                verdict(b, &frame),
                XDP_PASS,
                "{}: no local address",
                case.name
            );
            local(maps, &[DST4.into()]);
        }
        assert_eq!(verdict(b, &frame), XDP_DROP, "{}: over 1", case.name);
        local(maps, &[]);
    }
    apply(maps, cfg);

    let at = |name: &str| over[cases.iter().position(|c| c.name == name).unwrap()];
    let plain = (at(PLAIN_BEFORE) + at(PLAIN_AFTER)) / 2.0;
    println!(
        "  match fields against the plain rule (+{:.1} before, +{:.1} after, mean +{plain:.1} over XDP_PASS):",
        at(PLAIN_BEFORE),
        at(PLAIN_AFTER)
    );
    for (case, o) in cases.iter().zip(&over) {
        println!(
            "    {:<55} {o:>+8.1} over XDP_PASS {:>+8.1} against the plain rule",
            case.name,
            o - plain
        );
    }
}
