//! The data plane's semantics with real packets through a veth, judged by an independent UDP
//! receiver and cross-checked against the daemon's counters: throttle accuracy, the
//! sliding-window long-run rate, token bucket bursts, bans and their expiry, preview,
//! exceed_action = pass, soft limits, overrides, IPv6 /64 aggregation, and the key = all
//! backstop.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use ratelimit_tests::{
    kernel_test,
    scenario::{Scenario, reason, rule_counter, verdict},
};

const PORT: u16 = 9000;

fn ip4(c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(198, 19, c, d))
}

/// Loss share in percent.
fn loss(sent: u64, got: u64) -> f64 {
    100.0 * (sent - got) as f64 / sent as f64
}

#[test]
fn throttle_loses_the_excess_share_and_spares_clients_under_the_threshold() {
    kernel_test!();
    let mut s = Scenario::new("rlt");
    s.start(
        r#"
[[rule]]
name = "udp"
match = { protocol = "udp", dst_ports = ["9000"] }
threshold = { count = 1000, interval = "1s" }
"#,
    );
    let sink = s.sink(PORT);
    let (heavy, light) = (ip4(1, 1), ip4(1, 2));
    // 1.25x the threshold for 4 intervals, and 0.8x beside it.
    ratelimit_tests::scenario::align_to_window(Duration::from_secs(1));
    let a = s.blast(s.udp(heavy, PORT), 1250, Duration::from_secs(4), None);
    let b = s.blast(s.udp(light, PORT), 800, Duration::from_secs(4), None);
    let (a, b) = (a.join().unwrap(), b.join().unwrap());
    let st = s.settle(&sink, "udp", a.sent + b.sent);
    let got = sink.stop();

    let heavy_loss = loss(a.sent, got.from(heavy));
    println!(
        "heavy: sent {} got {} loss {heavy_loss:.2}%; light: sent {} got {}",
        a.sent,
        got.from(heavy),
        b.sent,
        got.from(light)
    );
    assert!(
        (heavy_loss - 20.0).abs() <= 2.0,
        "1.25x the threshold must lose 20% +- 2 points, lost {heavy_loss:.2}%"
    );
    assert_eq!(
        got.from(light),
        b.sent,
        "a client under its threshold loses nothing"
    );
    // The daemon's counters agree with the receiver exactly.
    assert_eq!(
        rule_counter(&st, "udp", "dropped"),
        a.sent - got.from(heavy)
    );
    assert_eq!(rule_counter(&st, "udp", "matched"), a.sent + b.sent);
    assert_eq!(verdict(&st, "drop_rule"), a.sent - got.from(heavy));

    // The throttled client is an offender; the light one is not throttled.
    let off = s.daemon().cli_json(&["offenders"]);
    let off = off.as_array().unwrap();
    assert!(
        off.iter()
            .any(|c| c["client"] == "198.19.1.1/32" && c["throttled"] == true),
        "{off:?}"
    );
    assert!(
        !off.iter()
            .any(|c| c["client"] == "198.19.1.2/32" && c["throttled"] == true),
        "{off:?}"
    );
    let ev = s.events();
    assert!(
        ev.iter()
            .any(|e| e["event"] == "throttle_start" && e["client"] == "198.19.1.1/32"),
        "{ev:?}"
    );
}

#[test]
fn sliding_window_long_run_rate_is_the_threshold() {
    kernel_test!();
    let mut s = Scenario::new("rlw");
    s.start(
        r#"
[[rule]]
name = "udp"
match = { protocol = "udp" }
threshold = { count = 500, interval = "1s" }
"#,
    );
    let sink = s.sink(PORT);
    let src = ip4(2, 1);
    // Twice the threshold for 6 s: after the first interval the admitted rate is the threshold.
    ratelimit_tests::scenario::align_to_window(Duration::from_secs(1));
    let a = s
        .blast(s.udp(src, PORT), 1000, Duration::from_secs(6), None)
        .join()
        .unwrap();
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop().from(src);
    let expect = 500.0 * a.elapsed.as_secs_f64();
    let err = 100.0 * (got as f64 - expect) / expect;
    println!(
        "sent {} in {:?}, admitted {got}, expected {expect:.0} ({err:+.2}%)",
        a.sent, a.elapsed
    );
    assert!(
        err.abs() <= 2.0,
        "long-run admitted rate must be within 2% of threshold/interval, off by {err:.2}%"
    );
}

