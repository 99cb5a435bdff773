//! Global thresholds (`scope = "global"`): three daemons, each in its own namespace with its
//! own veth to a sender, share one client's counts through a real `redis-server` in a
//! "store" namespace. One source sends at three times a global threshold, split evenly over
//! the three hosts: the fleet admits the threshold (within 5%) in each window of the wall
//! clock, where hosts counting alone admit three times it.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use ratelimit_tests::{
    NetNs, Scenario, VethPair, kernel_test, scenario::rule_counter, store::Redis,
};
use ratelimit_user::{
    control::{self, Answer, Request},
    fleet,
};

const PORT: u16 = 9000;
const REDIS_PORT: u16 = 6379;
/// The threshold: `L` packets a window of `T_SECS`.
const L: u64 = 300;
const T_SECS: u64 = 3;
/// Windows measured after the first full one.
const WINDOWS: u64 = 4;

fn policy(url: &str, host: usize, scope: &str) -> String {
    format!(
        r#"[fleet]
redis = "{url}"
host_id = "h{host}"
sync_interval = "50ms"

[[rule]]
name = "udp-global"
match = {{ protocol = "udp", dst_ports = ["{PORT}"] }}
action = "throttle"
threshold = {{ count = {L}, interval = "{T_SECS}s" }}
algorithm = "sliding_window"
scope = "{scope}"
"#
    )
}

struct Fleet {
    hosts: Vec<Scenario>,
    _links: Vec<VethPair>,
    _redis: Redis,
    _store: NetNs,
}

impl Fleet {
    fn new(tag: &str, scope: &str) -> Fleet {
        let store = NetNs::new(&format!("{tag}-st"));
        let mut hosts: Vec<Scenario> = (0..3)
            .map(|i| Scenario::new(&format!("{tag}{i}")))
            .collect();
        let links: Vec<VethPair> = hosts
            .iter()
            .map(|h| VethPair::new(&store, &h.server))
            .collect();
        let redis = Redis::start(&store, IpAddr::V4(links[0].a().ipv4), REDIS_PORT);
        for (i, h) in hosts.iter_mut().enumerate() {
            let url = format!("redis://{}:{REDIS_PORT}", links[i].a().ipv4);
            h.start(&policy(&url, i, scope));
        }
        Fleet {
            hosts,
            _links: links,
            _redis: redis,
            _store: store,
        }
    }

    fn fleet(&self, i: usize) -> fleet::Report {
        match control::call(self.hosts[i].daemon().socket_path(), &Request::Fleet) {
            Ok(Answer::Fleet(r)) => *r,
            other => panic!("fleet status answered {other:?}"),
        }
    }

    /// Packets the rule let through on each host so far.
    fn admitted(&self) -> Vec<u64> {
        self.hosts
            .iter()
            .map(|h| {
                let st = h.stats();
                rule_counter(&st, "udp-global", "matched")
                    - rule_counter(&st, "udp-global", "dropped")
            })
            .collect()
    }
}

/// Sleep until `at` (a wall-clock time).
fn sleep_until_wall(at: Duration) {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    if at > now {
        std::thread::sleep(at - now);
    }
}

/// One source at 3L a window, split evenly over the three hosts, for the whole measurement;
/// returns the fleet's admitted count in each wall-clock window after the first full one.
fn measure(f: &Fleet) -> Vec<u64> {
    let src = Ipv4Addr::new(198, 18, 7, 7);
    let per_host_pps = L / T_SECS; // 3 hosts x L/T = 3L per window in all
    let t = Duration::from_secs(T_SECS);
    // Start just after a window boundary, so the first window seen whole is the next one.
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let first = Duration::from_secs((now.as_secs() / T_SECS + 1) * T_SECS);
    sleep_until_wall(first);
    let run = t * (WINDOWS as u32 + 2);
    let senders: Vec<_> = f
        .hosts
        .iter()
        .map(|h| h.blast(h.udp4(src, PORT), per_host_pps, run, None))
        .collect();
    // Read the counters at each boundary from the second one on.
    let mut marks = Vec::new();
    for w in 1..=WINDOWS + 1 {
        sleep_until_wall(first + t * w as u32);
        marks.push(f.admitted().iter().sum::<u64>());
    }
    for s in senders {
        s.join().expect("sender");
    }
    marks.windows(2).map(|m| m[1] - m[0]).collect()
}

#[test]
fn a_global_threshold_holds_across_three_hosts_within_5_percent() {
    kernel_test!();
    let t0 = Instant::now();
    let f = Fleet::new("rlgl", "global");
    // Every host is connected and syncs the global rule.
    let give_up = Instant::now() + Duration::from_secs(10);
    while (0..3).any(|i| f.fleet(i).global.rules != ["udp-global"]) {
        assert!(
            Instant::now() < give_up,
            "the global rule is not synced: {:?}",
            (0..3).map(|i| f.fleet(i)).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let per_window = measure(&f);
    println!("global: admitted per {T_SECS}s window across 3 hosts (L = {L}): {per_window:?}");
    for i in 0..3 {
        println!("host {i}: {:?}", f.fleet(i).global);
    }
    for (w, &n) in per_window.iter().enumerate() {
        let off = (n as f64 - L as f64) / L as f64;
        assert!(
            off.abs() <= 0.05,
            "window {w}: {n} admitted across the fleet, {:.1}% off L = {L}: {per_window:?}",
            off * 100.0
        );
    }
    let g = f.fleet(0).global;
    assert!(g.synced_keys >= 1 && g.added_total > 0, "{g:?}");
    assert_eq!(g.store_errors, 0, "{g:?}");
    println!("global test took {:.1}s", t0.elapsed().as_secs_f64());
}

/// The same traffic with the rule local: each host admits L, the fleet about 3L (the
/// contrast the global scope exists for, measured the same way).
#[test]
fn a_local_threshold_is_held_per_host() {
    kernel_test!();
    let f = Fleet::new("rllo", "local");
    let per_window = measure(&f);
    println!("local: admitted per {T_SECS}s window across 3 hosts (L = {L}): {per_window:?}");
    for (w, &n) in per_window.iter().enumerate() {
        let ratio = n as f64 / L as f64;
        assert!(
            (2.7..=3.05).contains(&ratio),
            "window {w}: {n} admitted across 3 hosts counting alone, {ratio:.2}x L"
        );
    }
    let g = f.fleet(0).global;
    assert!(g.rules.is_empty() && g.synced_keys == 0, "{g:?}");
}
