//! Global thresholds (`scope = "global"`): three daemons, each in its own namespace with its
//! own veth to a sender, share one client's counts through a real `redis-server` in a
//! "store" namespace. One source sends at three times a global threshold, split evenly over
//! the three hosts: the fleet admits the threshold (within 5%) in each window of the wall
//! clock, where hosts counting alone admit three times it. With the store killed, frozen or
//! slowed mid-flood, the packet path goes on: each host holds the threshold on its own, a
//! client under it keeps all its traffic, the control API answers, and the fleet is back
//! within 5% in the first whole window after the store returns.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use ratelimit_tests::{
    fleet_lab::{FleetLab, Setup, Store, fleet_section, per_window, sleep_until_wall, udp_rule},
    kernel_test,
};
use ratelimit_user::api::Request;

const PORT: u16 = 9000;
/// A client under the threshold (a rule of its own, the same threshold), on every host.
const LIGHT_PORT: u16 = 9002;
const LIGHT_PPS: u64 = 10;
/// The cluster's nodes' ports, and the one address they announce (on the store namespace's
/// loopback, routed to through each host's own link).
const CLUSTER: Store = Store::Cluster {
    ip: Ipv4Addr::new(100, 64, 251, 1),
    ports: [7101, 7102, 7103],
};

/// The threshold: `L` packets a window of `T_SECS`.
const L: u64 = 300;
const T_SECS: u64 = 6;
/// Windows measured after the first full one (each is held to 5% on its own).
const WINDOWS: u64 = 3;

fn policy(url: &str, host: usize, scope: &str) -> String {
    format!(
        "{}\n{}\n{}",
        fleet_section(url, host),
        udp_rule("udp-global", PORT, L, T_SECS, scope),
        udp_rule("udp-light", LIGHT_PORT, L, T_SECS, scope)
    )
}

type Fleet = FleetLab;

/// Three hosts on `store`, each with [`policy`] in `scope`.
fn start_fleet(tag: &str, scope: &str, store: Store) -> Fleet {
    Setup::new(tag)
        .store(store)
        .start(|i, url| policy(url, i, scope))
}

/// Packets the heavy source's rule let through on each host so far.
fn admitted(f: &Fleet) -> Vec<u64> {
    f.admitted_by("udp-global")
}

/// One source at 3L a window, split evenly over the three hosts, for the whole measurement;
/// returns the fleet's admitted count in each wall-clock window after the first full one.
fn measure(f: &Fleet) -> Vec<u64> {
    let src = Ipv4Addr::new(198, 18, 7, 7);
    let per_host_pps = L / T_SECS; // 3 hosts x L/T = 3L per window in all
    let send = |run| {
        f.hosts
            .iter()
            .map(|h| h.blast(h.udp4(src, PORT), per_host_pps, run, None))
            .collect()
    };
    per_window(T_SECS, WINDOWS, send, || vec![admitted(f).iter().sum()])
        .into_iter()
        .map(|w| w[0])
        .collect()
}

