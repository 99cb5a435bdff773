//! What a `[fleet]` section exposes that the operator may not mean to: a TLS store whose
//! certificate is not verified (`#insecure`), or a password sent in clear text to a store
//! that is not on this host. Neither is an error (a lab, a private link), so each is a
//! warning the daemon logs at start and `check-config` prints.

use std::net::IpAddr;

use super::Fleet;

/// The warnings for `f`, one sentence each.
pub fn fleet_warnings(f: &Fleet) -> Vec<String> {
    let url = f.redis.trim();
    let mut out = Vec::new();
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let (rest, fragment) = match rest.split_once('#') {
        Some((r, frag)) => (r, Some(frag)),
        None => (rest, None),
    };
    let tls = scheme.starts_with("rediss");
    if fragment.is_some_and(|frag| frag.split('&').any(|p| p == "insecure")) {
        out.push(
            "fleet.redis ends in #insecure: the store's TLS certificate is not verified, so \
             anyone on the path can pose as the store and write the fleet's bans and counts; \
             give the store's CA in fleet.tls_ca_file instead"
                .to_string(),
        );
    }
    if tls || scheme.contains("unix") {
        return out;
    }
    // `user:password@host:port,host:port/db`: the hosts, and whether the URL has a password.
    let authority = rest.split('/').next().unwrap_or("");
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    let password = f.password_file.is_some()
        || f.sentinel_password_file.is_some()
        || userinfo.is_some_and(|u| u.split_once(':').is_some_and(|(_, p)| !p.is_empty()));
    if !password {
        return out;
    }
    let remote: Vec<&str> = hosts
        .split(',')
        .map(host_of)
        .filter(|h| !is_loopback(h))
        .collect();
    if !remote.is_empty() {
        out.push(format!(
            "fleet.redis sends the store's password in clear text to {}: anyone on the path \
             can read it and write to the store; use rediss:// (TLS), or a store on this host",
            remote.join(", ")
        ));
    }
    out
}

/// The host of `host:port`, `[v6]:port` or a bare host.
fn host_of(hp: &str) -> &str {
    let hp = hp.trim();
    if let Some(inner) = hp.strip_prefix('[') {
        return inner.split(']').next().unwrap_or(inner);
    }
    match hp.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => hp,
    }
}

fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost") || host.parse::<IpAddr>().is_ok_and(|a| a.is_loopback())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn fleet(url: &str, password: bool) -> Fleet {
        Fleet {
            redis: url.into(),
            host_id: None,
            password_file: password.then(|| PathBuf::from("/etc/ratelimit/redis.pass")),
            sentinel_password_file: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            sync_interval: super::super::DEFAULT_SYNC_INTERVAL,
            share_bans: true,
            max_clock_skew: super::super::DEFAULT_MAX_CLOCK_SKEW,
            name: "default".into(),
            key_file: None,
            remote_ban_min_prefix_v4: super::super::DEFAULT_REMOTE_BAN_MIN_PREFIX_V4,
            remote_ban_min_prefix_v6: super::super::DEFAULT_REMOTE_BAN_MIN_PREFIX_V6,
            remote_ban_max_duration: super::super::DEFAULT_REMOTE_BAN_MAX_DURATION,
        }
    }

    #[test]
    fn exposure_insecure_tls_and_clear_text_passwords_to_other_hosts_are_warned() {
        let warn = |url: &str, pw: bool| fleet_warnings(&fleet(url, pw));
        // Quiet: no password, loopback, unix, TLS.
        for (url, pw) in [
            ("redis://10.1.0.5:6379", false),
            ("redis://127.0.0.1:6379", true),
            ("redis://localhost/2", true),
            ("redis://[::1]:6379", true),
            ("unix:///run/redis.sock", true),
            ("rediss://10.1.0.5:6379", true),
            ("rediss+cluster://a:6379,b:6379", true),
        ] {
            assert_eq!(warn(url, pw), Vec::<String>::new(), "{url}");
        }
        let w = warn("redis://10.1.0.5:6379", true);
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("clear text to 10.1.0.5"), "{w:?}");
        let w = warn("redis://:s3cret@[2001:db8::5]:6379/0", false);
        assert!(w[0].contains("clear text to 2001:db8::5"), "{w:?}");
        let w = warn("redis+cluster://127.0.0.1:7000,10.0.0.2:7001", true);
        assert!(
            w[0].contains("clear text to 10.0.0.2") && !w[0].contains("127."),
            "{w:?}"
        );
        let w = warn("rediss://10.1.0.5:6379/#insecure", true);
        assert_eq!(w.len(), 1);
        assert!(
            w[0].contains("#insecure") && w[0].contains("not verified"),
            "{w:?}"
        );
    }
}
