//! Fleet mode over TLS: daemons, each in its own namespace, share their bans through
//! one real `redis-server` that speaks only TLS (`--port 0 --tls-port`) and requires client
//! certificates (`--tls-auth-clients yes`), with a throwaway CA made by `openssl`. Hosts 0 and
//! 1 verify the server with that CA and present a client certificate it signed: a ban added on
//! either reaches the other. Host 2 is given another CA: it cannot verify the server, so its
//! `fleet status` says degraded with the certificate error, answers fast, and the host still
//! enforces its own bans (which wait in its outbox). Host 3 trusts the right CA but has no
//! client certificate: the server refuses it. A Redis Cluster of three masters speaking only
//! TLS (`rediss+cluster://`, `--tls-cluster yes`) carries bans between two hosts.
//!
//! `ratelimit check-config` reads the TLS files too (no kernel needed): a private key readable
//! by every user, a missing file, a CA file that holds no certificate are refused, naming the
//! key.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::Path,
    time::{Duration, Instant},
};

use ratelimit_tests::{
    env::ratelimit_bin,
    fleet_lab::{FleetLab, Setup, Store, call, percentile, wait_for},
    kernel_test,
    store::TlsFiles,
};
use ratelimit_user::api::Request;

/// No rule matches this port: only a ban drops what is sent to it.
const OTHER_PORT: u16 = 9001;
/// The TLS store: an address on the store namespace's loopback, routed to through each host's
/// own link, and its TLS port.
const STORE_IP: Ipv4Addr = Ipv4Addr::new(100, 64, 251, 1);
const STORE_PORT: u16 = 6380;
/// The TLS cluster's nodes: one address, three ports.
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(100, 64, 251, 2);
const CLUSTER_PORTS: [u16; 3] = [7101, 7102, 7103];

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
fn bans_spread_over_tls_and_a_host_with_the_wrong_ca_enforces_alone() {
    kernel_test!();
    let t_all = Instant::now();
    // Declared first, dropped last: the lab's server and daemons read these files.
    let pki = TlsFiles::generate(&[IpAddr::V4(STORE_IP)]);
    let (ca, other_ca, cert, key) = (
        pki.ca(),
        pki.other_ca(),
        pki.client_cert(),
        pki.client_key(),
    );
    let f: FleetLab = Setup::new("rlta")
        .store(Store::Tls {
            ip: STORE_IP,
            port: STORE_PORT,
        })
        .tls(pki.server(true))
        .hosts(4)
        .start(|i, url| {
            assert!(url.starts_with("rediss://"), "{url}");
            let ca = if i == 2 { &other_ca } else { &ca };
            let client = if i == 3 {
                String::new()
            } else {
                format!(
                    "tls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n",
                    cert.display(),
                    key.display()
                )
            };
            format!(
                "[fleet]\nredis = \"{url}\"\nhost_id = \"h{i}\"\ntls_ca_file = \"{}\"\n\
                 {client}{RULES}",
                ca.display(),
            )
        });
    for i in 0..2 {
        assert!(
            wait_for(Duration::from_secs(10), || f.fleet(i).connected),
            "host {i} never connected over TLS: {:?}\n{}",
            f.fleet(i),
            f.d(i).logs()
        );
    }
    // `redis-cli --tls` with the client certificate is answered.
    assert_eq!(f.redis.as_ref().unwrap().cli(&["PING"]), "PONG");

    // (a) `ban add` on host 0 reaches host 1, and on host 1 reaches host 0: the time from the
    // CLI's return to the ban in the other host's `bans`, 20 times each way.
    let mut delays = Vec::new();
    for n in 0..40u8 {
        let (from, to) = if n % 2 == 0 { (0, 1) } else { (1, 0) };
        let cidr = format!("203.0.113.{n}/32");
        f.d(from).cli_ok(&["ban", "add", &cidr, "--for", "1h"]);
        let t0 = Instant::now();
        assert!(
            wait_for(Duration::from_secs(5), || f.holds(to, &cidr).is_some()),
            "{cidr} did not reach host {to}: {:?}",
            f.fleet(to)
        );
        delays.push(t0.elapsed());
    }
    delays.sort();
    let (p50, p99) = (percentile(&delays, 0.5), percentile(&delays, 0.99));
    println!(
        "ban propagation over TLS, 40 bans: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
        delays.last().unwrap().as_secs_f64() * 1e3
    );
    // The plain-TCP store's bound (e2e_fleet) with room for the handshake-free TLS records on
    // a busy machine.
    assert!(p99 <= Duration::from_millis(500), "p99 {p99:?}");
    let b = f.holds(1, "203.0.113.4/32").unwrap();
    assert_eq!(b.origin.as_deref(), Some("h0"), "{b:?}");
    let banned = Ipv4Addr::new(203, 0, 113, 4);
    let clean = Ipv4Addr::new(198, 19, 1, 1);
    assert_eq!(f.reaching(1, banned, OTHER_PORT, 10), 0, "host 1 let it in");
    assert_eq!(f.reaching(1, clean, OTHER_PORT, 10), 10);
    let st = f.fleet(0);
    assert_eq!(st.bans_published, 20, "{st:?}");
    assert!(st.store.starts_with("rediss://"), "{st:?}");

    // (b) Host 2 cannot verify the server (another CA): degraded, with the certificate
    // error, and none of the fleet's bans.
    assert!(
        wait_for(Duration::from_secs(10), || f.fleet(2).last_error.is_some()),
        "host 2 reports no error: {:?}",
        f.fleet(2)
    );
    let st = f.fleet(2);
    println!("host 2 (wrong CA): {:?}", st.last_error);
    assert!(!st.connected && st.degraded_since.is_some(), "{st:?}");
    let err = st.last_error.clone().unwrap().to_lowercase();
    assert!(
        err.contains("certificate") || err.contains("unknownissuer"),
        "not a certificate error: {st:?}"
    );
    assert!(f.holds(2, "203.0.113.4/32").is_none());
    let human = f.d(2).cli_ok(&["fleet", "status"]);
    assert!(human.contains("DEGRADED since"), "{human}");
    assert!(
        wait_for(Duration::from_secs(5), || !f
            .events(2, "fleet_degraded")
            .is_empty()),
        "no fleet_degraded event: {}",
        f.hosts[2].events_text()
    );
    // `fleet status` and `status` answer fast while it keeps failing to connect: 50 calls
    // of each.
    for req in [Request::Fleet, Request::Status] {
        let mut t: Vec<Duration> = (0..50)
            .map(|_| {
                let t0 = Instant::now();
                call(f.d(2).socket_path(), &req);
                t0.elapsed()
            })
            .collect();
        t.sort();
        let p99 = percentile(&t, 0.99);
        println!(
            "{req:?} on the degraded host: p50 {:.2} ms, p99 {:.2} ms",
            percentile(&t, 0.5).as_secs_f64() * 1e3,
            p99.as_secs_f64() * 1e3
        );
        assert!(p99 < Duration::from_millis(100), "{req:?}: {p99:?}");
    }
    // It enforces locally: a ban added there drops at once, waits in its outbox, and does
    // not reach the others.
    f.d(2)
        .cli_ok(&["ban", "add", "203.0.113.222", "--for", "1h"]);
    assert_eq!(
        f.reaching(2, Ipv4Addr::new(203, 0, 113, 222), OTHER_PORT, 10),
        0,
        "host 2 let its banned source in"
    );
    assert_eq!(f.reaching(2, clean, OTHER_PORT, 10), 10);
    assert!(
        wait_for(Duration::from_secs(5), || f.fleet(2).outbox == 1),
        "{:?}",
        f.fleet(2)
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(f.holds(0, "203.0.113.222/32").is_none());
    // And its rule still bans by itself.
    let offender = Ipv4Addr::new(198, 19, 7, 7);
    let h2 = &f.hosts[2];
    let mut tx = h2.sender();
    tx.send_n(std::iter::repeat(h2.udp4(offender, 9000)), 20, None);
    assert!(
        wait_for(Duration::from_secs(5), || f
            .holds(2, "198.19.7.7/32")
            .is_some_and(|b| b.rule.as_deref() == Some("udp-ban"))),
        "the rule did not ban on host 2: {:?}",
        f.bans(2)
    );

    // (c) Host 3 presents no client certificate: refused by the server, degraded.
    assert!(
        wait_for(Duration::from_secs(10), || f.fleet(3).last_error.is_some()),
        "host 3 reports no error: {:?}",
        f.fleet(3)
    );
    let st = f.fleet(3);
    println!("host 3 (no client certificate): {:?}", st.last_error);
    assert!(!st.connected && st.degraded_since.is_some(), "{st:?}");
    assert!(f.holds(3, "203.0.113.4/32").is_none());
    println!("total {:.1} s", t_all.elapsed().as_secs_f64());
}

#[test]
fn bans_spread_over_a_tls_cluster() {
    kernel_test!();
    let pki = TlsFiles::generate(&[IpAddr::V4(CLUSTER_IP)]);
    let (ca, cert, key) = (pki.ca(), pki.client_cert(), pki.client_key());
    let mut f: FleetLab = Setup::new("rltc")
        .hosts(2)
        .store(Store::TlsCluster {
            ip: CLUSTER_IP,
            ports: CLUSTER_PORTS,
        })
        .tls(pki.server(true))
        .start(|i, url| {
            assert!(url.starts_with("rediss+cluster://"), "{url}");
            format!(
                "[fleet]\nredis = \"{url}\"\nhost_id = \"h{i}\"\ntls_ca_file = \"{}\"\n\
                 tls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n{RULES}",
                ca.display(),
                cert.display(),
                key.display()
            )
        });
    f.wait_connected(Duration::from_secs(15));
    let mut delays = Vec::new();
    for n in 0..20u8 {
        let cidr = format!("203.0.113.{n}/32");
        f.d(0).cli_ok(&["ban", "add", &cidr, "--for", "1h"]);
        let t0 = Instant::now();
        assert!(
            wait_for(Duration::from_secs(5), || f.holds(1, &cidr).is_some()),
            "{cidr} did not reach host 1: {:?}",
            f.fleet(1)
        );
        delays.push(t0.elapsed());
    }
    delays.sort();
    println!(
        "ban propagation over a TLS cluster, 20 bans: p50 {:.1} ms, p99 {:.1} ms",
        percentile(&delays, 0.5).as_secs_f64() * 1e3,
        percentile(&delays, 0.99).as_secs_f64() * 1e3
    );
    assert_eq!(
        f.reaching(1, Ipv4Addr::new(203, 0, 113, 4), OTHER_PORT, 10),
        0
    );
    // The bans live on the master of `{bans}`'s slot (read over TLS).
    let owner = f.cluster().owner_of("ratelimit:{bans}:stream");
    assert!(f.cluster().dbsize(owner) >= 2, "{owner}");
}

/// `ratelimit check-config FILE`: (success, stdout and stderr).
fn check_config(dir: &Path, text: &str) -> (bool, String) {
    let file = dir.join("ratelimit.toml");
    std::fs::write(&file, text).unwrap();
    let out = std::process::Command::new(ratelimit_bin())
        .arg("check-config")
        .arg(&file)
        .output()
        .expect("running ratelimit check-config");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn check_config_reads_the_tls_files() {
    use std::os::unix::fs::PermissionsExt as _;
    let pki = TlsFiles::generate(&[IpAddr::V4(STORE_IP)]);
    let dir = pki.path("check");
    std::fs::create_dir(&dir).unwrap();
    let config = |ca: &Path, key: &Path| {
        format!(
            "[fleet]\nredis = \"rediss://{STORE_IP}:{STORE_PORT}\"\ntls_ca_file = \"{}\"\n\
             tls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n",
            ca.display(),
            pki.client_cert().display(),
            key.display()
        )
    };
    let (ok, out) = check_config(&dir, &config(&pki.ca(), &pki.client_key()));
    assert!(ok && out.contains(": ok (0 rules)"), "{out}");
    // A key readable by every user.
    let key = pki.client_key();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (ok, out) = check_config(&dir, &config(&pki.ca(), &key));
    assert!(
        !ok && out.contains("fleet.tls_key_file") && out.contains("readable by every user"),
        "{out}"
    );
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    // A missing CA file, and a CA file that is a key.
    let (ok, out) = check_config(&dir, &config(&dir.join("nope.pem"), &key));
    assert!(
        !ok && out.contains("fleet.tls_ca_file") && out.contains("nope.pem"),
        "{out}"
    );
    let (ok, out) = check_config(&dir, &config(&key, &key));
    assert!(
        !ok && out.contains("fleet.tls_ca_file") && out.contains("holds no certificate"),
        "{out}"
    );
    // TLS files with a plain address: refused by the parser, naming the key.
    let text = config(&pki.ca(), &key).replace("rediss://", "redis://");
    let (ok, out) = check_config(&dir, &text);
    assert!(
        !ok && out.contains("fleet.tls_ca_file needs a TLS store address"),
        "{out}"
    );
}
