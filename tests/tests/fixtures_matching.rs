//! The match fields (source ports, length, TTL, fragments, ICMP types and codes, payload
//! bytes, destinations, `except`) through the real XDP object with BPF_PROG_TEST_RUN: each
//! case names the rules the frame must meet, and meets no other.

use std::net::{Ipv4Addr, Ipv6Addr};

use ratelimit_tests::{
    fixture::{
        Fixture, XDP_DROP, XDP_PASS, case,
        frames::{CLIENT_MAC, SERVER_MAC, v4, v6},
    },
    kernel_test,
    packet::{Frame, tcp_flags},
};

const CONFIG: &str = include_str!("../configs/fixture-matching.toml");

/// `frame` with the byte at `at` set to `v` (checksums left: the program reads none).
fn poke(frame: Frame, at: usize, v: u8) -> Vec<u8> {
    let mut f = frame.build();
    f[at] = v;
    f
}

/// The IPv6 hop limit (byte 7 of the header).
const HOP_LIMIT: usize = 14 + 7;
/// An IPv4 ICMP header's type and code, after a 20-byte IP header.
const ICMP4_TYPE: usize = 14 + 20;
const ICMP6_TYPE: usize = 14 + 40;

#[test]
fn each_match_field_matches_exactly_what_it_says() {
    kernel_test!();
    let mut fx = Fixture::load(CONFIG);
    let other4 = |src: [u8; 4]| {
        Frame::new(CLIENT_MAC, SERVER_MAC).ipv4(Ipv4Addr::from(src), Ipv4Addr::new(198, 18, 0, 2))
    };
    let other6 = |src: &str| {
        Frame::new(CLIENT_MAC, SERVER_MAC).ipv6(
            src.parse().unwrap(),
            "2001:db8::2".parse::<Ipv6Addr>().unwrap(),
        )
    };
    #[rustfmt::skip]
    let cases = vec![
        // --- source ports and length (a reflection rule), with its `except`.
        case("a large response from :53 meets refl", XDP_PASS,
             "pass state_created refl/matched refl/admitted",
             v4([198, 18, 9, 1]).udp(53, 40000).pad_to(300)),
        case("a small one does not", XDP_PASS, "pass",
             v4([198, 18, 9, 1]).udp(53, 40000).payload(&[0; 20])),
        case("199 bytes of IP packet is under the range", XDP_PASS, "pass",
             v4([198, 18, 9, 1]).udp(53, 40000).payload(&[0; 199 - 28])),
        case("200 bytes is in it", XDP_PASS, "pass refl/matched refl/admitted",
             v4([198, 18, 9, 1]).udp(53, 40000).payload(&[0; 200 - 28])),
        case("from :54 it does not", XDP_PASS, "pass",
             v4([198, 18, 9, 1]).udp(54, 40000).pad_to(300)),
        case("from :11211, the ninth port, it does", XDP_PASS, "pass refl/matched refl/admitted",
             v4([198, 18, 9, 1]).udp(11211, 40000).pad_to(300)),
        case("and from :12010, the tenth range's end", XDP_PASS,
             "pass refl/matched refl/admitted",
             v4([198, 18, 9, 1]).udp(12010, 40000).pad_to(300)),
        case("but not :12011", XDP_PASS, "pass", v4([198, 18, 9, 1]).udp(12011, 40000).pad_to(300)),
        case("TCP from :53 does not", XDP_PASS, "pass",
             v4([198, 18, 9, 1]).tcp(53, 40000, tcp_flags::ACK).pad_to(300)),
        case("IPv6 from :123 does", XDP_PASS, "pass refl/matched refl/admitted",
             v6("2001:db8:9::1").udp(123, 40000).pad_to(300)),
        case("the host's own resolver is excepted", XDP_PASS, "pass",
             v4([198, 18, 9, 53]).udp(53, 40000).pad_to(300)),
        case("and its IPv6 one", XDP_PASS, "pass",
             v6("2001:db8:9::53").udp(53, 40000).pad_to(300)),
        case("a first fragment is judged by its header", XDP_PASS,
             "pass refl/matched refl/admitted",
             v4([198, 18, 9, 1]).ipv4_fragment(true, 0).udp(53, 40000).pad_to(300)),
        // A later fragment has no ports: the port condition counts as met, the length not.
        // (It meets the payload rule too: UDP, its port and payload conditions unknowable.)
        case("a large later fragment meets refl", XDP_PASS,
             "pass fragments refl/matched refl/admitted \
              state_created payload/matched payload/admitted",
             v4([198, 18, 9, 1]).ipv4_fragment(false, 100).udp(53, 40000).payload(&[0; 300])),
        case("a small later fragment does not", XDP_PASS,
             "pass fragments payload/matched payload/admitted",
             v4([198, 18, 9, 1]).ipv4_fragment(false, 100).udp(53, 40000).payload(&[0; 50])),
        // --- TTL / hop limit.
        case("TTL 5 meets ttl", XDP_PASS, "pass state_created ttl/matched ttl/admitted",
             v4([198, 18, 10, 1]).ipv4_ttl(5).udp(1, 7001)),
        case("TTL 10 is the range's end", XDP_PASS, "pass ttl/matched ttl/admitted",
             v4([198, 18, 10, 1]).ipv4_ttl(10).udp(1, 7001)),
        case("TTL 11 is not in it", XDP_PASS, "pass",
             v4([198, 18, 10, 1]).ipv4_ttl(11).udp(1, 7001)),
        case("TTL 64 is not", XDP_PASS, "pass", v4([198, 18, 10, 1]).udp(1, 7001)),
        case("TTL 255 is in the second range", XDP_PASS, "pass ttl/matched ttl/admitted",
             v4([198, 18, 10, 1]).ipv4_ttl(255).udp(1, 7001)),
        case("hop limit 250 is", XDP_PASS, "pass ttl/matched ttl/admitted",
             poke(v6("2001:db8:10::1").udp(1, 7001), HOP_LIMIT, 250)),
        case("hop limit 64 is not", XDP_PASS, "pass", v6("2001:db8:10::1").udp(1, 7001)),
        // --- fragments.
        case("any: a first fragment", XDP_PASS,
             "pass state_created frag-any/matched frag-any/admitted",
             v4([198, 18, 30, 1]).ipv4_fragment(true, 0).raw_l4(47).payload(&[0; 16])),
        case("any: a later one", XDP_PASS, "pass fragments frag-any/matched frag-any/admitted",
             v4([198, 18, 30, 1]).ipv4_fragment(false, 2).raw_l4(47).payload(&[0; 16])),
        case("any: not a whole datagram", XDP_PASS, "pass", v4([198, 18, 30, 1]).udp(1, 9)),
        case("any: an IPv6 first fragment", XDP_PASS, "pass frag-any/matched frag-any/admitted",
             v6("2001:db8:30::1").ipv6_fragment(true, 0, 7).raw_l4(47).payload(&[0; 16])),
        case("later: not a first fragment", XDP_PASS, "pass",
             v4([198, 18, 31, 1]).ipv4_fragment(true, 0).raw_l4(47).payload(&[0; 16])),
        case("later: a later one", XDP_PASS,
             "pass fragments state_created frag-later/matched frag-later/admitted",
             v4([198, 18, 31, 1]).ipv4_fragment(true, 4).raw_l4(47).payload(&[0; 16])),
        case("later: an IPv6 later one", XDP_PASS,
             "pass fragments frag-later/matched frag-later/admitted",
             v6("2001:db8:31::1").ipv6_fragment(false, 4, 7).raw_l4(47).payload(&[0; 16])),
        case("none: a whole datagram", XDP_PASS,
             "pass state_created frag-none/matched frag-none/admitted",
             v4([198, 18, 32, 1]).udp(1, 9)),
        case("none: not a first fragment", XDP_PASS, "pass",
             v4([198, 18, 32, 1]).ipv4_fragment(true, 0).udp(1, 9).payload(&[0; 16])),
        case("none: not a later one", XDP_PASS,
             "pass fragments payload/matched payload/admitted",
             v4([198, 18, 32, 1]).ipv4_fragment(false, 4).udp(1, 9).payload(&[0; 16])),
        // --- ICMP types and codes.
        case("echo request, code 0", XDP_PASS, "pass state_created icmp/matched icmp/admitted",
             v4([198, 18, 11, 1]).icmp_echo(1, 1)),
        case("echo request, code 1", XDP_PASS, "pass",
             poke(v4([198, 18, 11, 1]).icmp_echo(1, 1), ICMP4_TYPE + 1, 1)),
        case("echo reply", XDP_PASS, "pass",
             poke(v4([198, 18, 11, 1]).icmp_echo(1, 1), ICMP4_TYPE, 0)),
        case("timestamp request (13)", XDP_PASS, "pass icmp/matched icmp/admitted",
             poke(v4([198, 18, 11, 1]).icmp_echo(1, 1), ICMP4_TYPE, 13)),
        case("a later ICMP fragment meets its L4 conditions", XDP_PASS,
             "pass fragments icmp/matched icmp/admitted",
             v4([198, 18, 11, 1]).ipv4_fragment(false, 8).icmp_echo(1, 1).payload(&[0; 16])),
        case("ICMPv6 echo request (128)", XDP_PASS,
             "pass state_created icmp6/matched icmp6/admitted",
             v6("2001:db8:11::1").icmp_echo(1, 1)),
        case("ICMPv6 echo reply (129)", XDP_PASS, "pass",
             poke(v6("2001:db8:11::1").icmp_echo(1, 1), ICMP6_TYPE, 129)),
        // --- payload bytes: 0xabcd at the payload's start, and 0xa_ at byte 8 of UDP.
        case("both payload conditions hold", XDP_PASS, "pass payload/matched payload/admitted",
             v4([198, 18, 12, 1]).udp(1, 7003).payload(&[0xab, 0xcd, 0, 0])),
        case("the second byte differs", XDP_PASS, "pass",
             v4([198, 18, 12, 1]).udp(1, 7003).payload(&[0xab, 0xce, 0, 0])),
        case("a payload of one byte is too short to read", XDP_PASS, "pass",
             v4([198, 18, 12, 1]).udp(1, 7003).payload(&[0xab])),
        case("no payload at all", XDP_PASS, "pass", v4([198, 18, 12, 1]).udp(1, 7003)),
        case("IPv6 too", XDP_PASS, "pass payload/matched payload/admitted",
             v6("2001:db8:12::1").udp(1, 7003).payload(&[0xab, 0xcd])),
        case("to another port, no", XDP_PASS, "pass",
             v4([198, 18, 12, 1]).udp(1, 7004).payload(&[0xab, 0xcd])),
        // --- destinations.
        case("to the listed address", XDP_PASS, "pass state_created dst/matched dst/admitted",
             v4([198, 18, 33, 1]).udp(1, 9)),
        case("to another", XDP_PASS, "pass", other4([198, 18, 33, 1]).udp(1, 9)),
        case("IPv6 to the listed address", XDP_PASS, "pass dst/matched dst/admitted",
             v6("2001:db8:33::1").udp(1, 9)),
        case("IPv6 to another", XDP_PASS, "pass", other6("2001:db8:33::1").udp(1, 9)),
    ];
    fx.run_table("ratelimit", &cases);
}

