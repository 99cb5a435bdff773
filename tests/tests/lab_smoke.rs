//! Smoke test of the lab itself, with no daemon: if these counts are not
//! exact, no rate-limiter test built on the lab can be trusted.
//!
//! Client namespace --veth--> protected namespace; crafted frames from a real
//! and from spoofed sources must arrive exactly once each at the tap (after
//! XDP; no program attached here) and at a UDP socket (after the stack).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use ratelimit_tests as lab;
use ratelimit_tests::kernel_test;

const PORT: u16 = 9999;
const NON_IP_ETHERTYPE: u16 = 0x88b5;

/// Everything a smoke test owns, dropped in reverse order (pair, then
/// namespaces) so teardown can be checked afterwards.
struct Wire {
    client: lab::NetNs,
    server: lab::NetNs,
    pair: lab::VethPair,
}

fn wire() -> Wire {
    let client = lab::NetNs::new("rlsm-c");
    let server = lab::NetNs::new("rlsm-s");
    let pair = lab::VethPair::new(&client, &server);
    lab::disable_rp_filter(&server, &pair.b().name);
    Wire {
        client,
        server,
        pair,
    }
}

/// Drops the lab and checks that its namespaces are really gone.
fn teardown(w: Wire) {
    let names = [w.client.name().to_string(), w.server.name().to_string()];
    let Wire {
        client,
        server,
        pair,
    } = w;
    drop(pair);
    drop(client);
    drop(server);
    let left = lab::netns::list_netns();
    for n in &names {
        assert!(!left.contains(n), "namespace {n} still listed: {left:?}");
    }
}

fn assert_exact(what: &str, counts: &lab::Counts, sources: &[IpAddr], per_source: u64) {
    for src in sources {
        assert_eq!(
            counts.from(*src),
            per_source,
            "{what}: frames from {src}; all counts: {counts:?}"
        );
    }
    assert_eq!(
        counts.socket_drops, 0,
        "{what} dropped at its socket: {counts:?}"
    );
}

#[test]
fn ipv4_real_and_spoofed_sources_arrive_exactly() {
    kernel_test!();
    let w = wire();
    let (a, b) = (w.pair.a().clone(), w.pair.b().clone());
    let tap = lab::Tap::new(&w.server, b.ifindex);
    let sink = lab::UdpSink::new(&w.server, PORT);
    let mut tx = lab::PacketSocket::new(&w.client, a.ifindex);

    let sources = [
        IpAddr::V4(a.ipv4),
        IpAddr::V4(Ipv4Addr::new(198, 19, 1, 1)),
        IpAddr::V4(Ipv4Addr::new(198, 19, 200, 7)),
    ];
    let frame = |src: IpAddr| {
        let IpAddr::V4(src) = src else { unreachable!() };
        lab::Frame::new(a.mac, b.mac)
            .ipv4(src, b.ipv4)
            .udp(40_000, PORT)
            .payload(b"lab smoke v4")
            .build()
    };
    // Interleaved, so per-source counts also prove nothing is merged.
    let frames: Vec<Vec<u8>> = (0..100)
        .flat_map(|_| sources.iter().map(|s| frame(*s)))
        .collect();
    let stats = tx.send_n(&frames, 300, None);
    assert_eq!(stats.sent, 300);
    let non_ip = lab::Frame::new(a.mac, b.mac)
        .ethertype_raw(NON_IP_ETHERTYPE)
        .payload(b"not ip")
        .pad_to(60)
        .build();
    let stats = tx.send_n(std::iter::repeat(&non_ip), 20, None);
    assert_eq!(stats.sent, 20);
    assert_eq!(tx.sent(), 320);

    tap.wait_quiet(Duration::from_millis(300));
    sink.wait_quiet(Duration::from_millis(300));
    let tapped = tap.stop();
    let delivered = sink.stop();
    println!(
        "tap: {tapped:?}\nudp: {delivered:?}\nsend retries: {}",
        tx.retries()
    );

    assert_exact("tap", &tapped, &sources, 100);
    assert_eq!(tapped.non_ip, 20, "tap non-IP frames: {tapped:?}");
    assert_exact("udp sink", &delivered, &sources, 100);
    assert_eq!(delivered.total, 300, "udp sink: {delivered:?}");
    drop(tx);
    teardown(w);
}