#[test]
fn token_bucket_admits_the_burst_then_the_rate() {
    kernel_test!();
    let mut s = Scenario::new("rlb");
    s.start(
        r#"
[[rule]]
name = "tb"
match = { protocol = "udp" }
threshold = { count = 100, interval = "1s" }
algorithm = "token_bucket"
burst = 50
"#,
    );
    let sink = s.sink(PORT);
    let src = ip4(3, 1);
    let frame = s.udp(src, PORT);
    let mut tx = s.sender();
    // 300 back to back: the bucket holds 50, refilling 1 per 10 ms.
    let t = std::time::Instant::now();
    tx.send_n(std::iter::repeat(&frame), 300, None);
    let burst_time = t.elapsed();
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.snapshot().from(src);
    let refill = (burst_time.as_secs_f64() * 100.0).ceil() as u64;
    println!("burst of 300 in {burst_time:?}: admitted {got} (bucket 50 + refill <= {refill})");
    assert!(got >= 50 && got <= 50 + refill + 1, "admitted {got}");
    // Then one per 10 ms is within the rate: 1 s at 90 pps loses nothing.
    std::thread::sleep(Duration::from_millis(600));
    let before = sink.snapshot().from(src);
    let st = tx.send_rate(|_| &frame, 90, Duration::from_secs(1));
    sink.wait_quiet(Duration::from_millis(300));
    assert_eq!(
        sink.stop().from(src) - before,
        st.sent,
        "under the rate after the burst"
    );
}

#[test]
fn rate_based_ban_drops_everything_from_the_client_then_expires() {
    kernel_test!();
    let mut s = Scenario::new("rln");
    s.start(
        r#"
[[rule]]
name = "ban"
match = { protocol = "udp", dst_ports = ["9000"] }
action = "rate_based_ban"
threshold = { count = 100, interval = "1s" }
ban_threshold = { count = 150, interval = "1s" }
ban_duration = "2s"
"#,
    );
    let sink = s.sink(PORT);
    let other = s.sink(PORT + 1);
    let (bad, good) = (ip4(4, 1), ip4(4, 2));
    let mut tx = s.sender();
    // 200 in well under a second: 100 admitted, the rest throttled, banned past 150. All in
    // one 1 s window (a sliding window entered mid-burst would admit the new window's share;
    // 50 ms in, the coarse clock has left the last window too).
    ratelimit_tests::scenario::align_to_window(Duration::from_secs(1));
    std::thread::sleep(Duration::from_millis(50));
    tx.send_n(
        std::iter::repeat(s.udp(bad, PORT)),
        200,
        Some(Duration::from_millis(1)),
    );
    tx.send_n(
        std::iter::repeat(s.udp(good, PORT)),
        50,
        Some(Duration::from_millis(1)),
    );
    sink.wait_quiet(Duration::from_millis(200));
    assert_eq!(
        sink.snapshot().from(bad),
        100,
        "admitted up to the threshold"
    );
    assert_eq!(sink.snapshot().from(good), 50, "others unaffected");
    let bans = s.daemon().cli_json(&["bans"]);
    let ban = bans
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["cidr"] == "198.19.4.1/32")
        .unwrap_or_else(|| panic!("{bans:?}"));
    assert_eq!(ban["rule"], "ban");
    // During the ban every packet from the client is dropped, whatever port or protocol.
    tx.send_n(std::iter::repeat(s.udp(bad, PORT + 1)), 20, None);
    let icmp = s
        .builder()
        .ipv4(Ipv4Addr::new(198, 19, 4, 1), s.pair.b().ipv4)
        .icmp_echo(1, 1)
        .build();
    tx.send_n(std::iter::repeat(&icmp), 10, None);
    other.wait_quiet(Duration::from_millis(200));
    assert_eq!(other.snapshot().from(bad), 0, "banned on every port");
    let st = s.stats();
    // Packet k of the flood has an offered count of k: 101..=150 throttled, 151 crosses the
    // ban threshold (dropped by the rule, ban issued), 152..=200 meet the ban; then 30 more.
    assert_eq!(verdict(&st, "drop_rule"), 51);
    assert_eq!(verdict(&st, "drop_ban"), 49 + 30);
    assert_eq!(rule_counter(&st, "ban", "bans"), 1);
    assert_eq!(reason(&st, "bans_issued"), 1);
    // After ban_duration the kernel lifts it, with no daemon involvement, and the client
    // starts clean.
    std::thread::sleep(Duration::from_millis(2300));
    tx.send_n(std::iter::repeat(s.udp(bad, PORT + 1)), 20, None);
    tx.send_n(
        std::iter::repeat(s.udp(bad, PORT)),
        80,
        Some(Duration::from_millis(1)),
    );
    sink.wait_quiet(Duration::from_millis(300));
    other.wait_quiet(Duration::from_millis(100));
    assert_eq!(other.stop().from(bad), 20);
    assert_eq!(
        sink.stop().from(bad),
        180,
        "a fresh allowance after the ban"
    );
    std::thread::sleep(Duration::from_millis(300));
    let ev = s.events();
    let kinds: Vec<&str> = ev
        .iter()
        .filter(|e| e["client"] == "198.19.4.1/32")
        .filter_map(|e| e["event"].as_str())
        .collect();
    assert!(
        kinds.contains(&"ban") && kinds.contains(&"unban"),
        "{kinds:?}"
    );
    let b = ev.iter().find(|e| e["event"] == "ban").unwrap();
    assert!(
        b["ban_expires"].is_string() && b["rule"] == "ban" && b["threshold"] == 150,
        "{b}"
    );
}

