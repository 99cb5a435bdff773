//! The real XDP object through BPF_PROG_TEST_RUN with a table of frames: description, bytes,
//! expected action, expected counter deltas. Covers every parser branch and malformed frames,
//! list and ban precedence, rule matching, and drives a bucket past its limit with `repeat`.
//! Also the VLAN cases the lab cannot deliver through a veth (the kernel here has no 802.1Q).

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, Ipv6Addr},
    sync::atomic::Ordering,
};

use ratelimit_common::maps::BanEntry;
use ratelimit_tests::{
    fixture::{
        self, Fixture, HOUR_NS, XDP_DROP, XDP_PASS, XDP_TX, case, coarse_ns,
        frames::{
            CLIENT_MAC, SERVER_MAC, SERVER4, SERVER6, eth_only, ihl, segment, set_u16, tcp_segment,
            v4, v6, version,
        },
        key_v4, manual_ban, parse, prefix, v6_source,
    },
    kernel_test,
    packet::{Frame, arp_request, checksum, tcp_flags, truncate},
};
use ratelimit_user::{
    kernel::datapath::Maps,
    policy::apply::{self, Plan},
    policy::report,
};

/// The config of the fixture tables: an allow and a deny list, a rule on SYNs to port 80 (5 an
/// hour) and a preview rule on UDP to ports 8000-8100 (3 an hour).
const CONFIG: &str = include_str!("../configs/fixture-table.toml");

/// TOML: `[tracking]` with `keys` (the admission budget, the store's size).
fn tracking(keys: &str) -> String {
    format!("[tracking]\n{keys}\n")
}

/// TOML: the admission budget, `per_sec` new sources a second with a burst of `burst`.
fn budget(per_sec: u64, burst: u64) -> String {
    tracking(&format!(
        "new_sources_per_sec = {per_sec}\nnew_sources_burst = {burst}"
    ))
}

/// TOML: a rule named `name` on UDP port `port`, `count` packets each `interval` by
/// `algorithm`, then `more` keys of the rule (and keys written after it are the rule's too).
fn rule(
    name: &str,
    port: u16,
    (count, interval): (u64, &str),
    algorithm: &str,
    more: &str,
) -> String {
    format!(
        r#"
[[rule]]
name = "{name}"
match = {{ protocol = "udp", dst_ports = ["{port}"] }}
threshold = {{ count = {count}, interval = "{interval}" }}
algorithm = "{algorithm}"
{more}"#
    )
}

/// TOML: a rule named `name` on UDP port `port` (9000: where most fixtures' clients send),
/// `count` packets an hour in fixed windows.
fn udp_rule(name: &str, port: u16, count: u64) -> String {
    rule(name, port, (count, "1h"), "fixed_window", "")
}

/// TOML: a `rate_based_ban` rule named `name` on UDP port 9000 in fixed windows of
/// `interval`: `count` packets a window, and a ban once `ban_count` came in one, for
/// `duration`.
fn ban_rule(name: &str, (count, ban_count): (u64, u64), interval: &str, duration: &str) -> String {
    let ban = format!(
        "action = \"rate_based_ban\"\n\
         ban_threshold = {{ count = {ban_count}, interval = \"{interval}\" }}\n\
         ban_duration = \"{duration}\"\n"
    );
    rule(name, 9000, (count, interval), "fixed_window", &ban)
}

/// TOML: a token bucket rule "udp" on UDP port 9000, `count` packets each `interval` with a
/// burst of `burst`.
fn bucket_rule(count: u64, interval: &str, burst: u64) -> String {
    rule(
        "udp",
        9000,
        (count, interval),
        "token_bucket",
        &format!("burst = {burst}\n"),
    )
}

#[test]
fn fixture_table() {
    kernel_test!();
    let mut fx = Fixture::load(CONFIG);
    let (xlated, verified) = fx.dp.program_info().expect("program info");
    println!("program: {xlated} translated instructions, {verified} verified instructions");
    // A guard against verifier blow-ups: far below the kernel's 1M budget. Verifiers before
    // 6.8 prune fewer states (6.1 walks 3-4x what 6.12 walks for the same object), so they
    // get a guard of their own.
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut v = release
        .trim()
        .split(['.', '-'])
        .map(|n| n.parse::<u32>().unwrap_or(0));
    let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
    let guard = if (major, minor) < (6, 8) {
        400_000
    } else {
        200_000
    };
    assert!(
        verified < guard,
        "the verifier of {} walked {verified} instructions (guard {guard})",
        release.trim()
    );

    // A manual ban, inserted exactly as `ratelimit ban add` does.
    fx.ban("198.18.60.0/24");

    let syn = tcp_flags::SYN;
    let dq = |f: Frame| f.vlan(0x8100, 10);
    let qinq = |f: Frame| f.vlan(0x88a8, 100).vlan(0x8100, 10);
    #[rustfmt::skip]
    let cases = vec![
        // --- not IP, or not parseable: pass, counted by reason.
        case("ARP passes as non-IP", XDP_PASS, "pass_non_ip",
             arp_request(CLIENT_MAC, Ipv4Addr::new(198, 18, 0, 2), SERVER4)),
        case("unknown ethertype", XDP_PASS, "pass_non_ip",
             Frame::new(CLIENT_MAC, SERVER_MAC).ethertype_raw(0x88b5).payload(&[0; 46])),
        // (BPF_PROG_TEST_RUN refuses frames shorter than an Ethernet header, so the shortest
        // runt testable here is a bare header announcing a VLAN tag or IPv4.)
        case("bare Ethernet header announcing a VLAN", XDP_PASS, "pass_malformed malformed_l2",
             eth_only(0x8100)),
        case("bare Ethernet header announcing IPv4", XDP_PASS, "pass_malformed malformed_ipv4",
             eth_only(0x0800)),
        case("truncated VLAN tag", XDP_PASS, "pass_malformed malformed_l2",
             truncate(&dq(v4([198, 18, 1, 1]).udp(1, 53)).build(), 16)),
        // More tags than a valid frame has: counted as malformed, but judged by its source,
        // so a tag more cannot carry a denied or banned source past the lists and bans.
        case("three VLAN tags", XDP_PASS, "pass malformed_l2",
             v4([198, 18, 1, 1]).vlan(0x88a8, 1).vlan(0x8100, 2).vlan(0x8100, 3).udp(1, 53)),
        case("three VLAN tags from a denied source", XDP_DROP, "drop_deny malformed_l2",
             v4([198, 18, 50, 1]).vlan(0x88a8, 1).vlan(0x8100, 2).vlan(0x8100, 3).udp(1, 53)),
        case("three VLAN tags from a banned source", XDP_DROP, "drop_ban malformed_l2",
             v4([198, 18, 60, 1]).vlan(0x88a8, 1).vlan(0x8100, 2).vlan(0x8100, 3).udp(1, 53)),
        case("four VLAN tags: no source to read", XDP_PASS, "pass_malformed malformed_l2",
             (0..4).fold(v4([198, 18, 50, 1]), |f, i| f.vlan(0x8100, i + 1)).udp(1, 53)),
        case("IPv4 truncated header", XDP_PASS, "pass_malformed malformed_ipv4",
             truncate(&v4([198, 18, 1, 1]).udp(1, 53).build(), 14 + 12)),
        // A bad IHL, total length or version: the L4 header cannot be found, so every L4
        // condition counts as met (as for a cut-off header), and the source decides.
        case("IPv4 IHL < 5", XDP_PASS,
             "pass malformed_ipv4 state_created udp-range/matched udp-range/admitted",
             ihl(v4([198, 18, 7, 7]).udp(1, 53).build(), 4)),
        case("IPv4 IHL < 5 from a denied source", XDP_DROP, "drop_deny malformed_ipv4",
             ihl(v4([198, 18, 50, 2]).udp(1, 53).build(), 4)),
        case("IPv4 total length < header from a banned source", XDP_DROP, "drop_ban malformed_ipv4",
             set_u16(v4([198, 18, 60, 2]).udp(1, 53).build(), 14 + 2, 19)),
        case("IPv4 ethertype, version 6, from a denied source", XDP_DROP,
             "drop_deny malformed_ipv4",
             version(v4([198, 18, 50, 4]).udp(1, 53).build(), 6)),
        case("IPv6 ethertype, version 4, from a denied source", XDP_DROP,
             "drop_deny malformed_ipv6",
             version(v6("2001:db8:dead::7").udp(1, 53).build(), 4)),
        // IPv6 bogon sources: dropped before any list, ban or state (`::ffff:a.b.c.d` would
        // otherwise be the IPv4 client a.b.c.d to every per-source key).
        case("IPv6 from ::1", XDP_DROP, "drop_bogon", v6("::1").udp(1, 8000)),
        case("IPv6 from ::", XDP_DROP, "drop_bogon", v6("::").udp(1, 8000)),
        case("IPv6 from an IPv4-mapped address", XDP_DROP, "drop_bogon",
             v6("::ffff:198.18.1.1").udp(1, 8000)),
        case("IPv6 from an IPv4-compatible address", XDP_DROP, "drop_bogon",
             v6("::198.18.1.1").udp(1, 8000)),
        case("IPv6 from a multicast address", XDP_DROP, "drop_bogon", v6("ff02::1").udp(1, 8000)),
        case("IPv6 from ::ffff:198.18.50.1 is a bogon, not the denied IPv4 client", XDP_DROP,
             "drop_bogon",
             v6("::ffff:198.18.50.1").udp(1, 53)),
        // `deny = ["::/8"]` (a common IPv6 bogon entry) covers IPv6 sources only.
        case("IPv6 in ::/8 (not a bogon) is denied by ::/8", XDP_DROP, "drop_deny",
             v6("::1:0:0:1").udp(1, 53)),
        // Once the fixed L3 header is valid the source is known: the packet is judged
        // (lists, bans, rules) and the problem counted as a reason.
        case("IPv4 options cut off", XDP_PASS, "pass malformed_ipv4",
             truncate(&v4([198, 18, 1, 1]).ipv4_options(&[1; 12]).raw_l4(47).build(), 14 + 24)),
        case("IPv4 TCP header cut off counts against a SYN rule", XDP_PASS,
             "pass malformed_l4 state_created syn80/matched syn80/admitted",
             truncate(&v4([198, 18, 1, 1]).tcp(1, 80, syn).build(), 14 + 20 + 10)),
        case("denied source with a cut-off TCP header", XDP_DROP, "drop_deny malformed_l4",
             truncate(&v4([198, 18, 50, 3]).tcp(1, 80, syn).build(), 14 + 20 + 8)),
        case("IPv6 truncated header", XDP_PASS, "pass_malformed malformed_ipv6",
             truncate(&v6("2001:db8:1::1").udp(1, 53).build(), 14 + 30)),
        case("IPv6 extension header cut off", XDP_PASS,
             "pass malformed_ipv6 state_created udp-range/matched udp-range/admitted",
             truncate(&v6("2001:db8:1::1").ipv6_ext(0, &[0; 14]).udp(1, 53).build(), 14 + 40 + 4)),
        case("denied IPv6 with a cut-off extension header", XDP_DROP, "drop_deny malformed_ipv6",
             truncate(&v6("2001:db8:dead::3").ipv6_ext(0, &[0; 14]).udp(1, 53).build(),
                      14 + 40 + 4)),
        // --- clean frames of every kind pass.
        case("IPv4 UDP", XDP_PASS, "pass", v4([198, 18, 1, 1]).udp(1, 53)),
        case("IPv4 ICMP echo", XDP_PASS, "pass", v4([198, 18, 1, 1]).icmp_echo(1, 1)),
        case("IPv4 with options, TCP ACK", XDP_PASS, "pass",
             v4([198, 18, 1, 1]).ipv4_options(&[1, 1, 1, 0]).tcp(1, 80, tcp_flags::ACK)),
        case("IPv4 GRE (no L4 parse)", XDP_PASS, "pass",
             v4([198, 18, 1, 1]).raw_l4(47).payload(&[0; 8])),
        // Non-first fragments carry no ports: they count against port rules of their protocol.
        case("IPv4 non-first fragment", XDP_PASS,
             "pass fragments state_created udp-range/matched udp-range/admitted",
             v4([198, 18, 1, 1]).ipv4_fragment(false, 100).udp(1, 53).payload(&[0; 16])),
        case("IPv6 UDP", XDP_PASS, "pass", v6("2001:db8:1::1").udp(1, 53)),
        case("IPv6 ICMPv6 echo", XDP_PASS, "pass", v6("2001:db8:1::1").icmp_echo(1, 1)),
        case("IPv6 hop-by-hop, routing, dest-opts, AH, TCP", XDP_PASS, "pass",
             v6("2001:db8:1::1").ipv6_ext(0, &[0; 6]).ipv6_ext(43, &[0; 6]).ipv6_ext(60, &[0; 6])
                 .ipv6_ext(51, &[0; 14]).tcp(1, 443, tcp_flags::ACK)),
        case("IPv6 non-first fragment", XDP_PASS,
             "pass fragments udp-range/matched udp-range/admitted",
             v6("2001:db8:1::1").ipv6_fragment(false, 10, 7).udp(1, 53).payload(&[0; 16])),
        // The walk stops at a non-first fragment: its payload is never read as headers.
        case("IPv6 non-first fragment whose next header is dest-opts", XDP_PASS, "pass fragments",
             v6("2001:db8:1::2").ipv6_fragment(false, 10, 7).raw_l4(60)
                 .payload(&[17, 200, 0, 0, 0, 0, 0, 0])),
        case("IPv6 chain longer than the walk", XDP_PASS, "pass ipv6_ext_limit",
             v6("2001:db8:1::1").ipv6_ext(0, &[0; 6]).ipv6_ext(60, &[0; 6]).ipv6_ext(60, &[0; 6])
                 .ipv6_ext(60, &[0; 6]).ipv6_ext(60, &[0; 6]).ipv6_ext(60, &[0; 6])
                 .ipv6_ext(60, &[0; 6]).udp(1, 53)),
        case("802.1Q IPv4 UDP", XDP_PASS, "pass", dq(v4([198, 18, 1, 1])).udp(1, 53)),
        // --- lists and bans, whatever the L4 protocol, behind VLAN tags too.
        case("denied IPv4", XDP_DROP, "drop_deny", v4([198, 18, 50, 1]).udp(1, 53)),
        case("denied IPv4 behind 802.1Q", XDP_DROP, "drop_deny",
             dq(v4([198, 18, 50, 1])).icmp_echo(1, 1)),
        case("denied IPv6 behind 802.1ad+802.1Q", XDP_DROP, "drop_deny",
             qinq(v6("2001:db8:dead::9")).tcp(1, 22, syn)),
        case("denied non-first fragment", XDP_DROP, "drop_deny fragments",
             v4([198, 18, 50, 1]).ipv4_fragment(false, 8).udp(1, 53).payload(&[0; 8])),
        case("denied GRE", XDP_DROP, "drop_deny", v4([198, 18, 50, 1]).raw_l4(47).payload(&[0; 8])),
        case("allow wins over deny", XDP_PASS, "pass_allow", v4([198, 18, 50, 7]).udp(1, 53)),
        case("banned source", XDP_DROP, "drop_ban", v4([198, 18, 60, 9]).udp(1, 53)),
        case("banned source behind QinQ", XDP_DROP, "drop_ban",
             qinq(v4([198, 18, 60, 9])).tcp(1, 80, syn)),
        // --- rule matching.
        case("SYN to 80 matches syn80", XDP_PASS, "pass state_created syn80/matched syn80/admitted",
             v4([198, 18, 2, 1]).tcp(1, 80, syn)),
        case("SYN+ACK does not match 'syn'", XDP_PASS, "pass",
             v4([198, 18, 2, 1]).tcp(1, 80, syn | tcp_flags::ACK)),
        case("SYN to 81 does not match", XDP_PASS, "pass", v4([198, 18, 2, 1]).tcp(1, 81, syn)),
        case("UDP to 8050 matches the range", XDP_PASS,
             "pass state_created udp-range/matched udp-range/admitted",
             v4([198, 18, 2, 1]).udp(1, 8050)),
        case("UDP to 8101 is outside it", XDP_PASS, "pass", v4([198, 18, 2, 1]).udp(1, 8101)),
        case("UDP fragment counts against a port rule", XDP_PASS,
             "pass fragments udp-range/matched udp-range/admitted",
             v4([198, 18, 2, 1]).ipv4_fragment(false, 8).udp(1, 9999).payload(&[0; 8])),
        case("SYN over VLAN matches", XDP_PASS, "pass syn80/matched syn80/admitted",
             dq(v4([198, 18, 2, 1])).tcp(1, 80, syn)),
        // --- repeat drives the bucket: 5 per hour, 2 already used by 198.18.2.1 above.
        case("10 SYNs: 3 admitted, 7 dropped", XDP_DROP,
             "pass=3 drop_rule=7 syn80/matched=10 syn80/admitted=3 syn80/dropped=7",
             v4([198, 18, 2, 1]).tcp(1, 80, syn)).times(10),
        case("another client has its own bucket", XDP_PASS,
             "pass state_created syn80/matched syn80/admitted",
             v4([198, 18, 2, 2]).tcp(1, 80, syn)),
        // Preview rule: 3 per hour, 1 used above by 198.18.2.1 (8050) and 1 by the fragment.
        case("preview never drops", XDP_PASS,
             "pass=4 udp-range/matched=4 udp-range/admitted udp-range/would_drop=3 \
              preview_would_drop=3",
             v4([198, 18, 2, 1]).udp(1, 8000)).times(4),
    ];

    fx.run_table("ratelimit", &cases);
}