#[test]
fn ipv6_real_and_spoofed_sources_arrive_exactly() {
    kernel_test!();
    let w = wire();
    let (a, b) = (w.pair.a().clone(), w.pair.b().clone());
    let tap = lab::Tap::new(&w.server, b.ifindex);
    let sink = lab::UdpSink::new(&w.server, PORT);
    let mut tx = lab::PacketSocket::new(&w.client, a.ifindex);

    let sources = [
        IpAddr::V6(a.ipv6),
        IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0xffff, 0, 0, 0, 0, 0x77)),
    ];
    let frames: Vec<Vec<u8>> = (0..30)
        .flat_map(|_| {
            sources.iter().map(|s| {
                let IpAddr::V6(src) = *s else { unreachable!() };
                lab::Frame::new(a.mac, b.mac)
                    .ipv6(src, b.ipv6)
                    .udp(40_001, PORT)
                    .payload(b"lab smoke v6")
                    .build()
            })
        })
        .collect();
    let stats = tx.send_n(&frames, 60, None);
    assert_eq!(stats.sent, 60);

    tap.wait_quiet(Duration::from_millis(300));
    sink.wait_quiet(Duration::from_millis(300));
    let tapped = tap.stop();
    let delivered = sink.stop();
    println!(
        "tap: {tapped:?}\nudp: {delivered:?}\nsend retries: {}",
        tx.retries()
    );

    assert_exact("tap", &tapped, &sources, 30);
    assert_exact("udp sink", &delivered, &sources, 30);
    assert_eq!(delivered.total, 60, "udp sink: {delivered:?}");
    drop(tx);
    teardown(w);
}

#[test]
fn paced_and_rate_sends_are_bounded_and_counted() {
    kernel_test!();
    let w = wire();
    let (a, b) = (w.pair.a().clone(), w.pair.b().clone());
    let tap = lab::Tap::new(&w.server, b.ifindex);
    let mut tx = lab::PacketSocket::new(&w.client, a.ifindex);
    let src = Ipv4Addr::new(198, 19, 3, 3);
    let frame = lab::Frame::new(a.mac, b.mac)
        .ipv4(src, b.ipv4)
        .udp(40_002, PORT)
        .build();

    let paced = tx.send_n(
        std::iter::repeat(&frame),
        50,
        Some(Duration::from_millis(2)),
    );
    assert_eq!(paced.sent, 50);
    assert!(
        paced.elapsed >= Duration::from_millis(98),
        "pacing ignored: {paced:?}"
    );
    // 2000 pps for 0.25 s: at most 500 frames, whatever the machine's speed.
    let rate = tx.send_rate(|_| &frame, 2_000, Duration::from_millis(250));
    assert!(
        rate.sent <= 500 && rate.sent >= 400,
        "send_rate count out of bounds: {rate:?}"
    );

    tap.wait_quiet(Duration::from_millis(300));
    let tapped = tap.stop();
    assert_eq!(tapped.from(IpAddr::V4(src)), 50 + rate.sent, "{tapped:?}");
    assert_eq!(tapped.socket_drops, 0);
    drop(tx);
    teardown(w);
}

#[test]
fn namespace_helpers_work() {
    kernel_test!();
    let ns = lab::NetNs::new("rlsm-h");
    // enter(): a thread in the namespace sees only its lo (/proc/self/net
    // would show the main thread's namespace, hence thread-self).
    let links = ns.enter(|| std::fs::read_to_string("/proc/thread-self/net/dev").expect("net/dev"));
    assert!(links.contains("lo:"), "{links}");
    assert!(
        !links.contains("eth0:"),
        "enter() did not switch namespace: {links}"
    );
    // command_in(): the child runs in the namespace but keeps our mounts.
    let out = ns
        .command_in("ip")
        .args(["-o", "link", "show"])
        .output()
        .expect("ip link");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("lo:") && !text.contains("eth0"),
        "{text}"
    );
    ns.sysctl("net.ipv4.conf.all.rp_filter", "0");
    let name = ns.name().to_string();
    drop(ns);
    assert!(!lab::netns::list_netns().contains(&name));
}

