//! Bans received from the fleet cannot take the operator's ban table: once the table remote
//! bans go into is full, further remote bans (written straight into the store's stream as
//! records, as a host tripping rule bans under a spoofed flood, or anyone who can write to the
//! store, would send them) still reach the host and are enforced (spilled into the rules'
//! table of bans that drop, counted), and `ratelimit ban add` still goes in and drops.
//!
//! One daemon and a real `redis-server`. Reading a quarter million records through the store
//! takes minutes here, so the test fills the table the daemon installs remote bans in through
//! its pin (as the earlier records would have: the same entries), all but 1,000 places, and
//! sends 2,000 more through the store. Before the fleet had a table of its own, that table was
//! the operator's (`RL_BANS_OPERATOR`): the test fills whichever the daemon uses, so it shows
//! `ban add` failing on a build without `RL_BANS_REMOTE`.

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use aya::maps::{LpmTrie, Map, MapData};
use ratelimit_common::{
    addr::{IpKey, LpmAddr},
    caps::MAX_REMOTE_BANS,
    maps::{BAN_MANUAL, BAN_REMOTE, BanEntry},
};
use ratelimit_tests::{
    fleet_lab::{Setup, wait_for},
    kernel_test,
    scenario::metric_sum,
};
use ratelimit_user::fleet;

/// No rule matches this port: only a ban drops what is sent to it.
const PORT: u16 = 9001;
const HTTP_PORT: u16 = 19478;
/// Places left in the table before the records are sent, and the records sent.
const LEFT: u32 = 1000;
const SENT: u32 = 2000;

/// The `i`-th remote ban: `45.a.b.c/32` with `abc` = `i`.
fn remote_addr(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x2d00_0000 | i)
}

#[test]
fn remote_bans_beyond_their_table_leave_ban_add_working() {
    kernel_test!();
    let mut f = Setup::new("rlfrb")
        .hosts(1)
        .http(HTTP_PORT)
        .start(|i, url| format!("[fleet]\nredis = \"{url}\"\nhost_id = \"h{i}\"\n"));
    f.wait_connected(Duration::from_secs(10));
    let exp_ms = fleet::unix_ms(std::time::SystemTime::now()) + 3_600_000;
    let record = |i: u32| -> Vec<String> {
        let r = fleet::Record {
            op: fleet::Op::Ban,
            net: format!("{}/32", remote_addr(i)),
            exp_ms,
            at_ms: exp_ms - 3_600_000,
            host: "elsewhere".into(),
            rule: Some("udp-flood".into()),
            reason: None,
        };
        vec![
            "XADD".into(),
            fleet::STREAM_KEY.into(),
            "*".into(),
            "r".into(),
            serde_json::to_string(&r).unwrap(),
        ]
    };
    // The reader is at the stream's end (a first record read proves it).
    let out = f.redis().pipe(&[record(0)]);
    assert!(out.contains("errors: 0"), "{out}");
    assert!(
        wait_for(Duration::from_secs(10), || f.fleet(0).bans_received >= 1),
        "the first record was not read: {:?}",
        f.fleet(0)
    );
    // The table remote bans go into, filled but for LEFT places (record 0 holds one).
    let pins = f.hosts[0].bpffs();
    let table = if pins.join("RL_BANS_REMOTE").exists() {
        "RL_BANS_REMOTE"
    } else {
        "RL_BANS_OPERATOR"
    };
    let data = MapData::from_pin(pins.join(table)).expect("pinned ban table");
    let mut bans: LpmTrie<MapData, LpmAddr, BanEntry> =
        LpmTrie::try_from(Map::LpmTrie(data)).expect("lpm trie");
    let now = ratelimit_user::clock::mono_ns();
    let first = SENT + 1;
    for i in first..first + MAX_REMOTE_BANS - 1 - LEFT {
        let addr = IpKey::from_v4(remote_addr(i).octets());
        let e = BanEntry {
            flags: BAN_MANUAL | BAN_REMOTE,
            ..BanEntry::manual(128, addr.addr, now, 0)
        };
        let key = ratelimit_user::kernel::datapath::ban_key(128, &addr);
        ratelimit_user::kernel::datapath::retry_enomem(|| bans.insert(&key, e, 0))
            .expect("fill the table");
    }
    // SENT more records through the store.
    let t0 = Instant::now();
    let cmds: Vec<Vec<String>> = (1..=SENT).map(record).collect();
    let out = f.redis().pipe(&cmds);
    assert!(out.contains("errors: 0"), "{out}");
    assert!(
        wait_for(Duration::from_secs(120), || f.fleet(0).bans_received
            > SENT as u64),
        "not every record was read within 120 s: {:?}",
        f.fleet(0)
    );
    let report = f.fleet(0);
    println!(
        "{table} filled; {SENT} records read and applied in {:?}: {report:?}",
        t0.elapsed()
    );
    // The operator's ban goes in and drops.
    let out = f.d(0).cli(&["ban", "add", "198.51.100.0/24", "--local"]);
    assert!(
        out.status.success(),
        "`ban add` with the fleet's table full failed: {}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(f.reaching(0, Ipv4Addr::new(198, 51, 100, 7), PORT, 5), 0);
    assert_eq!(f.reaching(0, Ipv4Addr::new(203, 0, 113, 7), PORT, 5), 5);
    // Every remote ban sent is enforced (the first ones in the fleet's table, the rest
    // spilled into the rules' table), and the spilled ones are counted.
    assert_eq!(report.bans_skipped, 0, "{report:?}");
    for i in [1, LEFT, LEFT + 1, SENT] {
        assert_eq!(
            f.reaching(0, remote_addr(i), PORT, 3),
            0,
            "{}",
            remote_addr(i)
        );
    }
    // A scrape walks a quarter million bans: on a busy machine it may not answer at once.
    let mut body = String::new();
    assert!(
        wait_for(Duration::from_secs(60), || {
            let (status, b) = f.hosts[0].http_get("/metrics");
            body = b;
            status == 200
        }),
        "/metrics: {body}"
    );
    assert_eq!(
        metric_sum(&body, "ratelimit_remote_bans_spilled_total", &[]),
        (SENT - LEFT) as f64
    );
}