/// The L3 entry (`ratelimit_l3`, for tun, wireguard and ip tunnels) reads the IP header at
/// byte 0, its version nibble saying which, and judges exactly as the Ethernet entry does:
/// lists, bans and rules in both families, malformed headers counted, anything else non-IP.
#[test]
fn l3_entry_fixture_table() {
    kernel_test!();
    let mut fx = Fixture::load(CONFIG);
    fx.ban("198.18.60.0/24");
    // BPF_PROG_TEST_RUN takes no frame shorter than an Ethernet header (14 bytes).
    let ip = |f: Frame| f.build()[14..].to_vec();
    let syn = tcp_flags::SYN;
    #[rustfmt::skip]
    let cases = vec![
        case("IPv4 UDP", XDP_PASS, "pass", ip(v4([198, 18, 1, 1]).udp(1, 53))),
        case("IPv6 UDP", XDP_PASS, "pass", ip(v6("2001:db8:1::1").udp(1, 53))),
        case("IPv6 extension chain, TCP", XDP_PASS, "pass",
             ip(v6("2001:db8:1::1").ipv6_ext(0, &[0; 6]).ipv6_ext(60, &[0; 6])
                 .tcp(1, 443, tcp_flags::ACK))),
        case("denied IPv4", XDP_DROP, "drop_deny", ip(v4([198, 18, 50, 1]).udp(1, 53))),
        case("denied IPv6", XDP_DROP, "drop_deny", ip(v6("2001:db8:dead::9").tcp(1, 22, syn))),
        case("banned IPv4 ICMP", XDP_DROP, "drop_ban", ip(v4([198, 18, 60, 4]).icmp_echo(1, 1))),
        case("denied non-first fragment", XDP_DROP, "drop_deny fragments",
             ip(v4([198, 18, 50, 1]).ipv4_fragment(false, 8).udp(1, 53).payload(&[0; 8]))),
        case("IPv4 header cut at 14 bytes", XDP_PASS, "pass_malformed malformed_ipv4",
             truncate(&ip(v4([198, 18, 1, 1]).udp(1, 53)), 14)),
        case("IPv6 header cut at 16 bytes", XDP_PASS, "pass_malformed malformed_ipv6",
             truncate(&ip(v6("2001:db8:1::1").udp(1, 53)), 16)),
        case("IPv6 header cut at 30 bytes", XDP_PASS, "pass_malformed malformed_ipv6",
             truncate(&ip(v6("2001:db8:1::1").udp(1, 53)), 30)),
        case("denied source with a cut-off TCP header", XDP_DROP, "drop_deny malformed_l4",
             truncate(&ip(v4([198, 18, 50, 3]).tcp(1, 80, syn)), 20 + 8)),
        case("IP version 5 is not IP", XDP_PASS, "pass_non_ip",
             { let mut p = ip(v4([198, 18, 50, 1]).udp(1, 53)); p[0] = 0x55; p }),
        case("an Ethernet frame is not read as IP (version nibble 0 of its MAC)", XDP_PASS,
             "pass_non_ip", v4([198, 18, 50, 1]).udp(1, 53)),
        case("8 SYNs to port 80: 5 admitted, 3 dropped", XDP_DROP,
             "pass=5 drop_rule=3 state_created syn80/matched=8 syn80/admitted=5 syn80/dropped=3",
             ip(v4([198, 18, 2, 1]).tcp(1, 80, syn))).times(8),
    ];
    fx.run_table("ratelimit_l3", &cases);
}

/// The program skips the ban lookup while `RL_BANS_PRESENT` is clear. The daemon clears it
/// only when the ban map is empty; a ban issued by a rule, or by an operator, sets it again,
/// and the very next packet of the banned source is dropped as banned.
#[test]
fn bans_flag_follows_the_ban_map() {
    kernel_test!();
    let config = ban_rule("udp-ban", (2, 3), "1h", "1h");
    let mut fx = Fixture::load(&config);
    use ratelimit_common::maps::{BAN_TABLE_OPERATOR, BAN_TABLE_RULE, BAN_TABLES};
    let flags = |maps: &Maps| -> Vec<u64> {
        (0..BAN_TABLES)
            .map(|t| maps.bans_present.get(&t, 0).unwrap())
            .collect()
    };
    let flag = |maps: &Maps| maps.bans_present.get(&BAN_TABLE_RULE, 0).unwrap();
    let op_flag = |maps: &Maps| maps.bans_present.get(&BAN_TABLE_OPERATOR, 0).unwrap();
    assert_eq!(
        flags(&fx.maps),
        [1, 1, 1, 1],
        "set at start, before the daemon has looked"
    );
    fx.maps.refresh_bans_present();
    assert_eq!(flags(&fx.maps), [0, 0, 0, 0], "cleared: no ban exists");

    // A rule issues a ban: 4 packets cross the ban threshold of 3; the 5th is dropped as banned.
    let frame = v4([198, 18, 9, 9]).udp(40000, 9000).build();
    let before = fx.counters();
    fx.run_singly(&frame, 4);
    assert_eq!(flag(&fx.maps), 1, "the program set it with its ban");
    assert_eq!(fx.run(&frame, 1), XDP_DROP);
    fx.delta(&before).assert("bans_issued=1 drop_ban=1");
    fx.maps.refresh_bans_present();
    assert_eq!(flag(&fx.maps), 1, "kept: a ban exists");

    // Remove the ban: the flag clears; an operator ban sets it again and is enforced.
    for b in fx.maps.all_bans() {
        let table = ratelimit_common::maps::ban_table(b.flags);
        let addr = ratelimit_common::addr::IpKey { addr: b.addr };
        assert!(fx.maps.remove_ban(table, b.prefix_len, &addr).unwrap());
    }
    fx.maps.refresh_bans_present();
    assert_eq!(flags(&fx.maps), [0, 0, 0, 0]);
    let other = v4([198, 18, 10, 10]).udp(40000, 53).build();
    assert_eq!(fx.run(&other, 1), XDP_PASS);
    fx.insert_ban(manual_ban(
        "198.18.10.0/24",
        ratelimit_user::clock::mono_ns(),
        0,
    ));
    assert_eq!(op_flag(&fx.maps), 1);
    assert_eq!(
        flag(&fx.maps),
        0,
        "an operator ban is in the operator's table"
    );
    assert_eq!(fx.run(&other, 1), XDP_DROP);
}

