//! DNS reflection, for real: eight reflectors (a real dnsmasq answering on eight addresses)
//! get queries for a large record whose source was spoofed to the protected host's address,
//! and send their ~800-byte answers to it. One of the reflectors' addresses is the host's own
//! resolver, which the host queries meanwhile, and another client sends the host ordinary UDP.
//!
//! The spoofed queries leave the protected end's veth from a packet socket (the attacker's
//! sender, so to speak): the program sees only the answers, arriving from real reflectors.
//! With the ready reflection rule (`packaging/ratelimit.example.toml`, its threshold sized to
//! the lab), the answers that reach the host's socket are held to the rule's threshold; the
//! host's own lookups all succeed (its resolver is in the rule's `except`); the other client
//! loses nothing. Without a rule the whole flood reaches the socket. The embedded default
//! policy (`ratelimit check-config --print-default`, its exceptions from a resolv.conf naming
//! the lab's resolver) counts every answer in its reflection rule, and keeps the rest whole.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use ratelimit_tests::{
    daemon::print_default,
    dns::{self, BIG, Dnsmasq},
    kernel_test,
    link::add_address,
    packet::Frame,
    scenario::{Scenario, align_to_window, rule_counter},
};

/// Where the spoofed queries say they come from, on the protected host: the answers go there.
const VICTIM_PORT: u16 = 9000;
/// Where the other client sends its ordinary UDP.
const OTHER_PORT: u16 = 9001;
const REFLECTORS: u8 = 8;
/// Spoofed queries a second, for [`FLOOD`]: three times the rule's threshold.
const QPS: u64 = 3000;
const FLOOD: Duration = Duration::from_secs(3);
/// The rule's threshold a second (a fixed window of one second).
const THRESHOLD: u64 = 1000;
/// The host's own lookups during the flood, and the other client's datagrams.
const LOOKUPS: usize = 60;
const OTHER: u64 = 1000;

/// The ready reflection rule, the lab's resolver excepted.
fn rule(resolver: Ipv4Addr) -> String {
    format!(
        r#"
[[rule]]
name = "udp-reflection"
match = {{ protocol = "udp", src_ports = ["19", "53", "123", "161", "389", "1900", "3702", "5353", "11211"], length = ["400-65535"] }}
except = ["{resolver}/32"]
key = "all"
action = "throttle"
threshold = {{ count = {THRESHOLD}, interval = "1s" }}
algorithm = "fixed_window"
"#
    )
}

/// The embedded default policy for a host whose resolv.conf names `resolver` (behind a local
/// stub, which is left out).
fn default_policy(resolver: Ipv4Addr) -> String {
    let text = print_default(&format!("nameserver 127.0.0.53\nnameserver {resolver}\n"));
    assert!(
        text.contains(&format!("except = [\"{resolver}/32\"]")),
        "the default policy excepts the host's resolver (and not the local stub):\n{text}"
    );
    text
}

/// What one phase counted.
#[derive(Debug)]
struct Phase {
    queries: u64,
    /// Answers that reached the host's socket, and those of them from the host's resolver
    /// (a reflector too, whose answers the rule's `except` lets through).
    answers: u64,
    from_resolver: u64,
    lookups_ok: usize,
    /// The other client's datagrams: sent, and received.
    other_sent: u64,
    other_got: u64,
    /// The reflection rule's (matched, dropped), with a daemon.
    rule: Option<(u64, u64)>,
}

