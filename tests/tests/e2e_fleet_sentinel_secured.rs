//! Fleet mode through Redis Sentinel with passwords and TLS: two daemons, each in its own
//! namespace, reach a master, its replica and three sentinels (quorum 2) in the store
//! namespace. First a master and replica that require a password (`requirepass`,
//! `masterauth`) behind sentinels that require one of their own (`requirepass`,
//! `sentinel-pass`); then every one of them speaking only TLS (`rediss+sentinel://`, client
//! certificates required, a throwaway CA) with both passwords. In each, the daemons connect
//! through the sentinels and a ban issued on one host reaches the other; a host given a wrong
//! sentinel password (the first) or the wrong CA (the second) cannot, and says why.
//!
//! Tolerances (a busy 2-core machine): connected within 15 s; a ban within 5 s.

use std::{
    net::{IpAddr, Ipv4Addr},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use ratelimit_tests::{
    fleet_lab::{FleetLab, Setup, Store, wait_for},
    kernel_test,
    store::TlsFiles,
};

const MASTER_PW: &str = "m4ster-s3cret";
const SENTINEL_PW: &str = "sent1nel-s3cret";

/// A private temp dir holding the password files; removed on drop.
struct Secrets(PathBuf);

impl Secrets {
    fn new(tag: &str) -> Secrets {
        let dir =
            std::env::temp_dir().join(format!("rl-sentinel-secrets-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Secrets(dir)
    }

    /// A password file (mode 600) holding `pw`.
    fn file(&self, name: &str, pw: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, format!("{pw}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        p
    }
}

impl Drop for Secrets {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn fleet_table(url: &str, host: usize, master_pw: &Path, sentinel_pw: &Path, tls: &str) -> String {
    format!(
        "[fleet]\nredis = \"{url}\"\nhost_id = \"h{host}\"\npassword_file = \"{}\"\n\
         sentinel_password_file = \"{}\"\n{tls}",
        master_pw.display(),
        sentinel_pw.display()
    )
}

/// Hosts 0 and 1 connected, and a ban issued on host 0 held by host 1 within 5 s; the time it
/// took.
fn a_ban_spreads(f: &FleetLab, what: &str) -> Duration {
    for i in 0..2 {
        assert!(
            wait_for(Duration::from_secs(15), || f.fleet(i).connected),
            "{what}: host {i} never connected: {:?}\n{}",
            f.fleet(i),
            f.d(i).logs()
        );
    }
    let t0 = Instant::now();
    f.d(0).cli_ok(&["ban", "add", "203.0.113.9", "--for", "1h"]);
    assert!(
        wait_for(Duration::from_secs(5), || f
            .holds(1, "203.0.113.9/32")
            .is_some()),
        "{what}: the ban did not reach host 1: {:?}",
        f.fleet(1)
    );
    let took = t0.elapsed();
    let b = f.holds(1, "203.0.113.9/32").unwrap();
    assert_eq!(b.origin.as_deref(), Some("h0"), "{b:?}");
    took
}

/// Host 2 cannot connect; its last error contains `why`.
fn cannot_connect(f: &FleetLab, why: &str) {
    assert!(
        wait_for(Duration::from_secs(15), || f
            .fleet(2)
            .last_error
            .is_some_and(|e| e.contains(why))),
        "host 2's error does not say {why:?}: {:?}",
        f.fleet(2)
    );
    let r = f.fleet(2);
    assert!(!r.connected, "{r:?}");
    println!("host 2: {}", r.last_error.unwrap_or_default());
}

#[test]
fn a_password_protected_master_behind_password_protected_sentinels() {
    kernel_test!();
    let secrets = Secrets::new("pw");
    let (mpw, spw, wrong) = (
        secrets.file("master.pass", MASTER_PW),
        secrets.file("sentinel.pass", SENTINEL_PW),
        secrets.file("wrong.pass", "not-the-password"),
    );
    let f = Setup::new("rlsp")
        .store(Store::Sentinel {
            ip: Ipv4Addr::new(100, 64, 253, 1),
            ports: [6379, 6378, 26379, 26380, 26381],
        })
        .sentinel_passwords(Some(MASTER_PW), Some(SENTINEL_PW))
        .hosts(3)
        .start(|i, url| {
            assert!(url.starts_with("redis+sentinel://"), "{url}");
            fleet_table(url, i, &mpw, if i == 2 { &wrong } else { &spw }, "")
        });
    // The master and the sentinels require their passwords.
    let s = f.sentinels.as_ref().unwrap();
    assert!(
        s.master
            .cli(&["config", "get", "requirepass"])
            .contains(MASTER_PW)
    );
    assert!(s.sentinels[0].cli(&["ping"]).contains("PONG"));
    let took = a_ban_spreads(&f, "passwords");
    println!(
        "passwords: a ban reached the other host in {:.1} ms",
        took.as_secs_f64() * 1e3
    );
    cannot_connect(&f, "Password authentication failed");
}

#[test]
fn tls_sentinels_and_master_with_passwords() {
    kernel_test!();
    let ip = Ipv4Addr::new(100, 64, 254, 1);
    // Declared first, dropped last: the store and the daemons read these files.
    let pki = TlsFiles::generate(&[IpAddr::V4(ip)]);
    let secrets = Secrets::new("tls");
    let (mpw, spw) = (
        secrets.file("master.pass", MASTER_PW),
        secrets.file("sentinel.pass", SENTINEL_PW),
    );
    let (ca, other_ca, cert, key) = (
        pki.ca(),
        pki.other_ca(),
        pki.client_cert(),
        pki.client_key(),
    );
    let f = Setup::new("rlst")
        .store(Store::Sentinel {
            ip,
            ports: [6379, 6378, 26379, 26380, 26381],
        })
        .tls(pki.server(true))
        .sentinel_passwords(Some(MASTER_PW), Some(SENTINEL_PW))
        .hosts(3)
        .start(|i, url| {
            assert!(url.starts_with("rediss+sentinel://"), "{url}");
            let tls = format!(
                "tls_ca_file = \"{}\"\ntls_cert_file = \"{}\"\ntls_key_file = \"{}\"\n",
                if i == 2 { &other_ca } else { &ca }.display(),
                cert.display(),
                key.display()
            );
            fleet_table(url, i, &mpw, &spw, &tls)
        });
    // The sentinels name the master (asked over TLS, with their password).
    let s = f.sentinels.as_ref().unwrap();
    assert!(
        s.sentinels[0]
            .cli(&["sentinel", "get-master-addr-by-name", "fleet"])
            .contains(&ip.to_string())
    );
    let took = a_ban_spreads(&f, "TLS");
    println!(
        "TLS: a ban reached the other host in {:.1} ms",
        took.as_secs_f64() * 1e3
    );
    cannot_connect(&f, "UnknownIssuer");
}