/// Bans received from the fleet have a table of their own (`RL_BANS_REMOTE`): they drop, a
/// ban that passes never hides one, they expire in the kernel, and its presence flag is its
/// own. However many the fleet sends, the operator's table stays the operator's: once the
/// remote table is full, a remote ban goes into the rules' table of bans that drop
/// (`BAN_SPILLED`, counted) and is enforced from there, and an operator's ban still goes in and
/// drops.
#[test]
fn remote_bans_have_a_table_of_their_own_and_spill_into_the_rules_table_when_it_is_full() {
    kernel_test!();
    use ratelimit_common::{
        addr::IpKey,
        maps::{
            BAN_MANUAL, BAN_PREVIEW, BAN_REMOTE, BAN_SPILLED, BAN_TABLE_OPERATOR, BAN_TABLE_REMOTE,
            BAN_TABLE_RULE,
        },
    };
    let mut fx = Fixture::load("");
    fx.maps.refresh_bans_present();
    let now = ratelimit_user::clock::mono_ns();
    let entry = |cidr: &str, flags: u32, expires: u64| -> (u32, IpKey, BanEntry) {
        let (plen, key) = prefix(cidr);
        let e = BanEntry {
            flags,
            ..manual_ban(cidr, now, expires)
        };
        (plen, key, e)
    };
    let remote = BAN_MANUAL | BAN_REMOTE;

    // A remote ban: in the remote table, its flag set, and it drops.
    let (plen, key, e) = entry("198.18.30.0/24", remote, 0);
    fx.insert_ban(e);
    assert_eq!(fx.maps.ban_at(BAN_TABLE_REMOTE, plen, &key), Some(e));
    assert_eq!(fx.maps.ban_at(BAN_TABLE_OPERATOR, plen, &key), None);
    assert_eq!(fx.maps.bans_present.get(&BAN_TABLE_REMOTE, 0).unwrap(), 1);
    assert_eq!(fx.maps.bans_present.get(&BAN_TABLE_OPERATOR, 0).unwrap(), 0);
    let banned = v4([198, 18, 30, 7]).udp(40000, 53).build();
    fx.expect(&banned, 1, XDP_DROP, "drop_ban=1");
    // A longer ban that passes (a preview rule's, here) does not hide it.
    let (_, _, p) = entry("198.18.30.7/32", BAN_PREVIEW, 0);
    fx.insert_ban(p);
    assert_eq!(fx.run(&banned, 1), XDP_DROP);

    // It expires in the kernel: gone from its table when a packet meets it after its end.
    let (plen, key, e) = entry("198.18.31.0/24", remote, now + 200_000_000);
    fx.insert_ban(e);
    let short = v4([198, 18, 31, 7]).udp(40000, 53).build();
    assert_eq!(fx.run(&short, 1), XDP_DROP);
    std::thread::sleep(std::time::Duration::from_millis(400));
    assert_eq!(fx.run(&short, 1), XDP_PASS);
    assert_eq!(
        fx.maps.ban_at(BAN_TABLE_REMOTE, plen, &key),
        None,
        "removed by the program"
    );

    // Fill the remote table as a fleet-wide flood of bans would.
    ratelimit_tests::bans::fill_remote_ban_table(&mut fx.maps, now);
    assert_eq!(
        fx.maps.remote_bans_spilled, 1,
        "the table held one remote ban already: the fill's last one spilled"
    );
    // One more: spilled into the rules' table that drops, counted, and enforced.
    let (plen, key, e) = entry("198.18.32.0/24", remote, 0);
    fx.insert_ban(e);
    assert_eq!(fx.maps.remote_bans_spilled, 2);
    assert_eq!(fx.maps.ban_at(BAN_TABLE_REMOTE, plen, &key), None);
    let spilled = fx.maps.ban_at(BAN_TABLE_RULE, plen, &key).expect("spilled");
    assert_eq!(spilled.flags, remote | BAN_SPILLED);
    assert_eq!(fx.maps.remote_ban_at(plen, &key), Some(spilled));
    let src = v4([198, 18, 32, 9]).udp(40000, 53).build();
    assert_eq!(fx.run(&src, 1), XDP_DROP);
    // The operator's table is untouched: `ban add` goes in and drops.
    let (plen, key, op) = entry("198.18.33.0/24", BAN_MANUAL, 0);
    fx.maps
        .insert_ban(op)
        .expect("an operator's ban with the remote table full");
    assert_eq!(fx.maps.ban_at(BAN_TABLE_OPERATOR, plen, &key), Some(op));
    let src = v4([198, 18, 33, 9]).udp(40000, 53).build();
    assert_eq!(fx.run(&src, 1), XDP_DROP);
    // And the first remote ban is still in force.
    assert_eq!(fx.run(&banned, 1), XDP_DROP);
}

/// A ban that lets packets through (a preview rule's ban) inside a broader ban that drops does
/// not shadow it: the address is dropped. Outside the broad ban the preview ban only counts.
#[test]
fn a_passing_ban_does_not_hide_a_broader_dropping_ban() {
    kernel_test!();
    use ratelimit_common::maps::{BAN_EXCEED_PASS, BAN_MANUAL, BAN_PREVIEW};
    let mut fx = Fixture::load("");
    let now = ratelimit_user::clock::mono_ns();
    for (cidr, flags) in [
        ("198.18.20.0/24", BAN_MANUAL),
        ("198.18.20.5/32", BAN_PREVIEW),
        ("198.18.20.6/32", BAN_EXCEED_PASS),
        ("198.18.21.5/32", BAN_PREVIEW),
    ] {
        fx.insert_ban(BanEntry {
            flags,
            ..manual_ban(cidr, now, 0)
        });
    }
    let before = fx.counters();
    let run = |src: [u8; 4]| fx.run(&v4(src).udp(40000, 53).build(), 1);
    assert_eq!(
        run([198, 18, 20, 5]),
        XDP_DROP,
        "preview /32 inside a dropping /24"
    );
    assert_eq!(
        run([198, 18, 20, 6]),
        XDP_DROP,
        "exceed-pass /32 inside a dropping /24"
    );
    assert_eq!(run([198, 18, 20, 7]), XDP_DROP, "the /24 itself");
    assert_eq!(
        run([198, 18, 21, 5]),
        XDP_PASS,
        "a preview ban alone passes"
    );
    fx.delta(&before).assert("drop_ban=3 preview_would_drop=1");
}

