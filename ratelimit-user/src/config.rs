//! The config file: its model, parser and validator.
//!
//! [`parse`] turns TOML text into a [`Config`] or into every problem it can find at once
//! ([`ConfigErrors`]), each with the file, line and column of the offending key or value and a
//! message naming the field, e.g.
//! `ratelimit.toml:14:39: rule "syn-per-client": threshold.interval must be greater than 0`.
//! A config that parses fits the kernel maps (see [`ratelimit_common::caps`]): the daemon can
//! apply it without a partial failure.
//!
//! Value syntax, shared with the CLI through the `parse_*` helpers and the `FromStr` impls:
//! - durations: `"500ms"`, `"30s"`, `"20m"`, `"1h"`, `"1d"` ([`parse_duration`]);
//! - addresses: IPv4 or IPv6, bare (a /32 or /128) or CIDR; a CIDR with host bits set is an
//!   error ([`parse_net`]);
//! - byte sizes: an integer, or a string with a `B`, `KB`/`kB` (1000), `KiB` (1024), `MB`,
//!   `MiB`, `GB` or `GiB` suffix ([`parse_bytes`]);
//! - destination ports: `80`, `"80"` or `"8000-8100"` ([`parse_port_range`]);
//! - TCP flags: names `fin`, `syn`, `rst`, `psh`, `ack`, `urg`, `ece`, `cwr` separated by `,`
//!   or `|`, `!name` for a flag that must be clear. Exactly `"syn"` alone is shorthand for
//!   `"syn,!ack"`: a connection attempt, not a SYN-ACK ([`parse_tcp_flags`]);
//! - thresholds: `{ count = 2000, interval = "20m" }` or `{ bytes = "10MiB", interval = "1s" }`
//!   in the file, `2000/20m` or `10MiB/1s` on the command line ([`Threshold`]'s `FromStr`).

use std::fmt;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use ipnet::IpNet;
use ratelimit_common::caps;

mod exposure;
mod tree;
mod validate;
mod values;

pub use exposure::fleet_warnings;

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;

pub use values::{
    MAX_BAN_DURATION, MIN_BYTE_AMOUNT, aliases_ipv4, check_ban_duration, check_byte_burst,
    format_duration, labelled, parse_ban_duration, parse_bytes, parse_duration, parse_net,
    parse_port_range, parse_region, parse_tcp_flags,
};

/// Default `daemon.control_socket`.
pub const DEFAULT_CONTROL_SOCKET: &str = "/run/ratelimit/control.sock";
/// Default `daemon.http_listen`.
pub const DEFAULT_HTTP_LISTEN: SocketAddr =
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9477));
/// Default `daemon.state_dir`.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/ratelimit";
/// Default `daemon.bpffs_dir`.
pub const DEFAULT_BPFFS_DIR: &str = "/sys/fs/bpf/ratelimit";
/// Longest interface name Linux accepts (`IFNAMSIZ - 1`).
pub const MAX_IFACE_NAME_LEN: usize = 15;

/// A whole config file.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Config {
    pub daemon: Daemon,
    pub tracking: Tracking,
    pub lists: Lists,
    pub geoip: Option<GeoIp>,
    pub pressure: Pressure,
    /// `[fleet]`: `None` when the section is absent (no store is contacted).
    pub fleet: Option<Fleet>,
    /// In file order, which is evaluation order.
    pub rules: Vec<Rule>,
}

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
/// Default of `daemon.events_per_sec`: about 200 KB/s of lines at most, which a disk and a
/// log shipper keep up with, and more than an attack's distinct offenders per second that an
/// L7 system can act on.
pub const EVENTS_PER_SEC_DEFAULT: u32 = 1000;
/// Largest `daemon.events_per_sec`.
pub const EVENTS_PER_SEC_MAX: u32 = 1_000_000;

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