#[test]
fn a_global_threshold_holds_across_three_hosts_within_5_percent() {
    kernel_test!();
    let t0 = Instant::now();
    let f = start_fleet("rlgl", "global", Store::Direct);
    // Every host is connected and syncs the global rule.
    let give_up = Instant::now() + Duration::from_secs(10);
    while (0..3).any(|i| f.fleet(i).global.rules != ["udp-global", "udp-light"]) {
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
    let f = start_fleet("rllo", "local", Store::Direct);
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

/// A token bucket of `TB_RATE` packets a second and a burst of `TB_BURST`, measured over
/// `TB_SECS` after a warm-up.
const TB_RATE: u64 = 50;
const TB_BURST: u64 = 25;
const TB_SECS: u64 = 20;
const TB_PORT: u16 = 9004;

fn bucket_policy(url: &str, host: usize, scope: &str) -> String {
    let fleet = fleet_section(url, host);
    format!(
        r#"{fleet}
[[rule]]
name = "udp-bucket"
match = {{ protocol = "udp", dst_ports = ["{TB_PORT}"] }}
action = "throttle"
threshold = {{ count = {TB_RATE}, interval = "1s" }}
algorithm = "token_bucket"
burst = {TB_BURST}
scope = "{scope}"
"#
    )
}

/// One source at three times the bucket's rate, split evenly over the three hosts: the
/// fleet's admitted count over [`TB_SECS`] after a warm-up of 5 s (the buckets drained, the
/// client synced).
fn measure_bucket(f: &Fleet) -> u64 {
    let src = Ipv4Addr::new(198, 18, 7, 9);
    let warm = Duration::from_secs(5);
    let span = Duration::from_secs(TB_SECS);
    let senders: Vec<_> = f
        .hosts
        .iter()
        .map(|h| {
            h.blast(
                h.udp4(src, TB_PORT),
                TB_RATE,
                warm + span + Duration::from_secs(1),
                None,
            )
        })
        .collect();
    std::thread::sleep(warm);
    let t0 = Instant::now();
    let a0: u64 = f.admitted_by("udp-bucket").iter().sum();
    std::thread::sleep(span.saturating_sub(t0.elapsed()));
    let a1: u64 = f.admitted_by("udp-bucket").iter().sum();
    for s in senders {
        s.join().expect("sender");
    }
    a1 - a0
}

/// A global token bucket: each host takes what the others admitted out of its bucket, so the
/// fleet admits the rate (within 5%), where buckets counting alone admit all three shares.
#[test]
fn a_global_token_bucket_holds_its_rate_across_three_hosts_within_5_percent() {
    kernel_test!();
    let expected = TB_RATE * TB_SECS;
    {
        let f = Setup::new("rltb")
            .store(Store::Direct)
            .start(|i, url| bucket_policy(url, i, "global"));
        let give_up = Instant::now() + Duration::from_secs(10);
        while (0..3).any(|i| f.fleet(i).global.rules != ["udp-bucket"]) {
            assert!(
                Instant::now() < give_up,
                "the global bucket is not synced: {:?}",
                (0..3).map(|i| f.fleet(i)).collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let n = measure_bucket(&f);
        let off = (n as f64 - expected as f64) / expected as f64;
        println!(
            "global token bucket: {n} admitted across 3 hosts in {TB_SECS}s at 3x the rate \
             (rate x time = {expected}): {:+.1}%",
            off * 100.0
        );
        for i in 0..3 {
            println!("host {i}: {:?}", f.fleet(i).global);
        }
        assert!(
            off.abs() <= 0.05,
            "{n} admitted, {:.1}% off {expected}",
            off * 100.0
        );
        let g = f.fleet(0).global;
        assert!(g.synced_keys >= 1 && g.added_total > 0, "{g:?}");
        assert_eq!(g.store_errors, 0, "{g:?}");
    }
    // The same buckets local: each host admits its whole share, the fleet three times the rate.
    let f = Setup::new("rltl")
        .store(Store::Direct)
        .start(|i, url| bucket_policy(url, i, "local"));
    let n = measure_bucket(&f);
    let ratio = n as f64 / expected as f64;
    println!("local token buckets: {n} admitted across 3 hosts ({ratio:.2}x the rate)");
    assert!((2.8..=3.05).contains(&ratio), "{n} admitted, {ratio:.2}x");
}

/// The shared-key rules' ports: `key = "all"` and `key = "region"`.
const ALL_PORT: u16 = 9006;
const REGION_PORT: u16 = 9008;

fn shared_policy(url: &str, host: usize, scope: &str, db: &std::path::Path) -> String {
    let fleet = fleet_section(url, host);
    format!(
        r#"{fleet}
[geoip]
database = "{}"

[[rule]]
name = "udp-all"
match = {{ protocol = "udp", dst_ports = ["{ALL_PORT}"] }}
key = "all"
action = "throttle"
threshold = {{ count = {L}, interval = "{T_SECS}s" }}
scope = "{scope}"

[[rule]]
name = "udp-region"
match = {{ protocol = "udp", dst_ports = ["{REGION_PORT}"] }}
key = "region"
action = "throttle"
threshold = {{ count = {L}, interval = "{T_SECS}s" }}
scope = "{scope}"
"#,
        db.display()
    )
}

/// Windows measured by the shared-key test.
const SHARED_WINDOWS: u64 = 3;

/// Each host's own sources (one per host and rule, all in one region) at L/T a second to each
/// shared-key rule, 3L a window in all per rule: the fleet's admitted count of each rule in
/// each whole wall-clock window after the first.
fn measure_shared(f: &Fleet) -> (Vec<u64>, Vec<u64>) {
    let per_host_pps = L / T_SECS;
    let send = |run| {
        let mut senders = Vec::new();
        for (i, h) in f.hosts.iter().enumerate() {
            let all_src = Ipv4Addr::new(198, 18, 8, 1 + i as u8);
            let region_src = Ipv4Addr::new(198, 18, 9, 1 + i as u8);
            senders.push(h.blast(h.udp4(all_src, ALL_PORT), per_host_pps, run, None));
            senders.push(h.blast(h.udp4(region_src, REGION_PORT), per_host_pps, run, None));
        }
        senders
    };
    let sums = per_window(T_SECS, SHARED_WINDOWS, send, || {
        vec![
            f.admitted_by("udp-all").iter().sum(),
            f.admitted_by("udp-region").iter().sum(),
        ]
    });
    (
        sums.iter().map(|w| w[0]).collect(),
        sums.iter().map(|w| w[1]).collect(),
    )
}

/// Global rules of shared keys: `key = "all"` (one count for all the rule's traffic) and
/// `key = "region"` (one per country) hold their threshold across the fleet within 5%, where
/// the same rules local admit it once per host.
#[test]
fn shared_keys_all_and_region_hold_their_threshold_across_three_hosts() {
    kernel_test!();
    let dir = std::env::temp_dir().join(format!("rl-fleet-shared-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("country.mmdb");
    ratelimit_tests::mmdb::write_country_db(&db, &[("198.18.0.0/16", "DE")]).unwrap();
    for scope in ["global", "local"] {
        let f = Setup::new(if scope == "global" { "rlsg" } else { "rlsl" })
            .store(Store::Direct)
            .start(|i, url| shared_policy(url, i, scope, &db));
        if scope == "global" {
            let give_up = Instant::now() + Duration::from_secs(10);
            while (0..3).any(|i| f.fleet(i).global.rules != ["udp-all", "udp-region"]) {
                assert!(
                    Instant::now() < give_up,
                    "the global rules are not in force: {:?}",
                    (0..3).map(|i| f.fleet(i)).collect::<Vec<_>>()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let (all, region) = measure_shared(&f);
        println!(
            "{scope}: admitted per {T_SECS}s window across 3 hosts (L = {L}): key = all \
             {all:?}, key = region {region:?}"
        );
        for (rule, per_window) in [("all", &all), ("region", &region)] {
            for (w, &n) in per_window.iter().enumerate() {
                let ratio = n as f64 / L as f64;
                if scope == "global" {
                    assert!(
                        (ratio - 1.0).abs() <= 0.05,
                        "key = {rule}, window {w}: {n} admitted across the fleet, {:.1}% off L",
                        (ratio - 1.0) * 100.0
                    );
                } else {
                    assert!(
                        (2.7..=3.05).contains(&ratio),
                        "key = {rule}, window {w}: {n} admitted by 3 hosts counting alone, {ratio:.2}x L"
                    );
                }
            }
        }
        let g = f.fleet(0).global;
        if scope == "global" {
            println!("host 0: {g:?}");
            assert_eq!(g.shared_keys, 2, "one key = all, one region: {g:?}");
            assert!(g.added_total > 0 && g.store_errors == 0, "{g:?}");
            let text = f.d(0).cli_ok(&["fleet", "status"]);
            assert!(text.contains("shared keys  2"), "{text}");
        } else {
            assert!(g.rules.is_empty(), "{g:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// What is done to the store at a window boundary.
#[derive(Clone, Copy, Debug)]
enum Act {
    Nothing,
    Kill,
    Restart,
    Freeze,
    Thaw,
    /// Delay every byte between this host and the store by this much each way.
    Slow(usize, Duration),
}

/// `status` on each host, 50 times: the answers' times, all hosts pooled.
fn status_times(f: &Fleet) -> Vec<Duration> {
    let mut t: Vec<Duration> = (0..3)
        .flat_map(|i| {
            (0..50).map(move |_| {
                let t0 = Instant::now();
                ratelimit_user::serve::control::call(
                    f.hosts[i].daemon().socket_path(),
                    &Request::Status,
                )
                .expect("status answers");
                t0.elapsed()
            })
        })
        .collect();
    t.sort();
    t
}

/// One window's figures: the heavy source's admitted count on each host, and the p99 of
/// `status` answers (150, all hosts) during it.
struct Window {
    act: Act,
    per_host: Vec<u64>,
    status_p99: Duration,
}

/// The heavy source at 3L a window split evenly and the light one on every host, for
/// `acts.len()` whole wall-clock windows; `acts[k]` is done at the start of window k.
fn phased(f: &mut Fleet, acts: &[Act]) -> Vec<Window> {
    let heavy = Ipv4Addr::new(198, 18, 7, 7);
    let light = Ipv4Addr::new(198, 18, 8, 8);
    let t = Duration::from_secs(T_SECS);
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    // One window of warm-up, so the first window measured starts with a full previous one.
    let start = Duration::from_secs((now.as_secs() / T_SECS + 1) * T_SECS);
    sleep_until_wall(start);
    let run = t * (acts.len() as u32 + 1) + Duration::from_millis(500);
    let mut senders: Vec<_> = f
        .hosts
        .iter()
        .map(|h| h.blast(h.udp4(heavy, PORT), L / T_SECS, run, None))
        .collect();
    senders.extend(
        f.hosts
            .iter()
            .map(|h| h.blast(h.udp4(light, LIGHT_PORT), LIGHT_PPS, run, None)),
    );
    let mut out = Vec::new();
    sleep_until_wall(start + t);
    let mut mark = admitted(f);
    for (k, &act) in acts.iter().enumerate() {
        match act {
            Act::Nothing => {}
            Act::Kill => f.redis().kill(),
            Act::Restart => f.redis().restart(),
            Act::Freeze => f.redis().freeze(),
            Act::Thaw => f.redis().thaw(),
            Act::Slow(i, d) => f.proxies[i].set_delay(d),
        }
        let times = status_times(f);
        let status_p99 = times[(times.len() * 99).div_ceil(100) - 1];
        sleep_until_wall(start + t * (k as u32 + 2));
        let now = admitted(f);
        out.push(Window {
            act,
            per_host: now.iter().zip(&mark).map(|(a, b)| a - b).collect(),
            status_p99,
        });
        mark = now;
    }
    for s in senders {
        s.join().expect("sender");
    }
    out
}

#[test]
fn without_the_store_every_host_holds_the_threshold_alone_and_the_fleet_recovers() {
    kernel_test!();
    let mut f = start_fleet("rlgf", "global", Store::Proxied);
    let acts = [
        Act::Nothing,
        Act::Nothing,
        Act::Kill,
        Act::Nothing,
        Act::Restart,
        Act::Nothing,
        Act::Freeze,
        Act::Thaw,
        Act::Nothing,
        Act::Slow(0, Duration::from_millis(100)),
        Act::Nothing,
    ];
    let light_before = f.judged("udp-light");
    let w = phased(&mut f, &acts);
    let light_after = f.judged("udp-light");
    for (k, x) in w.iter().enumerate() {
        println!(
            "window {k} ({:?}): {:?} = {} (L = {L}), status p99 {:.1} ms",
            x.act,
            x.per_host,
            x.per_host.iter().sum::<u64>(),
            x.status_p99.as_secs_f64() * 1e3
        );
    }
    for i in 0..3 {
        println!("host {i}: {:?}", f.fleet(i).global);
    }
    let within = |k: usize, lo: f64, hi: f64| {
        let n = w[k].per_host.iter().sum::<u64>() as f64 / L as f64;
        assert!(
            (lo..=hi).contains(&n),
            "window {k} ({:?}): the fleet admitted {:.3} L, outside {lo}..={hi}",
            w[k].act,
            n
        );
    };
    // The store there: the fleet holds L.
    within(1, 0.95, 1.05);
    // Killed, restarted, frozen, slowed: never more than L on any host (what each host holds
    // alone), and the control API answers quickly throughout.
    for x in &w {
        for &n in &x.per_host {
            assert!(
                n <= L + L / 50,
                "a host admitted {n} > L = {L} in {:?}",
                x.act
            );
        }
        // A status that waited on the store would wait for its answer's timeout
        // (`fleet::REQUEST_TIMEOUT`, 500 ms) or a connection's (1 s); 300 ms leaves room for
        // a busy 2-core machine running three daemons, their senders and the store (117 ms
        // was seen at p99 with a build running beside it).
        assert!(
            x.status_p99 < Duration::from_millis(300),
            "status p99 {:?} in {:?}",
            x.status_p99,
            x.act
        );
    }
    // Back within 5% in the first whole window after the store returns (restarted empty:
    // window 5; thawed: window 8), and with one host's link slowed to a 200 ms round trip.
    within(5, 0.95, 1.05);
    within(8, 0.95, 1.05);
    // (The slowed host learns the others' counts 200 ms later, and they its: a few percent
    // more, measured 307 to 315 of 300 in the runs before this bound was set.)
    within(10, 0.95, 1.15);
    // The client under the threshold lost nothing, whatever the store did.
    let (m, d) = (
        light_after.0 - light_before.0,
        light_after.1 - light_before.1,
    );
    assert!(m > 0 && d == 0, "the light client: {d} of {m} dropped");
}

/// Sources, each at 3L a window split evenly over the hosts, for the Cluster test.
const MANY: u8 = 24;

/// On a 3-master Redis Cluster: every source's counts shared (each script call stays in one
/// slot: no CROSSSLOT), so each source is held to L across the fleet. With one master killed,
/// the sources whose bucket lives on it go back to each host's own count (about 3L), and every
/// other source stays global.
#[test]
fn on_a_cluster_each_key_is_global_and_a_lost_master_takes_only_its_own_keys_local() {
    kernel_test!();
    let mut f = start_fleet("rlgc", "global", CLUSTER);
    let srcs: Vec<Ipv4Addr> = (1..=MANY).map(|n| Ipv4Addr::new(198, 18, 9, n)).collect();
    let rid = |i: usize| f.fleet(i).global.rules.first().cloned().unwrap_or_default();
    let give_up = Instant::now() + Duration::from_secs(10);
    while (0..3).any(|i| rid(i) != "udp-global") {
        assert!(Instant::now() < give_up, "the global rule is not synced");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Per source: admitted across the fleet over `windows` whole wall-clock windows.
    let run = |f: &Fleet, windows: u64| -> Vec<u64> {
        let t = Duration::from_secs(T_SECS);
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        let start = Duration::from_secs((now.as_secs() / T_SECS + 1) * T_SECS);
        sleep_until_wall(start);
        let sinks: Vec<_> = f.hosts.iter().map(|h| h.sink(PORT)).collect();
        // Each host: every source at L/T a second (3L a window over the three hosts).
        let senders: Vec<_> = f
            .hosts
            .iter()
            .map(|h| {
                let frames: Vec<Vec<u8>> = srcs.iter().map(|&s| h.udp4(s, PORT)).collect();
                let mut tx = h.sender();
                let pps = L / T_SECS * MANY as u64;
                let dur = t * windows as u32;
                std::thread::spawn(move || {
                    tx.send_rate(|i| frames[i as usize % frames.len()].clone(), pps, dur)
                })
            })
            .collect();
        for s in senders {
            s.join().expect("sender");
        }
        std::thread::sleep(Duration::from_millis(300));
        let counts: Vec<_> = sinks.into_iter().map(|s| s.stop()).collect();
        srcs.iter()
            .map(|&s| counts.iter().map(|c| c.from(IpAddr::V4(s))).sum())
            .collect()
    };
    let windows = 2;
    let before = run(&f, windows);
    println!("cluster, all masters: admitted per source over {windows} windows: {before:?}");
    for i in 0..3 {
        let g = f.fleet(i).global;
        assert_eq!(g.store_errors, 0, "host {i}: {g:?}");
    }
    // The first window starts with no previous one: up to 2L there, then L a window.
    let global_max = (windows + 1) * L * 105 / 100;
    for (s, &n) in srcs.iter().zip(&before) {
        assert!(n <= global_max, "{s}: {n} admitted, over {global_max}");
    }
    // Which master holds each source's counts: the hashes of the rule's admitted counts on
    // each node name their bucket (and the rule's id in the store).
    let mut bucket_owner = std::collections::HashMap::new();
    let mut rid = String::new();
    for node in 0..3 {
        let keys = f.cluster.as_ref().unwrap().cli(
            node,
            &["--scan", "--pattern", "ratelimit:{g*}:a:udp-global#*"],
        );
        for k in keys.lines().filter(|l| l.starts_with("ratelimit:{g")) {
            let mut parts = k.splitn(5, ':');
            let tag = parts.nth(1).unwrap_or_default();
            let bucket: u64 = tag
                .trim_matches(|c| c == '{' || c == '}' || c == 'g')
                .parse()
                .unwrap();
            rid = parts.nth(1).unwrap_or_default().to_string();
            bucket_owner.insert(bucket, node);
        }
    }
    assert!(!rid.is_empty(), "no counts of udp-global on any node");
    let owner_of = |s: &Ipv4Addr| {
        let b = ratelimit_user::fleet::global::bucket_of(&rid, &format!("{s}/32"));
        *bucket_owner
            .get(&b)
            .unwrap_or_else(|| panic!("no node holds bucket {b} of {s}: {bucket_owner:?}"))
    };
    // Kill the master of the first source's bucket (so at least one source is on it).
    let owners: Vec<usize> = srcs.iter().map(owner_of).collect();
    let dead = owners[0];
    f.cluster.as_mut().unwrap().nodes[dead].kill();
    std::thread::sleep(Duration::from_secs(3)); // the cluster's node timeout is 2 s
    let after = run(&f, windows);
    println!("cluster, master {dead} killed: admitted per source: {after:?} (owners {owners:?})");
    let lost = owners.iter().filter(|&&o| o == dead).count();
    println!(
        "{} of {MANY} sources' buckets on the lost master; {:.0}% of the sources stay global",
        lost,
        100.0 * (MANY as usize - lost) as f64 / MANY as f64
    );
    for ((s, &n), &o) in srcs.iter().zip(&after).zip(&owners) {
        if o == dead {
            // Each host alone: about L each, 3L a window across the fleet.
            assert!(
                n > global_max,
                "{s} (on the lost master): only {n} admitted"
            );
        } else {
            assert!(
                n <= global_max,
                "{s} (on a live master): {n} admitted, over {global_max}"
            );
        }
    }
}
