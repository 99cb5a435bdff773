//! The fleet settings in force, resolved from `[fleet]` at start: the host id, the fleet's
//! name and key, and how the store is reached (one server, a Redis Cluster, or sentinels).

use std::{path::Path, sync::Arc};

use anyhow::Context as _;

use super::{
    Clock, Keys, Settings,
    credentials::{read_password, read_password_of, read_tls},
    redacted,
    store::{Client, SentinelStore},
    trust::{self, Trust},
};
use crate::config;

/// The host name of this machine (`fleet.host_id`'s default).
pub fn hostname() -> anyhow::Result<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .context("reading the hostname (/proc/sys/kernel/hostname)")?;
    Ok(name.trim().to_string())
}

impl Settings {
    /// Resolve `[fleet]`: the host id (the hostname by default), the password file read.
    pub fn resolve(f: &config::Fleet, state_dir: &Path) -> anyhow::Result<Self> {
        let host_id = match &f.host_id {
            Some(h) => h.clone(),
            None => {
                let h = hostname()?;
                config::check_host_id(&h)
                    .map_err(|e| anyhow::anyhow!("fleet.host_id (the hostname) {e}; set it"))?;
                h
            }
        };
        let password = f.password_file.as_deref().map(read_password).transpose()?;
        let key = f.key_file.as_deref().map(trust::read_key).transpose()?;
        let trust = Arc::new(Trust::new(
            &f.name,
            key,
            trust::Bounds {
                min_prefix_v4: f.remote_ban_min_prefix_v4,
                min_prefix_v6: f.remote_ban_min_prefix_v6,
                max_duration: f.remote_ban_max_duration,
            },
        ));
        let tls = read_tls(f)?;
        if config::is_tls_url(&f.redis) {
            // The one TLS implementation built in; installed once per process (a second call
            // finds it there).
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        let with_password = |mut info: redis::ConnectionInfo| {
            if let Some(pw) = &password {
                let settings = info.redis_settings().clone().set_password(pw.clone());
                info = info.set_redis_settings(settings);
            }
            info
        };
        let sentinel_password = f
            .sentinel_password_file
            .as_deref()
            .map(|p| read_password_of(p, "fleet.sentinel_password_file"))
            .transpose()?;
        let client = match config::cluster_nodes(&f.redis) {
            None if config::is_sentinel_url(&f.redis) => {
                let (nodes, master) = config::sentinel_nodes(&f.redis)
                    .expect("a sentinel address")
                    .map_err(|e| anyhow::anyhow!("fleet.redis {e}"))?;
                let sentinels = nodes
                    .iter()
                    .map(|n| {
                        redis::IntoConnectionInfo::into_connection_info(n.as_str())
                            .map(|info| info.addr().clone())
                            .map_err(|e| anyhow::anyhow!("fleet.redis {n:?}: {e}"))
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let store = SentinelStore {
                    sentinels,
                    master,
                    tls: config::is_tls_url(&f.redis),
                    certs: tls,
                    password: password.clone(),
                    sentinel_password,
                };
                // Checked now: a setting the client refuses is an error at start.
                store
                    .client()
                    .with_context(|| format!("fleet.redis {}", redacted(&f.redis)))?;
                Client::Sentinel(Box::new(store))
            }
            Some(nodes) => {
                let nodes = nodes.map_err(|e| anyhow::anyhow!("fleet.redis {e}"))?;
                let infos = nodes
                    .iter()
                    .map(|n| {
                        redis::IntoConnectionInfo::into_connection_info(n.as_str())
                            .map(with_password)
                            .map_err(|e| anyhow::anyhow!("fleet.redis {:?}: {e}", redacted(n)))
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?;
                Client::Cluster(infos, tls)
            }
            None => {
                let info = redis::IntoConnectionInfo::into_connection_info(f.redis.as_str())
                    .map_err(|e| anyhow::anyhow!("fleet.redis {:?}: {e}", redacted(&f.redis)))?;
                let info = with_password(info);
                let client = match tls {
                    Some(certs) => redis::Client::build_with_tls(info, certs)
                        .context("fleet.redis with its TLS files")?,
                    None => redis::Client::open(info).context("fleet.redis")?,
                };
                Client::Single(client)
            }
        };
        Ok(Self {
            store: redacted(&f.redis),
            host_id,
            share_bans: f.share_bans,
            state_dir: state_dir.to_path_buf(),
            clock: Arc::new(Clock::new(f.max_clock_skew)),
            keys: Keys::of(&f.name),
            trust,
            id_guard: Arc::default(),
            client,
        })
    }

    /// Whether this host takes part in global counting now: its clock within the bound of
    /// the store's, and its host id its own.
    pub fn counting(&self) -> bool {
        self.clock.counting() && !self.id_guard.duplicate()
    }

    /// Whether the store is a Redis Cluster.
    pub fn cluster(&self) -> bool {
        matches!(self.client, Client::Cluster(..))
    }
}

#[cfg(test)]
mod tests {
    use super::super::credentials::check_files;
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redacted("redis://10.0.0.1:6379"), "redis://10.0.0.1:6379");
        assert_eq!(
            redacted("redis://user:secret@10.0.0.1:6379/0"),
            "redis://user:***@10.0.0.1:6379/0"
        );
        assert_eq!(redacted("redis://:pw@h:1"), "redis://:***@h:1");
        assert_eq!(redacted("unix:///run/redis.sock"), "unix:///run/redis.sock");
        assert_eq!(
            redacted("redis+cluster://u:pw@a:1,b:2"),
            "redis+cluster://u:***@a:1,b:2"
        );
    }

    /// A self-signed CA certificate (P-256), for the TLS files' checks.
    const TEST_CA: &str = "-----BEGIN CERTIFICATE-----
MIIBmjCCAT+gAwIBAgIUTUa0JDpbynNnxzgZwOEl9QApyGQwCgYIKoZIzj0EAwIw
ITEfMB0GA1UEAwwWcmF0ZWxpbWl0IHVuaXQgdGVzdCBDQTAgFw0yNjExMjQxNTQ4
MjJaGA8yMTI2MTAzMTE1NDgyMlowITEfMB0GA1UEAwwWcmF0ZWxpbWl0IHVuaXQg
dGVzdCBDQTBZMBMGByqGSM49AgEGCCqGSM49AwEHA0IABO4zfaLm6TVspYCQvkoD
ESDUjjspKYfw/6rg8ZLxlCsncipCHutjGAuKrguKBvpLvjQnprnIPEwbOr0y+BAM
rSWjUzBRMB0GA1UdDgQWBBS88xSkcnXztM+zPMsf7kKuKAIMKDAfBgNVHSMEGDAW
gBS88xSkcnXztM+zPMsf7kKuKAIMKDAPBgNVHRMBAf8EBTADAQH/MAoGCCqGSM49
BAMCA0kAMEYCIQDAkUz8uowjYDKf94dOXCRkO6eM1rvc03v7OXDTUs6XoAIhAILu
11Q9gQv/WjNJLfhoDhY++j/GdLYGjgl1Dd1SR5qA
-----END CERTIFICATE-----
";

    #[test]
    fn tls_files_are_read_and_checked() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("rl-fleet-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Parsed as PEM, not as certificates (but for the CA, which must be one).
        let pem = |tag: &str| format!("-----BEGIN {tag}-----\nAAECAwQF\n-----END {tag}-----\n");
        let (ca, cert, key) = (dir.join("ca.pem"), dir.join("c.pem"), dir.join("k.pem"));
        std::fs::write(&ca, TEST_CA).unwrap();
        std::fs::write(&cert, pem("CERTIFICATE")).unwrap();
        std::fs::write(&key, pem("PRIVATE KEY")).unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        let mut f = config::Fleet {
            redis: "rediss://127.0.0.1:6380".into(),
            host_id: Some("h".into()),
            password_file: None,
            sentinel_password_file: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            sync_interval: config::DEFAULT_SYNC_INTERVAL,
            share_bans: true,
            max_clock_skew: config::DEFAULT_MAX_CLOCK_SKEW,
            name: crate::fleet::trust::DEFAULT_NAME.into(),
            key_file: None,
            remote_ban_min_prefix_v4: config::DEFAULT_REMOTE_BAN_MIN_PREFIX_V4,
            remote_ban_min_prefix_v6: config::DEFAULT_REMOTE_BAN_MIN_PREFIX_V6,
            remote_ban_max_duration: config::DEFAULT_REMOTE_BAN_MAX_DURATION,
        };
        assert!(read_tls(&f).unwrap().is_none());
        f.tls_ca_file = Some(ca.clone());
        let t = read_tls(&f).unwrap().unwrap();
        assert!(t.root_cert.is_some() && t.client_tls.is_none());
        f.tls_cert_file = Some(cert.clone());
        f.tls_key_file = Some(key.clone());
        let t = read_tls(&f).unwrap().unwrap();
        assert!(t.client_tls.is_some());
        check_files(&f).unwrap();
        // A key readable by everyone is refused; a certificate may be.
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = format!("{:#}", read_tls(&f).unwrap_err());
        assert!(
            e.contains("fleet.tls_key_file") && e.contains("readable by every user (mode 0644)"),
            "{e}"
        );
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        // Each file must hold what its key names.
        std::fs::write(&ca, "not a certificate\n").unwrap();
        let e = format!("{:#}", read_tls(&f).unwrap_err());
        assert!(
            e.contains("fleet.tls_ca_file") && e.contains("holds no certificate"),
            "{e}"
        );
        std::fs::write(&ca, pem("CERTIFICATE")).unwrap();
        let e = format!("{:#}", read_tls(&f).unwrap_err());
        assert!(
            e.contains("fleet.tls_ca_file") && e.contains("not a usable CA"),
            "{e}"
        );
        std::fs::write(&ca, TEST_CA).unwrap();
        std::fs::write(&key, pem("CERTIFICATE")).unwrap();
        let e = format!("{:#}", read_tls(&f).unwrap_err());
        assert!(
            e.contains("fleet.tls_key_file") && e.contains("no private key"),
            "{e}"
        );
        f.tls_cert_file = Some(dir.join("missing.pem"));
        let e = format!("{:#}", check_files(&f).unwrap_err());
        assert!(
            e.contains("fleet.tls_cert_file") && e.contains("No such file"),
            "{e}"
        );
        // Resolving builds a TLS client with them.
        std::fs::write(&key, pem("PRIVATE KEY")).unwrap();
        f.tls_cert_file = Some(cert);
        let s = Settings::resolve(&f, &dir).unwrap();
        assert!(!s.cluster());
        f.redis = "rediss+cluster://127.0.0.1:7001,127.0.0.1:7002".into();
        assert!(Settings::resolve(&f, &dir).unwrap().cluster());
        // Through sentinels over TLS, with passwords for the master and the sentinels.
        f.redis = "rediss+sentinel://127.0.0.1:26379,127.0.0.1:26380/fleet".into();
        let (pw, spw) = (dir.join("pw"), dir.join("spw"));
        for (p, text) in [(&pw, "m\n"), (&spw, "s\n")] {
            std::fs::write(p, text).unwrap();
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        (f.password_file, f.sentinel_password_file) = (Some(pw), Some(spw.clone()));
        let s = Settings::resolve(&f, &dir).unwrap();
        assert!(!s.cluster());
        match &s.client {
            Client::Sentinel(st) => {
                assert_eq!((st.sentinels.len(), st.master.as_str()), (2, "fleet"));
                assert!(
                    matches!(&st.sentinels[0], redis::ConnectionAddr::TcpTls { host, port: 26379, insecure: false, .. } if host == "127.0.0.1"),
                    "{:?}",
                    st.sentinels
                );
                assert!(st.tls && st.certs.is_some());
                assert_eq!(
                    (st.password.as_deref(), st.sentinel_password.as_deref()),
                    (Some("m"), Some("s"))
                );
            }
            other => panic!("{other:?}"),
        }
        std::fs::set_permissions(&spw, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = format!("{:#}", check_files(&f).unwrap_err());
        assert!(
            e.contains("fleet.sentinel_password_file") && e.contains("readable by every user"),
            "{e}"
        );
        // Without TLS.
        f.redis = "redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/fleet".into();
        (f.tls_ca_file, f.tls_cert_file, f.tls_key_file) = (None, None, None);
        (f.password_file, f.sentinel_password_file) = (None, None);
        let s = Settings::resolve(&f, &dir).unwrap();
        match &s.client {
            Client::Sentinel(st) => {
                assert!(
                    matches!(&st.sentinels[1], redis::ConnectionAddr::Tcp(h, 26380) if h == "127.0.0.1")
                );
                assert!(!st.tls && st.password.is_none());
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            s.store,
            "redis+sentinel://127.0.0.1:26379,127.0.0.1:26380/fleet"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