/// `[daemon]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Daemon {
    /// Empty by default: `ratelimit run --iface` can supply them.
    pub interfaces: Vec<String>,
    pub xdp_mode: XdpMode,
    pub control_socket: PathBuf,
    /// `None` when the config says `""` or `"off"`.
    pub http_listen: Option<SocketAddr>,
    pub state_dir: PathBuf,
    /// `None` when absent.
    pub events: Option<EventsSink>,
    /// At most this many event lines a second from the data plane (the rest are counted in a
    /// summary line per second); 1 to `events::MAX_PER_SEC`.
    pub events_per_sec: u32,
    /// Where maps and links are pinned.
    pub bpffs_dir: PathBuf,
}

impl Default for Daemon {
    fn default() -> Self {
        Daemon {
            interfaces: Vec::new(),
            xdp_mode: XdpMode::Auto,
            control_socket: PathBuf::from(DEFAULT_CONTROL_SOCKET),
            http_listen: Some(DEFAULT_HTTP_LISTEN),
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            events: None,
            events_per_sec: EVENTS_PER_SEC_DEFAULT,
            bpffs_dir: PathBuf::from(DEFAULT_BPFFS_DIR),
        }
    }
}

/// Where events go: `"-"` is stdout, anything else a file (JSON lines, appended).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventsSink {
    Stdout,
    File(PathBuf),
}

/// `[pressure]`: when the host counts as under pressure (any signal above its mark; see
/// the pressure module).
#[derive(Debug, Clone, PartialEq)]
pub struct Pressure {
    /// Busy share of the watched CPUs, in (0, 1]: above it is pressure. 1 never is.
    pub cpu_busy: f64,
    /// Listen-queue drops per second (TcpExt), at least 0: above it is pressure.
    pub listen_overflows_per_sec: f64,
    /// How long the level stays high after the last signal above its mark.
    pub hold: Duration,
    /// The CPUs watched (receive CPUs), ascending and distinct; empty = every online CPU.
    pub cpus: Vec<u32>,
}

impl Default for Pressure {
    fn default() -> Self {
        Pressure {
            cpu_busy: 0.8,
            listen_overflows_per_sec: 1.0,
            hold: Duration::from_secs(10),
            cpus: Vec::new(),
        }
    }
}

/// The highest CPU number `pressure.cpus` takes (Linux's `NR_CPUS` limit).
pub const MAX_CPU: u32 = 8191;
/// The longest `pressure.hold`.
pub const MAX_PRESSURE_HOLD: Duration = Duration::from_secs(86_400);

/// `[tracking]`: bounds on per-client state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tracking {
    /// At least 1.
    pub max_sources: u32,
    /// Admission budget for new per-client state, per second, as enforced; 0 = unlimited.
    /// With `new_sources_auto`, [`auto_new_sources_per_sec`] of `max_sources`.
    pub new_sources_per_sec: u64,
    /// `new_sources_per_sec = "auto"` (the default): the budget follows `max_sources`.
    pub new_sources_auto: bool,
    /// Defaults to `max(new_sources_per_sec, 1)`; may only be set with a budget (not 0).
    pub new_sources_burst: u64,
    /// `syn_cookies` (default true): a TCP SYN from a source refused state is answered from
    /// XDP with a SYN cookie of its listener, and the source that completes the handshake gets
    /// state without the budget.
    pub syn_cookies: bool,
}

/// How long a random-source flood takes, at the least, to turn the whole store over under
/// `new_sources_per_sec = "auto"`: a client that sent within about this long keeps its state.
pub const AUTO_ADMISSION_TURNOVER_SECS: u64 = 60;

/// `new_sources_per_sec = "auto"`: the whole store at most once a minute
/// ([`AUTO_ADMISSION_TURNOVER_SECS`]), and at least one new source a second.
pub fn auto_new_sources_per_sec(max_sources: u32) -> u64 {
    u64::from(max_sources)
        .div_ceil(AUTO_ADMISSION_TURNOVER_SECS)
        .max(1)
}

impl Tracking {
    /// The defaults for a store of `max_sources`: the automatic admission budget.
    pub fn auto(max_sources: u32) -> Self {
        let rate = auto_new_sources_per_sec(max_sources);
        Tracking {
            max_sources,
            new_sources_per_sec: rate,
            new_sources_auto: true,
            new_sources_burst: rate,
            syn_cookies: true,
        }
    }
}

impl Default for Tracking {
    fn default() -> Self {
        Tracking::auto(caps::DEFAULT_MAX_SOURCES)
    }
}

