//! `[fleet]`: the store's address and credentials, TLS, the global counts' timing and the
//! fleet's trust (its name, key and the bounds on bans received from it).

use std::path::PathBuf;
use std::time::Duration;

use super::{duration, int_in, path};
use crate::config::tree::{Checker, Table};
use crate::config::{self, Fleet};

/// `[fleet]`, in steps: the store's address and credentials, TLS, the global counts' timing,
/// the fleet's trust.
pub(super) fn fleet(mut t: Table, ck: &mut Checker) -> Option<Fleet> {
    let redis = redis(&mut t, ck);
    let host_id = t.get("host_id").and_then(|f| {
        let s = f.str(ck)?;
        config::check_host_id(s)
            .map_err(|e| f.invalid(ck, e))
            .ok()
            .map(|()| s.to_owned())
    });
    let password_file = t.get("password_file").and_then(|f| path(&f, ck));
    let sentinel_password_file = sentinel_password_file(&mut t, redis.as_deref(), ck);
    let (tls_ca_file, tls_cert_file, tls_key_file) = tls(&mut t, redis.as_deref(), ck);
    let (sync_interval, share_bans, max_clock_skew) = global(&mut t, ck);
    let name = name(&mut t, ck);
    let key_file = t.get("key_file").and_then(|f| path(&f, ck));
    let (remote_ban_min_prefix_v4, remote_ban_min_prefix_v6, remote_ban_max_duration) =
        remote_bans(&mut t, ck);
    t.finish(ck);
    Some(Fleet {
        redis: redis?,
        host_id,
        password_file,
        sentinel_password_file,
        tls_ca_file,
        tls_cert_file,
        tls_key_file,
        sync_interval,
        share_bans,
        max_clock_skew,
        name,
        key_file,
        remote_ban_min_prefix_v4,
        remote_ban_min_prefix_v6,
        remote_ban_max_duration,
    })
}

/// `redis`, the store's address: required.
fn redis(t: &mut Table, ck: &mut Checker) -> Option<String> {
    match t.get("redis") {
        Some(f) => f.str(ck).and_then(|s| {
            config::check_redis_url(s)
                .map_err(|e| f.invalid(ck, e))
                .ok()
                .map(|()| s.to_owned())
        }),
        None => {
            t.missing(
                ck,
                "redis",
                " (the store's address, e.g. \"redis://10.1.0.5:6379\")",
            );
            None
        }
    }
}

/// `sentinel_password_file`: only with a sentinel address (`redis`, when it was valid).
fn sentinel_password_file(t: &mut Table, redis: Option<&str>, ck: &mut Checker) -> Option<PathBuf> {
    let sentinel = redis.map(config::is_sentinel_url);
    t.get("sentinel_password_file").and_then(|f| {
        let p = path(&f, ck)?;
        if sentinel == Some(false) {
            f.error(
                ck,
                "needs a Redis Sentinel address (fleet.redis = \"redis+sentinel://...\" or \
                 \"rediss+sentinel://...\")",
            );
            return None;
        }
        Some(p)
    })
}

/// TLS material: `tls_ca_file`, `tls_cert_file` and `tls_key_file`, only with a TLS address
/// (`redis`, when it was valid); a client certificate goes with its key.
fn tls(
    t: &mut Table,
    redis: Option<&str>,
    ck: &mut Checker,
) -> (Option<PathBuf>, Option<PathBuf>, Option<PathBuf>) {
    let tls = redis.map(config::is_tls_url);
    let mut tls_path = |key: &'static str| {
        let f = t.get(key)?;
        let p = path(&f, ck)?;
        if tls == Some(false) {
            f.error(
                ck,
                "needs a TLS store address (fleet.redis = \"rediss://HOST:PORT\", \
                 \"rediss+cluster://...\" or \"rediss+sentinel://...\")",
            );
            return None;
        }
        Some((p, f))
    };
    let tls_ca_file = tls_path("tls_ca_file").map(|(p, _)| p);
    let cert = tls_path("tls_cert_file");
    let key = tls_path("tls_key_file");
    let (tls_cert_file, tls_key_file) = match (cert, key) {
        (Some((c, _)), Some((k, _))) => (Some(c), Some(k)),
        (Some((_, f)), None) if tls != Some(false) => {
            f.error(
                ck,
                "needs fleet.tls_key_file (the certificate's private key)",
            );
            (None, None)
        }
        (None, Some((_, f))) if tls != Some(false) => {
            f.error(ck, "needs fleet.tls_cert_file (the key's certificate)");
            (None, None)
        }
        _ => (None, None),
    };
    (tls_ca_file, tls_cert_file, tls_key_file)
}

