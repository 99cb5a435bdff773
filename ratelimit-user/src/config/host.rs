//! The sections about this host: `[daemon]` (with its defaults), `[tracking]`, `[lists]`,
//! `[geoip]` and `[pressure]`.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;
use ratelimit_common::caps;

use super::XdpMode;

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

/// Default of `daemon.events_per_sec`: about 200 KB/s of lines at most, which a disk and a
/// log shipper keep up with, and more than an attack's distinct offenders per second that an
/// L7 system can act on.
pub const EVENTS_PER_SEC_DEFAULT: u32 = 1000;
/// Largest `daemon.events_per_sec`.
pub const EVENTS_PER_SEC_MAX: u32 = 1_000_000;

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