#[test]
fn preview_and_exceed_pass_count_but_never_drop() {
    kernel_test!();
    let mut s = Scenario::new("rlp");
    s.start(
        r#"
[[rule]]
name = "preview"
match = { protocol = "udp", dst_ports = ["9000"] }
threshold = { count = 100, interval = "1h" }
algorithm = "fixed_window"
preview = true

[[rule]]
name = "pass"
match = { protocol = "udp", dst_ports = ["9001"] }
threshold = { count = 100, interval = "1h" }
algorithm = "fixed_window"
exceed_action = "pass"
"#,
    );
    let (a, b) = (s.sink(PORT), s.sink(PORT + 1));
    let src = ip4(5, 1);
    let mut tx = s.sender();
    tx.send_n(std::iter::repeat(s.udp(src, PORT)), 250, None);
    tx.send_n(std::iter::repeat(s.udp(src, PORT + 1)), 250, None);
    a.wait_quiet(Duration::from_millis(300));
    b.wait_quiet(Duration::from_millis(100));
    assert_eq!(a.stop().from(src), 250);
    assert_eq!(b.stop().from(src), 250);
    let st = s.stats();
    assert_eq!(rule_counter(&st, "preview", "would_drop"), 150);
    assert_eq!(rule_counter(&st, "preview", "admitted"), 100);
    assert_eq!(rule_counter(&st, "pass", "exceed_passed"), 150);
    assert_eq!(reason(&st, "preview_would_drop"), 150);
    assert_eq!(reason(&st, "exceed_pass"), 150);
    assert_eq!(verdict(&st, "drop_rule"), 0);
}

