//! The fleet store as a trust boundary: the attacker writes straight into the store (with
//! `redis-cli`), as anyone holding its password, another tenant or a staging fleet could. A
//! forged ban of `0.0.0.0/0` or `::/0` (stream record or snapshot entry) is not enforced
//! (with the fleet key: it is not authenticated; without: it is wider than the floor), a
//! remote `unban` does not lift a ban this host's own rule issued, a forged count does not
//! throttle a global `key = "all"` rule, and two fleets of other names on one database never
//! see each other's bans. Bans and counts signed with the fleet key still spread.

use std::{
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use ratelimit_tests::{
    fleet_lab::{FleetLab, Setup, Store, fleet_section, sleep_until_wall, wait_for},
    kernel_test,
};

const PORT: u16 = 9000;
/// No rule matches this port: only a ban drops what is sent to it.
const OTHER_PORT: u16 = 9001;

const BAN_RULE: &str = r#"
[[rule]]
name = "udp-ban"
match = { protocol = "udp", dst_ports = ["9000"] }
action = "rate_based_ban"
threshold = { count = 5, interval = "1h" }
algorithm = "fixed_window"
ban_threshold = { count = 10, interval = "1h" }
ban_duration = "1h"
"#;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A fleet key file (mode 0600) in a directory of its own for this test.
fn key_file(tag: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = std::env::temp_dir().join(format!("rl-trust-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("fleet.key");
    std::fs::write(&p, "a-fleet-key-of-32-bytes-0123456\n").unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

fn keyed(url: &str, i: usize, key: &Path) -> String {
    format!(
        "{}key_file = \"{}\"\n",
        fleet_section(url, i),
        key.display()
    )
}

/// A record as the daemon writes it, issued by `host` now.
fn record(op: &str, net: &str, exp_ms: u64, host: &str) -> String {
    format!(
        r#"{{"op":"{op}","net":"{net}","exp_ms":{exp_ms},"at_ms":{},"host":"{host}"}}"#,
        now_ms()
    )
}

/// The attacker's stream records: bans of all of IPv4 and IPv6, forever, from a made-up host,
/// and a narrow one; `mac` as the field `m` of each (a wrong one), or none.
fn forge_stream(f: &mut FleetLab, stream: &str, mac: Option<&str>) {
    for net in ["0.0.0.0/0", "::/0", "198.51.100.9/32"] {
        let r = record("ban", net, 0, "h9");
        let mut args = vec!["XADD", stream, "*", "r", r.as_str()];
        if let Some(m) = mac {
            args.extend(["m", m]);
        }
        let out = f.redis().cli(&args);
        assert!(out.contains('-'), "XADD answered {out}");
    }
}

fn rejected(f: &FleetLab, i: usize) -> u64 {
    f.fleet(i).records_rejected.values().sum()
}

/// (a), (b), (f) with the fleet key: forged stream records and snapshot entries (no MAC, a
/// wrong MAC) are dropped and counted; bans signed by a host of the fleet still spread, and
/// a host that resyncs from the snapshot takes them.
#[test]
fn forged_records_and_snapshot_entries_are_refused_with_a_key_and_signed_bans_spread() {
    kernel_test!();
    let t0 = Instant::now();
    let key = key_file("keyed");
    let mut f = Setup::new("rltk")
        .hosts(2)
        .store(Store::Direct)
        .start(|i, url| keyed(url, i, &key));
    f.wait_connected(Duration::from_secs(10));
    let victim = Ipv4Addr::new(198, 51, 100, 9);
    assert_eq!(f.reaching(1, victim, OTHER_PORT, 10), 10);

    // Stream records: no MAC, then a wrong one.
    forge_stream(&mut f, "ratelimit:{bans}:stream", None);
    forge_stream(&mut f, "ratelimit:{bans}:stream", Some(&"0".repeat(64)));
    // A signed ban from host 0 comes after them: once it is here, they were read.
    f.d(0)
        .cli_ok(&["ban", "add", "203.0.113.77/32", "--for", "1h"]);
    assert!(
        wait_for(Duration::from_secs(5), || f
            .holds(1, "203.0.113.77/32")
            .is_some()),
        "a signed ban did not spread: {:?}\n{}",
        f.fleet(1),
        f.d(1).logs()
    );
    for net in ["0.0.0.0/0", "::/0", "198.51.100.9/32"] {
        assert!(
            f.holds(1, net).is_none(),
            "a forged ban of {net} is enforced"
        );
    }
    assert_eq!(f.reaching(1, victim, OTHER_PORT, 10), 10);
    let r = f.fleet(1);
    assert!(
        r.records_rejected.get("unauthenticated") >= Some(&3)
            && r.records_rejected.get("bad_mac") >= Some(&3),
        "{r:?}"
    );

    // Snapshot entries: host 1 is stopped, a ban is issued on host 0 meanwhile, the attacker
    // writes entries of its own and trims the stream away: host 1 restarted resyncs from the
    // snapshot, takes the signed ban and none of the forged ones.
    f.hosts[1].daemon_mut().stop();
    f.d(0)
        .cli_ok(&["ban", "add", "203.0.113.78/32", "--for", "1h"]);
    for net in ["0.0.0.0/0", "::/0", "198.51.100.9/32"] {
        let r = record("ban", net, 0, "h9");
        f.redis()
            .cli(&["HSET", "ratelimit:{bans}:snap", net, &format!("0|{r}")]);
    }
    // A signed entry replayed as another prefix's.
    let signed = f
        .redis()
        .cli(&["HGET", "ratelimit:{bans}:snap", "203.0.113.78/32"]);
    assert!(signed.starts_with(|c: char| c.is_ascii_digit()), "{signed}");
    f.redis()
        .cli(&["HSET", "ratelimit:{bans}:snap", "198.51.100.0/24", &signed]);
    f.redis()
        .cli(&["XTRIM", "ratelimit:{bans}:stream", "MAXLEN", "0"]);
    f.hosts[1].daemon_mut().restart();
    assert!(
        wait_for(Duration::from_secs(10), || f.fleet(1).connected
            && f.holds(1, "203.0.113.78/32").is_some()),
        "host 1 did not resync the signed ban: {:?}\n{}",
        f.fleet(1),
        f.d(1).logs()
    );
    assert!(f.fleet(1).resyncs >= 1);
    for net in ["0.0.0.0/0", "::/0", "198.51.100.9/32", "198.51.100.0/24"] {
        assert!(
            f.holds(1, net).is_none(),
            "a forged snapshot entry {net} is enforced"
        );
    }
    assert!(
        f.holds(1, "203.0.113.78/32")
            .unwrap()
            .remaining_secs
            .unwrap()
            <= 3600.0
    );
    assert_eq!(f.reaching(1, victim, OTHER_PORT, 10), 10);
    assert!(rejected(&f, 1) >= 4, "{:?}", f.fleet(1));
    let r = f.fleet(1);
    assert!(r.authenticated, "{r:?}");
    let m = f.d(1).cli_ok(&["fleet", "status"]);
    assert!(m.contains("authenticated: true"), "{m}");
    println!(
        "keyed: rejected {:?}; took {:.1}s",
        f.fleet(1).records_rejected,
        t0.elapsed().as_secs_f64()
    );
}

/// (a) without a key, and item 10's bounds: a forged ban of all of IPv4 or IPv6 is wider
/// than the floor and refused, a permanent one is clamped to the maximum, a record with an
/// out-of-bound field is dropped; each counted.
#[test]
fn without_a_key_remote_bans_are_held_to_the_floor_the_maximum_and_their_bounds() {
    kernel_test!();
    let mut f = Setup::new("rltn")
        .hosts(1)
        .store(Store::Direct)
        .start(|i, url| {
            format!(
                "{}remote_ban_max_duration = \"1h\"\n",
                fleet_section(url, i)
            )
        });
    f.wait_connected(Duration::from_secs(10));
    let stream = "ratelimit:{bans}:stream";
    for net in ["0.0.0.0/0", "::/0", "10.0.0.0/8", "2001:db8::/31"] {
        f.redis()
            .cli(&["XADD", stream, "*", "r", &record("ban", net, 0, "h9")]);
    }
    let long_host = "h".repeat(200);
    f.redis().cli(&[
        "XADD",
        stream,
        "*",
        "r",
        &record("ban", "198.51.100.7/32", 0, &long_host),
    ]);
    let future = format!(
        r#"{{"op":"ban","net":"198.51.100.8/32","exp_ms":0,"at_ms":{},"host":"h9"}}"#,
        now_ms() + 86_400_000
    );
    f.redis().cli(&["XADD", stream, "*", "r", &future]);
    // Within the floor, forever: taken, for an hour at most.
    f.redis().cli(&[
        "XADD",
        stream,
        "*",
        "r",
        &record("ban", "198.51.0.0/16", 0, "h9"),
    ]);
    assert!(
        wait_for(Duration::from_secs(5), || f
            .holds(0, "198.51.0.0/16")
            .is_some()),
        "{:?}",
        f.bans(0)
    );
    let b = f.holds(0, "198.51.0.0/16").unwrap();
    let left = b.remaining_secs.expect("clamped to an end");
    assert!(left <= 3600.0 && left > 3500.0, "{b:?}");
    for net in [
        "0.0.0.0/0",
        "::/0",
        "10.0.0.0/8",
        "2001:db8::/31",
        "198.51.100.7/32",
        "198.51.100.8/32",
    ] {
        assert!(f.holds(0, net).is_none(), "{net} is enforced");
    }
    assert_eq!(
        f.reaching(0, Ipv4Addr::new(10, 1, 2, 3), OTHER_PORT, 10),
        10
    );
    let r = f.fleet(0);
    assert_eq!(r.records_rejected.get("too_wide"), Some(&4), "{r:?}");
    assert_eq!(r.records_rejected.get("out_of_bounds"), Some(&2), "{r:?}");
    assert_eq!(r.bans_clamped, 1, "{r:?}");
    assert!(!r.authenticated);
    let status = f.d(0).cli_ok(&["fleet", "status"]);
    assert!(status.contains("authenticated: false"), "{status}");
}

/// (c): a remote `unban` lifts the fleet's copy of a ban here, never a ban this host's own
/// rule issued.
#[test]
fn a_remote_unban_never_lifts_this_host_s_rule_ban() {
    kernel_test!();
    let f = Setup::new("rltu")
        .hosts(2)
        .store(Store::Direct)
        .start(|i, url| format!("{}{BAN_RULE}", fleet_section(url, i)));
    f.wait_connected(Duration::from_secs(10));
    // A rule ban on host 1, which host 0 receives.
    let offender = Ipv4Addr::new(198, 19, 8, 8);
    let h1 = &f.hosts[1];
    let mut tx = h1.sender();
    tx.send_n(std::iter::repeat(h1.udp4(offender, PORT)), 20, None);
    let cidr = "198.19.8.8/32";
    assert!(
        wait_for(Duration::from_secs(5), || f
            .holds(1, cidr)
            .is_some_and(|b| b.rule.as_deref() == Some("udp-ban"))
            && f.holds(0, cidr).is_some()),
        "the rule did not ban on host 1, or it did not spread: {:?} {:?}",
        f.bans(1),
        f.bans(0)
    );
    // An operator's ban on host 0, which host 1 receives.
    f.d(0)
        .cli_ok(&["ban", "add", "203.0.113.90/32", "--for", "1h"]);
    assert!(wait_for(Duration::from_secs(5), || f
        .holds(1, "203.0.113.90/32")
        .is_some()));
    // Host 0's operator lifts both: a published unban each.
    f.d(0).cli_ok(&["ban", "del", cidr]);
    f.d(0).cli_ok(&["ban", "del", "203.0.113.90"]);
    assert!(
        wait_for(Duration::from_secs(5), || f
            .holds(1, "203.0.113.90/32")
            .is_none()),
        "the remote copy was not lifted"
    );
    // The unban of the rule's ban came first: it was read, and left the rule's ban.
    let b = f.holds(1, cidr);
    assert!(
        b.as_ref()
            .is_some_and(|b| b.rule.as_deref() == Some("udp-ban")),
        "host 1's own rule ban was lifted by a remote unban: {b:?}"
    );
    assert_eq!(f.fleet(1).unbans_received, 2);
}

/// (d): with the fleet key, counts written into a global `key = "all"` rule's hashes without
/// a valid MAC do not throttle it; the hosts' signed counts still hold the threshold across
/// the fleet.
#[test]
fn a_forged_count_does_not_throttle_a_global_key_all_rule_with_a_key() {
    kernel_test!();
    const T: u64 = 4;
    let key = key_file("counts");
    let mut f = Setup::new("rltc")
        .hosts(2)
        .store(Store::Direct)
        .start(|i, url| {
            format!(
                "{}\n[[rule]]\nname = \"udp-all\"\nmatch = {{ protocol = \"udp\", dst_ports = \
             [\"{PORT}\"] }}\nkey = \"all\"\naction = \"throttle\"\nthreshold = {{ count = \
             100, interval = \"{T}s\" }}\nscope = \"global\"\n",
                keyed(url, i, &key)
            )
        });
    f.wait_connected(Duration::from_secs(10));
    assert!(wait_for(Duration::from_secs(10), || (0..2).all(|i| f
        .fleet(i)
        .global
        .rules
        == ["udp-all"])));
    let src = Ipv4Addr::new(198, 18, 9, 9);
    // The attacker, every 100 ms: every count hash of the store gets a huge count for the
    // key, unauthenticated and with a wrong MAC.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let redis = f.redis.take().expect("a single store");
    let attacker = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut forged = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let keys = redis.cli(&["--scan", "--pattern", "ratelimit:*:a:*"]);
                for k in keys.lines().filter(|k| !k.is_empty()) {
                    redis.cli(&[
                        "HSET",
                        k,
                        "all",
                        "1000000",
                        "all|h9",
                        "1000000",
                        "all#m",
                        &format!("h9,1000000;h8,1000000,{}", "0".repeat(64)),
                    ]);
                    forged += 1;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            (redis, forged)
        })
    };
    // A light client on host 0 (well under the threshold) for 3 windows.
    let (mut sent, mut got) = (0u64, 0u64);
    let until = Instant::now() + Duration::from_secs(3 * T);
    while Instant::now() < until {
        got += f.reaching(0, src, PORT, 5);
        sent += 5;
        std::thread::sleep(Duration::from_millis(300));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (redis, forged) = attacker.join().unwrap();
    f.redis = Some(redis);
    println!("forged counts written {forged} times; the light client: {got} of {sent}");
    assert!(forged > 0, "the attacker found no count hash");
    assert!(
        got * 100 >= sent * 95,
        "forged counts throttled the rule: {got} of {sent} passed"
    );
    let g = f.fleet(0);
    assert!(g.counts_rejected.values().sum::<u64>() > 0, "{g:?}");

    // Signed counts are believed: host 1 admits the threshold early in a window, then host 0
    // admits (nearly) nothing of it.
    let start = Duration::from_secs((now_ms() / 1000 / T + 1) * T);
    sleep_until_wall(start + Duration::from_millis(200));
    let h1 = f.reaching(1, src, PORT, 150);
    std::thread::sleep(Duration::from_millis(800));
    let h0 = f.reaching(0, src, PORT, 50);
    println!("one window: host 1 admitted {h1} of 150, then host 0 {h0} of 50");
    assert!(h1 <= 100, "host 1: {h1}");
    assert!(
        h0 <= 10,
        "host 0 admitted {h0} after the fleet reached its threshold"
    );
}

/// (e): two fleets of other names on one store: neither sees the other's bans or peers.
#[test]
fn two_fleets_on_one_store_never_share_bans_or_peers() {
    kernel_test!();
    let mut f = Setup::new("rltf")
        .hosts(2)
        .store(Store::Direct)
        .start(|i, url| {
            format!(
                "{}name = \"{}\"\n",
                fleet_section(url, i),
                ["blue", "green"][i]
            )
        });
    f.wait_connected(Duration::from_secs(10));
    f.d(0)
        .cli_ok(&["ban", "add", "203.0.113.60/32", "--for", "1h"]);
    f.d(1)
        .cli_ok(&["ban", "add", "203.0.113.61/32", "--for", "1h"]);
    assert!(
        wait_for(Duration::from_secs(5), || f
            .redis()
            .cli(&["XLEN", "ratelimit:blue:{bans}:stream"])
            == "1"
            && f.redis().cli(&["XLEN", "ratelimit:green:{bans}:stream"])
                == "1"),
        "{}",
        f.redis().cli(&["KEYS", "*"])
    );
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        f.holds(1, "203.0.113.60/32").is_none(),
        "green took blue's ban"
    );
    assert!(
        f.holds(0, "203.0.113.61/32").is_none(),
        "blue took green's ban"
    );
    for i in 0..2 {
        let peers: Vec<String> = f.fleet(i).peers.into_iter().map(|p| p.host_id).collect();
        assert_eq!(peers, [format!("h{i}")], "host {i}'s peers");
    }
    assert_eq!(f.fleet(0).fleet_name, "blue");
}
