//! Under attack: one client's packets processed on both CPUs at once must not get more than
//! its threshold, and a random-source flood must not cost established clients their state or
//! their allowance.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use aya::maps::{Map, MapData, PerCpuArray};
use ratelimit_common::stats::{Counter, rule as rc, rule_index};
use ratelimit_tests::{
    kernel_test,
    scenario::{Scenario, reason, rule_counter},
};

const PORT: u16 = 9000;

/// Per-CPU packet counts of one counter, straight from the pinned map.
fn per_cpu(s: &Scenario, index: u32) -> Vec<u64> {
    let data = MapData::from_pin(s.bpffs().join("RL_STATS")).expect("pinned stats map");
    let arr: PerCpuArray<MapData, Counter> =
        PerCpuArray::try_from(Map::PerCpuArray(data)).expect("per-cpu array");
    let mut v = vec![0u64; 0];
    for slot in 0..ratelimit_common::caps::MAX_IFACES {
        let vals = arr
            .get(&(slot * ratelimit_common::stats::PER_IFACE + index), 0)
            .expect("read");
        if v.is_empty() {
            v = vec![0; vals.len()];
        }
        for (acc, c) in v.iter_mut().zip(vals.iter()) {
            *acc += c.packets;
        }
    }
    v
}

#[test]
fn two_cpu_accuracy_one_client_on_both_cpus_gets_its_threshold_once() {
    kernel_test!();
    let cpus = ratelimit_tests::sender::online_cpus();
    assert!(
        cpus >= 2,
        "this test needs two CPUs, the machine has {cpus}"
    );
    let mut s = Scenario::with_queues("rl2", 2);
    // Steer the client's two tx queues to CPU 0 and CPU 1.
    s.pair.a().set_xps(0, 0b01);
    s.pair.a().set_xps(1, 0b10);
    s.start(
        r#"
[[rule]]
name = "udp"
match = { protocol = "udp" }
threshold = { count = 1000, interval = "1s" }
"#,
    );
    let sink = s.sink(PORT);
    let src = IpAddr::V4(Ipv4Addr::new(198, 19, 20, 1));
    let frame = s.udp(src, PORT);
    // 1.25x the threshold in total, half from each CPU.
    ratelimit_tests::scenario::align_to_window(Duration::from_secs(1));
    let a = s.blast(frame.clone(), 625, Duration::from_secs(4), Some(0));
    let b = s.blast(frame, 625, Duration::from_secs(4), Some(1));
    let sent = a.join().unwrap().sent + b.join().unwrap().sent;
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop().from(src);
    let lost = 100.0 * (sent - got) as f64 / sent as f64;
    let matched = per_cpu(&s, rule_index(0, 0, rc::MATCHED));
    println!("sent {sent}, admitted {got}, loss {lost:.2}%, matched per CPU {matched:?}");
    // Both CPUs really ran the program for this client.
    let total: u64 = matched.iter().sum();
    assert_eq!(total, sent);
    assert!(
        matched.iter().take(2).all(|&m| m * 10 >= total * 3),
        "each CPU must carry at least 30%: {matched:?}"
    );
    // Shared state: no x2 inflation, no lost updates beyond the tolerance.
    assert!((lost - 20.0).abs() <= 2.0, "loss {lost:.2}% (want 20 +- 2)");
    let st = s.stats();
    assert_eq!(rule_counter(&st, "udp", "dropped"), sent - got);
}

#[test]
fn random_source_flood_keeps_established_clients_and_bounds_state() {
    kernel_test!();
    random_source_flood(
        "max_sources = 4000\nnew_sources_per_sec = 200\nnew_sources_burst = 200",
        4000,
        false,
    );
}

/// The same flood under the default admission budget (`new_sources_per_sec = "auto"`): a
/// store of 12,000 gets 12,000 / 60 = 200 new states a second, burst 200, the budget above.
#[test]
fn default_admission_budget_keeps_established_clients_and_bounds_state() {
    kernel_test!();
    random_source_flood("max_sources = 12000", 12_000, true);
}