/// Rules on the coarse clock read it once per timer tick and CPU and reuse it within the
/// tick: the time the program stamps on a client is CLOCK_MONOTONIC_COARSE as user space
/// reads it around the run (give or take one tick), and it moves on with the ticks.
#[test]
fn rules_see_the_coarse_clock_tick_by_tick() {
    kernel_test!();
    let config = udp_rule("udp", 9000, 1_000_000);
    let fx = Fixture::load(&config);
    let frame = v4([198, 18, 11, 11]).udp(40000, 9000).build();
    let last_seen = |maps: &Maps| {
        let mut seen = None;
        report::for_each_client(maps, |k, s| {
            if k.addr[12..] == [198, 18, 11, 11] {
                seen = Some(s.last_ns);
            }
        })
        .unwrap();
        seen.expect("the client has state")
    };
    let mut stamps = Vec::new();
    for _ in 0..40 {
        let (before, tick) = coarse_ns();
        // A burst within the tick (the cached value), then one more stamp to read.
        assert_eq!(fx.run(&frame, 1000), XDP_PASS);
        let (after, _) = coarse_ns();
        let stamp = last_seen(&fx.maps);
        assert!(
            stamp + tick >= before && stamp <= after,
            "stamp {stamp} outside [{before} - {tick}, {after}]"
        );
        stamps.push(stamp);
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // (Never back by more than a tick: the run may move to the other CPU, whose value may be
    // from the tick in which jiffies moved a moment before the clock did.)
    let (_, tick) = coarse_ns();
    assert!(stamps.windows(2).all(|w| w[1] + tick >= w[0]), "{stamps:?}");
    let distinct = stamps.windows(2).filter(|w| w[0] < w[1]).count();
    assert!(
        distinct >= 30,
        "the stamp moved only {distinct} times in 40 steps of 5 ms: {stamps:?}"
    );
}

/// Sources the admission budget refuses share their rule's one aggregate state (an array
/// entry per rule, not a per-client entry): reported as the rule's `overflow` client, judged
/// by the rule's threshold as one bucket, and cleared when the rule's position changes hands.
#[test]
fn refused_sources_share_the_rules_overflow_state() {
    kernel_test!();
    let config = budget(1, 1) + &udp_rule("udp", 9000, 3);
    let mut fx = Fixture::load(&config);
    let before = fx.counters();
    // The first source takes the budget's one state; eight more sources are refused and share
    // one bucket of 3: the first 3 of their packets pass, the other 5 are dropped.
    let first = v4([198, 18, 12, 1]).udp(40000, 9000).build();
    assert_eq!(fx.run(&first, 1), XDP_PASS);
    let mut actions = Vec::new();
    for i in 2..10u8 {
        let f = v4([198, 18, 12, i]).udp(40000, 9000).build();
        actions.push(fx.run(&f, 1));
    }
    assert_eq!(
        actions,
        [
            XDP_PASS, XDP_PASS, XDP_PASS, XDP_DROP, XDP_DROP, XDP_DROP, XDP_DROP, XDP_DROP
        ]
    );
    fx.delta(&before)
        .assert("admission_refused=8 state_created=1");
    let clients = |maps: &Maps| {
        let mut v = Vec::new();
        report::for_each_client(maps, |k, s| {
            v.push((report::key_name(k.kind), s.packets, s.drop_count()))
        })
        .unwrap();
        v.sort();
        v
    };
    assert_eq!(clients(&fx.maps), [("ip", 1, 0), ("overflow", 8, 5)]);
    // The rule's position goes to another rule: its overflow state goes with its clients.
    ratelimit_user::daemon::retire_rule_slots(&mut fx.maps, &fx.rules, &["other".to_string()]);
    assert_eq!(clients(&fx.maps), []);
}

/// Within a timer tick, a refused packet's like packets are dropped from the per-CPU
/// fast-drop table without a client lookup: verdicts and every counter are what the full
/// evaluation gives, the per-client totals include what is still pending, packets that differ
/// (another port, no matching rule) are judged in full, a policy write voids the table at
/// once, and a refusal by a rule that was not the first to match is never remembered.
#[test]
fn fast_drops_within_a_tick_are_exact() {
    kernel_test!();
    let fast = |count| {
        udp_rule("udp9000", 9000, count)
            + &udp_rule("udp-any", 9001, 1_000_000)
            + &udp_rule("udp9001-strict", 9001, 2)
    };
    let mut fx = Fixture::load(&fast(5));
    let src = [198, 18, 13, 1];
    let frame = v4(src).udp(40000, 9000).build();

    // 1000 runs back to back: 5 admitted, 995 dropped, most of them by the fast table.
    fx.expect(
        &frame,
        1000,
        XDP_DROP,
        "udp9000/matched=1000 udp9000/admitted=5 udp9000/dropped=995 drop_rule=995 pass=5",
    );
    assert_eq!(fx.client_totals()[&(0, src)], (1000, 995));
    // (The table was used: the last tick's drops are still pending in it.)
    assert!(fx.fast_pending() > 0, "no fast-drop entry was used");

    // Another port of the same source, matched by no rule: passes at once.
    let other = v4(src).udp(40000, 53).build();
    assert_eq!(fx.run(&other, 1), XDP_PASS);

    // Every policy write is a new generation.
    let strict = fx.plan.clone();
    let loose = apply::plan(&parse(&fast(100_000)), false);
    let generation = |maps: &Maps| maps.global.get(&0, 0).unwrap().generation;
    let g = generation(&fx.maps);
    fx.apply_plan(&strict);
    assert_eq!(generation(&fx.maps), g.wrapping_add(1));
    // A new generation voids the table at once: raise the threshold and the very next like
    // packet is admitted.
    let voided = "a fast-drop entry outlived the policy it was made under";
    a_policy_write_voids_the_tick(&mut fx, (&strict, &loose), &frame, voided);

    // Port 9001: rule 1 matches and admits, rule 2 refuses after 2. Rule 1 must count every
    // packet (its clients' totals too), so nothing is remembered for the fast table.
    fx.apply_plan(&strict);
    let frame9001 = v4(src).udp(40000, 9001).build();
    fx.expect(
        &frame9001,
        500,
        XDP_DROP,
        "udp-any/matched=500 udp-any/admitted=500 \
         udp9001-strict/admitted=2 udp9001-strict/dropped=498",
    );
    assert_eq!(fx.client_totals()[&(1, src)], (500, 0));
    assert_eq!(fx.client_totals()[&(2, src)], (500, 498));

    // Rule 0's position changes hands: its clients go, and so do their pending counts.
    assert_eq!(fx.run(&frame, 100), XDP_DROP);
    let pending_of_rule0 = |maps: &Maps| {
        (0..ratelimit_common::maps::FAST_ENTRIES)
            .flat_map(|i| {
                maps.fast
                    .get(&i, 0)
                    .unwrap()
                    .iter()
                    .copied()
                    .collect::<Vec<_>>()
            })
            .filter(|e| e.rule == 0 && e.jiffies != 0)
            .map(|e| e.pending_packets)
            .sum::<u64>()
    };
    assert!(pending_of_rule0(&fx.maps) > 0);
    let renamed = vec![
        "other".to_string(),
        fx.rules[1].clone(),
        fx.rules[2].clone(),
    ];
    ratelimit_user::daemon::retire_rule_slots(&mut fx.maps, &fx.rules, &renamed);
    assert_eq!(pending_of_rule0(&fx.maps), 0);
    assert!(fx.client_totals().keys().all(|&(rule, _)| rule != 0));
    assert_eq!(fx.client_totals()[&(2, src)], (500, 498));
}

/// Twenty times over: under `strict`, `frame` is refused within a tick (which makes, or hits,
/// what the program remembers for the tick: a fast-drop entry, a closed overflow state), then
/// rule 0 of `loose` and a new generation are written, as `apply` writes them last, and the
/// very next `frame` is admitted (else panics with `voided`). The writes are two map writes
/// apart, and the runs after them single: a repeated run waits for an RCU grace period at its
/// start and end, long enough for the tick to move on.
fn a_policy_write_voids_the_tick(
    fx: &mut Fixture,
    (strict, loose): (&Plan, &Plan),
    frame: &[u8],
    voided: &str,
) {
    for _ in 0..20 {
        fx.apply_plan(strict);
        assert_eq!(fx.run(frame, 50), XDP_DROP);
        // Refused in this tick: what it remembers is made (or hit).
        assert_eq!(fx.run(frame, 1), XDP_DROP);
        fx.write_rule(0, loose.rules[0]);
        assert_eq!(fx.run(frame, 1), XDP_PASS, "{voided}");
    }
}

/// The known-sources filter: off until the first rebuild; then a source with no state skips
/// the per-client lookup (`lookup_skipped`), a new state's bit is set before its insert so
/// the source's next packet finds its state, an evicted state's bit stays set until the next
/// rebuild clears it, and states inserted while a rebuild walks the map are never hidden.
#[test]
fn known_filter_skips_untracked_sources_and_never_hides_a_tracked_one() {
    kernel_test!();
    let config = budget(1, 3) + &udp_rule("udp", 9000, 1000);
    let mut fx = Fixture::load(&config);
    let known = fx.dp.take_known().expect("known filter");
    known.disable();
    let send = |fx: &Fixture, a: [u8; 4]| {
        let f = v4(a).udp(40000, 9000).build();
        assert_eq!(fx.run(&f, 1), XDP_PASS);
    };
    let tracked = [198, 18, 14, 1];

    // Off: the first source is looked up (and gets state).
    let before = fx.counters();
    send(&fx, tracked);
    fx.delta(&before).assert("state_created=1 lookup_skipped=0");

    // On: the one state is in the active half.
    let r = known.rebuild(&fx.maps.clients).expect("rebuild");
    assert_eq!((r.states, r.bits_set, r.bits), (1, 1, 4096 * 8));
    assert!(known.enabled());

    // The tracked source is looked up and counted in its own state; 40 new sources skip the
    // lookup: the budget's 2 remaining states go to the first two, 38 are refused.
    let before = fx.counters();
    send(&fx, tracked);
    let fresh: Vec<[u8; 4]> = (1..=40u8).map(|i| [198, 18, 15, i]).collect();
    for &a in &fresh {
        send(&fx, a);
    }
    fx.delta(&before)
        .assert("lookup_skipped=40 state_created=2 admission_refused=38");

    // The two new states' bits were set with their insert: their next packets find them.
    let before = fx.counters();
    send(&fx, fresh[0]);
    send(&fx, fresh[1]);
    send(&fx, fresh[2]);
    let d = fx.delta(&before);
    assert_eq!(
        d.get("lookup_skipped"),
        Some(&1),
        "only the refused one: {d:?}"
    );
    d.assert("admission_refused=1");
    let totals = fx.client_totals();
    assert_eq!(totals[&(0, tracked)], (2, 0));
    assert_eq!(totals[&(0, fresh[0])], (2, 0));
    assert_eq!(totals[&(0, fresh[1])], (2, 0));
    for k in fx.maps.clients.keys().unwrap() {
        assert!(
            known.may_be_tracked(&k),
            "a tracked state's bit is clear: {k:?}"
        );
    }

    // A state removed (as an eviction would) keeps its bit until the next rebuild: looked up,
    // found missing, judged new.
    let state_of = |fx: &Fixture| {
        let keys = fx.maps.clients.keys().unwrap();
        keys.into_iter().find(|k| k.addr[12..] == tracked)
    };
    assert!(fx.maps.clients.remove(&state_of(&fx).unwrap()));
    let before = fx.counters();
    send(&fx, tracked);
    let d = fx.delta(&before);
    d.assert("lookup_skipped=0");
    assert_eq!(
        d.get("admission_refused").or(d.get("state_created")),
        Some(&1),
        "{d:?}"
    );
    if let Some(k) = state_of(&fx) {
        assert!(fx.maps.clients.remove(&k));
    }
    let r = known.rebuild(&fx.maps.clients).expect("rebuild");
    assert_eq!((r.states, r.bits_set), (2, 2));
    let before = fx.counters();
    send(&fx, tracked);
    fx.delta(&before).assert("lookup_skipped=1");

    // Rebuilds racing inserts: with no budget, every packet of 20k new sources inserts a
    // state while the filter is rebuilt over and over; no state may end up with a clear bit.
    let mut unlimited = fx.config.clone();
    unlimited.tracking.new_sources_per_sec = 0;
    unlimited.tracking.new_sources_burst = 0;
    fx.apply_config(&unlimited);
    let done = std::sync::atomic::AtomicBool::new(false);
    let rebuilds = std::thread::scope(|sc| {
        let h = sc.spawn(|| {
            let mut n = 0;
            while !done.load(Ordering::Relaxed) {
                known.rebuild(&fx.maps.clients).expect("rebuild");
                n += 1;
            }
            n
        });
        for i in 0..20_000u32 {
            let b = (0x0a00_0000 | i).to_be_bytes();
            send(&fx, b);
        }
        done.store(true, Ordering::Relaxed);
        h.join().unwrap()
    });
    let mut hidden = 0;
    let mut states = 0;
    for k in fx.maps.clients.keys().unwrap() {
        states += 1;
        hidden += usize::from(!known.may_be_tracked(&k));
    }
    println!("{rebuilds} rebuilds during the inserts; {states} states, {hidden} hidden");
    assert!(rebuilds >= 2, "{rebuilds} rebuilds");
    assert!(states > 2048, "the store is nearly full: {states}");
    assert_eq!(hidden, 0);
}

/// Once the admission budget and then the rule's overflow state have refused a new source in
/// a tick, the tick's other new sources of that rule are dropped without either (a random-
/// source flood's common case): counters and the overflow state's totals are what the full
/// evaluation gives, a policy write voids it at once, and a rule with per-CIDR overrides (whose
/// refused sources may have different thresholds) never takes the shortcut.
#[test]
fn overflow_closes_to_new_sources_for_the_tick_exactly() {
    kernel_test!();
    let ovf = |count| {
        budget(1, 1)
            + &udp_rule("udp", 9000, count)
            + &udp_rule("udp-overrides", 9001, 3)
            + "[[rule.override]]\ncidr = \"198.19.0.0/16\"\n\
               threshold = { count = 5, interval = \"1h\" }\n"
    };
    let mut fx = Fixture::load(&ovf(3));
    let plan = fx.plan.clone();
    let overflow = |maps: &Maps, rule: u8| {
        let mut got = None;
        report::for_each_client(maps, |k, s| {
            if k.kind == ratelimit_common::maps::KEY_OVERFLOW && k.rule == rule {
                got = Some((s.packets, s.drop_count()));
            }
        })
        .unwrap();
        got
    };

    // The budget's one state goes to the first source; a second source's 1000 packets are
    // each a new source refused state: 3 pass on the overflow state, 997 are dropped.
    let first = v4([198, 18, 16, 1]).udp(40000, 9000).build();
    assert_eq!(fx.run(&first, 1), XDP_PASS);
    let before = fx.counters();
    let new = v4([198, 18, 16, 2]).udp(40000, 9000).build();
    assert_eq!(fx.run(&new, 1000), XDP_DROP);
    fx.delta(&before).assert(
        "udp/matched=1000 udp/admitted=3 udp/dropped=997 \
         admission_refused=1000 drop_rule=997 pass=3 state_created=0",
    );
    assert_eq!(overflow(&fx.maps, 0), Some((1000, 997)));
    // (The shortcut was taken: the last tick's drops are still pending.)
    assert!(fx.ovf_pending() > 0, "the overflow state was never closed");

    // A policy write voids it at once: raise the threshold and the very next new source is
    // admitted by the overflow state.
    let loose = apply::plan(&parse(&ovf(100_000)), false);
    let voided = "a closed overflow state outlived the policy it was closed under";
    a_policy_write_voids_the_tick(&mut fx, (&plan, &loose), &new, voided);
    fx.apply_plan(&plan);

    // Per-CIDR overrides: sources refused state share the overflow state but may have other
    // thresholds, so it is never closed: every packet is judged, and a source under the
    // override's 5 passes after one under the rule's 3 was refused.
    let pending = fx.ovf_pending();
    let before = fx.counters();
    let plain = v4([198, 18, 17, 1]).udp(40000, 9001).build();
    let wide = v4([198, 19, 17, 1]).udp(40000, 9001).build();
    assert_eq!(fx.run(&plain, 100), XDP_DROP);
    assert_eq!(fx.run(&wide, 1), XDP_PASS);
    assert_eq!(fx.run(&wide, 1), XDP_PASS);
    assert_eq!(fx.run(&wide, 1), XDP_DROP);
    fx.delta(&before)
        .assert("udp-overrides/admitted=5 udp-overrides/dropped=98");
    assert_eq!(overflow(&fx.maps, 1), Some((103, 98)));
    assert!(fx.ovf_pending() <= pending, "rule 1's overflow was closed");
    assert_eq!(
        (0..ratelimit_common::caps::MAX_RULES)
            .filter(|&r| r != 0)
            .map(|r| fx
                .maps
                .ovf_tick
                .get(&r, 0)
                .unwrap()
                .iter()
                .map(|e| e.jiffies)
                .sum::<u64>())
            .sum::<u64>(),
        0,
        "only rule 0's overflow state was ever closed"
    );

    // The rule's position changes hands: its overflow state and pending counts go with it.
    ratelimit_user::daemon::retire_rule_slots(&mut fx.maps, &fx.rules, &["other".to_string()]);
    assert_eq!(overflow(&fx.maps, 0), None);
    assert_eq!(fx.ovf_pending(), 0);
}

/// The fast-drop table is checked before the lists and bans (an entry is made only for a
/// packet no list and no ban matched): a ban added within the tick voids every entry at once
/// (the ban epoch), so the very next packet is dropped and counted as banned; a ban that lets
/// packets on to the rules (preview) keeps entries from being made, so each packet is
/// counted against it.
#[test]
fn fast_drops_give_way_to_a_new_ban_at_once() {
    kernel_test!();
    let config =
        "[lists]\ndeny = [\"198.18.99.0/24\"]\n".to_owned() + &udp_rule("udp9000", 9000, 5);
    let mut fx = Fixture::load(&config);

    // A ban added between two packets of one tick: the second is banned.
    let mut banned_at_once = 0;
    for i in 0..20u8 {
        let src = [198, 18, 20, i];
        let frame = v4(src).udp(40000, 9000).build();
        assert_eq!(fx.run(&frame, 50), XDP_DROP);
        // Refused in this tick: the entry is made (or hit).
        assert_eq!(fx.run(&frame, 1), XDP_DROP);
        let before = fx.counters();
        fx.ban(&format!("198.18.20.{i}/32"));
        assert_eq!(fx.run(&frame, 1), XDP_DROP);
        let d = fx.delta(&before);
        assert_eq!(
            d.get("drop_rule"),
            None,
            "a fast-drop entry outlived a new ban: {d:?}"
        );
        d.assert("drop_ban=1");
        banned_at_once += 1;
    }
    assert_eq!(banned_at_once, 20);

    // A preview ban passes packets on to the rules: no entry is made, every packet is
    // counted against the ban as well as the rule.
    let src = [198, 18, 21, 1];
    let now = ratelimit_user::clock::mono_ns();
    let mut entry = manual_ban("198.18.21.1/32", now, now + HOUR_NS);
    entry.flags |= ratelimit_common::maps::BAN_PREVIEW;
    fx.insert_ban(entry);
    let pending = fx.fast_pending();
    let before = fx.counters();
    let frame = v4(src).udp(40000, 9000).build();
    assert_eq!(fx.run(&frame, 1000), XDP_DROP);
    fx.delta(&before)
        .assert("ban_pass=1000 preview_would_drop=1000 udp9000/dropped=995");
    assert_eq!(fx.fast_pending(), pending, "an entry was made under a ban");

    // The deny list still decides for a listed source (never given an entry).
    let denied = v4([198, 18, 99, 1]).udp(40000, 9000).build();
    fx.expect(&denied, 100, XDP_DROP, "drop_deny=100");
}

/// A budget's burst is spread over timer ticks: one CPU inserts at most
/// `admission_tick_cap` new states per tick (64 here), the rest of the tick's new sources
/// share the overflow state; the next tick admits again.
#[test]
fn new_states_per_tick_and_cpu_are_capped() {
    kernel_test!();
    let config = budget(1000, 100000) + &udp_rule("udp", 9000, 1_000_000);
    ratelimit_tests::sender::pin_current_thread(0).expect("pin");
    let mut fx = Fixture::builder().max_sources(65536).load(&config);
    let cap = fx.maps.global.get(&0, 0).unwrap().admission_tick_cap as u64;
    let tick_ns = coarse_ns().1;
    assert_eq!(
        cap,
        ratelimit_common::maps::admission_tick_cap(1000, tick_ns) as u64
    );
    assert_eq!(cap, 64, "1000/s is under 64 a tick at any HZ");
    // The tick as the program saw it (`RL_TICK`: this CPU's last jiffies), not the coarse
    // clock: the program caps per jiffy, and the coarse clock can move a moment apart from
    // jiffies, which a busy machine makes likely over 20 rounds.
    let tick_map: aya::maps::PerCpuArray<_, [u64; 2]> =
        aya::maps::PerCpuArray::try_from(fx.dp.ebpf_mut().take_map("RL_TICK").expect("RL_TICK"))
            .expect("RL_TICK is a per-CPU array");
    let jiffies = || tick_map.get(&0, 0).expect("RL_TICK")[0][0];
    // 192 new sources as fast as one thread sends them: within one tick, exactly 64 get
    // state (retried on fresh sources until a round fits in one tick).
    let mut exact = false;
    let mut bounded = 0;
    for round in 0..20u32 {
        let frames: Vec<Vec<u8>> = (0..3 * cap as u32)
            .map(|i| {
                let b = (0x0a00_0000 | (64 + round) << 16 | i).to_be_bytes();
                v4(b).udp(40000, 9000).build()
            })
            .collect();
        let before = fx.counters();
        fx.run(&frames[0], 1);
        let j0 = jiffies();
        for f in &frames[1..] {
            fx.run(f, 1);
        }
        let ticks = jiffies() - j0;
        let d = fx.delta(&before);
        let created = d.of("state_created");
        let refused = d.of("admission_refused");
        assert_eq!(created + refused, frames.len() as u64, "{d:?}");
        assert!(
            created <= cap * (ticks + 1),
            "{created} states in {ticks} tick(s): {d:?}"
        );
        bounded += 1;
        if ticks == 0 {
            assert_eq!(created, cap, "{d:?}");
            exact = true;
            break;
        }
    }
    assert!(
        exact,
        "no round of {} runs fitted in one tick ({bounded} tried)",
        3 * cap
    );
}

/// A report races the program, which adds an entry's pending counts to the state when a later
/// tick's packet comes: after the report first read the pending counts (the state it reads
/// then holds them), and after it read the states (which do not). Either way every packet is
/// counted once, a client's and an overflow state's alike.
#[test]
fn a_report_racing_the_programs_own_addition_counts_each_packet_once() {
    kernel_test!();
    let config = budget(1, 1) + &udp_rule("udp", 9000, 5);
    use ratelimit_common::maps::{KEY_IP, KEY_OVERFLOW};
    use report::ReportPoint::{self, PendingRead, StatesRead};
    // The fast-drop entries are per CPU: every run on one, so the racing packet meets them.
    ratelimit_tests::sender::pin_current_thread(0).expect("pin");
    let mut fx = Fixture::load(&config);
    // One new state an hour, so none comes free while the test runs.
    let hour = HOUR_NS;
    let mut g = fx.maps.global.get(&0, 0).unwrap();
    g.admission_inc_ns = ratelimit_common::limiter::gcra_increment(1, 1, hour);
    g.admission_burst_ns = ratelimit_common::limiter::gcra_burst_ns(1, 1, hour);
    fx.maps.global.set(0, g, 0).unwrap();
    // The budget's one state goes to the client; every later source shares the overflow.
    let client = v4([198, 18, 17, 1]).udp(40000, 9000).build();
    let newcomer = v4([198, 18, 17, 2]).udp(40000, 9000).build();
    // (packets, drops) of the client and of the overflow state, with the program running
    // `frame` once in a later tick at `point`.
    let report = |point: ReportPoint, frame: &[u8]| {
        let (mut ip, mut ovf) = ((0, 0), (0, 0));
        report::for_each_client_raced(
            &fx.maps,
            &mut |k, s| match k.kind {
                KEY_IP => ip = (s.packets, s.drop_count()),
                KEY_OVERFLOW => ovf = (s.packets, s.drop_count()),
                _ => {}
            },
            &mut |p| {
                if p == point {
                    std::thread::sleep(std::time::Duration::from_millis(30));
                    assert_eq!(fx.run(frame, 1), XDP_DROP);
                }
            },
        )
        .unwrap();
        (ip, ovf)
    };
    assert_eq!(fx.run(&client, 100), XDP_DROP);
    assert_eq!(fx.run(&newcomer, 100), XDP_DROP);
    assert!(fx.fast_pending() > 0 && fx.ovf_pending() > 0);
    // A client's packet in a later tick adds its pending counts to its state.
    assert_eq!(report(PendingRead, &client), ((101, 96), (100, 95)));
    assert_eq!(fx.run(&client, 50), XDP_DROP);
    assert!(fx.fast_pending() > 0);
    assert_eq!(report(StatesRead, &client), ((152, 147), (100, 95)));
    // And a new source's packet the overflow state's.
    assert_eq!(report(PendingRead, &newcomer), ((152, 147), (101, 96)));
    assert_eq!(fx.run(&newcomer, 50), XDP_DROP);
    assert!(fx.ovf_pending() > 0);
    assert_eq!(report(StatesRead, &newcomer), ((152, 147), (152, 147)));
    // Quiet now: a plain report agrees.
    let mut plain = Vec::new();
    report::for_each_client(&fx.maps, |k, s| {
        plain.push((k.kind, s.packets, s.drop_count()))
    })
    .unwrap();
    plain.sort();
    assert_eq!(plain, [(KEY_IP, 152, 147), (KEY_OVERFLOW, 152, 147)]);
}

/// The per-source store, against a model of it: in a store of 4 sets of 8 slots, each new
/// source takes a free slot of the one of its two sets with more of them, and when both are
/// full, the slot of the state idle longest in the two that is not protected (a throttled
/// state, here: one of its packets was refused, and its protection, 20 s, outlasts the
/// test); when all 16 are protected, none (`state_protected`). A source seen again is the
/// most recent. After 300 sources (every fifth packet a tracked source seen again, every
/// twelfth new source sending two packets at once, which a bucket of one refuses), every slot
/// holds exactly the source the model puts there, and `state_created` / `state_evicted` /
/// `state_protected` are the model's counts.
#[test]
fn the_store_evicts_the_state_idle_longest_in_a_new_sources_two_sets() {
    kernel_test!();
    use ratelimit_common::maps::{STORE_WAYS, slot_tag};
    // A token bucket whose burst (one packet) refills in 10 ms: judged on the precise clock,
    // so every packet's last-seen time is its own; a second packet within 10 ms is refused.
    let config =
        tracking("new_sources_per_sec = 0\nmax_sources = 32") + &bucket_rule(1000, "10s", 1);
    let fx = Fixture::builder().max_sources(32).load(&config);
    assert_eq!(fx.plan.rules[0].protect_ms, 20_000);
    let sets = fx.maps.clients.sets();
    assert_eq!((sets, fx.maps.clients.capacity()), (4, 32));

    // The model: per slot, (source, time of its last packet, protected).
    type Model = Vec<Option<([u8; 4], u64, bool)>>;
    let mut model: Model = vec![None; 32];
    let (mut created, mut evicted, mut protected) = (0u64, 0u64, 0u64);
    // Whether the packet gets a state of its own.
    let mut model_packet = |model: &mut Model, a: [u8; 4], now: u64| -> bool {
        if let Some(s) = model.iter_mut().flatten().find(|s| s.0 == a) {
            s.1 = now;
            return true;
        }
        let (x, y) = fx.sets_of(&key_v4(a));
        let ways = |set: u32| (set as usize * STORE_WAYS)..(set as usize + 1) * STORE_WAYS;
        let scan: Vec<std::ops::Range<usize>> = if x == y {
            vec![ways(x)]
        } else {
            vec![ways(x), ways(y)]
        };
        let free: Vec<usize> = scan
            .iter()
            .map(|r| r.clone().filter(|&i| model[i].is_none()).count())
            .collect();
        let first_free = |k: usize| scan[k].clone().find(|&i| model[i].is_none());
        let oldest = scan
            .iter()
            .flat_map(|r| r.clone())
            .filter(|&i| model[i].is_some_and(|s| !s.2))
            .fold(None, |best: Option<usize>, i| match best {
                Some(b) if model[b].unwrap().1 <= model[i].unwrap().1 => Some(b),
                _ => Some(i),
            });
        let second = free.get(1).copied().unwrap_or(0);
        let victim = if free[0] != 0 && free[0] >= second {
            first_free(0).unwrap()
        } else if second != 0 {
            first_free(1).unwrap()
        } else if let Some(v) = oldest {
            evicted += 1;
            v
        } else {
            protected += 1;
            return false;
        };
        created += 1;
        model[victim] = Some((a, now, false));
        true
    };

    let before = fx.counters();
    let mut now = 0u64;
    let mut packet = |model: &mut Model, a: [u8; 4]| {
        now += 1;
        let verdict = fx.run(&v4(a).udp(40000, 9000).build(), 1);
        assert!(verdict == XDP_PASS || verdict == XDP_DROP, "{verdict}");
        if model_packet(model, a, now) && verdict == XDP_DROP {
            // Refused by its own bucket: throttled, so protected.
            model.iter_mut().flatten().find(|s| s.0 == a).unwrap().2 = true;
        }
    };
    for i in 0..300u32 {
        if i % 5 == 4 {
            // A tracked source seen again: the one the model holds idle longest.
            let again = model.iter().flatten().min_by_key(|s| s.1).unwrap().0;
            packet(&mut model, again);
        } else {
            let a = (0xc612_0000u32 + i).to_be_bytes();
            packet(&mut model, a);
            if i % 12 == 0 {
                packet(&mut model, a);
            }
        }
    }
    let d = fx.delta(&before);
    let mut got: Vec<Option<[u8; 4]>> = vec![None; 32];
    fx.maps
        .clients
        .walk_slots(&mut |i, tag, s| {
            let a = [s.addr[12], s.addr[13], s.addr[14], s.addr[15]];
            assert_eq!(tag, slot_tag(0, 128, fx.maps.clients.hash(&key_v4(a))));
            got[i as usize] = Some(a);
        })
        .unwrap();
    let want: Vec<Option<[u8; 4]>> = model.iter().map(|s| s.map(|s| s.0)).collect();
    assert_eq!(got, want);
    d.assert(&format!(
        "state_created={created} state_evicted={evicted} state_protected={protected} \
         state_insert_failed=0"
    ));
    let kept = model.iter().flatten().filter(|s| s.2).count();
    assert!(
        evicted > 100 && kept >= 8,
        "{evicted} evicted, {kept} protected"
    );
    println!(
        "300 packets: {created} states created, {evicted} evicted, {protected} refused (all \
         protected), {kept} protected states held, as the model says"
    );
    // The 32 states, and the overflow state if a source was refused one.
    assert_eq!(
        report::tracked_clients(&fx.maps).unwrap(),
        32 + u64::from(protected != 0)
    );
}

/// The attack: a client throttled by its rule pauses; an attacker who knows where the store
/// places sources (with a fixed hash, anyone; here the test reads the load's key) sends new
/// IPv6 sources that land in the client's two sets, more than they hold. The client's state
/// is protected, so the flood evicts only its own states, and the client comes back still
/// throttled: its bucket (10 an hour) refuses every packet.
#[test]
fn a_flood_aimed_at_a_throttled_clients_sets_does_not_reset_it() {
    kernel_test!();
    let config = tracking("new_sources_per_sec = 0\nmax_sources = 32") + &bucket_rule(10, "1h", 10);
    let fx = Fixture::builder().max_sources(32).load(&config);
    // A client whose two sets differ (with 4 sets, 1 in 4 have one set twice).
    let client = (7u8..)
        .map(|i| [198, 51, 100, i])
        .find(|&a| {
            let (x, y) = fx.sets_of(&key_v4(a));
            x != y
        })
        .unwrap();
    let ck = key_v4(client);
    let sets = fx.sets_of(&ck);
    let flood = fx.colliding(sets, 24);
    let run = |f: &[u8], n: u32| {
        let mut v = (0, 0);
        for _ in 0..n {
            match fx.run(f, 1) {
                XDP_PASS => v.0 += 1,
                XDP_DROP => v.1 += 1,
                x => panic!("verdict {x}"),
            }
        }
        v
    };
    let cf = v4(client).udp(40000, 9000).build();
    let before = fx.counters();
    assert_eq!(run(&cf, 15), (10, 5), "the client is throttled");
    // The client pauses: the flood's states are younger than its own (more than a tick, the
    // coarse clock's step).
    std::thread::sleep(std::time::Duration::from_millis(50));
    for (src, _) in &flood {
        let f = v6(src).udp(40000, 9000).build();
        assert_eq!(run(&f, 1), (1, 0), "{src}");
    }
    assert_eq!(
        run(&cf, 5),
        (0, 5),
        "the client came back with a fresh state"
    );
    // The client and 24 sources in 16 slots: from the 16th flood source on, each evicts one
    // of the flood's own states, never the client's.
    fx.delta(&before)
        .assert("state_created=25 state_evicted=9 state_protected=0");
    // Its totals, what the fast-drop table still holds for it included.
    assert_eq!(fx.client_totals().get(&(0, client)), Some(&(20, 10)));
    assert_ne!(
        fx.maps.clients.get(&ck).expect("its state").last_exceed_ns,
        0
    );
}

/// When every state in a new source's two sets is protected (here a ban rule's meter holds
/// a count for each), the new source gets no state of its own (`state_protected`) and is
/// limited in the rule's overflow state; once the protection lapses (two ban intervals, 4 s,
/// after a state's last packet: a source that never returns), the oldest is evicted again.
#[test]
fn protected_states_refuse_a_new_source_until_their_protection_lapses() {
    kernel_test!();
    let config = tracking("new_sources_per_sec = 0\nmax_sources = 32")
        + &ban_rule("udp", (1000, 1000), "2s", "1m");
    let fx = Fixture::builder().max_sources(32).load(&config);
    assert_eq!(fx.plan.rules[0].protect_ms, 4000);
    // A pair of distinct sets, and 16 + 4 sources in them.
    let (_, first) = v6_source(0x7000);
    let mut sets = fx.sets_of(&first);
    let mut n = 0x7000;
    while sets.0 == sets.1 {
        n += 1;
        sets = fx.sets_of(&v6_source(n).1);
    }
    let sources = fx.colliding(sets, 20);
    let send = |src: &str| {
        let f = v6(src).udp(40000, 9000).build();
        assert_eq!(fx.run(&f, 1), XDP_PASS, "{src}");
    };
    let before = fx.counters();
    let t = std::time::Instant::now();
    for (i, (src, _)) in sources[..16].iter().enumerate() {
        send(src);
        if i == 0 {
            // The first state the oldest by more than a tick of the coarse clock.
            std::thread::sleep(std::time::Duration::from_millis(30));
        }
    }
    for (src, _) in &sources[16..19] {
        send(src);
    }
    let elapsed = t.elapsed();
    let d = fx.delta(&before);
    assert!(
        elapsed < std::time::Duration::from_secs(3),
        "19 packets took {elapsed:?}: the machine is too slow for this test's 4 s protection"
    );
    d.assert("state_created=16 state_evicted=0 state_protected=3 state_insert_failed=0");
    // The three went to the overflow state.
    let ovf = fx.maps.overflow.get(&0, 0).unwrap();
    assert_eq!(ovf.packets, 3);
    for (_, k) in &sources[16..19] {
        assert!(fx.maps.clients.get(k).is_none());
    }

    // Past the protection (4 s after the last packet, and a tick of the coarse clock), the
    // state idle longest, the first source's, makes way for a new one.
    std::thread::sleep(std::time::Duration::from_millis(4500));
    send(&sources[19].0);
    fx.delta(&before)
        .assert("state_created=17 state_evicted=1 state_protected=3");
    assert!(fx.maps.clients.get(&sources[0].1).is_none());
    assert!(fx.maps.clients.get(&sources[19].1).is_some());
}

/// The placement hash is keyed per load: two loads draw different keys, and the same 64
/// sources land in other sets; a load that adopts the pinned maps (a restarted daemon)
/// reads the key back, and every source finds its state again, in the program (no new
/// state, its packet counted in its own) and in the daemon's reader.
#[test]
fn the_placement_key_differs_per_load_and_survives_adoption() {
    kernel_test!();
    let config =
        tracking("new_sources_per_sec = 0\nmax_sources = 1024") + &udp_rule("udp", 9000, 1000);
    let sources: Vec<[u8; 4]> = (0..64u32)
        .map(|i| (0xc633_6400u32 + i).to_be_bytes())
        .collect();
    let send = |fx: &Fixture, a: [u8; 4]| {
        let f = v4(a).udp(40000, 9000).build();
        assert_eq!(fx.run(&f, 1), XDP_PASS);
    };
    // Where each source's state sits, by set.
    let placement = |maps: &Maps| {
        let mut at = BTreeMap::new();
        maps.clients
            .walk_slots(&mut |i, _, s| {
                let a = [s.addr[12], s.addr[13], s.addr[14], s.addr[15]];
                at.insert(a, i / ratelimit_common::maps::STORE_WAYS as u64);
            })
            .unwrap();
        assert_eq!(at.len(), sources.len());
        at
    };

    let load = || Fixture::builder().max_sources(1024).load(&config);
    let (a, b) = (load(), load());
    assert!(!a.dp.adopted && !b.dp.adopted);
    assert_ne!(a.dp.hash_key, [0; ratelimit_common::maps::HASH_KEY_WORDS]);
    assert_ne!(a.dp.hash_key, b.dp.hash_key, "two loads drew the same key");
    assert_eq!(a.maps.clients.hash_key(), a.dp.hash_key);
    for &s in &sources {
        send(&a, s);
        send(&b, s);
    }
    let (at_a, at_b) = (placement(&a.maps), placement(&b.maps));
    let moved = sources.iter().filter(|s| at_a[*s] != at_b[*s]).count();
    // Under independent keys a source keeps its set with a chance of about 1 in 64 (either
    // of its two sets of 128, either way round): 64 sources keep about 1.
    assert!(moved >= 56, "only {moved} of 64 sources placed elsewhere");
    println!("two loads: {moved} of 64 sources in another set");

    // A restart: the program reloaded against the pinned maps.
    let key = a.dp.hash_key;
    let before = a.counters();
    let a2 = a.reload();
    assert!(a2.dp.adopted);
    assert_eq!(a2.dp.hash_key, key, "the adopted maps' key");
    assert_eq!(placement(&a2.maps), at_a);
    for &s in &sources {
        send(&a2, s);
        let st = a2
            .maps
            .clients
            .get(&key_v4(s))
            .expect("the state, found by the daemon");
        assert_eq!(st.packets, 2, "{s:?}");
    }
    a2.delta(&before).assert("state_created=0 pass=64");
    // The daemon's second handle (its known-sources thread) reads the same key from the pins.
    let reader = a2.dp.open_clients().expect("open clients");
    assert_eq!(reader.hash_key(), key);
}

/// Two CPUs sending the same 4000 new sources at once: a source never holds two slots, and
/// every packet is counted once, in its source's state or (a CPU that gave way to the other's
/// insert, `state_insert_failed`) the rule's overflow state.
#[test]
fn two_cpus_inserting_the_same_sources_keep_one_state_each() {
    kernel_test!();
    let config = tracking("new_sources_per_sec = 0") + &udp_rule("udp", 9000, 1_000_000);
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        eprintln!("skipped: one CPU");
        return;
    }
    let fx = Fixture::builder().max_sources(65536).load(&config);
    const N: u32 = 4000;
    let frames: Vec<Vec<u8>> = (0..N)
        .map(|i| {
            v4((0x0a10_0000u32 + i).to_be_bytes())
                .udp(40000, 9000)
                .build()
        })
        .collect();
    let before = fx.counters();
    let go = std::sync::Barrier::new(2);
    std::thread::scope(|sc| {
        for cpu in 0..2 {
            let (dp, frames, go) = (&fx.dp, &frames, &go);
            sc.spawn(move || {
                ratelimit_tests::sender::pin_current_thread(cpu).expect("pin");
                go.wait();
                for f in frames {
                    assert_eq!(fixture::run(dp, f, 1), XDP_PASS);
                }
            });
        }
    });
    let d = fx.delta(&before);
    let mut seen = std::collections::HashMap::new();
    let (mut own, mut overflow) = (0u64, 0u64);
    report::for_each_client(&fx.maps, |k, s| {
        if k.kind == ratelimit_common::maps::KEY_OVERFLOW {
            overflow += s.packets;
        } else {
            *seen.entry(k.addr).or_insert(0u32) += 1;
            own += s.packets;
            assert_eq!(s.drop_count(), 0, "{k:?}");
        }
    })
    .unwrap();
    let twice = seen.values().filter(|&&n| n > 1).count();
    assert_eq!(twice, 0, "{twice} sources hold two slots");
    assert_eq!(own + overflow, 2 * N as u64, "{own} + {overflow}");
    assert_eq!(d.of("state_created"), seen.len() as u64, "{d:?}");
    assert_eq!(d.of("state_insert_failed"), overflow, "{d:?}");
    println!(
        "{} sources tracked, {overflow} packets gave way to the other CPU's insert",
        seen.len()
    );
}

