//! Fleet mode at scale, and against what others write into the store: daemons in their own
//! namespaces share a real `redis-server`, and the test writes into the store straight.
//!
//! - `fleet key` asked by 8 looping HTTP clients at once (half of one peer's most): the store sees a bounded number
//!   of reads from the host (one shared connection, a cache, a rate bound), and the answers
//!   are still right.
//! - A restarted host catches up from a snapshot of 300,000 bans, read page by page.
//! - 200,000 fake peers in the peers hash: `fleet peers` and `/v1/fleet` stay bounded in size
//!   and time, the real peers stay fresh, and bans still travel.
//! - Two hosts given one host id find each other out, say so, and leave global counting
//!   until one of them is gone; a restart is not a duplicate.

use std::{
    net::Ipv4Addr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use ratelimit_tests::{
    fleet_lab::{FleetLab, Setup, fleet_section, udp_rule, wait_for},
    kernel_test,
};
use ratelimit_user::{fleet, fleet::key::KeyReport};

const PORT: u16 = 9000;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The `calls=` of one command in `INFO commandstats` (0 if it was never called).
fn calls(stats: &str, cmd: &str) -> u64 {
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
        .and_then(|rest| rest.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

/// One field of `INFO` (e.g. `total_connections_received`).
fn info_field(info: &str, name: &str) -> u64 {
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// One plain `/metrics` series' value (no labels), if present.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
}

/// `/v1/fleet/key` from looping clients for a few seconds (as many as one peer may hold).
///
/// The bound: the daemon reads the store for `fleet key` at most 10 times a second (a burst
/// of 10), one `HMGET` per global rule and window each (here 1 rule, 2 windows); its
/// heartbeat adds one `HMGET` a second. Over `RUN` seconds that is at most
/// `2 * (10 * RUN + 10) + RUN` `HMGET`s, given a tolerance of 20 more for a slow second at
/// the edges. The store sees at most a few new connections from the daemon (one shared
/// connection for `fleet key`; none per request). Before: two `HGETALL`s and a new
/// connection per request.
#[test]
fn fleet_key_from_many_clients_puts_a_bounded_load_on_the_store() {
    kernel_test!();
    const HTTP_PORT: u16 = 19491;
    // Half of what one peer may hold open at once (`http_slots::MAX_PER_PEER`): more from one
    // address are refused by the listener before they reach the daemon, and each request's
    // connection is given back a moment after its client closed it.
    const CLIENTS: usize = ratelimit_user::serve::http_slots::MAX_PER_PEER / 2;
    const RUN: Duration = Duration::from_secs(4);
    const T_SECS: u64 = 60;
    let mut f = Setup::new("rlsk").hosts(1).http(HTTP_PORT).start(|i, url| {
        format!(
            "{}\n{}",
            fleet_section(url, i),
            udp_rule("udp-global", PORT, 1000, T_SECS, "global")
        )
    });
    f.wait_connected(Duration::from_secs(15));
    let probe = "198.18.7.7";
    // The client's hash and window, from a first answer; then counts of another host (h9,
    // with a heartbeat, so it is a known peer) written into the store by hand.
    let first = |f: &FleetLab| -> KeyReport {
        let (code, body) = f.hosts[0].http_get(&format!("/v1/fleet/key?addr={probe}"));
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    };
    let k = first(&f);
    let r = &k.rules[0];
    let w = &r.fleet.as_ref().expect("the store read")[0];
    let (hash, window) = (w.hash.clone(), w.window);
    let name = r.key.clone();
    let beat = format!(
        r#"{{"host_id":"h9","version":"0","seen_ms":{},"bans_published":0,"bans_received":0}}"#,
        now_ms()
    );
    f.redis().cli(&["HSET", fleet::PEERS_KEY, "h9", &beat]);
    f.redis()
        .cli(&["HSET", &hash, &name, "150", &format!("{name}|h9"), "150"]);
    f.redis().cli(&["PEXPIRE", &hash, "300000"]);
    // The cache (if any) forgets the first answer (it serves counts up to 10 s old when the
    // rate bound is reached); the heartbeat finds h9.
    std::thread::sleep(Duration::from_secs(11));

    let info0 = f.redis().cli(&["INFO", "all"]);
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, busy, other, right, wrong) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for c in 0..CLIENTS {
            let (stop, ok, busy, other, right, wrong) = (
                stop.clone(),
                ok.clone(),
                busy.clone(),
                other.clone(),
                right.clone(),
                wrong.clone(),
            );
            let (h, name) = (&f.hosts[0], name.clone());
            s.spawn(move || {
                let mut n = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    // Half the clients ask for the probe; the rest each for addresses of
                    // their own, changing, so the cache alone cannot answer them.
                    let addr = if c % 2 == 0 {
                        probe.to_string()
                    } else {
                        n += 1;
                        format!("198.19.{}.{}", c, n % 250)
                    };
                    let (code, body) = h.http_get(&format!("/v1/fleet/key?addr={addr}"));
                    match code {
                        200 => {
                            ok.fetch_add(1, Ordering::Relaxed);
                            if addr == probe {
                                let k: KeyReport = serde_json::from_str(&body).unwrap();
                                let fleet = k.rules[0].fleet.clone().unwrap_or_default();
                                let seen = fleet.iter().find(|w| w.window == window);
                                match seen {
                                    Some(w)
                                        if w.total == 150
                                            && w.hosts.get("h9") == Some(&150)
                                            && k.rules[0].key == name =>
                                    {
                                        right.fetch_add(1, Ordering::Relaxed);
                                    }
                                    // The window rolled on (a minute's): not this answer's.
                                    None if !fleet.is_empty() => {}
                                    _ => {
                                        eprintln!("a wrong answer: {body}");
                                        wrong.fetch_add(1, Ordering::Relaxed);
                                    }
                                }
                            }
                        }
                        429 | 503 => {
                            busy.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {
                            eprintln!("HTTP {code}: {body}");
                            other.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
        }
        std::thread::sleep(RUN);
        stop.store(true, Ordering::Relaxed);
    });
    let secs = t0.elapsed().as_secs_f64();
    let info1 = f.redis().cli(&["INFO", "all"]);
    let d = |cmd: &str| calls(&info1, cmd) - calls(&info0, cmd);
    let (hmget, hgetall) = (d("hmget"), d("hgetall"));
    let conns = info_field(&info1, "total_connections_received")
        - info_field(&info0, "total_connections_received");
    let (ok, busy, other, right, wrong) = (
        ok.load(Ordering::Relaxed),
        busy.load(Ordering::Relaxed),
        other.load(Ordering::Relaxed),
        right.load(Ordering::Relaxed),
        wrong.load(Ordering::Relaxed),
    );
    println!(
        "{CLIENTS} clients for {secs:.1}s: {ok} answered, {busy} refused busy (429/503), \
         {other} other; probe answers right {right}, wrong {wrong}; the store saw {hmget} \
         HMGET, {hgetall} HGETALL, {conns} new connections"
    );
    let bound = 2 * (10 * secs.ceil() as u64 + 10) + secs.ceil() as u64 + 20;
    assert_eq!(other, 0, "answers other than 200, 429 and 503");
    assert_eq!(wrong, 0, "wrong answers for the probe");
    assert!(right >= 10, "too few right answers for the probe: {right}");
    assert_eq!(hgetall, 0, "count hashes read whole");
    assert!(
        hmget <= bound,
        "{hmget} HMGET in {secs:.1}s, more than the bound {bound}"
    );
    assert!(conns <= 3, "{conns} new connections to the store");
    // The bound is said: in the answers, and in the metrics.
    let (_, text) = f.hosts[0].http_get("/metrics");
    let reads = metric(&text, "ratelimit_fleet_key_store_reads_total").unwrap_or(-1.0);
    let refused = metric(&text, "ratelimit_fleet_key_busy_total").unwrap_or(-1.0);
    println!("metrics: {reads} store reads, {refused} refused busy");
    assert!(reads >= 1.0 && refused >= 1.0, "{text}");
    // The CLI (the control socket) is served the same way.
    let d = f.d(0);
    let text = d.cli_ok(&["fleet", "key", probe]);
    assert!(text.contains("150 admitted (h9 150)"), "{text}");
}

/// The record of a ban of `net` by host h9, as the publishing script stores it in the
/// snapshot (`<end ms>|<record>`).
const SNAPSHOT_SCRIPT: &str = r#"
local from, to, exp, at = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4]
for i = from, to - 1 do
  local net = '10.' .. math.floor(i / 65536) .. '.' .. (math.floor(i / 256) % 256) .. '.' .. (i % 256) .. '/32'
  local rec = '{"op":"ban","net":"' .. net .. '","exp_ms":' .. exp .. ',"at_ms":' .. at ..
    ',"host":"h9","rule":"scanners","reason":"' .. ARGV[5] .. '"}'
  redis.call('HSET', KEYS[1], net, exp .. '|' .. rec)
end
return to - from
"#;

/// A restarted host whose cursor was trimmed away catches up from a snapshot of bans read a
/// page at a time: it installs every one the table holds (the operator's table holds
/// `MAX_OPERATOR_BANS` = 262,144; the rest fail to install, are counted as skipped, and are
/// not retried), then follows the stream (two `unban`s and a `ban` written after arrive).
///
/// 300,000 bans (`RATELIMIT_RESYNC_BANS` sets another number), given 0.4 s per 1,000 bans
/// (45 s at least: 120 s for 300,000, which took 24 s here in a debug build, and 290 s before). Before: the snapshot was
/// read whole (`HGETALL`) under a 2 s timeout, and read again whole after every failure; then
/// each page's apply copied every ban's reason and origin kept so far, and the bans were saved
/// to disk every second however long a save took, so the catch-up slowed as it went (about
/// 400 bans a second past 100,000).
#[test]
fn a_restarted_host_catches_up_from_a_snapshot_of_300k_bans() {
    kernel_test!();
    let bans: u64 = std::env::var("RATELIMIT_RESYNC_BANS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300_000);
    let catch_up = Duration::from_secs(45).max(Duration::from_micros(bans * 400));
    let table = u64::from(ratelimit_common::caps::MAX_OPERATOR_BANS);
    let mut f = Setup::new("rlsr")
        .hosts(1)
        .start(|i, url| fleet_section(url, i));
    f.wait_connected(Duration::from_secs(15));
    f.hosts[0].daemon_mut().stop();
    // The snapshot, written by hand in pages of 50,000; the stream emptied (the cursor gone).
    let t_write = Instant::now();
    let exp = (now_ms() + 3_600_000).to_string();
    let at = now_ms().to_string();
    let reason = "banned by the fleet's scanner rule, seen probing many ports; ticket 12345";
    for from in (0..bans).step_by(50_000) {
        let n = f.redis().cli(&[
            "EVAL",
            SNAPSHOT_SCRIPT,
            "1",
            fleet::SNAP_KEY,
            &from.to_string(),
            &(from + 50_000).min(bans).to_string(),
            &exp,
            &at,
            reason,
        ]);
        assert_eq!(n, (bans - from).min(50_000).to_string());
    }
    f.redis().cli(&[
        "XADD",
        fleet::STREAM_KEY,
        "*",
        "r",
        r#"{"op":"unban","net":"192.0.2.1/32","at_ms":1,"host":"h9"}"#,
    ]);
    f.redis().cli(&["XTRIM", fleet::STREAM_KEY, "MAXLEN", "0"]);
    assert_eq!(f.redis().cli(&["HLEN", fleet::SNAP_KEY]), bans.to_string());
    println!(
        "{bans} bans written into the snapshot in {:.1}s",
        t_write.elapsed().as_secs_f64()
    );

    let t0 = Instant::now();
    f.hosts[0].daemon_mut().restart();
    let want = bans.min(table);
    let mut last = None;
    let done = wait_for(catch_up, || {
        let st = f.fleet(0);
        let done = st.connected && st.bans_received >= want;
        last = Some(st);
        if !done {
            std::thread::sleep(Duration::from_millis(250));
        }
        done
    });
    let took = t0.elapsed();
    let st = last.expect("read");
    println!(
        "restarted: {} bans installed ({} skipped), {} resyncs, connected {} after {:.1}s",
        st.bans_received,
        st.bans_skipped,
        st.resyncs,
        st.connected,
        took.as_secs_f64()
    );
    assert!(
        done,
        "not caught up within {catch_up:?}: {st:?}\n{}",
        f.d(0)
            .logs()
            .lines()
            .rev()
            .take(30)
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(st.resyncs, 1, "{st:?}");
    let held = f.d(0).status().active_bans;
    assert!(held >= want, "{held} bans held, {want} wanted");
    // The stream is followed: an unban frees two places, and a new ban takes one.
    for r in [
        r#"{"op":"unban","net":"10.0.0.5/32","at_ms":AT,"host":"h9"}"#,
        r#"{"op":"unban","net":"10.0.0.6/32","at_ms":AT,"host":"h9"}"#,
        r#"{"op":"ban","net":"198.51.100.77/32","exp_ms":EXP,"at_ms":AT,"host":"h9"}"#,
    ] {
        let r = r.replace("AT", &now_ms().to_string()).replace("EXP", &exp);
        f.redis().cli(&["XADD", fleet::STREAM_KEY, "*", "r", &r]);
    }
    assert!(
        wait_for(Duration::from_secs(10), || {
            let st = f.fleet(0);
            st.unbans_received >= 2 && st.bans_received > want
        }),
        "the stream's records after the resync did not arrive: {:?}",
        f.fleet(0)
    );
    assert_eq!(f.d(0).status().active_bans, held - 1);
}

/// Fake heartbeats in the peers hash (`KEYS[1]`) and the recency index (`KEYS[2]`): ids
/// `ARGV[1]..ARGV[2]`, seen at `ARGV[3]` (unix ms); every hundredth claims in the index to be
/// seen at `ARGV[4]` (a time to come).
const PEERS_SCRIPT: &str = r#"
local from, to, seen, later = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4]
for i = from, to - 1 do
  local id = 'fake-' .. i
  redis.call('HSET', KEYS[1], id, '{"host_id":"' .. id .. '","version":"0.0.0","seen_ms":' .. seen ..
    ',"bans_published":0,"bans_received":0}')
  if i % 100 == 0 then
    redis.call('ZADD', KEYS[2], later, id)
  else
    redis.call('ZADD', KEYS[2], seen, id)
  end
end
return to - from
"#;

/// 200,000 fake peers (seen a minute ago, 2,000 of them claiming an hour to come in the recency
/// index) written into the peers hash and the index: every host still shows a bounded list (at
/// most 256 peers: itself and the most recently seen, and how many more there are), answers
/// `/v1/fleet` and `fleet peers` small and fast, sees its real peer fresh, keeps the index
/// bounded, and receives bans. Before: every host read the whole hash every second; then a
/// real peer not yet seen when the fakes came was found only when the walk of the hash
/// reached it (400 beats).
#[test]
fn fake_peers_by_the_hundred_thousand_keep_the_peers_list_bounded() {
    kernel_test!();
    const HTTP_PORT: u16 = 19493;
    const FAKES: u64 = 200_000;
    let mut f = Setup::new("rlsp")
        .hosts(2)
        .http(HTTP_PORT)
        .start(|i, url| fleet_section(url, i));
    f.wait_connected(Duration::from_secs(15));
    let seen = (now_ms() - 60_000).to_string();
    let later = (now_ms() + 3_600_000).to_string();
    for from in (0..FAKES).step_by(50_000) {
        f.redis().cli(&[
            "EVAL",
            PEERS_SCRIPT,
            "2",
            fleet::PEERS_KEY,
            fleet::PEERS_SEEN_KEY,
            &from.to_string(),
            &(from + 50_000).to_string(),
            &seen,
            &later,
        ]);
    }
    assert_eq!(
        f.redis().cli(&["HLEN", fleet::PEERS_KEY]),
        (FAKES + 2).to_string()
    );
    // Long enough for a peer no longer read to show stale (10 s).
    std::thread::sleep(Duration::from_secs(12));
    for i in 0..2 {
        let t0 = Instant::now();
        let (code, body) = f.hosts[i].http_get("/v1/fleet");
        let took = t0.elapsed();
        assert_eq!(code, 200);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let peers = v["peers"].as_array().unwrap();
        let me = format!("h{i}");
        let other = format!("h{}", 1 - i);
        println!(
            "host {i}: /v1/fleet {} bytes in {:.0} ms, {} peers shown, {} in all",
            body.len(),
            took.as_secs_f64() * 1e3,
            peers.len(),
            v["peers_total"]
        );
        assert!(body.len() < 256 * 1024, "{} bytes", body.len());
        assert!(took < Duration::from_secs(2), "{took:?}");
        assert!(peers.len() <= 256, "{} peers", peers.len());
        assert_eq!(v["peers_total"], FAKES + 2, "{}", v["peers_total"]);
        for id in [&me, &other] {
            let p = peers
                .iter()
                .find(|p| p["host_id"] == id.as_str())
                .unwrap_or_else(|| panic!("{id} not among the peers shown by host {i}"));
            assert_eq!(p["stale"], false, "{id} is shown stale by host {i}: {p}");
        }
        let p = peers
            .iter()
            .find(|p| p["host_id"] == me.as_str())
            .unwrap_or_else(|| panic!("{me} not among the peers shown by host {i}"));
        assert_eq!(p["this_host"], true, "{p}");
        assert_eq!(p["stale"], false, "{me} is shown stale by host {i}: {p}");
        let t0 = Instant::now();
        let text = f.d(i).cli_ok(&["fleet", "peers"]);
        let took = t0.elapsed();
        assert!(
            text.lines().count() <= 260,
            "{} lines",
            text.lines().count()
        );
        assert!(took < Duration::from_secs(5), "{took:?}");
        assert!(
            text.contains("more peers"),
            "{}",
            &text[text.len().saturating_sub(500)..]
        );
    }
    let kept: usize = f
        .redis()
        .cli(&["ZCARD", fleet::PEERS_SEEN_KEY])
        .parse()
        .unwrap();
    assert!(
        kept <= fleet::peers::SEEN_KEEP,
        "{kept} in the recency index"
    );
    // Bans still travel.
    f.d(0)
        .cli_ok(&["ban", "add", "203.0.113.90", "--for", "1h"]);
    assert!(
        wait_for(Duration::from_secs(5), || f
            .holds(1, "203.0.113.90/32")
            .is_some()),
        "the ban did not reach host 1: {:?}",
        f.fleet(1)
    );
}

/// Two hosts started with one host id (a cloned image) find each other out within 10 s: each
/// says so (`fleet_duplicate_id`, `fleet status`, `/v1/fleet`, the metric) and takes no part
/// in global counting while it lasts. One of them stopped, the other clears within 20 s
/// (`fleet_duplicate_id_cleared`) and counts again; restarted alone, it is no duplicate.
#[test]
fn two_hosts_with_one_id_are_told_and_leave_global_counting() {
    kernel_test!();
    const HTTP_PORT: u16 = 19494;
    let mut f = Setup::new("rlsd").hosts(2).http(HTTP_PORT).start(|_, url| {
        format!(
            "[fleet]\nredis = \"{url}\"\nhost_id = \"twin\"\nsync_interval = \"50ms\"\n\n{}",
            udp_rule("udp-global", PORT, 300, 3, "global")
        )
    });
    f.wait_connected(Duration::from_secs(15));
    let dup = |f: &FleetLab, i: usize| -> serde_json::Value {
        f.d(i).cli_json(&["fleet", "status"])["duplicate_id"].clone()
    };
    for i in 0..2 {
        assert!(
            wait_for(Duration::from_secs(10), || dup(&f, i)["active"] == true),
            "host {i} does not see the duplicate: {}",
            dup(&f, i)
        );
    }
    println!("host 0: {}", dup(&f, 0));
    for i in 0..2 {
        let ev = f.events(i, "fleet_duplicate_id");
        assert_eq!(ev.len(), 1, "{ev:?}");
        assert_eq!(ev[0]["host_id"], "twin", "{ev:?}");
        let status = f.d(i).cli_ok(&["fleet", "status"]);
        assert!(status.contains("DUPLICATE HOST ID"), "{status}");
        let (_, text) = f.hosts[i].http_get("/metrics");
        assert_eq!(
            metric(&text, "ratelimit_fleet_duplicate_id"),
            Some(1.0),
            "{text}"
        );
        let (_, body) = f.hosts[i].http_get("/v1/fleet");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["duplicate_id"]["active"], true, "{body}");
    }
    // No global counting meanwhile: traffic under the global rule makes no round.
    let src = Ipv4Addr::new(198, 18, 9, 9);
    let rounds = |f: &FleetLab| -> Vec<u64> { (0..2).map(|i| f.fleet(i).global.rounds).collect() };
    let before = rounds(&f);
    let senders: Vec<_> = f
        .hosts
        .iter()
        .map(|h| h.blast(h.udp4(src, PORT), 100, Duration::from_secs(3), None))
        .collect();
    for s in senders {
        s.join().expect("sender");
    }
    assert_eq!(rounds(&f), before, "global rounds while a duplicate");

    // Host 1 gone: host 0 clears, and counts again.
    f.hosts[1].daemon_mut().stop();
    assert!(
        wait_for(Duration::from_secs(20), || dup(&f, 0)["active"] == false),
        "host 0 still sees a duplicate: {}",
        dup(&f, 0)
    );
    let cleared = f.events(0, "fleet_duplicate_id_cleared");
    assert_eq!(cleared.len(), 1, "{cleared:?}");
    let (_, text) = f.hosts[0].http_get("/metrics");
    assert_eq!(metric(&text, "ratelimit_fleet_duplicate_id"), Some(0.0));
    let h = &f.hosts[0];
    let before = f.fleet(0).global.rounds;
    h.blast(h.udp4(src, PORT), 100, Duration::from_secs(2), None)
        .join()
        .expect("sender");
    assert!(
        wait_for(Duration::from_secs(5), || f.fleet(0).global.rounds > before),
        "no global round after the duplicate cleared: {:?}",
        f.fleet(0).global
    );

    // A restart finds the old instance's heartbeat: that is no duplicate.
    f.hosts[0].daemon_mut().restart();
    assert!(
        wait_for(Duration::from_secs(15), || f.fleet(0).connected),
        "{:?}",
        f.fleet(0)
    );
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(dup(&f, 0)["active"], false, "{}", dup(&f, 0));
    assert!(
        f.events(0, "fleet_duplicate_id").len() <= 1,
        "a restart taken for a duplicate"
    );
}
