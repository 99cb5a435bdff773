//! The match fields with real traffic from the stack: datagrams the client's kernel fragments,
//! `ping -f` with and without a low TTL, and datagrams whose payload starts with given bytes,
//! each counted exactly by the rules that name them (in preview: they count, never drop).

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::process::Command;
use std::time::{Duration, Instant};

use ratelimit_tests::{
    kernel_test,
    scenario::{Scenario, rule_counter},
};

const PORT: u16 = 9000;
/// Datagrams of 4,000 bytes (the stack sends each as three fragments on a 1,500-byte MTU)
/// and of 100 bytes (whole).
const BIG: usize = 20;
const SMALL: usize = 30;
/// Echo requests with TTL 5, and with the default TTL.
const PINGS_LOW: u32 = 40;
const PINGS: u32 = 60;
/// Datagrams whose payload starts with 0xabcd, and as many others. (A later fragment meets a
/// payload condition, as it meets a port condition: it carries no L4 header to refute it; the
/// rule names `fragment = "none"` to count whole datagrams only.)
const MARKED: usize = 25;

const POLICY: &str = r#"
[[rule]]
name = "later-fragments"
match = { protocol = "udp", fragment = "later" }
key = "all"
threshold = { count = 1, interval = "1h" }
preview = true

[[rule]]
name = "any-fragment"
match = { fragment = "any" }
key = "all"
threshold = { count = 1, interval = "1h" }
preview = true

[[rule]]
name = "whole"
match = { protocol = "udp", fragment = "none", dst_ports = ["9000"] }
key = "all"
threshold = { count = 1, interval = "1h" }
preview = true

[[rule]]
name = "echo-requests"
match = { protocol = "icmp", icmp_types = [8], icmp_codes = [0] }
key = "all"
threshold = { count = 1, interval = "1h" }
preview = true

[[rule]]
name = "echo-replies"
match = { protocol = "icmp", icmp_types = [0] }
key = "all"
threshold = { count = 1, interval = "1h" }
preview = true

[[rule]]
name = "low-ttl"
match = { ttl = ["1-10"] }
key = "all"
threshold = { count = 1, interval = "1h" }
preview = true

[[rule]]
name = "marked"
match = { protocol = "udp", fragment = "none", payload = [{ from = "l4_payload", offset = 0, value = "0xabcd" }] }
key = "all"
threshold = { count = 1, interval = "1h" }
preview = true
"#;

fn ping(s: &Scenario, count: u32, ttl: Option<u8>) {
    let target = s.pair.b().ipv4.to_string();
    let count = count.to_string();
    let mut args = vec!["-f", "-q", "-c", count.as_str(), "-W", "1"];
    let ttl = ttl.map(|t| t.to_string());
    if let Some(t) = &ttl {
        args.extend(["-t", t.as_str()]);
    }
    args.push(&target);
    let out = s
        .client
        .enter(|| Command::new("ping").args(&args).output().expect("ping"));
    assert!(out.status.success(), "ping {args:?}: {out:?}");
}

#[test]
fn real_fragments_pings_and_payloads_meet_exactly_the_rules_that_name_them() {
    kernel_test!();
    let mut s = Scenario::new("rlmt");
    s.start(POLICY);
    let sink = s.sink(PORT);
    let server = SocketAddr::new(IpAddr::V4(s.pair.b().ipv4), PORT);
    s.client.enter(|| {
        let sock = UdpSocket::bind("0.0.0.0:0").unwrap();
        for _ in 0..BIG {
            sock.send_to(&[7u8; 4000], server).unwrap();
        }
        for _ in 0..SMALL {
            sock.send_to(&[7u8; 100], server).unwrap();
        }
        for i in 0..MARKED * 2 {
            let first = if i % 2 == 0 {
                [0xab, 0xcd]
            } else {
                [0xab, 0xce]
            };
            let mut p = vec![0u8; 64];
            p[..2].copy_from_slice(&first);
            sock.send_to(&p, server).unwrap();
        }
    });
    ping(&s, PINGS_LOW, Some(5));
    ping(&s, PINGS, None);
    let datagrams = (BIG + SMALL + MARKED * 2) as u64;
    sink.wait_total(datagrams, Duration::from_secs(10));
    assert_eq!(
        sink.stop().total,
        datagrams,
        "every datagram reassembled and delivered"
    );
    let give_up = Instant::now() + Duration::from_secs(10);
    let st = loop {
        let st = s.stats();
        if rule_counter(&st, "echo-requests", "matched") >= (PINGS + PINGS_LOW) as u64
            || Instant::now() > give_up
        {
            break st;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let m = |r| rule_counter(&st, r, "matched");
    let big = BIG as u64;
    assert_eq!(
        m("later-fragments"),
        2 * big,
        "two later fragments a datagram"
    );
    assert_eq!(m("any-fragment"), 3 * big, "and the first");
    // Whole datagrams to the port: the small and the marked ones, not the fragmented.
    assert_eq!(m("whole"), (SMALL + 2 * MARKED) as u64);
    assert_eq!(m("echo-requests"), (PINGS + PINGS_LOW) as u64);
    assert_eq!(
        m("echo-replies"),
        0,
        "the replies leave the host; none arrives"
    );
    assert_eq!(m("low-ttl"), PINGS_LOW as u64);
    assert_eq!(m("marked"), MARKED as u64);
    // Preview: every packet passed, and each rule counted what it would have dropped.
    assert_eq!(rule_counter(&st, "later-fragments", "dropped"), 0);
    assert_eq!(
        rule_counter(&st, "later-fragments", "would_drop"),
        2 * big - 1
    );
}