/// `[lists]`. Bare addresses become /32 or /128 networks; duplicates within a list are dropped.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Lists {
    pub allow: Vec<IpNet>,
    pub deny: Vec<IpNet>,
}

/// `[geoip]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeoIp {
    /// A MaxMind-format country database. Not opened by the parser.
    pub database: PathBuf,
}

/// One `[[rule]]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Unique, non-empty.
    pub name: String,
    /// TOML key `match`; absent = all traffic.
    pub matcher: Match,
    pub key: KeyKind,
    /// 1..=32; may only be set with `key = "ip"`.
    pub ipv4_prefix: u8,
    /// 1..=128; may only be set with `key = "ip"`.
    pub ipv6_prefix: u8,
    pub action: Action,
    pub threshold: Threshold,
    pub algorithm: Algorithm,
    /// Token bucket capacity in threshold units; defaults to `threshold.amount`, and may only be
    /// set with `algorithm = "token_bucket"`.
    pub burst: u64,
    /// Defaults to `threshold`; may only be set with `action = "rate_based_ban"`; same unit as
    /// `threshold`.
    pub ban_threshold: Threshold,
    /// Greater than zero for `rate_based_ban`, zero for `throttle`.
    pub ban_duration: Duration,
    pub exceed_action: ExceedAction,
    pub preview: bool,
    /// In (0, 1].
    pub soft_limit: f64,
    /// `elastic = F`: while the host has room (pressure low), every count of the rule
    /// (threshold, token bucket burst, ban threshold) times F; under pressure, the rule as
    /// written. `None`: the rule holds whatever the level.
    pub elastic: Option<Elastic>,
    /// `scope`: where the threshold holds.
    pub scope: Scope,
    /// TOML `[[rule.override]]`, in file order.
    pub overrides: Vec<Override>,
}

/// A rule's `scope`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scope {
    /// Each host holds the threshold on its own (the default).
    #[default]
    Local,
    /// The threshold holds across the fleet: each host adds the other hosts' counts of a
    /// client, shared through the `[fleet]` store, into its own (the fleet's global counts).
    Global,
}

/// What a rule matches. The default matches every packet.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Match {
    /// `None` = any protocol.
    pub protocol: Option<Protocol>,
    /// Only with `protocol = Tcp`.
    pub tcp_flags: Option<TcpFlags>,
    /// Inclusive ranges, `lo <= hi`, no port 0; at most `caps::MAX_PORT_RANGES`; only with TCP
    /// or UDP; empty = any port.
    pub dst_ports: Vec<(u16, u16)>,
    /// Source networks the rule is limited to; empty = any source.
    pub src: Vec<IpNet>,
}

/// TCP flag match: `(flags & mask) == value`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpFlags {
    pub mask: u8,
    pub value: u8,
}

impl TcpFlags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const PSH: u8 = 0x08;
    pub const ACK: u8 = 0x10;
    pub const URG: u8 = 0x20;
    pub const ECE: u8 = 0x40;
    pub const CWR: u8 = 0x80;
    /// Flag names in bit order.
    pub const NAMES: [(&'static str, u8); 8] = [
        ("fin", Self::FIN),
        ("syn", Self::SYN),
        ("rst", Self::RST),
        ("psh", Self::PSH),
        ("ack", Self::ACK),
        ("urg", Self::URG),
        ("ece", Self::ECE),
        ("cwr", Self::CWR),
    ];
}

/// Canonical form, e.g. `syn,!ack`; parses back to the same value.
impl fmt::Display for TcpFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (name, bit) in Self::NAMES {
            if self.mask & bit == 0 {
                continue;
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if self.value & bit == 0 {
                f.write_str("!")?;
            }
            f.write_str(name)?;
        }
        Ok(())
    }
}

impl FromStr for TcpFlags {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        parse_tcp_flags(s)
    }
}

/// A rate: `amount` packets or bytes per `interval`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Threshold {
    /// At least 1.
    pub amount: u64,
    pub unit: Unit,
    /// Greater than zero, at most `caps::MAX_INTERVAL_NS`.
    pub interval: Duration,
}