/// 10k spoofed sources against an established client under a budget of 200 new states a
/// second (burst 200), with a store of `max_sources` set by `tracking`.
fn random_source_flood(tracking: &str, max_sources: u32, auto: bool) {
    let mut s = Scenario::new("rlr");
    s.start(&format!(
        r#"
[tracking]
{tracking}

[[rule]]
name = "per-ip"
match = {{ protocol = "udp" }}
threshold = {{ count = 100, interval = "1s" }}
"#
    ));
    let status = s.daemon().status();
    assert_eq!(
        (
            status.admission.new_sources_per_sec,
            status.admission.new_sources_burst,
            status.admission.auto
        ),
        (200, 200, auto),
        "the budget in force"
    );
    let sink = s.sink(PORT);
    let est = IpAddr::V4(Ipv4Addr::new(198, 19, 30, 1));
    // The established client is known before the flood starts.
    let mut tx = s.sender();
    tx.send_n(
        std::iter::repeat(s.udp(est, PORT)),
        20,
        Some(Duration::from_millis(2)),
    );
    std::thread::sleep(Duration::from_millis(1100));
    let created_before = reason(&s.stats(), "state_created");

    // 10k spoofed sources, one packet each, at 5k pps, while the client goes on at 50 pps.
    let frames: Vec<Vec<u8>> = (0..10_000u32)
        .map(|i| s.udp(IpAddr::V4(Ipv4Addr::from(0xc6_14_00_00 | i)), PORT))
        .collect();
    let client = s.blast(s.udp(est, PORT), 50, Duration::from_secs(2), None);
    let mut ftx = s.sender();
    let flood = ftx.send_n(frames.iter(), 10_000, Some(Duration::from_micros(200)));
    let c = client.join().unwrap();
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop();
    let st = s.stats();

    let flood_through = got.total - got.from(est);
    let created = reason(&st, "state_created") - created_before;
    let refused = reason(&st, "admission_refused");
    let skipped = reason(&st, "lookup_skipped");
    println!(
        "flood {} sent in {:?}: {flood_through} delivered; states created {created}, admissions refused {refused}, lookups skipped {skipped}; client sent {} got {}",
        flood.sent,
        flood.elapsed,
        c.sent,
        got.from(est) - 20
    );
    // The known-sources filter (rebuilt at the daemon's start, 8 bits a source of the store
    // rounded up to a power of two: 2^15 for 4000) spares the spoofed sources their
    // per-client lookup: all but those whose bit another state set. Fewer than 1000 states
    // take at most 1000 of the 32768 or more bits, so at most ~3% of the sources are looked
    // up; 10% is the stated bound.
    assert!(
        (9_000..=10_000).contains(&skipped),
        "{skipped} of 10000 new sources skipped their lookup"
    );
    let status = s.daemon().cli_json(&["status"]);
    let kf = &status["known_filter"];
    assert_eq!(
        kf["bits"],
        1u64 << ratelimit_common::maps::known_log2_bits(max_sources),
        "{status}"
    );
    assert!(kf["states"].as_u64().is_some(), "{status}");
    assert_eq!(
        got.from(est),
        20 + c.sent,
        "the established client keeps its whole allowance"
    );
    // New per-client state is bounded by the admission budget (burst + rate x time, + the
    // aggregate overflow state), not by the flood. The budget is metered on the coarse clock
    // (it refills its burst in 1 s), which may start the flood up to one tick (at most 10 ms)
    // early: rate x tick more.
    let tick = 200.0 * 0.010;
    let budget = 200 + (200.0 * flood.elapsed.as_secs_f64() + tick).ceil() as u64 + 1;
    assert!(
        created <= budget,
        "created {created} states, budget {budget}"
    );
    assert_eq!(
        refused + created,
        10_000,
        "every flood source was either admitted or refused"
    );
    // Refused sources share one aggregate bucket of 100/s: the flood gets admitted sources'
    // first packets plus the aggregate's allowance, not 10k fresh buckets.
    let aggregate = 100 + (100.0 * flood.elapsed.as_secs_f64()).ceil() as u64;
    assert!(
        flood_through <= created + aggregate,
        "{flood_through} flood packets got through"
    );
    let top = s.daemon().cli_json(&["top", "-n", "1000"]);
    assert!(
        top.as_array()
            .unwrap()
            .iter()
            .any(|c| c["client"] == "198.19.30.1/32"),
        "client state kept"
    );
    assert!(
        top.as_array()
            .unwrap()
            .iter()
            .any(|c| c["key"] == "overflow"),
        "aggregate state present"
    );
}

/// Many window rotations while both CPUs count the same client: a rotation racing a CPU's
/// update must neither lose the window's count nor shut the client out (a count that wrapped
/// below zero would refuse every packet for two windows, costing ~7 points per occurrence).
#[test]
fn two_cpus_across_many_window_rotations() {
    kernel_test!();
    assert!(ratelimit_tests::sender::online_cpus() >= 2);
    let mut s = Scenario::with_queues("rl3", 2);
    s.pair.a().set_xps(0, 0b01);
    s.pair.a().set_xps(1, 0b10);
    s.start(
        r#"
[[rule]]
name = "udp"
match = { protocol = "udp" }
threshold = { count = 100, interval = "100ms" }
"#,
    );
    let sink = s.sink(PORT);
    let src = IpAddr::V4(Ipv4Addr::new(198, 19, 21, 1));
    let frame = s.udp(src, PORT);
    ratelimit_tests::scenario::align_to_window(Duration::from_millis(100));
    let a = s.blast(frame.clone(), 625, Duration::from_secs(4), Some(0));
    let b = s.blast(frame, 625, Duration::from_secs(4), Some(1));
    let sent = a.join().unwrap().sent + b.join().unwrap().sent;
    sink.wait_quiet(Duration::from_millis(300));
    let got = sink.stop().from(src);
    let lost = 100.0 * (sent - got) as f64 / sent as f64;
    println!("40 windows, both CPUs: sent {sent}, admitted {got}, loss {lost:.2}%");
    assert!((lost - 20.0).abs() <= 2.0, "loss {lost:.2}% (want 20 +- 2)");
    assert_eq!(
        ratelimit_tests::scenario::reason(&s.stats(), "contended"),
        0,
        "no update lost every retry"
    );
}