/// The global counts' timing and the bans' sharing: `sync_interval`, `share_bans` and
/// `max_clock_skew`.
fn global(t: &mut Table, ck: &mut Checker) -> (Duration, bool, Duration) {
    let mut sync_interval = config::DEFAULT_SYNC_INTERVAL;
    if let Some(f) = t.get("sync_interval")
        && let Some(d) = duration(&f, ck)
    {
        if d < Duration::from_millis(10) || d > Duration::from_secs(60) {
            f.error(ck, "must be between 10ms and 1m");
        } else {
            sync_interval = d;
        }
    }
    let share_bans = t.get("share_bans").and_then(|f| f.bool(ck)).unwrap_or(true);
    let mut max_clock_skew = config::DEFAULT_MAX_CLOCK_SKEW;
    if let Some(f) = t.get("max_clock_skew")
        && let Some(d) = duration(&f, ck)
    {
        if d < config::MIN_MAX_CLOCK_SKEW || d > config::MAX_MAX_CLOCK_SKEW {
            f.error(
                ck,
                format!(
                    "must be between {} and {}",
                    config::format_duration(config::MIN_MAX_CLOCK_SKEW),
                    config::format_duration(config::MAX_MAX_CLOCK_SKEW)
                ),
            );
        } else {
            max_clock_skew = d;
        }
    }
    (sync_interval, share_bans, max_clock_skew)
}

/// `name`, the fleet's name: the default when absent or invalid.
fn name(t: &mut Table, ck: &mut Checker) -> String {
    match t.get("name") {
        Some(f) => f
            .str(ck)
            .and_then(|s| {
                config::check_fleet_name(s)
                    .map_err(|e| f.invalid(ck, e))
                    .ok()
                    .map(|()| s.to_owned())
            })
            .unwrap_or_else(|| config::FLEET_DEFAULT_NAME.to_string()),
        None => config::FLEET_DEFAULT_NAME.to_string(),
    }
}

/// The bounds on bans received from the fleet: `remote_ban_min_prefix_v4`,
/// `remote_ban_min_prefix_v6` and `remote_ban_max_duration`.
fn remote_bans(t: &mut Table, ck: &mut Checker) -> (u8, u8, Duration) {
    let remote_ban_min_prefix_v4 = t
        .get("remote_ban_min_prefix_v4")
        .and_then(|f| int_in(&f, ck, 0, 32))
        .map_or(config::DEFAULT_REMOTE_BAN_MIN_PREFIX_V4, |n| n as u8);
    let remote_ban_min_prefix_v6 = t
        .get("remote_ban_min_prefix_v6")
        .and_then(|f| int_in(&f, ck, 0, 128))
        .map_or(config::DEFAULT_REMOTE_BAN_MIN_PREFIX_V6, |n| n as u8);
    let mut remote_ban_max_duration = config::DEFAULT_REMOTE_BAN_MAX_DURATION;
    if let Some(f) = t.get("remote_ban_max_duration")
        && let Some(d) = duration(&f, ck)
    {
        if d < Duration::from_secs(1) || d > config::MAX_REMOTE_BAN_MAX_DURATION {
            f.error(
                ck,
                format!(
                    "must be between 1s and {}",
                    config::format_duration(config::MAX_REMOTE_BAN_MAX_DURATION)
                ),
            );
        } else {
            remote_ban_max_duration = d;
        }
    }
    (
        remote_ban_min_prefix_v4,
        remote_ban_min_prefix_v6,
        remote_ban_max_duration,
    )
}