#[test]
fn burst_with_backpressure_is_counted_exactly() {
    kernel_test!();
    let w = wire();
    let (a, b) = (w.pair.a().clone(), w.pair.b().clone());
    let tap = lab::Tap::new(&w.server, b.ifindex);
    let sink = lab::UdpSink::new(&w.server, PORT);
    let mut tx = lab::PacketSocket::new(&w.client, a.ifindex);
    let src = IpAddr::V4(Ipv4Addr::new(198, 19, 4, 4));
    let IpAddr::V4(src4) = src else {
        unreachable!()
    };
    let frame = lab::Frame::new(a.mac, b.mac)
        .ipv4(src4, b.ipv4)
        .udp(40_003, PORT)
        .build();
    // Unpaced and far more than the 1000-frame receive backlog: any ENOBUFS
    // must be retried, never lost or double counted.
    const N: u64 = 20_000;
    let stats = tx.send_n(std::iter::repeat(&frame), N, None);
    assert_eq!(stats.sent, N);
    tap.wait_quiet(Duration::from_millis(300));
    sink.wait_quiet(Duration::from_millis(300));
    let tapped = tap.stop();
    let delivered = sink.stop();
    let ring = b.ethtool_stats();
    println!("burst: {stats:?}\ntap: {tapped:?}\nudp: {delivered:?}\nethtool -S: {ring:?}");
    assert_exact("tap", &tapped, &[src], N);
    assert_exact("udp sink", &delivered, &[src], N);
    // The XDP counters tests use when the stack cannot deliver (VLAN).
    assert_eq!(ring.get("rx_queue_0_xdp_drops"), Some(&0), "{ring:?}");
    drop(tx);
    teardown(w);
}

#[test]
fn two_pinned_senders_on_a_two_queue_pair_are_counted_exactly() {
    kernel_test!();
    let client = lab::NetNs::new("rlsm-c");
    let server = lab::NetNs::new("rlsm-s");
    let pair = lab::VethPair::with_queues(&client, &server, 2);
    lab::disable_rp_filter(&server, &pair.b().name);
    let (a, b) = (pair.a().clone(), pair.b().clone());
    // Queue i is used by CPU i, so each pinned sender feeds its own queue.
    a.set_xps(0, 0b01);
    a.set_xps(1, 0b10);
    let tap = lab::Tap::new(&server, b.ifindex);
    let cpus = lab::sender::online_cpus().min(2);
    const N: u64 = 5_000;
    let sources: Vec<Ipv4Addr> = (0..2u8).map(|i| Ipv4Addr::new(198, 19, 9, i + 1)).collect();
    let sent: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = sources
            .iter()
            .enumerate()
            .map(|(i, src)| {
                let mut tx = lab::PacketSocket::new(&client, a.ifindex);
                let frame = lab::Frame::new(a.mac, b.mac)
                    .ipv4(*src, b.ipv4)
                    .udp(40_010, PORT)
                    .build();
                s.spawn(move || {
                    lab::sender::pin_current_thread(i % cpus).expect("pinning a sender");
                    tx.send_n(std::iter::repeat(&frame), N, None).sent
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("sender"))
            .collect()
    });
    assert_eq!(sent, vec![N, N]);
    tap.wait_quiet(Duration::from_millis(300));
    let tapped = tap.stop();
    let ring = b.ethtool_stats();
    println!("tap: {tapped:?}\nethtool -S: {ring:?}");
    assert!(
        ring.contains_key("rx_queue_1_drops"),
        "no second rx queue: {ring:?}"
    );
    let srcs: Vec<IpAddr> = sources.iter().map(|s| IpAddr::V4(*s)).collect();
    assert_exact("tap", &tapped, &srcs, N);
    teardown(Wire {
        client,
        server,
        pair,
    });
}