#[test]
fn soft_limit_reports_once_per_episode_without_dropping() {
    kernel_test!();
    let mut s = Scenario::new("rls");
    s.start(
        r#"
[[rule]]
name = "soft"
match = { protocol = "udp" }
threshold = { count = 100, interval = "1h" }
algorithm = "fixed_window"
soft_limit = 0.5
"#,
    );
    let sink = s.sink(PORT);
    let src = ip4(6, 1);
    let mut tx = s.sender();
    tx.send_n(std::iter::repeat(s.udp(src, PORT)), 80, None);
    sink.wait_total(80, Duration::from_secs(10));
    sink.wait_quiet(Duration::from_millis(300));
    assert_eq!(sink.stop().from(src), 80);
    std::thread::sleep(Duration::from_millis(300));
    let soft: Vec<_> = s
        .events()
        .into_iter()
        .filter(|e| e["event"] == "soft_limit")
        .collect();
    assert_eq!(soft.len(), 1, "{soft:?}");
    assert_eq!(
        soft[0]["count"], 50,
        "reported when usage reached 50% of 100"
    );
    let off = s.daemon().cli_json(&["offenders"]);
    let c = &off.as_array().unwrap()[0];
    assert_eq!(c["client"], "198.19.6.1/32");
    assert_eq!(c["above_soft_limit"], true);
    assert_eq!(c["throttled"], false);
    assert_eq!(c["usage"], 80);
}

#[test]
fn cidr_override_and_ipv6_prefix_aggregation() {
    kernel_test!();
    let mut s = Scenario::new("rlo");
    s.start(
        r#"
[[rule]]
name = "per64"
match = { protocol = "udp" }
threshold = { count = 50, interval = "1h" }
algorithm = "fixed_window"

[[rule.override]]
cidr = "198.19.7.2/32"
threshold = { count = 200, interval = "1h" }

[[rule.override]]
cidr = "2001:db8:99::/48"
threshold = { count = 70, interval = "1h" }
"#,
    );
    let sink = s.sink(PORT);
    let mut tx = s.sender();
    let send = |tx: &mut ratelimit_tests::PacketSocket, src: IpAddr, n: u64| {
        tx.send_n(std::iter::repeat(s.udp(src, PORT)), n, None);
    };
    let v6 = |x: &str| IpAddr::V6(x.parse::<Ipv6Addr>().unwrap());
    send(&mut tx, ip4(7, 1), 150);
    send(&mut tx, ip4(7, 2), 150);
    // Two hosts of one /64 share its bucket; another /64 has its own; an override by /48.
    send(&mut tx, v6("2001:db8:77::1"), 40);
    send(&mut tx, v6("2001:db8:77::2"), 40);
    send(&mut tx, v6("2001:db8:78::1"), 40);
    send(&mut tx, v6("2001:db8:99:1::1"), 100);
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop();
    assert_eq!(got.from(ip4(7, 1)), 50, "rule threshold");
    assert_eq!(got.from(ip4(7, 2)), 150, "override raises it");
    assert_eq!(
        got.from(v6("2001:db8:77::1")) + got.from(v6("2001:db8:77::2")),
        50,
        "one /64, one bucket"
    );
    assert_eq!(got.from(v6("2001:db8:77::1")), 40);
    assert_eq!(got.from(v6("2001:db8:78::1")), 40, "another /64");
    assert_eq!(
        got.from(v6("2001:db8:99:1::1")),
        70,
        "IPv6 override, most specific prefix"
    );
    let top = s.daemon().cli_json(&["top", "-n", "10"]);
    assert!(
        top.as_array()
            .unwrap()
            .iter()
            .any(|c| c["client"] == "2001:db8:77::/64" && c["packets"] == 80),
        "{top}"
    );
}

#[test]
fn key_all_is_one_bucket_for_every_source() {
    kernel_test!();
    let mut s = Scenario::new("rla");
    s.start(
        r#"
[[rule]]
name = "backstop"
match = { protocol = "udp" }
key = "all"
threshold = { count = 300, interval = "1h" }
algorithm = "fixed_window"
"#,
    );
    let sink = s.sink(PORT);
    let mut tx = s.sender();
    let frames: Vec<Vec<u8>> = (0..1000u32)
        .map(|i| s.udp(IpAddr::V4(Ipv4Addr::from(0xc6_14_00_00 | i)), PORT))
        .collect();
    tx.send_n(frames.iter(), 1000, None);
    sink.wait_total(300, Duration::from_secs(10));
    sink.wait_quiet(Duration::from_millis(300));
    assert_eq!(sink.stop().total, 300);
    let st = s.stats();
    assert_eq!(rule_counter(&st, "backstop", "dropped"), 700);
    assert_eq!(reason(&st, "state_created"), 1, "one state for all sources");
}