/// IPv4 and IPv6 never alias. A rule ban keyed per IPv6 /64 from a source in `::/64` (not a
/// bogon) bans `::/64`, which as 16-byte bits holds every IPv4 client's `::ffff:a.b.c.d` key:
/// IPv4 clients must still pass. Sources that would be those keys themselves (`::ffff:…`,
/// `::1`) are bogons: dropped, never given state or a ban. Operator bans of `::/0` and
/// `0.0.0.0/0` each stay in their own family.
#[test]
fn ipv6_bans_and_sources_never_cover_ipv4_clients() {
    kernel_test!();
    let config = ban_rule("udp-ban", (10, 20), "1h", "1h") + "ipv6_prefix = 64\n";
    let mut fx = Fixture::load(&config);
    let v4a = v4([198, 18, 40, 1]).udp(40000, 9000).build();
    let v4b = v4([203, 0, 113, 9]).udp(40000, 9000).build();

    // The reported attack: 30 packets each from ::1 and ::ffff:203.0.113.9.
    let before = fx.counters();
    for src in ["::1", "::ffff:203.0.113.9"] {
        let f = v6(src).udp(40000, 9000).build();
        assert_eq!(fx.run(&f, 30), XDP_DROP);
    }
    fx.delta(&before)
        .assert("drop_bogon=60 bans_issued=0 state_created=0");
    assert!(fx.maps.all_bans().is_empty());

    // A real IPv6 source in ::/64 crosses the ban threshold: `::/64` is banned.
    let before = fx.counters();
    let f = v6("::1:0:0:1").udp(40000, 9000).build();
    assert_eq!(fx.run(&f, 30), XDP_DROP);
    fx.delta(&before).assert("bans_issued=1");
    let bans = fx.maps.all_bans();
    assert_eq!(bans.len(), 1);
    assert_eq!(bans[0].prefix_len, 64);
    assert_eq!(bans[0].addr, [0; 16]);
    // Every IPv4 client still passes; another IPv6 source in ::/64 is banned.
    let before = fx.counters();
    assert_eq!(fx.run(&v4a, 3), XDP_PASS);
    assert_eq!(fx.run(&v4b, 3), XDP_PASS);
    let other6 = v6("::2:0:0:2").udp(40000, 53).build();
    assert_eq!(fx.run(&other6, 1), XDP_DROP);
    fx.delta(&before).assert("pass=6 drop_ban=1");

    // Operator bans of a whole family: ::/0 spares IPv4, 0.0.0.0/0 spares IPv6.
    fx.ban("::/0");
    let v6c = v6("2001:db8:7::1").udp(40000, 53).build();
    let v4c = v4([198, 18, 41, 1]).udp(40000, 53).build();
    assert_eq!(fx.run(&v6c, 1), XDP_DROP);
    assert_eq!(fx.run(&v4c, 1), XDP_PASS);
    assert!(fx.unban(ratelimit_common::maps::BAN_TABLE_OPERATOR, "::/0"));
    fx.ban("0.0.0.0/0");
    assert_eq!(fx.run(&v4c, 1), XDP_DROP);
    assert_eq!(fx.run(&v6c, 1), XDP_PASS);
}

