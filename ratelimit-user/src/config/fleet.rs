//! `[fleet]`: the section and its defaults, and the names and addresses of the fleet's store
//! (its checks, URL redaction, cluster and sentinel nodes, TLS).

use std::path::PathBuf;
use std::time::Duration;

/// `[fleet]`: hosts that share their bans through one Redis store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fleet {
    /// `redis://host:port[/db]`, `rediss://` (TLS), `unix:///path` (or `redis+unix://`),
    /// `redis+cluster://` or `rediss+cluster://` (a Redis Cluster's nodes), as written.
    pub redis: String,
    /// This host's name in the fleet; `None` = the hostname, taken at start.
    pub host_id: Option<String>,
    /// A file holding the store's password, read at start (not by the parser). Through
    /// sentinels: the master's (and its replicas').
    pub password_file: Option<PathBuf>,
    /// Through sentinels only: a file holding the sentinels' own password (`requirepass` of
    /// the sentinels), read at start.
    pub sentinel_password_file: Option<PathBuf>,
    /// TLS (`rediss://` only): the CA certificates (PEM) the store's certificate is verified
    /// against; `None` = the system's roots. Read at start.
    pub tls_ca_file: Option<PathBuf>,
    /// TLS: this host's certificate (PEM, chain) and private key, for a store that
    /// authenticates its clients (`tls-auth-clients yes`); both or neither. Read at start.
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    /// How often near-limit keys of global rules are shared (kept for them; bans are pushed).
    pub sync_interval: Duration,
    /// Publish this host's bans to the fleet and apply the fleet's.
    pub share_bans: bool,
    /// How far this host's wall clock may be off the store's before it stops taking part in
    /// global counting (the fleet's clock check).
    pub max_clock_skew: Duration,
    /// The fleet's name: every key in the store is under it (the fleet's trust).
    pub name: String,
    /// A file holding the fleet key (not the store's password): records and counts are
    /// authenticated with it. Read at start.
    pub key_file: Option<PathBuf>,
    /// The shortest prefix a ban received from the fleet may have (IPv4, IPv6).
    pub remote_ban_min_prefix_v4: u8,
    pub remote_ban_min_prefix_v6: u8,
    /// The longest a ban received from the fleet lasts from its receipt.
    pub remote_ban_max_duration: Duration,
}

/// Defaults of `fleet.remote_ban_min_prefix_v4`, `_v6` and `fleet.remote_ban_max_duration`.
pub const DEFAULT_REMOTE_BAN_MIN_PREFIX_V4: u8 = 16;
pub const DEFAULT_REMOTE_BAN_MIN_PREFIX_V6: u8 = 32;
pub const DEFAULT_REMOTE_BAN_MAX_DURATION: Duration = Duration::from_secs(86_400);
/// The longest `fleet.remote_ban_max_duration`.
pub const MAX_REMOTE_BAN_MAX_DURATION: Duration = Duration::from_secs(365 * 86_400);

/// Default `fleet.sync_interval`.
pub const DEFAULT_SYNC_INTERVAL: Duration = Duration::from_millis(100);
/// Default `fleet.max_clock_skew`.
pub const DEFAULT_MAX_CLOCK_SKEW: Duration = Duration::from_millis(250);
/// The range `fleet.max_clock_skew` may take.
pub const MIN_MAX_CLOCK_SKEW: Duration = Duration::from_millis(10);
pub const MAX_MAX_CLOCK_SKEW: Duration = Duration::from_secs(60);

/// `fleet.name`'s default: keys as before fleet names existed.
pub const FLEET_DEFAULT_NAME: &str = "default";
/// The longest `fleet.name`.
pub const MAX_FLEET_NAME_LEN: usize = 64;

/// Whether `name` can name a fleet: 1 to [`MAX_FLEET_NAME_LEN`] letters, digits, `.`, `-`, `_`.
pub fn check_fleet_name(name: &str) -> Result<(), String> {
    check_store_name(name, MAX_FLEET_NAME_LEN)
}

