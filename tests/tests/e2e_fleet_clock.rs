//! The clock guard of fleet mode: two daemons, each in its own namespace with its own veth to
//! a sender, share a global rule through a real `redis-server`. Host 0's wall clock is set
//! 5 s behind with libfaketime ([`FakeClock`]; only the wall clock, as on a host whose NTP
//! failed). It measures an offset of -5 s against the store (within 250 ms), says so
//! (`fleet_clock_skew`, `fleet status`, the peers' view of it, the metric), and takes no part
//! in global counting: one source at 3L a window split over the two hosts gets L admitted
//! on host 0 alone (its own threshold, not a share of it). Its clock set right again, it
//! rejoins (`fleet_clock_restored`) and the fleet holds the one threshold again.

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use ratelimit_tests::{
    faketime::FakeClock,
    fleet_lab::{FleetLab, Setup, fleet_section, per_window, udp_rule, wait_for},
    kernel_test,
};

const PORT: u16 = 9000;
const HTTP_PORT: u16 = 9419;
/// The threshold: `L` packets a window of `T_SECS`.
const L: u64 = 300;
const T_SECS: u64 = 6;
/// Windows measured in each phase, after the first full one.
const WINDOWS: u64 = 2;
/// The skew, and how close to it the measured offset must be (the measurement's own error is
/// at most half the fastest of five round trips on the lab's veth, well under a millisecond
/// when the machine is idle; the rest is room for a busy machine).
const SKEW_MS: f64 = -5000.0;
const OFFSET_TOLERANCE_MS: f64 = 250.0;

fn policy(url: &str, host: usize) -> String {
    format!(
        "{}max_clock_skew = \"250ms\"\n\n{}",
        fleet_section(url, host),
        udp_rule("udp-global", PORT, L, T_SECS, "global")
    )
}

/// One source at 3L a window, split evenly over the two hosts; each host's admitted count in
/// each wall-clock window after the first full one.
fn measure(f: &FleetLab) -> Vec<Vec<u64>> {
    let src = Ipv4Addr::new(198, 18, 9, 9);
    let per_host_pps = 3 * L / 2 / T_SECS;
    let send = |run| {
        f.hosts
            .iter()
            .map(|h| h.blast(h.udp4(src, PORT), per_host_pps, run, None))
            .collect()
    };
    per_window(T_SECS, WINDOWS, send, || f.admitted_by("udp-global"))
}