fn phase(label: &str, policy: Option<&str>) -> Phase {
    let mut s = Scenario::new("rlrf");
    let (a, b) = (s.pair.a().clone(), s.pair.b().clone());
    let net = s.pair.index();
    let reflectors: Vec<Ipv4Addr> = (0..REFLECTORS)
        .map(|i| Ipv4Addr::new(198, 18, net, 201 + i))
        .collect();
    // The host's resolver is a reflector too.
    let resolver = reflectors[0];
    for r in &reflectors {
        add_address(&s.client, &a.name, &format!("{r}/24"));
    }
    let dns = Dnsmasq::start(
        &s.client,
        &reflectors
            .iter()
            .map(|&r| IpAddr::V4(r))
            .collect::<Vec<_>>(),
    );
    if let Some(p) = policy {
        s.start(&p.replace("{resolver}", &resolver.to_string()));
    }
    let before = policy.map(|_| s.stats());
    let victim = s.sink(VICTIM_PORT);
    let other = s.sink(OTHER_PORT);
    // The attacker's queries, spoofed from the host, round-robin over the reflectors.
    let queries: Vec<Vec<u8>> = (0..QPS)
        .map(|i| {
            let r = reflectors[(i % REFLECTORS as u64) as usize];
            Frame::new(b.mac, a.mac)
                .ipv4(b.ipv4, r)
                .udp(VICTIM_PORT, 53)
                .payload(&dns::query(i as u16, BIG))
                .build()
        })
        .collect();
    let ordinary = s.udp4(a.ipv4, OTHER_PORT);
    let mut attacker = ratelimit_tests::sender::PacketSocket::new(&s.server, b.ifindex);
    let mut client = s.sender();
    let server_dns = SocketAddr::new(IpAddr::V4(resolver), 53);
    align_to_window(Duration::from_secs(1));
    let (sent, lookups_ok, other_sent) = std::thread::scope(|sc| {
        let flood = sc.spawn(|| {
            attacker
                .send_rate(|i| &queries[(i % QPS) as usize], QPS, FLOOD)
                .sent
        });
        let lookups = sc.spawn(|| {
            s.server.enter(|| {
                (0..LOOKUPS)
                    .filter(|_| {
                        let ok = dns::lookup(server_dns, BIG, Duration::from_secs(1)).is_ok();
                        std::thread::sleep(FLOOD / LOOKUPS as u32);
                        ok
                    })
                    .count()
            })
        });
        let others = client
            .send_rate(
                |_| &ordinary,
                OTHER * 1_000_000_000 / FLOOD.as_nanos() as u64,
                FLOOD,
            )
            .sent;
        (flood.join().unwrap(), lookups.join().unwrap(), others)
    });
    victim.wait_quiet(Duration::from_millis(500));
    other.wait_total(other_sent, Duration::from_secs(5));
    let got = victim.stop();
    let (answers, from_resolver) = (got.total, got.from(IpAddr::V4(resolver)));
    let other_got = other.stop().total;
    let rule = before.map(|before| {
        let st = s.stats();
        let d =
            |c| rule_counter(&st, "udp-reflection", c) - rule_counter(&before, "udp-reflection", c);
        (d("matched"), d("dropped"))
    });
    let p = Phase {
        queries: sent,
        answers,
        from_resolver,
        lookups_ok,
        other_sent,
        other_got,
        rule,
    };
    println!("{label}: {p:?}");
    drop(dns);
    p
}

#[test]
fn dns_reflection_is_held_to_the_rules_threshold_and_the_hosts_own_lookups_succeed() {
    kernel_test!();
    let none = phase("no rule", None);
    let ours = phase("the reflection rule", Some(&rule_template()));
    let default = phase("the embedded default", Some(&default_template()));

    for p in [&none, &ours, &default] {
        assert!(p.queries >= QPS * FLOOD.as_secs() * 9 / 10, "{p:?}");
        assert_eq!(
            p.lookups_ok, LOOKUPS,
            "every lookup of the host's own: {p:?}"
        );
        assert_eq!(
            p.other_got, p.other_sent,
            "the other client loses nothing: {p:?}"
        );
    }
    // Without a rule the flood reaches the socket: nearly every query was answered.
    assert!(none.answers >= none.queries * 95 / 100, "{none:?}");
    // With the rule: the other reflectors' answers are held to the threshold each second of
    // the flood, +-5% (a second's answers may straddle a window's edge); the resolver's pass,
    // excepted (an eighth of the flood: it is one of the reflectors).
    let reflected = ours.answers - ours.from_resolver;
    let want = THRESHOLD * FLOOD.as_secs();
    assert!(
        reflected.abs_diff(want) <= want / 20,
        "{reflected} reflected answers reached the socket, the threshold allows {want} (+-5%): \
         {ours:?}"
    );
    let (matched, dropped) = ours.rule.unwrap();
    assert_eq!(
        matched - dropped,
        reflected,
        "what the rule admitted reached the socket"
    );
    assert!(matched >= ours.queries * 7 / 8 * 95 / 100, "{ours:?}");
    assert!(
        ours.from_resolver >= ours.queries / 8 * 95 / 100,
        "{ours:?}"
    );
    // The default policy's budget (20,000 a second) is above this lab's flood: every answer
    // but the resolver's is matched, and passes.
    let (matched, dropped) = default.rule.unwrap();
    assert_eq!(
        (matched, dropped),
        (default.answers - default.from_resolver, 0),
        "{default:?}"
    );
}

fn rule_template() -> String {
    rule(Ipv4Addr::UNSPECIFIED).replace("0.0.0.0", "{resolver}")
}

fn default_template() -> String {
    default_policy(Ipv4Addr::new(198, 18, 250, 53)).replace("198.18.250.53", "{resolver}")
}