/// `2000/20m` for packets, `10485760B/1s` for bytes.
impl fmt::Display for Threshold {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let unit = match self.unit {
            Unit::Packets => "",
            Unit::Bytes => "B",
        };
        write!(
            f,
            "{}{unit}/{}",
            self.amount,
            format_duration(self.interval)
        )
    }
}

/// `COUNT/INTERVAL` as on the command line: `2000/20m` counts packets; a byte size with a unit
/// suffix (`10MiB/1s`, `1500B/1s`) counts bytes. Same limits as in the file.
impl FromStr for Threshold {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let Some((amount, interval)) = s.split_once('/') else {
            return Err(format!(
                "{s:?} is not a threshold; write COUNT/INTERVAL, e.g. \"2000/20m\" or \"10MiB/1s\""
            ));
        };
        let amount = amount.trim();
        let (amount, unit) = if !amount.is_empty() && amount.bytes().all(|b| b.is_ascii_digit()) {
            let n = amount
                .parse::<u64>()
                .map_err(|_| format!("{amount} is too large"))?;
            (n, Unit::Packets)
        } else {
            (parse_bytes(amount)?, Unit::Bytes)
        };
        if amount == 0 {
            return Err("the threshold amount must be at least 1".into());
        }
        let interval = parse_duration(interval)?;
        values::check_interval(interval).map_err(|e| format!("the interval {e}"))?;
        values::check_amount(amount, unit, interval)?;
        Ok(Threshold {
            amount,
            unit,
            interval,
        })
    }
}

/// Override of a rule's thresholds for some clients. `burst`, `ban_threshold` and `elastic`
/// fall back to the rule's when `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Override {
    pub target: OverrideTarget,
    pub threshold: Threshold,
    pub burst: Option<u64>,
    pub ban_threshold: Option<Threshold>,
    pub elastic: Option<Elastic>,
}

/// `elastic = F`, F > 1: how far above its counts a rule (or override) lets clients go while
/// the host has room. Kept in thousandths (1.5 is 1500), so it compares exactly and scales
/// counts without floating point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Elastic(u32);

impl Elastic {
    /// The largest factor: a hundred times the threshold is no longer a threshold.
    pub const MAX: u32 = 100;

    /// F from its number: greater than 1, at most [`Elastic::MAX`], at most three decimals.
    pub fn new(f: f64) -> Result<Elastic, String> {
        if !f.is_finite() || f <= 1.0 || f > Self::MAX as f64 {
            return Err(format!(
                "must be greater than 1 and at most {} (got {f}): the factor by which clients \
                 may exceed their threshold while the host has room",
                Self::MAX
            ));
        }
        let milli = (f * 1000.0).round();
        if (milli - f * 1000.0).abs() > 1e-6 || milli <= 1000.0 {
            return Err(format!("must have at most three decimals (got {f})"));
        }
        Ok(Elastic(milli as u32))
    }

    /// F in thousandths.
    pub fn milli(self) -> u32 {
        self.0
    }

    pub fn factor(self) -> f64 {
        self.0 as f64 / 1000.0
    }

    /// `n` times F, rounded down (never below `n`), saturating.
    pub fn scale(self, n: u64) -> u64 {
        let v = n as u128 * self.0 as u128 / 1000;
        v.clamp(n as u128, u64::MAX as u128) as u64
    }

    /// `t` times F (same unit and interval).
    pub fn scale_threshold(self, t: &Threshold) -> Threshold {
        Threshold {
            amount: self.scale(t.amount),
            ..*t
        }
    }
}

/// `1.5`, `2`: parses back to the same value.
impl fmt::Display for Elastic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.factor())
    }
}

impl FromStr for Elastic {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let f: f64 = s
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not a number; write a factor such as 1.5 or 2"))?;
        Elastic::new(f)
    }
}

/// Why `elastic` is refused on a rule with `exceed_action = "pass"`.
pub const ELASTIC_WITH_PASS: &str = "has no effect with exceed_action = \"pass\": elastic only \
     changes which packets are dropped, and this rule drops none";