#[test]
fn byte_thresholds_count_frame_lengths() {
    kernel_test!();
    let mut s = Scenario::new("rly2");
    // 66,000 bytes per hour (above the 64 KiB minimum): 1,100 60-byte frames, or 550
    // 120-byte frames.
    s.start(
        r#"
[[rule]]
name = "bytes"
match = { protocol = "udp" }
threshold = { bytes = "66KB", interval = "1h" }
algorithm = "fixed_window"
"#,
    );
    let sink = s.sink(PORT);
    let mut tx = s.sender();
    let small = s.udp(ip4(8, 1), PORT);
    assert_eq!(small.len(), 60);
    let big = s
        .builder()
        .ipv4(Ipv4Addr::new(198, 19, 8, 2), s.pair.b().ipv4)
        .udp(40000, PORT)
        .pad_to(120)
        .build();
    tx.send_n(std::iter::repeat(&small), 1200, None);
    tx.send_n(std::iter::repeat(&big), 600, None);
    sink.wait_total(1100 + 550, Duration::from_secs(10));
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop();
    assert_eq!(got.from(ip4(8, 1)), 1100);
    assert_eq!(got.from(ip4(8, 2)), 550);
    let st = s.stats();
    assert_eq!(st.rules[0].get("admitted").bytes, 132_000);
}

#[test]
fn an_override_raises_the_ban_threshold_with_the_threshold() {
    kernel_test!();
    let mut s = Scenario::new("rlz");
    s.start(
        r#"
[[rule]]
name = "ban"
match = { protocol = "udp" }
action = "rate_based_ban"
threshold = { count = 50, interval = "1h" }
algorithm = "fixed_window"
ban_duration = "1h"

[[rule.override]]
cidr = "198.19.9.2/32"
threshold = { count = 200, interval = "1h" }
"#,
    );
    let sink = s.sink(PORT);
    let mut tx = s.sender();
    tx.send_n(std::iter::repeat(s.udp(ip4(9, 1), PORT)), 80, None);
    tx.send_n(std::iter::repeat(s.udp(ip4(9, 2), PORT)), 150, None);
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop();
    assert_eq!(
        got.from(ip4(9, 1)),
        50,
        "the rule's client: threshold, then banned past it"
    );
    assert_eq!(
        got.from(ip4(9, 2)),
        150,
        "the override's client is neither throttled nor banned under 200"
    );
    let bans = s.daemon().cli_json(&["bans"]);
    let cidrs: Vec<&str> = bans
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| b["cidr"].as_str())
        .collect();
    assert_eq!(cidrs, ["198.19.9.1/32"]);
}