/// Per-CIDR overrides and rule source lists keep the families apart too: an override of
/// `::/0` raises no IPv4 client's threshold.
#[test]
fn an_ipv6_override_never_applies_to_an_ipv4_client() {
    kernel_test!();
    let config = udp_rule("udp", 9000, 2)
        + "[[rule.override]]\ncidr = \"::/0\"\nthreshold = { count = 1000, interval = \"1h\" }\n";
    let fx = Fixture::load(&config);
    let before = fx.counters();
    fx.run(&v4([198, 18, 42, 1]).udp(40000, 9000).build(), 10);
    fx.run(&v6("2001:db8:42::1").udp(40000, 9000).build(), 10);
    let d = fx.delta(&before);
    assert_eq!(d.get("udp/admitted"), Some(&12), "2 IPv4 + 10 IPv6: {d:?}");
    d.assert("udp/dropped=8");
}

/// The strictest ban in force wins: a preview rule's ban of a client does not stop an
/// enforcing rule from banning it too (before, the second insert met `EEXIST` and the client
/// was only dropped while the enforcing rule's meter stayed high); and passing bans nested
/// deeper than any walk bound never hide a wider ban that drops.
#[test]
fn a_preview_ban_never_blocks_or_hides_an_enforcing_one() {
    kernel_test!();
    let config = ban_rule("watch", (100, 2), "1h", "1h")
        + "preview = true\n"
        + &ban_rule("enforce", (100, 5), "1h", "1h");
    let mut fx = Fixture::load(&config);
    let f = v4([198, 18, 43, 1]).udp(40000, 9000).build();
    // Packets 1-2: under both. 3: "watch" issues its preview ban. 4-5: banned in preview,
    // counted by both rules. 6: "enforce" crosses 5 and bans.
    fx.delta_of(|fx| fx.run_singly(&f, 6))
        .assert("watch/bans=1 enforce/bans=1 bans_issued=2");
    // From now on every packet is dropped as banned, whatever the meters say.
    fx.expect(&f, 50, XDP_DROP, "drop_ban=50 enforce/matched=0");

    // Passing bans at /128 down to /122 (seven, deeper than any walk bound) inside a /120
    // that drops: the /120 wins.
    let now = ratelimit_user::clock::mono_ns();
    for len in 122..=128u8 {
        let low = 0xffu16 & (0xffffu16 << (128 - len as u32));
        fx.insert_ban(BanEntry {
            flags: ratelimit_common::maps::BAN_PREVIEW,
            rule: 0,
            ..manual_ban(&format!("2001:db8:44::{low:x}/{len}"), now, 0)
        });
    }
    fx.insert_ban(BanEntry {
        flags: 0,
        rule: 1,
        ..manual_ban("2001:db8:44::/120", now, 0)
    });
    let g = v6("2001:db8:44::ff").udp(40000, 53).build();
    fx.expect(&g, 1, XDP_DROP, "drop_ban=1");
}