/// The counts in force for a rule, or for one of its overrides: threshold, token bucket
/// burst, ban threshold (after what an override inherits from its rule), ban duration, and
/// the elastic factor. What `apply::plan` writes and what every check of `elastic`
/// (the config's, `override add`'s, `rule set`'s) checks are both read from this, so they
/// cannot disagree.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Counts {
    pub threshold: Threshold,
    /// The token bucket's capacity (the threshold's amount for the window algorithms).
    pub burst: u64,
    /// `Some` for a `rate_based_ban` rule only.
    pub ban: Option<Threshold>,
    /// `Some` for a `rate_based_ban` rule only.
    pub ban_duration: Option<Duration>,
    /// The rule's factor; an override's own, or its rule's.
    pub elastic: Option<Elastic>,
}

impl Counts {
    /// A rule's counts.
    pub fn of_rule(r: &Rule) -> Counts {
        let is_ban = r.action == Action::RateBasedBan;
        Counts {
            threshold: r.threshold,
            burst: r.burst,
            ban: is_ban.then_some(r.ban_threshold),
            ban_duration: is_ban.then_some(r.ban_duration),
            elastic: r.elastic,
        }
    }

    /// The counts of override `o` of rule `r`.
    pub fn of_override(r: &Rule, o: &Override) -> Counts {
        Counts::of_rule(r).for_override(o)
    }

    /// The counts of override `o` of the rule whose counts these are. Its own threshold; its
    /// own burst, else its threshold's amount; its own ban threshold, else: if the rule's ban
    /// threshold is the default (its threshold), the override's threshold; otherwise the
    /// larger of the two, so a client is never banned below its own allowance. Its own
    /// factor, else the rule's.
    pub fn for_override(&self, o: &Override) -> Counts {
        let ban = self.ban.map(|rule_ban| {
            o.ban_threshold.unwrap_or(
                if rule_ban == self.threshold || o.threshold.amount > rule_ban.amount {
                    o.threshold
                } else {
                    rule_ban
                },
            )
        });
        Counts {
            threshold: o.threshold,
            burst: o.burst.unwrap_or(o.threshold.amount),
            ban,
            ban_duration: self.ban_duration,
            elastic: o.elastic.or(self.elastic),
        }
    }

    /// The counts while the host has room: every count times the factor, intervals and ban
    /// duration as they are. `None` without a factor.
    pub fn relaxed(&self) -> Option<Counts> {
        let e = self.elastic?;
        Some(Counts {
            threshold: e.scale_threshold(&self.threshold),
            burst: e.scale(self.burst),
            ban: self.ban.map(|b| e.scale_threshold(&b)),
            ..*self
        })
    }

    /// Whether the factor (if any) fits a rule whose `exceed_action` is `exceed`: the rule
    /// must drop (elastic decides only which packets are dropped), and the scaled counts
    /// ([`Counts::relaxed`]) must stay rates the limiter meters. The error follows
    /// `elastic`, e.g. "= 2 makes the threshold ...".
    pub fn check_elastic(&self, exceed: ExceedAction) -> Result<(), String> {
        let (Some(e), Some(relaxed)) = (self.elastic, self.relaxed()) else {
            return Ok(());
        };
        if exceed == ExceedAction::Pass {
            return Err(ELASTIC_WITH_PASS.into());
        }
        for (what, scaled) in std::iter::once(("threshold", relaxed.threshold))
            .chain(relaxed.ban.map(|b| ("ban_threshold", b)))
        {
            values::check_amount(scaled.amount, scaled.unit, scaled.interval).map_err(|why| {
                format!("= {e} makes the {what} {scaled} while the host has room, and {why}")
            })?;
        }
        Ok(())
    }
}

/// Who an override applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OverrideTarget {
    /// Only for `key = "ip"` or `"all"`; the most specific prefix wins.
    Cidr(IpNet),
    /// Only for `key = "region"`: ISO 3166 alpha-2 as two uppercase ASCII letters, `ZZ` for
    /// unknown.
    Region([u8; 2]),
}

impl fmt::Display for OverrideTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OverrideTarget::Cidr(net) => write!(f, "cidr {net}"),
            OverrideTarget::Region([a, b]) => write!(f, "region {}{}", *a as char, *b as char),
        }
    }
}