/// `key = "dst"`: one budget per protected address. A flood of 1,000 sources to one address
/// gets exactly its threshold through; the other address, of either family, keeps its
/// budget whole; `top` names each state by its destination.
#[test]
fn key_dst_gives_each_destination_its_own_budget() {
    kernel_test!();
    let mut s = Scenario::new("rld");
    s.start(
        r#"
[[rule]]
name = "per-service"
match = { protocol = "udp" }
key = "dst"
threshold = { count = 300, interval = "1h" }
algorithm = "fixed_window"
"#,
    );
    let b = s.pair.b().clone();
    let second4 = Ipv4Addr::new(
        b.ipv4.octets()[0],
        b.ipv4.octets()[1],
        b.ipv4.octets()[2],
        3,
    );
    ratelimit_tests::link::add_address(&s.server, &b.name, &format!("{second4}/24"));
    let sink = s.sink(PORT);
    let mut tx = s.sender();
    let to = |src: IpAddr, dst: IpAddr| {
        let f = match (src, dst) {
            (IpAddr::V4(a), IpAddr::V4(d)) => s.builder().ipv4(a, d),
            (IpAddr::V6(a), IpAddr::V6(d)) => s.builder().ipv6(a, d),
            _ => unreachable!(),
        };
        f.udp(40000, PORT).pad_to(60).build()
    };
    // 1,000 sources flood the first address; 200 others send to the second, 100 over IPv6.
    let flood: Vec<Vec<u8>> = (0..1000u32)
        .map(|i| {
            to(
                IpAddr::V4(Ipv4Addr::from(0xc6_14_00_00 | i)),
                IpAddr::V4(b.ipv4),
            )
        })
        .collect();
    let other: Vec<Vec<u8>> = (0..200u32)
        .map(|i| {
            to(
                IpAddr::V4(Ipv4Addr::from(0xc6_15_00_00 | i)),
                IpAddr::V4(second4),
            )
        })
        .collect();
    let v6: Vec<Vec<u8>> = (0..100u16)
        .map(|i| {
            let src = Ipv6Addr::new(0x2001, 0xdb8, 0x15, 0, 0, 0, 0, i + 1);
            to(IpAddr::V6(src), IpAddr::V6(b.ipv6))
        })
        .collect();
    tx.send_n(flood.iter(), 1000, None);
    tx.send_n(other.iter(), 200, None);
    tx.send_n(v6.iter(), 100, None);
    sink.wait_total(600, Duration::from_secs(10));
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop();
    let from = |lo: u32, n: u32| {
        (0..n)
            .map(|i| got.from(IpAddr::V4(Ipv4Addr::from(lo | i))))
            .sum::<u64>()
    };
    assert_eq!(
        from(0xc6_14_00_00, 1000),
        300,
        "the flooded address: its threshold"
    );
    assert_eq!(
        from(0xc6_15_00_00, 200),
        200,
        "the other address: its whole budget"
    );
    assert_eq!(got.total, 600, "and IPv6's address its own");
    let st = s.stats();
    assert_eq!(rule_counter(&st, "per-service", "dropped"), 700);
    assert_eq!(reason(&st, "state_created"), 3, "one state per destination");
    let top = s.daemon().cli_json(&["top", "-n", "10"]);
    let mut clients: Vec<(String, String, u64)> = top
        .as_array()
        .expect("top --json is a list")
        .iter()
        .map(|c| {
            (
                c["key"].as_str().unwrap().to_string(),
                c["client"].as_str().unwrap().to_string(),
                c["packets"].as_u64().unwrap(),
            )
        })
        .collect();
    clients.sort();
    let mut want = vec![
        ("fields".to_string(), format!("dst={}", b.ipv4), 1000),
        ("fields".to_string(), format!("dst={}", b.ipv6), 100),
        ("fields".to_string(), format!("dst={second4}"), 200),
    ];
    want.sort();
    assert_eq!(clients, want);
}