#[test]
fn a_host_whose_clock_is_off_counts_alone_and_rejoins_when_it_is_right() {
    kernel_test!();
    let clock = FakeClock::new("-5s");
    let f = Setup::new("rlck")
        .hosts(2)
        .http(HTTP_PORT)
        .host_env(0, clock.env())
        .start(|i, url| policy(url, i));
    f.wait_connected(Duration::from_secs(15));

    // Host 0 measures its offset and leaves global counting; host 1 stays in.
    assert!(
        wait_for(Duration::from_secs(15), || f.fleet(0).clock.over_bound),
        "host 0 never found its clock off: {:?}\n{}",
        f.fleet(0).clock,
        f.d(0).logs()
    );
    let c0 = f.fleet(0).clock;
    let offset = c0.offset_ms.expect("measured");
    println!("host 0 clock: {c0:?}");
    assert!(
        (offset - SKEW_MS).abs() <= OFFSET_TOLERANCE_MS && !c0.counting,
        "host 0's offset {offset} ms, expected {SKEW_MS} ± {OFFSET_TOLERANCE_MS}: {c0:?}"
    );
    assert!(
        wait_for(Duration::from_secs(15), || f.fleet(1).clock.counting),
        "host 1 does not count globally: {:?}",
        f.fleet(1).clock
    );
    let c1 = f.fleet(1).clock;
    println!("host 1 clock: {c1:?}");
    assert!(
        c1.offset_ms.is_some_and(|o| o.abs() <= OFFSET_TOLERANCE_MS) && !c1.over_bound,
        "{c1:?}"
    );
    // The event, the CLI, the metric, and host 1's view of its peer.
    let ev = f.events(0, "fleet_clock_skew");
    assert_eq!(ev.len(), 1, "{ev:?}");
    let ev_offset = ev[0]["offset_ms"].as_f64().expect("offset_ms");
    assert!(
        (ev_offset - SKEW_MS).abs() <= OFFSET_TOLERANCE_MS && ev[0]["max_skew_ms"] == 250,
        "{ev:?}"
    );
    assert!(f.events(1, "fleet_clock_skew").is_empty());
    let status = f.d(0).cli_ok(&["fleet", "status"]);
    assert!(status.contains("OVER THE BOUND"), "{status}");
    let (code, metrics) = f.hosts[0].http_get("/metrics");
    assert_eq!(code, 200);
    let metric = |text: &str, name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} missing from:\n{text}"))
            .parse()
            .unwrap()
    };
    assert_eq!(metric(&metrics, "ratelimit_fleet_clock_skewed"), 1.0);
    let m_offset = metric(&metrics, "ratelimit_fleet_clock_offset_seconds");
    assert!(
        (m_offset * 1e3 - SKEW_MS).abs() <= OFFSET_TOLERANCE_MS,
        "{m_offset}"
    );
    assert!(
        wait_for(Duration::from_secs(15), || {
            f.fleet(1).peers.iter().any(|p| {
                p.host_id == "h0"
                    && p.clock_offset_ms
                        .is_some_and(|o| (o - SKEW_MS).abs() <= OFFSET_TOLERANCE_MS)
            })
        }),
        "host 1 does not see host 0's offset: {:?}",
        f.fleet(1).peers
    );
    let peers = f.d(1).cli_ok(&["fleet", "peers"]);
    println!("{peers}");

    // Host 0 holds the threshold alone: about L a window, where a share would be about L/2.
    let skewed = measure(&f);
    println!("clock off: admitted per {T_SECS}s window on each host (L = {L}): {skewed:?}");
    for (w, per_host) in skewed.iter().enumerate() {
        let r0 = per_host[0] as f64 / L as f64;
        assert!(
            (0.85..=1.1).contains(&r0),
            "window {w}: host 0 admitted {} ({r0:.2} L), expected its own threshold: {skewed:?}",
            per_host[0]
        );
    }
    assert_eq!(f.fleet(0).global.rounds, 0, "{:?}", f.fleet(0).global);

    // The clock set right: host 0 rejoins.
    clock.set("+0");
    let t0 = Instant::now();
    assert!(
        wait_for(Duration::from_secs(15), || f.fleet(0).clock.counting),
        "host 0 never rejoined: {:?}\n{}",
        f.fleet(0).clock,
        f.d(0).logs()
    );
    println!(
        "host 0 rejoined after {:.1}s: {:?}",
        t0.elapsed().as_secs_f64(),
        f.fleet(0).clock
    );
    let back = f.events(0, "fleet_clock_restored");
    assert_eq!(back.len(), 1, "{back:?}");
    assert!(back[0]["offset_ms"].as_f64().unwrap().abs() <= OFFSET_TOLERANCE_MS);
    assert!(f.d(0).logs().contains("global counting resumes"));
    // The program's windows follow the stepped clock within 10 s (the daemon's check of the
    // wall clock's offset); then the fleet holds L, where two hosts alone admit 2L.
    std::thread::sleep(Duration::from_secs(11));
    let joined = measure(&f);
    println!("clock right: admitted per {T_SECS}s window on each host (L = {L}): {joined:?}");
    for (w, per_host) in joined.iter().enumerate() {
        let total: u64 = per_host.iter().sum();
        let r = total as f64 / L as f64;
        assert!(
            (0.85..=1.2).contains(&r),
            "window {w}: {total} admitted across the fleet ({r:.2} L): {joined:?}"
        );
    }
    assert!(f.fleet(0).global.rounds > 0, "{:?}", f.fleet(0).global);
}