/// `url` with any password replaced by `***`.
pub fn redacted(url: &str) -> String {
    match (url.split_once("://"), url.rfind('@')) {
        (Some((scheme, rest)), Some(at)) if at > scheme.len() + 3 => {
            let userinfo = &rest[..at - scheme.len() - 3];
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{scheme}://{user}:***@{}", &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

/// The longest `fleet.host_id`.
pub const MAX_HOST_ID_LEN: usize = 64;

/// Whether `id` can name a host in the fleet: 1 to [`MAX_HOST_ID_LEN`] letters, digits, `.`,
/// `-` or `_` (a hostname fits).
pub fn check_host_id(id: &str) -> Result<(), String> {
    check_store_name(id, MAX_HOST_ID_LEN)
}

/// A name written into the fleet store's keys and fields: 1 to `max` letters, digits, `.`,
/// `-` or `_`.
fn check_store_name(name: &str, max: usize) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.len() > max {
        return Err(format!("must be at most {max} characters"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_')))
    {
        return Err(format!(
            "{name:?}: {c:?} is not allowed (letters, digits, '.', '-' and '_' are)"
        ));
    }
    Ok(())
}

/// The nodes of a `redis+cluster://[USER:PASSWORD@]HOST:PORT,HOST:PORT,...` address, each as
/// a `redis://` address (the credentials, if any, on each), or of a `rediss+cluster://` one,
/// each as a `rediss://` address (TLS); `None` if `url` is not a cluster address.
pub fn cluster_nodes(url: &str) -> Option<Result<Vec<String>, String>> {
    let (scheme, rest) = if let Some(rest) = url.strip_prefix("redis+cluster://") {
        ("redis", rest)
    } else {
        ("rediss", url.strip_prefix("rediss+cluster://")?)
    };
    let (userinfo, hosts) = match rest.rfind('@') {
        Some(at) => (&rest[..=at], &rest[at + 1..]),
        None => ("", rest),
    };
    let hosts = hosts.trim_end_matches('/');
    if hosts.is_empty() {
        return Some(Err(format!(
            "{:?} names no node (expected {scheme}+cluster://HOST:PORT,HOST:PORT,...)",
            redacted(url)
        )));
    }
    let mut nodes = Vec::new();
    for h in hosts.split(',') {
        let h = h.trim();
        if h.is_empty() || h.contains('/') {
            return Some(Err(format!(
                "{:?}: {h:?} is not a node (expected {scheme}+cluster://HOST:PORT,HOST:PORT,...)",
                redacted(url)
            )));
        }
        let node = format!("{scheme}://{userinfo}{h}");
        if let Err(e) = redis::IntoConnectionInfo::into_connection_info(node.as_str()) {
            return Some(Err(format!(
                "{:?}: {h:?} is not a node: {e}",
                redacted(url)
            )));
        }
        nodes.push(node);
    }
    Some(Ok(nodes))
}

/// The sentinels and the master's name of a `redis+sentinel://HOST:PORT,HOST:PORT,.../NAME`
/// address (the sentinels each as a `redis://` address), or of a `rediss+sentinel://` one
/// (sentinels and master over TLS; each as a `rediss://` address); `None` if `url` is not a
/// sentinel address.
pub fn sentinel_nodes(url: &str) -> Option<Result<(Vec<String>, String), String>> {
    let (scheme, rest) = if let Some(rest) = url.strip_prefix("redis+sentinel://") {
        ("redis", rest)
    } else {
        ("rediss", url.strip_prefix("rediss+sentinel://")?)
    };
    let shown = redacted(url);
    let expected = format!("expected {scheme}+sentinel://HOST:PORT,HOST:PORT,.../MASTER_NAME");
    let Some((hosts, name)) = rest.split_once('/') else {
        return Some(Err(format!("{shown:?} names no master ({expected})")));
    };
    if name.is_empty() || name.contains(['/', '@', ',']) {
        return Some(Err(format!(
            "{shown:?}: {name:?} is not a master name ({expected})"
        )));
    }
    if hosts.contains('@') {
        return Some(Err(format!(
            "{:?}: no credentials in a sentinel address (fleet.password_file is the master's \
             password, fleet.sentinel_password_file the sentinels')",
            redacted(url)
        )));
    }
    let mut nodes = Vec::new();
    for h in hosts.split(',') {
        let h = h.trim();
        let node = format!("{scheme}://{h}");
        if h.is_empty() || redis::IntoConnectionInfo::into_connection_info(node.as_str()).is_err() {
            return Some(Err(format!(
                "{shown:?}: {h:?} is not a sentinel ({expected})"
            )));
        }
        nodes.push(node);
    }
    Some(Ok((nodes, name.to_string())))
}

/// Whether `url` (a checked `fleet.redis`) reaches the store over TLS.
pub fn is_tls_url(url: &str) -> bool {
    url.starts_with("rediss://")
        || url.starts_with("rediss+cluster://")
        || url.starts_with("rediss+sentinel://")
}

/// Whether `url` (a checked `fleet.redis`) reaches the store through sentinels.
pub fn is_sentinel_url(url: &str) -> bool {
    url.starts_with("redis+sentinel://") || url.starts_with("rediss+sentinel://")
}

/// Check a `fleet.redis` address: the schemes the client speaks, refused clearly otherwise.
pub fn check_redis_url(url: &str) -> Result<(), String> {
    let scheme = url.split_once("://").map(|(s, _)| s);
    match scheme {
        Some("redis" | "rediss" | "unix" | "redis+unix") => {}
        Some("redis+cluster" | "rediss+cluster") => {
            return cluster_nodes(url).expect("a cluster address").map(drop);
        }
        Some("redis+sentinel" | "rediss+sentinel") => {
            return sentinel_nodes(url).expect("a sentinel address").map(drop);
        }
        _ => {
            return Err(format!(
                "{url:?} is not a store address (expected redis://HOST:PORT, \
                 rediss://HOST:PORT (TLS), redis+cluster://HOST:PORT,HOST:PORT,..., \
                 rediss+cluster://..., redis+sentinel://HOST:PORT,.../MASTER_NAME, \
                 rediss+sentinel://... or unix:///PATH)"
            ));
        }
    }
    redis::IntoConnectionInfo::into_connection_info(url)
        .map(drop)
        .map_err(|e| format!("{url:?} is not a store address: {e}"))
}