/// `key = ["ip", "dst_port"]`: a budget per client prefix and destination port, in both
/// families; the idle states of a short-memory rule are removed while the others stay.
#[test]
fn key_ip_and_dst_port_budgets_each_client_per_port_and_idle_states_go() {
    kernel_test!();
    let mut s = Scenario::new("rlk");
    s.start(&format!(
        r#"
[[rule]]
name = "per-client-port"
match = {{ protocol = "udp", dst_ports = ["{a}-{b}"] }}
key = ["ip", "dst_port"]
ipv4_prefix = 24
threshold = {{ count = 100, interval = "1h" }}
algorithm = "fixed_window"

[[rule]]
name = "short-memory"
match = {{ protocol = "udp", dst_ports = ["{c}"] }}
key = ["ip", "src_port"]
action = "rate_based_ban"
threshold = {{ count = 1000, interval = "1s" }}
ban_threshold = {{ count = 5, interval = "1s" }}
ban_duration = "1s"
"#,
        a = PORT,
        b = PORT + 1,
        c = PORT + 2,
    ));
    let b = s.pair.b().clone();
    let sink = s.sink(PORT);
    let mut tx = s.sender();
    let frame = |src: IpAddr, sport: u16, dport: u16| {
        let f = match src {
            IpAddr::V4(a) => s.builder().ipv4(a, b.ipv4),
            IpAddr::V6(a) => s.builder().ipv6(a, b.ipv6),
        };
        f.udp(sport, dport).pad_to(60).build()
    };
    let v4 = |net: u32, i: u32| IpAddr::V4(Ipv4Addr::from(net | i));
    // 300 frames from three sources of one /24, 50 from another /24, 150 from one IPv6 /64,
    // all to PORT; 100 more from the first /24 to PORT + 1; 40 sources to PORT + 2.
    let mut frames: Vec<Vec<u8>> = (0..300)
        .map(|i| frame(v4(0xc6_14_00_00, 1 + i % 3), 4000, PORT))
        .collect();
    frames.extend((0..50).map(|i| frame(v4(0xc6_15_00_00, 1 + i), 4000, PORT)));
    frames.extend((0..150u16).map(|i| {
        frame(
            IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0x15, 0, 0, 0, 0, i + 1)),
            4000,
            PORT,
        )
    }));
    frames.extend((0..100).map(|_| frame(v4(0xc6_14_00_00, 9), 4000, PORT + 1)));
    frames.extend((0..40).map(|i| frame(v4(0xc6_16_00_00, i + 1), 5000 + i as u16, PORT + 2)));
    // One of them banned for a second: 20 frames over the ban threshold of 5.
    frames.extend((0..20).map(|_| frame(v4(0xc6_16_00_00, 99), 6000, PORT + 2)));
    let n = frames.len() as u64;
    tx.send_n(frames.iter(), n, None);
    sink.wait_total(250, Duration::from_secs(10));
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop();
    let from = |lo: u32, n: u32| (0..n).map(|i| got.from(v4(lo, i))).sum::<u64>();
    assert_eq!(
        from(0xc6_14_00_00, 4),
        100,
        "one /24 to one port: its threshold"
    );
    assert_eq!(from(0xc6_15_00_00, 64), 50, "another /24: its whole budget");
    assert_eq!(got.total, 250, "and the IPv6 /64 its threshold");
    let st = s.stats();
    assert_eq!(
        rule_counter(&st, "per-client-port", "admitted"),
        350,
        "PORT + 1 has its own"
    );
    assert_eq!(rule_counter(&st, "per-client-port", "dropped"), 250);
    // The banned source's first 5 (its ban threshold), then its ban.
    assert_eq!(rule_counter(&st, "short-memory", "admitted"), 40 + 5);
    assert_eq!(rule_counter(&st, "short-memory", "bans"), 1);
    let states = |s: &Scenario| {
        let top = s.daemon().cli_json(&["top", "-n", "100"]);
        let mut v: Vec<(String, String)> = top
            .as_array()
            .expect("top --json is a list")
            .iter()
            .map(|c| {
                (
                    c["rule"].as_str().unwrap().to_string(),
                    c["client"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let first = states(&s);
    let mut want: Vec<(String, String)> = [
        "ip=198.20.0.0 dst_port=9000",
        "ip=198.20.0.0 dst_port=9001",
        "ip=198.21.0.0 dst_port=9000",
        "ip=2001:db8:15:: dst_port=9000",
    ]
    .iter()
    .map(|c| ("per-client-port".to_string(), c.to_string()))
    .collect();
    assert_eq!(first.len(), want.len() + 41, "{first:#?}");
    // The short-memory rule's states hold nothing two seconds after their last packet: gone
    // within a period of the reaper or two (bound: 20 s on a busy machine).
    let t0 = Instant::now();
    let mut now = first;
    while now.len() > want.len() && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(500));
        now = states(&s);
    }
    want.sort();
    assert_eq!(now, want, "after {:?}", t0.elapsed());
    // The ban ended in a state no packet reaches again: its `unban` came with the removal.
    let of_ban: Vec<String> = s
        .events()
        .into_iter()
        .filter(|e| e["rule"] == "short-memory")
        .map(|e| format!("{} {}", e["event"], e["client"]))
        .collect();
    let client = "\"ip=198.22.0.99 src_port=6000\"";
    assert_eq!(
        of_ban,
        [format!("\"ban\" {client}"), format!("\"unban\" {client}")]
    );
}