/// Rules filling their ban table never lock the operator out, and a rule ban that finds the
/// table full still drops its client for its ban_duration (held in the client's state,
/// counted as `ban_held_in_state`), then lets it start clean.
#[test]
fn a_full_rule_ban_table_holds_bans_in_state_and_leaves_the_operator_room() {
    kernel_test!();
    let config = ban_rule("udp-ban", (100, 3), "1h", "3s");
    let mut fx = Fixture::load(&config);
    // Fill the rules' table as a spoofed IPv6 flood would: one /64 ban each.
    let now = ratelimit_user::clock::mono_ns();
    ratelimit_tests::bans::fill_rule_ban_table(&mut fx.maps, 0, now);
    // The operator can still ban.
    fx.ban("198.18.45.0/24");
    assert_eq!(
        fx.run(&v4([198, 18, 45, 1]).udp(40000, 53).build(), 1),
        XDP_DROP
    );
    // A client crosses the ban threshold with the table full: banned all the same.
    let f = v4([198, 18, 46, 1]).udp(40000, 9000).build();
    fx.delta_of(|fx| fx.run_singly(&f, 4))
        .assert("bans_issued=1 ban_held_in_state=1 udp-ban/dropped=1");
    fx.expect(&f, 20, XDP_DROP, "udp-ban/banned_dropped=20 bans_issued=0");
    // After ban_duration (3 s; the coarse clock is at most a tick behind) it starts clean.
    std::thread::sleep(std::time::Duration::from_millis(3_500));
    fx.expect(&f, 3, XDP_PASS, "udp-ban/admitted=3");
}

/// A ban held in a client's state (the rules' ban table was full) lasts its whole
/// ban_duration even when the client goes quiet for longer than its rule remembers a
/// packet: such a state is never the one evicted for a new source (eviction would lift the
/// ban).
#[test]
fn a_ban_held_in_state_is_never_evicted_before_it_ends() {
    kernel_test!();
    let config = tracking("new_sources_per_sec = 0") + &ban_rule("udp-ban", (100, 3), "1s", "1h");
    // One set of 8 slots: every new source competes for the held client's slot.
    let mut fx = Fixture::builder().max_sources(8).load(&config);
    let now = ratelimit_user::clock::mono_ns();
    ratelimit_tests::bans::fill_rule_ban_table(&mut fx.maps, 0, now);
    let held = v4([198, 18, 47, 1]).udp(40000, 9000).build();
    fx.delta_of(|fx| fx.run_singly(&held, 4))
        .assert("ban_held_in_state=1");
    // Quiet for longer than the rule remembers a packet (two ban intervals: 2 s).
    std::thread::sleep(std::time::Duration::from_millis(2_500));
    // Eight new sources: seven take the free slots, the eighth finds the set full.
    let before = fx.counters();
    for i in 0..8u8 {
        fx.run(&v4([198, 18, 48, i]).udp(40000, 9000).build(), 1);
    }
    fx.delta(&before)
        .assert("state_created=7 state_evicted=0 state_protected=1");
    // The held client is still banned.
    fx.expect(&held, 5, XDP_DROP, "udp-ban/banned_dropped=5");
}

/// A full rule ban table reaches the log through aya-log, never per packet: the first held ban
/// at once, then at most one line a second (per CPU; this thread is pinned to one) carrying the
/// number of bans it stands for, the last rule and family. The lines add up to the counter.
#[test]
fn a_full_rule_ban_table_is_logged_at_most_once_a_second_with_its_count() {
    kernel_test!();
    use std::time::{Duration, Instant};
    let tcp_other = "[[rule]]\nname = \"tcp-other\"\n\
                     match = { protocol = \"tcp\", dst_ports = [\"1\"] }\n\
                     threshold = { count = 100, interval = \"1h\" }\n";
    let config = tcp_other.to_owned() + &ban_rule("udp-ban", (100, 3), "1h", "1h");
    const WHAT: &str = "rule ban table full: ";
    ratelimit_tests::sender::pin_current_thread(0).expect("pin");
    let mut fx = Fixture::load(&config);
    let mut log = fx.kernel_log();
    let now = ratelimit_user::clock::mono_ns();
    ratelimit_tests::bans::fill_rule_ban_table(&mut fx.maps, 1, now);
    let before = fx.counters();
    // 30 IPv4 clients cross the ban threshold (4 packets each): 30 held bans, one line.
    let t0 = Instant::now();
    for i in 0..30u8 {
        let f = v4([198, 18, 46, i]).udp(40000, 9000).build();
        assert_eq!(fx.run(&f, 4), XDP_DROP);
    }
    let burst1 = t0.elapsed();
    log.flush();
    let got = log.counts(WHAT);
    // Timing tolerance: a burst slower than 0.9 s (a very busy machine) may see a line for
    // every second it spans (give or take the coarse clock's tick).
    if burst1 < Duration::from_millis(900) {
        assert_eq!(got.len(), 1, "{got:?}");
    } else {
        let seconds = (burst1 + Duration::from_millis(10)).as_secs() as usize;
        assert!(got.len() <= 1 + seconds, "{burst1:?}: {got:?}");
    }
    assert_eq!(got[0].0, 1, "the first held ban is logged at once: {got:?}");
    assert!(got[0].1.contains("rule 1, IPv4"), "{got:?}");
    // Past the second, the next packet through the rules writes the rest; 10 IPv6 clients'
    // held bans right after it wait for the next second.
    std::thread::sleep(Duration::from_millis(1_200));
    let t1 = Instant::now();
    for i in 0..10u16 {
        let f = v6(&format!("2001:db8:46:{i:x}::1"))
            .udp(40000, 9000)
            .build();
        assert_eq!(fx.run(&f, 4), XDP_DROP);
    }
    let burst2 = t1.elapsed();
    log.flush();
    let got2 = log.counts(WHAT);
    if burst1 < Duration::from_millis(900) && burst2 < Duration::from_millis(900) {
        assert_eq!(got2.len(), 2, "{got2:?}");
        assert_eq!(got2[1].0, 29, "{got2:?}");
        assert!(got2[1].1.contains("rule 1, IPv4"), "{got2:?}");
    }
    std::thread::sleep(Duration::from_millis(1_200));
    let plain = v4([198, 18, 47, 1]).udp(40000, 9000).build();
    assert_eq!(fx.run(&plain, 1), XDP_PASS);
    log.flush();
    let all = log.counts(WHAT);
    fx.delta(&before).assert("ban_held_in_state=40");
    assert_eq!(
        all.iter().map(|(n, _)| n).sum::<u64>(),
        40,
        "every held ban is counted in exactly one line: {all:?}"
    );
    assert!(all.last().unwrap().1.contains("rule 1, IPv6"), "{all:?}");
    if burst1 < Duration::from_millis(900) && burst2 < Duration::from_millis(900) {
        assert_eq!(all.len(), 3, "{all:?}");
        assert_eq!(all[2].0, 10, "{all:?}");
    }
    println!("{all:#?}");
}