/// Whether a rule keyed `key` takes an override by CIDR (`region = false`) or by region: a
/// CIDR override needs key = "ip" or "all" (the shared bucket's threshold for those sources),
/// a region override key = "region". The error follows the field's name.
pub fn override_fits(key: KeyKind, region: bool) -> Result<(), String> {
    match (key, region) {
        (KeyKind::Region, false) => {
            Err("overrides need key = \"ip\" or \"all\" (this rule has key = \"region\")".into())
        }
        (KeyKind::Ip | KeyKind::All, true) => Err(format!(
            "overrides need key = \"region\" (this rule has key = \"{key}\")"
        )),
        _ => Ok(()),
    }
}

/// Defines a config keyword enum with `as_str`, `Display` (the config spelling), `FromStr`
/// (exact config spelling; the error lists the choices).
macro_rules! keyword_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vm])* $variant),+
        }

        impl $name {
            /// The spelling used in the config file and on the command line.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(format!(
                        "must be one of {} (got {s:?})",
                        values::quoted_list(&[$($text),+])
                    )),
                }
            }
        }
    };
}

keyword_enum!(
    /// How the XDP program is attached.
    #[derive(Default)]
    XdpMode {
        /// Native, falling back to generic.
        #[default]
        Auto = "auto",
        Native = "native",
        Generic = "generic",
    }
);

keyword_enum!(
    /// What a rule counts per: `key`.
    #[derive(Default)]
    KeyKind {
        /// One counter for all matching traffic.
        All = "all",
        /// Per source address, aggregated to `ipv4_prefix` / `ipv6_prefix`. The default.
        #[default]
        Ip = "ip",
        /// Per country from the GeoIP database.
        Region = "region",
    }
);

keyword_enum!(
    /// `action`.
    #[derive(Default)]
    Action {
        #[default]
        Throttle = "throttle",
        RateBasedBan = "rate_based_ban",
    }
);

keyword_enum!(
    /// `algorithm`.
    #[derive(Default)]
    Algorithm {
        #[default]
        SlidingWindow = "sliding_window",
        TokenBucket = "token_bucket",
        FixedWindow = "fixed_window",
    }
);

keyword_enum!(
    /// `exceed_action`: what happens to packets over the threshold.
    #[derive(Default)]
    ExceedAction {
        #[default]
        Drop = "drop",
        /// Count and report only.
        Pass = "pass",
    }
);

keyword_enum!(
    /// `match.protocol`.
    Protocol {
        Tcp = "tcp",
        Udp = "udp",
        Icmp = "icmp",
        Icmpv6 = "icmpv6",
    }
);

impl Protocol {
    /// Whether destination ports apply.
    pub fn has_ports(self) -> bool {
        matches!(self, Protocol::Tcp | Protocol::Udp)
    }
}

/// What a threshold counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    Packets,
    Bytes,
}

impl Unit {
    /// `"packets"` or `"bytes"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Packets => "packets",
            Unit::Bytes => "bytes",
        }
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One problem in a config file. `line` and `col` are 1-based; `col` counts characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: String,
    pub line: usize,
    pub col: usize,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.file, self.line, self.col, self.message
        )
    }
}

impl std::error::Error for ConfigError {}

/// Every problem found, sorted by position. Displays one per line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// Parses and validates config text. `file_name` only labels the errors.
pub fn parse(file_name: &str, text: &str) -> Result<Config, ConfigErrors> {
    let mut ck = tree::Checker::new(text);
    let config = match tree::parse_toml(text) {
        Ok(root) => Some(validate::build(&root, &mut ck)),
        Err((at, msg)) => {
            ck.error(at, format!("invalid TOML: {msg}"));
            None
        }
    };
    let errors = ck.into_errors(file_name);
    match config {
        Some(config) if errors.is_empty() => Ok(config),
        _ => Err(ConfigErrors(errors)),
    }
}

/// Reads and parses a config file. A read error is reported at 1:1.
pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
    let file_name = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => parse(&file_name, &text),
        Err(e) => Err(ConfigErrors(vec![ConfigError {
            file: file_name,
            line: 1,
            col: 1,
            message: e.to_string(),
        }])),
    }
}
