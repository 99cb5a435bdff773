//! Fleet mode through Redis Sentinel: three daemons, each in its own namespace, reach their
//! store as `redis+sentinel://` (three sentinels, quorum 2, watching a master and its one
//! replica, all in the store namespace). The master is killed: the sentinels promote the
//! replica (down after 500 ms without an answer); meanwhile every host answers its control
//! calls fast and enforces its bans locally, a ban issued then waits in its outbox; each host
//! reconnects to the promoted master by itself (through the sentinels), the waiting ban is
//! delivered and a ban issued after the failover reaches every host.
//!
//! Tolerances (a busy 2-core machine): the promotion within 15 s of the kill (typically 2-4
//! s: 500 ms to judge the master down, then the sentinels' vote); every host connected again
//! within 10 s of the promotion (the hosts retry at 100 ms doubling to 2 s); a ban within 5
//! s; control calls during the failover within 100 ms (p99).

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use ratelimit_tests::{
    fleet_lab::{Setup, Store, call, percentile, wait_for},
    kernel_test,
};
use ratelimit_user::api::Request;

/// No rule matches this port: only a ban drops what is sent to it.
const OTHER_PORT: u16 = 9001;
/// The master, the replica, the three sentinels: on one address of the store namespace's
/// loopback, routed to through each host's own link.
const SENTINEL: Store = Store::Sentinel {
    ip: Ipv4Addr::new(100, 64, 252, 1),
    ports: [6379, 6378, 26379, 26380, 26381],
};

const RULES: &str = r#"
[[rule]]
name = "udp-ban"
match = { protocol = "udp", dst_ports = ["9000"] }
action = "rate_based_ban"
threshold = { count = 5, interval = "1h" }
algorithm = "fixed_window"
ban_threshold = { count = 10, interval = "1h" }
ban_duration = "1h"
"#;

#[test]
fn a_failover_through_the_sentinels_is_followed_by_every_host() {
    kernel_test!();
    let t_all = Instant::now();
    let mut f = Setup::new("rlfo").store(SENTINEL).start(|i, url| {
        assert!(url.starts_with("redis+sentinel://"), "{url}");
        format!("[fleet]\nredis = \"{url}\"\nhost_id = \"h{i}\"\n{RULES}")
    });
    f.wait_connected(Duration::from_secs(10));
    let hosts = f.hosts.len();
    let reaches_all = |f: &ratelimit_tests::fleet_lab::FleetLab, cidr: &str| {
        (0..hosts).all(|i| f.holds(i, cidr).is_some())
    };
    f.d(0).cli_ok(&["ban", "add", "203.0.113.1", "--for", "1h"]);
    assert!(
        wait_for(Duration::from_secs(5), || reaches_all(&f, "203.0.113.1/32")),
        "a ban did not spread before the failover"
    );
    let (master, replica) = {
        let s = f.sentinels();
        (s.master.port(), s.replica.port())
    };
    assert_eq!(f.sentinels().master_port(0), Some(master));

    // The master is killed.
    f.sentinels().master.kill();
    let t_kill = Instant::now();
    // Every host notices (its connections are closed), and says so.
    assert!(
        wait_for(Duration::from_secs(5), || (0..hosts)
            .all(|i| !f.fleet(i).connected)),
        "a host did not notice the master's loss: {:?}",
        (0..hosts).map(|i| f.fleet(i)).collect::<Vec<_>>()
    );
    println!(
        "every host degraded {:.0} ms after the kill",
        t_kill.elapsed().as_secs_f64() * 1e3
    );
    // A ban issued now drops at once on its host.
    f.d(1)
        .cli_ok(&["ban", "add", "203.0.113.50", "--for", "1h"]);
    assert_eq!(
        f.reaching(1, Ipv4Addr::new(203, 0, 113, 50), OTHER_PORT, 10),
        0,
        "host 1 let its banned source in during the failover"
    );
    assert_eq!(
        f.reaching(2, Ipv4Addr::new(203, 0, 113, 1), OTHER_PORT, 10),
        0,
        "host 2 let a fleet ban's source in during the failover"
    );
    // Until the sentinels promote the replica, every host's control calls are timed.
    let mut calls = Vec::new();
    let promoted = {
        let give_up = t_kill + Duration::from_secs(15);
        loop {
            for i in 0..hosts {
                for req in [Request::Fleet, Request::Status] {
                    let t0 = Instant::now();
                    call(f.d(i).socket_path(), &req);
                    calls.push(t0.elapsed());
                }
            }
            let s = f.sentinels.as_ref().unwrap();
            if (0..3).all(|i| s.master_port(i) == Some(replica)) {
                break Some(t_kill.elapsed());
            }
            if Instant::now() > give_up {
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let promoted = promoted.unwrap_or_else(|| {
        let s = f.sentinels.as_ref().unwrap();
        panic!(
            "the sentinels did not promote the replica within 15 s: {:?}\n{}",
            (0..3).map(|i| s.master_port(i)).collect::<Vec<_>>(),
            s.sentinels[0].log()
        )
    });
    calls.sort();
    let p99 = percentile(&calls, 0.99);
    println!(
        "replica promoted {:.0} ms after the kill; {} control calls meanwhile: p50 {:.2} ms, \
         p99 {:.2} ms, max {:.2} ms",
        promoted.as_secs_f64() * 1e3,
        calls.len(),
        percentile(&calls, 0.5).as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
        calls.last().unwrap().as_secs_f64() * 1e3
    );
    assert!(p99 < Duration::from_millis(100), "{p99:?}");
    assert_ne!(master, replica);

    // Every host reconnects to the promoted master by itself.
    for i in 0..hosts {
        assert!(
            wait_for(Duration::from_secs(10), || f.fleet(i).connected),
            "host {i} did not reconnect after the failover: {:?}\n{}",
            f.fleet(i),
            f.d(i).logs()
        );
    }
    let reconnected = t_kill.elapsed();
    println!(
        "every host connected again {:.0} ms after the kill ({:.0} ms after the promotion)",
        reconnected.as_secs_f64() * 1e3,
        (reconnected - promoted).as_secs_f64() * 1e3
    );
    // The ban issued during the failover is delivered, and one issued now spreads.
    let t0 = Instant::now();
    assert!(
        wait_for(Duration::from_secs(5), || reaches_all(
            &f,
            "203.0.113.50/32"
        )),
        "the ban issued during the failover was not delivered: {:?}",
        f.fleet(1)
    );
    println!(
        "the outboxed ban reached every host {:.0} ms later",
        t0.elapsed().as_secs_f64() * 1e3
    );
    f.d(2)
        .cli_ok(&["ban", "add", "203.0.113.60", "--for", "1h"]);
    let t0 = Instant::now();
    assert!(
        wait_for(Duration::from_secs(5), || reaches_all(
            &f,
            "203.0.113.60/32"
        )),
        "a ban after the failover did not spread: {:?} {:?}",
        f.fleet(0),
        f.fleet(1)
    );
    println!(
        "a ban issued after the failover reached every host in {:.1} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(
        f.reaching(0, Ipv4Addr::new(203, 0, 113, 60), OTHER_PORT, 10),
        0
    );
    // The promoted master holds what the old one had (replicated) and what came since.
    assert!(f.holds(2, "203.0.113.1/32").is_some());
    for i in 0..hosts {
        assert!(
            !f.events(i, "fleet_degraded").is_empty() && !f.events(i, "fleet_restored").is_empty(),
            "host {i}: {}",
            f.hosts[i].events_text()
        );
    }
    println!("total {:.1} s", t_all.elapsed().as_secs_f64());
}
