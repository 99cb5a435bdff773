use std::{vec, vec::Vec};

use super::*;
use crate::{
    addr::IpKey,
    caps::MAX_VLAN_WALK,
    maps::*,
    stats::{global, rule as rc},
};

fn eth(ethertype: u16) -> Vec<u8> {
    let mut f = vec![0u8; 12];
    f.extend_from_slice(&ethertype.to_be_bytes());
    f
}

fn ipv4_udp(src: [u8; 4], dport: u16) -> Vec<u8> {
    let mut f = eth(ETH_P_IP);
    f.extend_from_slice(&[0x45, 0, 0, 28, 0, 0, 0, 0, 64, IPPROTO_UDP, 0, 0]);
    f.extend_from_slice(&src);
    f.extend_from_slice(&[198, 18, 0, 1]);
    f.extend_from_slice(&[0x9c, 0x40]);
    f.extend_from_slice(&dport.to_be_bytes());
    f.extend_from_slice(&[0, 8, 0, 0]);
    f
}

fn ip(p: Frame) -> Parsed {
    match p {
        Frame::Ip(p) => p,
        other => panic!("not judged: {other:?}"),
    }
}

#[test]
fn parser_branches() {
    assert_eq!(parse(&eth(0x0806)), Frame::NonIp);
    assert_eq!(
        parse(&eth(ETH_P_IP)),
        Frame::Unreadable(global::MALFORMED_IPV4)
    );
    assert_eq!(
        parse(&eth(ETH_P_8021Q)),
        Frame::Unreadable(global::MALFORMED_L2)
    );
    let udp = ipv4_udp([198, 18, 1, 1], 53);
    let p = ip(parse(&udp));
    assert!(p.v4 && p.l4 && !p.l4_cut && p.dport == 53 && p.proto == IPPROTO_UDP);
    // Truncated UDP: judged by L3 with every L4 condition met.
    let p = ip(parse(&udp[..udp.len() - 1]));
    assert!(p.l4_cut && !p.l4 && p.note == global::MALFORMED_L4);
    // Total length shorter than the header: still judged by its source.
    let mut bad = udp.clone();
    bad[17] = 19;
    let p = ip(parse(&bad));
    assert!(p.l4_cut && p.note == global::MALFORMED_IPV4);
    assert_eq!(p.src, IpKey::from_v4([198, 18, 1, 1]));
    // Three tags: one more than a valid frame has, judged by its source.
    let tagged = |n: usize| {
        let mut q = eth(ETH_P_8021AD);
        for _ in 1..n {
            q.extend_from_slice(&[0, 1]);
            q.extend_from_slice(&ETH_P_8021Q.to_be_bytes());
        }
        q.extend_from_slice(&[0, 1]);
        q.extend_from_slice(&ETH_P_IP.to_be_bytes());
        q.extend_from_slice(&udp[14..]);
        q
    };
    assert_eq!(ip(parse(&tagged(2))).note, 0);
    assert_eq!(ip(parse(&tagged(3))).note, global::MALFORMED_L2);
    assert_eq!(
        parse(&tagged(MAX_VLAN_WALK + 1)),
        Frame::Unreadable(global::MALFORMED_L2)
    );
}

#[test]
fn ipv6_bogon_sources_are_dropped_first() {
    let mut f = eth(ETH_P_IPV6);
    f.extend_from_slice(&[0x60, 0, 0, 0, 0, 8, IPPROTO_UDP, 64]);
    f.extend_from_slice(&[0u8; 15]);
    f.push(1); // ::1
    f.extend_from_slice(&[0x20, 0x01, 0x0d, 0xb8]);
    f.extend_from_slice(&[0u8; 12]);
    f.extend_from_slice(&[0x9c, 0x40, 0x23, 0x28, 0, 8, 0, 0]);
    assert_eq!(parse(&f), Frame::Bogon);
    f[14 + 8 + 15] = 0;
    f[14 + 8 + 7] = 1; // ::1:0:0:0:0 is no bogon
    assert!(matches!(parse(&f), Frame::Ip(_)));
}

fn policy(rule: RuleConfig) -> Policy {
    Policy {
        global: GlobalConfig {
            rule_count: 1,
            store_sets: 1,
            ..GlobalConfig::default()
        },
        rules: vec![rule],
        ..Policy::default()
    }
}

#[test]
fn a_fixed_window_admits_exactly_its_threshold_per_source() {
    let rule = RuleConfig {
        key: KEY_IP,
        algorithm: ALG_FIXED_WINDOW,
        protocol: PROTO_UDP,
        v4_prefix: 24,
        v6_prefix: 64,
        limit: Limit {
            threshold: 3,
            interval_ns: 3_600_000_000_000,
            ..Limit::default()
        },
        ..RuleConfig::default()
    };
    let mut m = Model::new(policy(rule)).unwrap();
    let now = 10 * 3_600_000_000_000 + 5;
    let mut total = Counters::default();
    for i in 0..5u8 {
        // Same /24: one key.
        let o = m.run(&ipv4_udp([198, 18, 1, i], 53), now);
        assert_eq!(o.action, if i < 3 { XDP_PASS } else { XDP_DROP });
        total.merge(&o.counters);
    }
    assert_eq!(total.global[global::STATE_CREATED as usize], (1, 0));
    assert_eq!(total.global[global::PASS as usize].0, 3);
    assert_eq!(total.global[global::DROP_RULE as usize].0, 2);
    assert_eq!(total.rules[0][rc::MATCHED as usize].0, 5);
    assert_eq!(total.rules[0][rc::DROPPED as usize].0, 2);
    assert_eq!(m.tracked_sources(), 1);
}

#[test]
fn a_ban_rule_bans_its_key_and_the_ban_drops_before_the_rules() {
    let rule = RuleConfig {
        key: KEY_IP,
        action: ACTION_BAN,
        algorithm: ALG_FIXED_WINDOW,
        v4_prefix: 32,
        v6_prefix: 64,
        limit: Limit {
            threshold: 2,
            interval_ns: 3_600_000_000_000,
            ban_threshold: 3,
            ban_interval_ns: 3_600_000_000_000,
            ban_duration_ns: 3_600_000_000_000,
            ..Limit::default()
        },
        ..RuleConfig::default()
    };
    let mut m = Model::new(policy(rule)).unwrap();
    let now = 7 * 3_600_000_000_000;
    let f = ipv4_udp([198, 18, 9, 9], 53);
    let actions: Vec<u32> = (0..6).map(|_| m.run(&f, now).action).collect();
    // 2 admitted, 1 over the threshold, the 4th crosses the ban threshold, then banned.
    assert_eq!(
        actions,
        [XDP_PASS, XDP_PASS, XDP_DROP, XDP_DROP, XDP_DROP, XDP_DROP]
    );
    let o = m.run(&f, now);
    assert_eq!(o.counters.global[global::DROP_BAN as usize].0, 1);
    assert_eq!(o.counters.rules[0][rc::MATCHED as usize].0, 0);
}