/// A shared key (`key = "all"`) whose state its full map refuses: every packet passes (fails
/// open, never a drop for a state it could not keep), is counted once in
/// `state_insert_failed`, and reaches the log at most once a second with its count.
#[test]
fn a_full_shared_state_map_fails_open_counts_each_packet_once_and_is_logged() {
    kernel_test!();
    use ratelimit_common::{
        caps::MAX_SHARED_STATES,
        maps::{ClientKey, KEY_REGION, SharedState},
    };
    use std::time::{Duration, Instant};
    let config = udp_rule("all", 9000, 5) + "key = \"all\"\n";
    const WHAT: &str = "shared-key state map refused a key: ";
    ratelimit_tests::sender::pin_current_thread(0).expect("pin");
    let mut fx = Fixture::load(&config);
    let mut log = fx.kernel_log();
    // Fill the shared keys' map with region keys of a rule slot no rule uses.
    for i in 0..MAX_SHARED_STATES {
        let mut addr = [0u8; 16];
        addr[..4].copy_from_slice(&i.to_be_bytes());
        let key = ClientKey {
            rule: 15,
            kind: KEY_REGION,
            prefix_len: 0,
            addr,
            ..ClientKey::default()
        };
        fx.maps
            .clients
            .shared
            .insert(key, SharedState::default(), 0)
            .expect("fill the shared map");
    }
    let f = v4([198, 18, 48, 1]).udp(40000, 9000).build();
    let before = fx.counters();
    let t0 = Instant::now();
    assert_eq!(fx.run(&f, 50), XDP_PASS);
    let took = t0.elapsed();
    fx.delta(&before).assert("pass=50 state_insert_failed=50");
    log.flush();
    if took < Duration::from_millis(900) {
        assert_eq!(log.counts(WHAT).len(), 1, "{:?}", log.counts(WHAT));
    }
    assert_eq!(log.counts(WHAT)[0].0, 1, "{:?}", log.counts(WHAT));
    std::thread::sleep(Duration::from_millis(1_200));
    assert_eq!(fx.run(&f, 1), XDP_PASS);
    log.flush();
    let got = log.counts(WHAT);
    assert_eq!(
        got.iter().map(|(n, _)| n).sum::<u64>(),
        51,
        "every refused packet in exactly one line: {got:?}"
    );
    assert!(got.last().unwrap().1.contains("rule 0;"), "{got:?}");
    println!("{got:#?}");
}

/// Handshake-proven admission through BPF_PROG_TEST_RUN, in a network namespace of its own with
/// `tcp_syncookies = 2` (the kernel makes cookies for a listener whatever its queue): a SYN
/// from a source refused state is answered with a SYN-ACK whose cookie is the listener's, the
/// ACK carrying it proves the source (a wrong one is dropped), and the proven source's next
/// packet gets state without the admission budget; a SYN to a closed port is dropped.
#[test]
fn syn_cookies_from_xdp_are_the_listeners_own() {
    kernel_test!();
    use std::net::{IpAddr, SocketAddr};
    const OPEN: u16 = 8443;
    const CLOSED: u16 = 8444;
    let config = budget(1, 1)
        + "[[rule]]\nname = \"tcp\"\n\
           match = { protocol = \"tcp\", dst_ports = [\"8443-8444\"] }\n\
           threshold = { count = 1, interval = \"1h\" }\nalgorithm = \"fixed_window\"\n";
    std::thread::spawn(move || {
        // SAFETY: unshare(2) of this thread's network namespace; no pointer involved.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0, "unshare");
        std::fs::write("/proc/sys/net/ipv4/tcp_syncookies", "2").expect("tcp_syncookies");
        let listen = |addr: SocketAddr| {
            let s = socket2::Socket::new(
                socket2::Domain::for_address(addr),
                socket2::Type::STREAM,
                None,
            )
            .unwrap();
            if addr.is_ipv6() {
                s.set_only_v6(true).unwrap();
            }
            s.bind(&addr.into()).unwrap();
            s.listen(8).unwrap();
            s
        };
        let _l4 = listen(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), OPEN));
        let _l6 = listen(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), OPEN));
        // The server's addresses are this namespace's own (which forwards nothing).
        let ip = |args: &[&str]| {
            let st = std::process::Command::new("ip")
                .args(args)
                .status()
                .expect("ip");
            assert!(st.success(), "ip {args:?}");
        };
        ip(&["link", "set", "lo", "up"]);
        ip(&["-4", "addr", "add", &format!("{SERVER4}/32"), "dev", "lo"]);
        ip(&[
            "-6",
            "addr",
            "add",
            &format!("{SERVER6}/128"),
            "dev",
            "lo",
            "nodad",
        ]);
        let mut fx = Fixture::builder().pins("fixtures-cookies").load(&config);
        // As the daemon does before it attaches.
        fx.maps.refresh_local_addrs();
        let mss = [2, 4, 0x05, 0xb4]; // 1460
        let server = |v6: bool| -> IpAddr { if v6 { SERVER6.into() } else { SERVER4.into() } };
        let syn = |src: IpAddr, dport: u16| {
            tcp_segment(
                src,
                server(src.is_ipv6()),
                (40000, dport),
                tcp_flags::SYN,
                (1000, 0),
                &mss,
            )
        };
        let run = |f: &[u8]| fx.run_out(f);
        // The first source takes the budget's one state, the second the overflow state's one
        // packet; from the third on, sources are refused and the overflow state is spent.
        let before = fx.counters();
        assert_eq!(
            run(&syn(Ipv4Addr::new(198, 18, 30, 1).into(), OPEN)).0,
            XDP_PASS
        );
        assert_eq!(
            run(&syn(Ipv4Addr::new(198, 18, 30, 2).into(), OPEN)).0,
            XDP_PASS
        );
        // A closed port: dropped, not answered.
        assert_eq!(
            run(&syn(Ipv4Addr::new(198, 18, 30, 3).into(), CLOSED)).0,
            XDP_DROP
        );
        let d = fx.delta(&before);
        d.assert("syn_cookies_sent=0");
        for (i, client) in [
            IpAddr::from(Ipv4Addr::new(198, 18, 30, 4)),
            "2001:db8:30::4".parse().unwrap(),
        ]
        .into_iter()
        .enumerate()
        {
            let before = fx.counters();
            let frame = syn(client, OPEN);
            let (action, out) = run(&frame);
            assert_eq!(action, XDP_TX, "{client}");
            let r = segment(&out);
            assert!(r.checksums_hold, "{client}: {out:02x?}");
            assert_eq!(out[..6], CLIENT_MAC, "back to the sender");
            assert_eq!(out[6..12], SERVER_MAC);
            assert_eq!((r.src, r.dst), (server(client.is_ipv6()), client));
            assert_eq!((r.sport, r.dport), (OPEN, 40000));
            assert_eq!(r.flags, tcp_flags::SYN | tcp_flags::ACK);
            assert_eq!(r.ack, 1001);
            // The MSS the cookie encodes: the kernel's table holds 1460 for IPv4 and 1440
            // for IPv6 as the largest at or under the client's 1460.
            let want = if client.is_ipv6() { 1440u16 } else { 1460 };
            assert_eq!(
                r.options,
                [&[2, 4][..], &want.to_be_bytes()].concat(),
                "{client}"
            );
            let cookie = r.seq;
            // A wrong cookie proves nothing and is dropped; the right one passes.
            let ack = |c: u32| {
                tcp_segment(
                    client,
                    server(client.is_ipv6()),
                    (40000, OPEN),
                    tcp_flags::ACK,
                    (1001, c.wrapping_add(1)),
                    &[],
                )
            };
            assert_eq!(run(&ack(cookie ^ 0x0100_0000)).0, XDP_DROP, "{client}");
            assert_eq!(run(&ack(cookie)).0, XDP_PASS, "{client}");
            // The proven source's next packet gets state without the budget.
            let data = tcp_segment(
                client,
                server(client.is_ipv6()),
                (40000, OPEN),
                tcp_flags::ACK | tcp_flags::PSH,
                (1001, cookie.wrapping_add(1)),
                &[],
            );
            assert_eq!(run(&data).0, XDP_PASS, "{client}");
            let d = fx.delta(&before);
            assert_eq!(d.get("syn_cookies_sent"), Some(&1), "{i}: {d:?}");
            assert_eq!(d.get("sources_proven"), Some(&1), "{i}: {d:?}");
            assert_eq!(d.get("proven_admitted"), Some(&1), "{i}: {d:?}");
            assert_eq!(d.get("state_created"), Some(&1), "{i}: {d:?}");
            // SYN, the wrong ACK, the right ACK; the data packet was judged in its own state.
            assert_eq!(d.get("admission_refused"), Some(&3), "{i}: {d:?}");
            assert_eq!(d.get("tcp/admitted"), Some(&1), "{i}: {d:?}");
        }
        // A SYN with the options Linux sends (MSS, SACK permitted, timestamps, window scale):
        // the reply is cut to its 20 bytes and the MSS, and carries what the kernel's own
        // replies do in their fixed fields.
        let linux_opts = [
            2, 4, 0x05, 0xb4, 4, 2, 8, 10, 0, 0, 0, 1, 0, 0, 0, 0, 1, 3, 3, 7,
        ];
        let client: IpAddr = Ipv4Addr::new(198, 18, 30, 5).into();
        let frame = tcp_segment(
            client,
            SERVER4.into(),
            (40001, OPEN),
            tcp_flags::SYN,
            (7, 0),
            &linux_opts,
        );
        let (action, out) = run(&frame);
        assert_eq!(action, XDP_TX);
        assert_eq!((frame.len(), out.len()), (74, 58), "{out:02x?}");
        let r = segment(&out);
        assert!(r.checksums_hold);
        assert_eq!((r.flags, r.ack, r.options.as_slice()), (0x12, 8, &mss[..]));
        assert_eq!(out[22], 64, "TTL");
        assert_eq!(out[20] & 0x40, 0x40, "DF");
        assert_eq!(
            u16::from_be_bytes([out[48], out[49]]),
            14600,
            "window: ten segments"
        );
        assert_eq!(u16::from_be_bytes([out[52], out[53]]), 0, "urgent pointer");
        // Not answered, and dropped as the rule said: a first fragment (more fragments set),
        // a SYN signed with TCP-MD5, one to a broadcast MAC, one from a martian source.
        let before = fx.counters();
        let mut first_fragment = syn(Ipv4Addr::new(198, 18, 30, 6).into(), OPEN);
        first_fragment[20] |= 0x20;
        first_fragment[24..26].copy_from_slice(&[0, 0]);
        let c = checksum(&first_fragment[14..34]);
        first_fragment[24..26].copy_from_slice(&c.to_be_bytes());
        let md5 = tcp_segment(
            Ipv4Addr::new(198, 18, 30, 7).into(),
            SERVER4.into(),
            (40000, OPEN),
            tcp_flags::SYN,
            (1, 0),
            &[&mss[..], &[19, 18], &[0; 16], &[1, 1]].concat(),
        );
        let mut broadcast = syn(Ipv4Addr::new(198, 18, 30, 8).into(), OPEN);
        broadcast[..6].copy_from_slice(&[0xff; 6]);
        let martian = syn(Ipv4Addr::new(127, 0, 0, 9).into(), OPEN);
        for (what, f) in [
            ("first fragment", &first_fragment),
            ("TCP-MD5", &md5),
            ("broadcast", &broadcast),
            ("martian", &martian),
        ] {
            assert_eq!(run(f).0, XDP_DROP, "{what}");
        }
        let d = fx.delta(&before);
        d.assert("syn_cookies_sent=0 drop_rule=4");
        // A SYN to an address this host does not own (which reaches the NIC all the same: a
        // shared segment, a mistaken route) is not answered, though the wildcard listener
        // matches any destination; dropped as the rule said. One to its own still is.
        let before = fx.counters();
        let foreign4: IpAddr = Ipv4Addr::new(198, 18, 99, 1).into();
        let foreign6: IpAddr = "2001:db8:99::1".parse().unwrap();
        for (i, (src, dst)) in [
            (IpAddr::from(Ipv4Addr::new(198, 18, 30, 10)), foreign4),
            ("2001:db8:32::10".parse().unwrap(), foreign6),
        ]
        .into_iter()
        .enumerate()
        {
            let f = tcp_segment(
                src,
                dst,
                (40000 + i as u16, OPEN),
                tcp_flags::SYN,
                (1, 0),
                &mss,
            );
            let (action, out) = run(&f);
            assert_eq!(action, XDP_DROP, "a SYN to {dst} was answered: {out:02x?}");
        }
        let d = fx.delta(&before);
        d.assert("syn_cookies_sent=0 drop_rule=2");
        assert_eq!(d.get("admission_refused"), Some(&2), "refused state: {d:?}");
        for src in [
            IpAddr::from(Ipv4Addr::new(198, 18, 30, 11)),
            // Another /64 than the one proven above (the rule keys IPv6 sources by /64).
            "2001:db8:33::11".parse().unwrap(),
        ] {
            let before = fx.counters();
            let action = run(&syn(src, OPEN)).0;
            let d = fx.delta(&before);
            assert_eq!(
                action, XDP_TX,
                "a SYN from {src} to this host's own address: {d:?}"
            );
        }
    })
    .join()
    .unwrap();
}