/// Keys of packet fields: one state per destination and port (TCP), per destination (UDP),
/// per protocol (ICMP), each with its own threshold, in `RL_KEYED`, named by its fields.
const KEYED: &str = r#"
[[rule]]
name = "svc"
match = { protocol = "tcp", dst_ports = ["80", "443"] }
key = ["dst", "dst_port"]
threshold = { count = 2, interval = "1h" }
algorithm = "fixed_window"

[[rule]]
name = "per-dst"
match = { protocol = "udp" }
key = "dst"
threshold = { count = 1, interval = "1h" }
algorithm = "fixed_window"

[[rule]]
name = "per-proto"
match = { protocol = "icmp" }
key = ["protocol", "src_port"]
threshold = { count = 1, interval = "1h" }
algorithm = "fixed_window"

[[rule]]
name = "client-svc"
match = { protocol = "tcp", dst_ports = ["7000-7001"] }
key = ["ip", "dst_port"]
ipv4_prefix = 24
threshold = { count = 1, interval = "1h" }
algorithm = "fixed_window"
"#;

#[test]
fn keys_of_packet_fields_count_each_combination_apart() {
    kernel_test!();
    let mut fx = Fixture::load(KEYED);
    let to = |dst: [u8; 4]| {
        Frame::new(CLIENT_MAC, SERVER_MAC).ipv4(Ipv4Addr::new(198, 18, 40, 1), Ipv4Addr::from(dst))
    };
    let to6 = |dst: &str| {
        Frame::new(CLIENT_MAC, SERVER_MAC).ipv6(
            "2001:db8:40::1".parse().unwrap(),
            dst.parse::<Ipv6Addr>().unwrap(),
        )
    };
    let from = |src: [u8; 4], dst: [u8; 4]| {
        Frame::new(CLIENT_MAC, SERVER_MAC).ipv4(Ipv4Addr::from(src), Ipv4Addr::from(dst))
    };
    let a = [198, 18, 0, 2];
    let b = [198, 18, 0, 3];
    let syn = tcp_flags::SYN;
    #[rustfmt::skip]
    let cases = vec![
        case("A:80, first", XDP_PASS, "pass state_created svc/matched svc/admitted",
             to(a).tcp(1000, 80, syn)),
        case("A:80 from another source and port is the same key", XDP_PASS,
             "pass svc/matched svc/admitted",
             Frame::new(CLIENT_MAC, SERVER_MAC)
                 .ipv4(Ipv4Addr::new(203, 0, 113, 9), Ipv4Addr::from(a)).tcp(2000, 80, syn)),
        case("A:80, third: over", XDP_DROP, "drop_rule svc/matched svc/dropped",
             to(a).tcp(1000, 80, syn)),
        case("A:443 has a budget of its own", XDP_PASS,
             "pass state_created svc/matched svc/admitted", to(a).tcp(1000, 443, syn)),
        case("B:80 too", XDP_PASS, "pass state_created svc/matched svc/admitted",
             to(b).tcp(1000, 80, syn)),
        case("IPv6 [2001:db8::2]:80 too", XDP_PASS,
             "pass state_created svc/matched svc/admitted", to6("2001:db8::2").tcp(1000, 80, syn)),
        case("UDP to A, first", XDP_PASS, "pass state_created per-dst/matched per-dst/admitted",
             to(a).udp(1, 53)),
        case("UDP to A on another port: same key, over", XDP_DROP,
             "drop_rule per-dst/matched per-dst/dropped", to(a).udp(1, 54)),
        case("UDP to B", XDP_PASS, "pass state_created per-dst/matched per-dst/admitted",
             to(b).udp(1, 53)),
        case("a later UDP fragment to A: keyed by its destination", XDP_DROP,
             "drop_rule fragments per-dst/matched per-dst/dropped",
             to(a).ipv4_fragment(false, 8).udp(1, 53).payload(&[0; 16])),
        case("ICMP, first", XDP_PASS, "pass state_created per-proto/matched per-proto/admitted",
             to(a).icmp_echo(1, 1)),
        case("ICMP to B: one key for the protocol", XDP_DROP,
             "drop_rule per-proto/matched per-proto/dropped", to(b).icmp_echo(1, 2)),
        case("198.18.40.1 to A:7000, first", XDP_PASS,
             "pass state_created client-svc/matched client-svc/admitted", to(a).tcp(1, 7000, syn)),
        case("another source of its /24 to B:7000: the same key", XDP_DROP,
             "drop_rule client-svc/matched client-svc/dropped",
             from([198, 18, 40, 200], b).tcp(2, 7000, syn)),
        case("the same source to A:7001: a budget of its own", XDP_PASS,
             "pass state_created client-svc/matched client-svc/admitted", to(a).tcp(1, 7001, syn)),
        case("another /24 to A:7000 too", XDP_PASS,
             "pass state_created client-svc/matched client-svc/admitted",
             from([198, 18, 41, 1], a).tcp(1, 7000, syn)),
        case("IPv6 to port 7000, first", XDP_PASS,
             "pass state_created client-svc/matched client-svc/admitted",
             to6("2001:db8::2").tcp(1, 7000, syn)),
        case("IPv6, another source of the /64: the same key", XDP_DROP,
             "drop_rule client-svc/matched client-svc/dropped",
             Frame::new(CLIENT_MAC, SERVER_MAC)
                 .ipv6("2001:db8:40::7".parse().unwrap(), "2001:db8::3".parse().unwrap())
                 .tcp(1, 7000, syn)),
    ];
    fx.run_table("ratelimit", &cases);

    use ratelimit_common::maps::KEY_TUPLE;
    use ratelimit_user::policy::report::client_label;
    let mut labels: Vec<String> = fx
        .maps
        .clients
        .keys()
        .unwrap()
        .iter()
        .filter(|k| k.kind == KEY_TUPLE)
        .map(|k| format!("{}: {}", fx.rules[k.rule as usize], client_label(k)))
        .collect();
    labels.sort();
    assert_eq!(
        labels,
        [
            "client-svc: ip=198.18.40.0 dst_port=7000",
            "client-svc: ip=198.18.40.0 dst_port=7001",
            "client-svc: ip=198.18.41.0 dst_port=7000",
            "client-svc: ip=2001:db8:40:: dst_port=7000",
            "per-dst: dst=198.18.0.2",
            "per-dst: dst=198.18.0.3",
            "per-proto: src_port=0 protocol=icmp",
            "svc: dst=198.18.0.2 dst_port=443",
            "svc: dst=198.18.0.2 dst_port=80",
            "svc: dst=198.18.0.3 dst_port=80",
            "svc: dst=2001:db8::2 dst_port=80",
        ]
    );
}
