//! Fleet mode, shared bans: a ban issued on one host (by a rule, or `ratelimit ban add`
//! without `--local`) is enforced by every host of the fleet, through one Redis store.
//!
//! ## The store
//! - `ratelimit:{bans}:stream`: a stream of [`Record`]s (`ban` with its absolute end, or
//!   `unban`), one field `r` holding the record as JSON, trimmed with `MAXLEN ~`
//!   [`STREAM_MAXLEN`].
//! - `ratelimit:{bans}:snap`: a hash, CIDR → `<end ms>|<record>`, the ban with the latest end
//!   for each prefix, or `t<unban ms>|<record>`, the tombstone of an `unban`. A ban's expiry
//!   needs no message: each host's kernel expires its own copy. Expired bans are pruned, and
//!   tombstones older than the stream's first entry (its retention), by every host's
//!   heartbeat, a bounded `HSCAN` at a time ([`SWEEP_COUNT`]). A host that has no cursor, or
//!   whose cursor was trimmed away, reads the snapshot and goes on from the stream's last
//!   entry; a host whose cursor the stream still holds goes on from its cursor.
//!
//! - `ratelimit:{bans}:peers`: a hash, host id → that host's [`Heartbeat`], written every
//!   [`HEARTBEAT`] by each host (`fleet peers`; stale after [`PEER_STALE`]), and read within a
//!   bound however large it is ([`peers`]).
//!
//! Every key shares the hash tag `{bans}`, so the script that updates two of them together
//! stays in one slot of a Redis Cluster (`redis+cluster://`), on one master: losing it with
//! no replica to take over is, for the hosts, a store that cannot be reached.
//!
//! These are the names in the fleet named `default`; another fleet's are under its name
//! ([`Keys`]). With the fleet key (`fleet.key_file`) each stream entry carries a field `m`,
//! the MAC of its record, and each snapshot value ends in `|<MAC>`; what is read is dropped
//! unless it verifies, and every record read is bounded (`crate::fleet::trust`).
//!
//! ## Tasks, and who waits for whom
//! Nothing on the packet path or the control API waits for the store. The owner task hands
//! the records it publishes to the **publisher** (an unbounded channel; it never waits), and
//! the **reader** hands the records it reads to the owner as jobs (the bans installed with
//! their absolute end, the later end winning). Both run under the supervisor, each with its
//! own connection and timeouts; what they know is in [`Shared`], which `fleet status`,
//! `/v1/fleet` and `/metrics` read without waiting for either.
//!
//! While the store cannot be reached the daemon enforces everything locally: outgoing records
//! wait in `state_dir/fleet-outbox.json` (written whole, durably, as the other state files)
//! and are sent when the store returns; the reader then goes on from its cursor (or resyncs
//! from the snapshot if the cursor was trimmed away meanwhile). The change is written as a
//! `fleet_degraded` event, and the return as `fleet_restored`.
//!
//! The cursor is written to `state_dir/fleet.json` at most every [`CURSOR_SAVE`] (and at
//! shutdown): after a crash a few records are read again, and applying them again changes
//! nothing. A ban lifted on this host (`ban del`, `--local` or not) is not installed again by
//! a record issued before the lift (last writer wins, by time), also after a restart (the
//! lifts are saved: `daemon::FLEET_LIFTS_FILE`).
//!
//! ## The clock
//! Global rules count in windows of the wall clock, and bans travel with their end in unix
//! ms: both assume the hosts' clocks agree. The **clock** task measures this host's wall
//! clock against the store's (`TIME`) when it connects and every [`CLOCK_EVERY`]: of
//! [`CLOCK_SAMPLES`] round trips, the one answered fastest gives the offset
//! `local - (store + rtt / 2)` (a measurement whose fastest round trip exceeds half the
//! bound is not trusted, and changes nothing). While the offset is beyond
//! `fleet.max_clock_skew` ([`Clock`]), or before it was first measured, the host takes no
//! part in global counting (its global rules hold their threshold on this host alone, as
//! without a store); the change is a `fleet_clock_skew` event, the return within the bound
//! a `fleet_clock_restored` one. Bans are shared all the same. Each host's offset goes into
//! its heartbeat (`fleet peers`).
//!
//! ## Duplicate host ids
//! Each heartbeat carries a random nonce of its process; a host that finds another nonce
//! writing its host id takes no part in global counting while that lasts ([`dup`]).
//!
//! Bans received from the fleet are marked [`BAN_REMOTE`] (and their origin host kept): they
//! are never published again, so no ban echoes between hosts.

use std::{
    collections::{BTreeMap, VecDeque},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, bail};
use redis::aio::MultiplexedConnection;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::{config, events, supervise};

pub mod dup;
pub mod global;
pub mod key;
pub mod key_reads;
pub mod peers;
pub mod resync;
pub mod trust;

use trust::Trust;

/// `BanEntry::flags` of a ban received from the fleet (in the remote bans' table, with
/// `BAN_MANUAL`).
pub use ratelimit_common::maps::BAN_REMOTE;

/// The keys' names in the fleet named `default`; a fleet of another name has its own
/// ([`Keys`], [`trust::store_name`]).
pub const STREAM_KEY: &str = "ratelimit:{bans}:stream";
pub const SNAP_KEY: &str = "ratelimit:{bans}:snap";
/// A hash, host id → that host's last [`Heartbeat`] (JSON), written every [`HEARTBEAT`].
pub const PEERS_KEY: &str = "ratelimit:{bans}:peers";
/// A sorted set, host id → when it last beat (unix ms): the peers most recently seen, found
/// in one read however large the peers hash grows ([`peers`]).
pub const PEERS_SEEN_KEY: &str = "ratelimit:{bans}:peers-seen";

/// The store's names of the ban stream, the snapshot and the peers in this fleet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    pub stream: String,
    pub snap: String,
    pub peers: String,
    pub peers_seen: String,
}

impl Keys {
    pub fn of(fleet: &str) -> Keys {
        Keys {
            stream: trust::store_name(fleet, STREAM_KEY),
            snap: trust::store_name(fleet, SNAP_KEY),
            peers: trust::store_name(fleet, PEERS_KEY),
            peers_seen: trust::store_name(fleet, PEERS_SEEN_KEY),
        }
    }
}
/// How often each host writes its heartbeat (and reads the others').
pub const HEARTBEAT: Duration = Duration::from_secs(1);
/// A peer not seen for this long is shown as stale.
pub const PEER_STALE: Duration = Duration::from_secs(10);
/// A peer not seen for this long is taken off the hash (by any host).
const PEER_FORGET: Duration = Duration::from_secs(24 * 3600);
/// The stream keeps about this many records (`XADD MAXLEN ~`); a host further behind
/// resyncs from the snapshot.
pub const STREAM_MAXLEN: u64 = 100_000;
/// The outgoing records waiting for the store, in `state_dir`.
pub const OUTBOX_FILE: &str = "fleet-outbox.json";
/// The reader's cursor, in `state_dir`.
pub const STATE_FILE: &str = "fleet.json";
/// The outbox holds at most this many records; beyond, the oldest are dropped (and counted).
pub const OUTBOX_MAX: usize = 100_000;
/// Each store command's answer is awaited this long at most.
pub const REQUEST_TIMEOUT: Duration = Duration::from_millis(500);
/// A connection is made within this, or the store counts as unreachable.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// The reader's `XREAD BLOCK`, in ms (its answer is awaited this long plus
/// [`REQUEST_TIMEOUT`]).
const READ_BLOCK_MS: u64 = 1000;
/// Records read (and records published) at once.
const BATCH: usize = 500;
/// The publisher looks at its outbox this often when nothing new comes.
const PUBLISH_RETRY: Duration = Duration::from_millis(250);
/// Waits between reconnection attempts: from the first to the last, doubling.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// The reader writes its cursor to disk at most this often.
pub const CURSOR_SAVE: Duration = Duration::from_secs(1);
/// Snapshot fields looked at per heartbeat by the sweep that prunes it.
pub const SWEEP_COUNT: usize = 1000;
/// How often the clock is measured against the store's.
pub const CLOCK_EVERY: Duration = Duration::from_secs(2);
/// Round trips (`TIME`) per measurement; the fastest one gives the offset.
pub const CLOCK_SAMPLES: usize = 5;

/// What a record does.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    Ban,
    Unban,
}

/// One entry of the ban stream.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub op: Op,
    /// The prefix, as `ban add` prints it (`203.0.113.0/24`, `2001:db8::/64`).
    pub net: String,
    /// Unix ms when the ban ends; 0 = until removed. 0 for an `unban`.
    #[serde(default)]
    pub exp_ms: u64,
    /// Unix ms when it was issued.
    pub at_ms: u64,
    /// The host that issued it.
    pub host: String,
    /// The rule that issued it there, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

/// The CLOCK_MONOTONIC ns of the unix ms `ms` (0 stays 0: until removed); `None` if it has
/// passed.
pub fn mono_of_unix_ms(ms: u64) -> Option<u64> {
    if ms == 0 {
        return Some(0);
    }
    let now_ms = unix_ms(SystemTime::now());
    if ms <= now_ms {
        return None;
    }
    Some(
        crate::clock::mono_ns()
            .saturating_add((ms - now_ms).saturating_mul(1_000_000))
            .max(1),
    )
}

/// The unix ms of the CLOCK_MONOTONIC ns `ns` (0 stays 0).
pub fn unix_ms_of_mono(ns: u64) -> u64 {
    if ns == 0 {
        return 0;
    }
    let now = crate::clock::mono_ns();
    let now_ms = unix_ms(SystemTime::now());
    if ns >= now {
        now_ms + (ns - now).div_ceil(1_000_000)
    } else {
        now_ms.saturating_sub((now - ns) / 1_000_000).max(1)
    }
}

/// This host's wall clock against the store's: whether this host takes part in global
/// counting (read by `crate::fleet::global` before every round). Not before the first trusted
/// measurement, nor while the offset is beyond `bound` (`fleet.max_clock_skew`).
#[derive(Debug)]
pub struct Clock {
    bound: Duration,
    counting: AtomicBool,
}

impl Clock {
    pub fn new(bound: Duration) -> Self {
        Self {
            bound,
            counting: AtomicBool::new(false),
        }
    }

    /// `fleet.max_clock_skew`.
    pub fn bound(&self) -> Duration {
        self.bound
    }

    /// Whether this host takes part in global counting now.
    pub fn counting(&self) -> bool {
        self.counting.load(Ordering::Relaxed)
    }
}

/// One `TIME` round trip: this host's wall clock (unix ns) when it was sent and when it was
/// answered, and the store's answer (unix ns).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockSample {
    pub sent_ns: i64,
    pub recv_ns: i64,
    pub store_ns: i64,
}

impl ClockSample {
    pub fn rtt_ns(&self) -> i64 {
        (self.recv_ns - self.sent_ns).max(0)
    }

    /// This host's clock minus the store's: `local - (store + rtt / 2)`, with `local` the
    /// answer's arrival (the store read its clock about half a round trip before).
    pub fn offset_ns(&self) -> i64 {
        self.recv_ns - (self.store_ns + self.rtt_ns() / 2)
    }
}

/// The sample answered fastest (the least uncertain offset).
pub fn best_sample(samples: &[ClockSample]) -> Option<ClockSample> {
    samples.iter().copied().min_by_key(ClockSample::rtt_ns)
}

/// What a measurement says of the clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockVerdict {
    /// Its round trip exceeds half the bound: the offset is too uncertain to act on.
    Untrusted,
    Within,
    Over,
}

/// Judge an offset measured with round trip `rtt_ns` against `bound`: beyond the bound
/// either way is over; a round trip longer than half the bound (an offset uncertain by more
/// than a quarter of it) is not trusted.
pub fn judge_clock(offset_ns: i64, rtt_ns: i64, bound: Duration) -> ClockVerdict {
    let bound = bound.as_nanos() as i64;
    if rtt_ns > bound / 2 {
        ClockVerdict::Untrusted
    } else if offset_ns.unsigned_abs() > bound as u64 {
        ClockVerdict::Over
    } else {
        ClockVerdict::Within
    }
}

/// The host name of this machine (`fleet.host_id`'s default).
pub fn hostname() -> anyhow::Result<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .context("reading the hostname (/proc/sys/kernel/hostname)")?;
    Ok(name.trim().to_string())
}

/// The store's password from `path` (one line): refused if the file is missing, empty, or
/// readable by every user (mode `o+r`).
pub fn read_password(path: &Path) -> anyhow::Result<String> {
    read_password_of(path, "fleet.password_file")
}

/// A password from `path` (one line), the key `field` naming it: refused as
/// [`read_password`] refuses.
fn read_password_of(path: &Path, field: &str) -> anyhow::Result<String> {
    let text = read_private(path, field)?;
    let pw = text.trim_end_matches(['\n', '\r']).to_string();
    if pw.is_empty() {
        bail!("{field} {} is empty", path.display());
    }
    Ok(pw)
}

/// The text of a file holding a secret (the key `field` names it): refused if missing or
/// readable by every user (mode `o+r`).
fn read_private(path: &Path, field: &str) -> anyhow::Result<String> {
    let bytes = crate::durable::read_secret(path, field, 0o004)?;
    String::from_utf8(bytes).with_context(|| format!("{field} {} is not UTF-8", path.display()))
}

/// The TLS material of `[fleet]` (`tls_ca_file`, `tls_cert_file`, `tls_key_file`), read and
/// checked: each file must hold what its key names (PEM), and the private key must not be
/// readable by every user. `None` without any of them.
pub fn read_tls(f: &config::Fleet) -> anyhow::Result<Option<redis::TlsCertificates>> {
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};
    if f.tls_ca_file.is_none() && f.tls_cert_file.is_none() && f.tls_key_file.is_none() {
        return Ok(None);
    }
    let certs = |path: &Path, field: &str| -> anyhow::Result<Vec<u8>> {
        let pem =
            std::fs::read(path).with_context(|| format!("reading {field} {}", path.display()))?;
        let n = CertificateDer::pem_slice_iter(&pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow::anyhow!("{field} {}: not PEM certificates: {e}", path.display()))?
            .len();
        if n == 0 {
            bail!(
                "{field} {} holds no certificate (expected PEM, -----BEGIN CERTIFICATE-----)",
                path.display()
            );
        }
        Ok(pem)
    };
    let root_cert = match f.tls_ca_file.as_deref() {
        Some(path) => {
            let pem = certs(path, "fleet.tls_ca_file")?;
            let mut roots = rustls::RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(&pem) {
                let cert = cert.expect("parsed above");
                roots.add(cert).map_err(|e| {
                    anyhow::anyhow!(
                        "fleet.tls_ca_file {}: not a usable CA certificate: {e}",
                        path.display()
                    )
                })?;
            }
            Some(pem)
        }
        None => None,
    };
    let client_tls = match (&f.tls_cert_file, &f.tls_key_file) {
        (Some(cert), Some(key)) => {
            let client_cert = certs(cert, "fleet.tls_cert_file")?;
            let client_key = read_private(key, "fleet.tls_key_file")?.into_bytes();
            PrivateKeyDer::from_pem_slice(&client_key).map_err(|e| {
                anyhow::anyhow!(
                    "fleet.tls_key_file {}: no private key (expected PEM, e.g. -----BEGIN \
                     PRIVATE KEY-----): {e}",
                    key.display()
                )
            })?;
            Some(redis::ClientTlsConfig {
                client_cert,
                client_key,
            })
        }
        (None, None) => None,
        _ => bail!("fleet.tls_cert_file and fleet.tls_key_file go together"),
    };
    Ok(Some(redis::TlsCertificates {
        client_tls,
        root_cert,
    }))
}

/// What `ratelimit check-config` checks of `[fleet]` beyond the file itself: the password
/// file and the TLS material can be read and hold what they should.
pub fn check_files(f: &config::Fleet) -> anyhow::Result<()> {
    f.password_file.as_deref().map(read_password).transpose()?;
    f.sentinel_password_file
        .as_deref()
        .map(|p| read_password_of(p, "fleet.sentinel_password_file"))
        .transpose()?;
    read_tls(f)?;
    f.key_file.as_deref().map(trust::read_key).transpose()?;
    Ok(())
}

/// The fleet settings in force, resolved at start.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The store's address as configured (no password in it is shown: see [`redacted`]).
    pub store: String,
    pub host_id: String,
    pub share_bans: bool,
    pub state_dir: PathBuf,
    /// This host's clock against the store's: whether it takes part in global counting.
    pub clock: Arc<Clock>,
    /// The fleet's name and key, remote bans' bounds, and what was rejected.
    pub trust: Arc<Trust>,
    /// The store's names of the ban stream, the snapshot and the peers.
    pub keys: Keys,
    /// This process's heartbeat nonce, and whether another process uses its host id.
    pub id_guard: Arc<dup::IdGuard>,
    client: Client,
}

/// How the store is reached: one server, the nodes a Redis Cluster is discovered from, or the
/// sentinels that name the master.
#[derive(Debug, Clone)]
enum Client {
    Single(redis::Client),
    /// The nodes, and the TLS material for a `rediss+cluster://` store.
    Cluster(Vec<redis::ConnectionInfo>, Option<redis::TlsCertificates>),
    /// Redis Sentinel: the sentinels, the master's name, and how both are reached (their
    /// passwords; TLS, with the TLS files, for a `rediss+sentinel://` store: to the
    /// sentinels and to the master alike). Each connection asks the sentinels for the master
    /// in office (and checks that it says it is one), so a connection lost to a failover is
    /// made again to the promoted replica.
    Sentinel(Box<SentinelStore>),
}

/// How a store behind sentinels is reached.
#[derive(Debug, Clone)]
struct SentinelStore {
    /// `ConnectionAddr::Tcp`, or `TcpTls` over TLS.
    sentinels: Vec<redis::ConnectionAddr>,
    master: String,
    tls: bool,
    certs: Option<redis::TlsCertificates>,
    /// The master's password (`fleet.password_file`), and the sentinels'
    /// (`fleet.sentinel_password_file`).
    password: Option<String>,
    sentinel_password: Option<String>,
}

impl SentinelStore {
    fn client(&self) -> redis::RedisResult<redis::sentinel::SentinelClient> {
        let mut b = redis::sentinel::SentinelClientBuilder::new(
            self.sentinels.clone(),
            &self.master,
            redis::sentinel::SentinelServerType::Master,
        )?;
        if let Some(pw) = &self.password {
            b = b.set_client_to_redis_password(pw);
        }
        if let Some(pw) = &self.sentinel_password {
            b = b.set_client_to_sentinel_password(pw);
        }
        if self.tls {
            b = b
                .set_client_to_redis_tls_mode(redis::TlsMode::Secure)
                .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure);
            if let Some(certs) = &self.certs {
                b = b
                    .set_client_to_redis_certificates(certs.clone())
                    .set_client_to_sentinel_certificates(certs.clone());
            }
        }
        b.build()
    }
}

/// A connection to the store: one server's, or a Redis Cluster's (which routes each command
/// to the master of its keys' slot; every key here carries the tag `{bans}`, so all of them,
/// and the script that updates two at once, live in one slot). Every command's answer is
/// awaited [`Conn::timeout`] at most, retries inside the cluster client included.
#[derive(Clone)]
pub struct Conn {
    inner: ConnKind,
    timeout: Duration,
}

#[derive(Clone)]
enum ConnKind {
    Single(MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection),
}

fn timed_out(what: &str, t: Duration) -> redis::RedisError {
    redis::RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!("{what}: no answer within {t:?}"),
    ))
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        let t = self.timeout;
        Box::pin(async move {
            let fut = match &mut self.inner {
                ConnKind::Single(c) => c.req_packed_command(cmd),
                ConnKind::Cluster(c) => c.req_packed_command(cmd),
            };
            tokio::time::timeout(t, fut)
                .await
                .unwrap_or_else(|_| Err(timed_out("the store", t)))
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        let t = self.timeout;
        Box::pin(async move {
            let fut = match &mut self.inner {
                ConnKind::Single(c) => c.req_packed_commands(pipeline, offset, count),
                ConnKind::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            };
            tokio::time::timeout(t, fut)
                .await
                .unwrap_or_else(|_| Err(timed_out("the store", t)))
        })
    }

    fn get_db(&self) -> i64 {
        match &self.inner {
            ConnKind::Single(c) => c.get_db(),
            ConnKind::Cluster(c) => c.get_db(),
        }
    }
}

/// `url` with any password replaced by `***` (the config's, which shows store URLs too).
pub use crate::config::redacted;

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

    /// A connection for global thresholds' counts.
    pub async fn connect_for_counts(&self) -> anyhow::Result<Conn> {
        self.connect(REQUEST_TIMEOUT).await
    }

    /// A connection whose commands are answered within `response` (or fail).
    async fn connect(&self, response: Duration) -> anyhow::Result<Conn> {
        let inner = match &self.client {
            Client::Single(client) => {
                let cfg = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(CONNECT_TIMEOUT))
                    .set_response_timeout(Some(response));
                // The client's own timeouts, and one over the whole (a handshake that hangs).
                match tokio::time::timeout(
                    CONNECT_TIMEOUT * 2,
                    client.get_multiplexed_async_connection_with_config(&cfg),
                )
                .await
                {
                    Ok(Ok(c)) => ConnKind::Single(c),
                    Ok(Err(e)) => bail!("connecting to {}: {e}", self.store),
                    Err(_) => bail!(
                        "connecting to {}: no answer within {:?}",
                        self.store,
                        CONNECT_TIMEOUT * 2
                    ),
                }
            }
            Client::Sentinel(store) => {
                let cfg = redis::AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(CONNECT_TIMEOUT))
                    .set_response_timeout(Some(response));
                let mut client = store
                    .client()
                    .with_context(|| format!("fleet.redis {}", self.store))?;
                // The sentinels asked (a few at once), the master's role checked, the
                // connection made: one bound over all of it.
                match tokio::time::timeout(
                    CONNECT_TIMEOUT * 2,
                    client.get_async_connection_with_config(&cfg),
                )
                .await
                {
                    Ok(Ok(c)) => ConnKind::Single(c),
                    Ok(Err(e)) => bail!("connecting to {}: {e}", self.store),
                    Err(_) => bail!(
                        "connecting to {}: no answer within {:?}",
                        self.store,
                        CONNECT_TIMEOUT * 2
                    ),
                }
            }
            Client::Cluster(nodes, tls) => {
                // Few retries inside the client: a slot whose master is gone fails fast, and
                // the tasks' own backoff takes over.
                let mut builder = redis::cluster::ClusterClientBuilder::new(nodes.clone())
                    .connection_timeout(CONNECT_TIMEOUT)
                    .response_timeout(response)
                    .retries(2)
                    .min_retry_wait(50)
                    .max_retry_wait(200);
                if let Some(certs) = tls {
                    builder = builder.certs(certs.clone());
                }
                let client = builder
                    .build()
                    .with_context(|| format!("fleet.redis {}", self.store))?;
                match tokio::time::timeout(CONNECT_TIMEOUT * 2, client.get_async_connection()).await
                {
                    Ok(Ok(c)) => ConnKind::Cluster(c),
                    Ok(Err(e)) => bail!("connecting to {}: {e}", self.store),
                    Err(_) => bail!(
                        "connecting to {}: no answer within {:?}",
                        self.store,
                        CONNECT_TIMEOUT * 2
                    ),
                }
            }
        };
        // The command's own timeout, and a little more for the client's retries.
        Ok(Conn {
            inner,
            timeout: response + REQUEST_TIMEOUT,
        })
    }
}

/// What `fleet status` and `/v1/fleet` answer.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Report {
    pub store: String,
    pub host_id: String,
    pub share_bans: bool,
    /// The reader is connected and caught up with the store.
    pub connected: bool,
    /// RFC 3339: since when connected, or since when degraded (cut off from the store).
    pub connected_since: Option<String>,
    pub degraded_since: Option<String>,
    /// Why the store was last unreachable.
    pub last_error: Option<String>,
    /// The last stream entry applied.
    pub cursor: Option<String>,
    /// Time from a record's issue to its receipt here, for the last record received (ms).
    pub lag_ms: Option<u64>,
    /// Outgoing records waiting for the store.
    pub outbox: usize,
    /// Outgoing records dropped because the outbox was full.
    pub outbox_dropped: u64,
    pub bans_published: u64,
    pub unbans_published: u64,
    /// Records of other hosts received, and what became of them.
    pub bans_received: u64,
    pub unbans_received: u64,
    /// Received bans not installed: expired already, or a ban here ends later.
    pub bans_skipped: u64,
    pub resyncs: u64,
    /// The store's round trip for the last command (ms).
    pub store_rtt_ms: Option<f64>,
    /// The hosts that wrote a heartbeat to the store (this one included), by host id, as last
    /// read.
    #[serde(default)]
    pub peers: Vec<Peer>,
    /// Global thresholds (`scope = "global"` rules): what is shared.
    #[serde(default)]
    pub global: global::GlobalReport,
    /// This host's clock against the store's.
    #[serde(default)]
    pub clock: ClockReport,
    /// `fleet.name`.
    #[serde(default)]
    pub fleet_name: String,
    /// Records and counts are authenticated with the fleet key (`fleet.key_file`); without
    /// it the store is trusted.
    #[serde(default)]
    pub authenticated: bool,
    /// Stream records and snapshot entries dropped, by reason (`crate::fleet::trust::Reject`).
    #[serde(default)]
    pub records_rejected: BTreeMap<String, u64>,
    /// Other hosts' counts of global rules dropped, by reason.
    #[serde(default)]
    pub counts_rejected: BTreeMap<String, u64>,
    /// Remote bans whose end was later than `fleet.remote_ban_max_duration` (or never):
    /// clamped to it.
    #[serde(default)]
    pub bans_clamped: u64,
    /// The peers in the store (the peers hash's length as last read; `peers` shows at most
    /// `peers::PEERS_MAX` of them).
    #[serde(default)]
    pub peers_total: u64,
    /// A resync from the snapshot under way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resync: Option<resync::Progress>,
    /// Whether another process writes this host id's heartbeat.
    #[serde(default)]
    pub duplicate_id: dup::DuplicateReport,
}

/// This host's wall clock against the store's, as `fleet status` and `/v1/fleet` show it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct ClockReport {
    /// This host's clock minus the store's (ms; negative: this host is behind), as last
    /// measured; `None` until measured.
    pub offset_ms: Option<f64>,
    /// The round trip of the sample that gave it (ms).
    pub rtt_ms: Option<f64>,
    /// `fleet.max_clock_skew` (ms).
    pub max_skew_ms: u64,
    /// The offset is beyond the bound: this host takes no part in global counting.
    pub over_bound: bool,
    /// This host takes part in global counting (measured, and within the bound).
    pub counting: bool,
    /// RFC 3339: the last trusted measurement.
    pub measured_at: Option<String>,
    /// RFC 3339: since when over the bound.
    pub over_since: Option<String>,
    /// Why the last measurement failed or was not trusted, if it was.
    pub last_error: Option<String>,
}

/// What each host writes into [`PEERS_KEY`] every [`HEARTBEAT`].
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Heartbeat {
    pub host_id: String,
    pub version: String,
    /// Unix ms, by the host's own clock.
    pub seen_ms: u64,
    #[serde(default)]
    pub bans_published: u64,
    #[serde(default)]
    pub bans_received: u64,
    #[serde(default)]
    pub cursor: Option<String>,
    /// Its clock minus the store's (ms), as it last measured it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_offset_ms: Option<f64>,
    /// A random nonce of the process that wrote it ([`dup`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nonce: Option<String>,
}

/// A peer as `fleet peers` and `/v1/fleet` show it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Peer {
    pub host_id: String,
    pub version: String,
    /// RFC 3339: its last heartbeat.
    pub last_seen: String,
    /// How long ago that was (ms, this host's clock against the peer's).
    pub age_ms: u64,
    /// Not seen for [`PEER_STALE`] or more (stopped, cut off from the store, or this host
    /// is).
    pub stale: bool,
    /// This host.
    pub this_host: bool,
    pub bans_published: u64,
    pub bans_received: u64,
    /// The last stream entry it applied.
    pub cursor: Option<String>,
    /// Its clock minus the store's (ms), as it last measured it.
    #[serde(default)]
    pub clock_offset_ms: Option<f64>,
}

impl Peer {
    fn of(h: &Heartbeat, me: &str, now_ms: u64) -> Peer {
        let age_ms = now_ms.saturating_sub(h.seen_ms);
        Peer {
            host_id: h.host_id.clone(),
            version: h.version.clone(),
            last_seen: crate::clock::rfc3339(UNIX_EPOCH + Duration::from_millis(h.seen_ms)),
            age_ms,
            stale: age_ms >= PEER_STALE.as_millis() as u64,
            this_host: h.host_id == me,
            bans_published: h.bans_published,
            bans_received: h.bans_received,
            cursor: h.cursor.clone(),
            clock_offset_ms: h.clock_offset_ms,
        }
    }
}

/// Buckets (seconds) of `ratelimit_fleet_store_latency_seconds`.
pub const LATENCY_BUCKETS: [f64; 10] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// The store's round trips, for `/metrics`: the count in each bucket (not cumulative; the
/// last is above every bound, `+Inf`), their sum and count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Latency {
    pub buckets: [u64; LATENCY_BUCKETS.len() + 1],
    pub sum: f64,
    pub count: u64,
}

impl Latency {
    pub fn observe(&mut self, secs: f64) {
        let i = LATENCY_BUCKETS
            .iter()
            .position(|le| secs <= *le)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[i] += 1;
        self.sum += secs;
        self.count += 1;
    }

    /// (upper bound, count in that bucket alone), `+Inf` last, as the encoder takes them.
    pub fn series(&self) -> Vec<(f64, u64)> {
        LATENCY_BUCKETS
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .zip(self.buckets)
            .collect()
    }
}

#[derive(Debug, Default)]
struct Inner {
    report: Report,
    latency: Latency,
    /// Degraded since (monotonic), for `down_for_ms`.
    down_at: Option<Instant>,
    /// The cursor as last written to disk.
    saved_cursor: Option<String>,
    /// The heartbeats last read from the store.
    peers: Vec<Heartbeat>,
    /// The duplicate-id watch.
    id_watch: dup::Watch,
}

/// What the fleet tasks know, for the reports; and the outbox.
pub struct Shared {
    inner: Mutex<Inner>,
    outbox: Mutex<VecDeque<Record>>,
    /// Bumped at every change of the outbox's content (under its lock), so that it is written
    /// to disk whenever it changed, whatever its length.
    outbox_gen: AtomicU64,
    /// Held while the cursor file is written (by the reader, or at shutdown).
    cursor_file: Mutex<()>,
    events: events::Events,
    global: Arc<global::Shared>,
    trust: Arc<Trust>,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn outbox(&self) -> std::sync::MutexGuard<'_, VecDeque<Record>> {
        self.outbox.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Change the outbox: `f` on it, and its generation bumped.
    fn change_outbox<T>(&self, f: impl FnOnce(&mut VecDeque<Record>) -> T) -> T {
        let mut ob = self.outbox();
        let out = f(&mut ob);
        self.outbox_gen.fetch_add(1, Ordering::Relaxed);
        out
    }

    pub fn report(&self) -> Report {
        let (mut r, peers) = {
            let i = self.lock();
            (i.report.clone(), i.peers.clone())
        };
        r.outbox = self.outbox().len();
        r.global = self.global.report();
        r.fleet_name = self.trust.name.clone();
        r.authenticated = self.trust.authenticated();
        r.records_rejected = self.trust.rejects.records_by_reason();
        r.counts_rejected = self.trust.rejects.counts_by_reason();
        r.bans_clamped = self.trust.rejects.clamped_total();
        let now_ms = unix_ms(SystemTime::now());
        r.peers = peers
            .iter()
            .map(|h| Peer::of(h, &r.host_id, now_ms))
            .collect();
        r
    }

    /// This host's heartbeat now, with its process's `nonce`.
    fn heartbeat(&self, nonce: &str) -> Heartbeat {
        let i = self.lock();
        Heartbeat {
            host_id: i.report.host_id.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            seen_ms: unix_ms(SystemTime::now()),
            bans_published: i.report.bans_published,
            bans_received: i.report.bans_received,
            cursor: i.report.cursor.clone(),
            clock_offset_ms: i.report.clock.offset_ms,
            nonce: Some(nonce.to_string()),
        }
    }

    pub fn latency(&self) -> Latency {
        self.lock().latency.clone()
    }

    fn rtt(&self, t0: Instant) {
        let secs = t0.elapsed().as_secs_f64();
        let mut i = self.lock();
        i.latency.observe(secs);
        i.report.store_rtt_ms = Some(secs * 1e3);
    }

    /// The store could not be reached: the first time since it could, a `fleet_degraded`
    /// event.
    fn degraded(&self, why: &str) {
        let outbox = self.outbox().len();
        let mut i = self.lock();
        i.report.last_error = Some(why.to_string());
        if !i.report.connected && i.report.degraded_since.is_some() {
            return;
        }
        let now = SystemTime::now();
        i.report.connected = false;
        i.report.connected_since = None;
        i.report.degraded_since = Some(crate::clock::rfc3339(now));
        i.down_at = Some(Instant::now());
        warn!(store = %i.report.store, "fleet store unreachable, enforcing locally: {why}");
        self.events.fleet(events::FleetLine {
            time: crate::clock::rfc3339(now),
            event: "fleet_degraded",
            store: i.report.store.clone(),
            host_id: i.report.host_id.clone(),
            reason: Some(why.to_string()),
            since: i.report.degraded_since.clone(),
            down_for_ms: None,
            outbox,
            offset_ms: None,
            max_skew_ms: None,
        });
    }

    /// A clock measurement could not be made: the state stays as it is.
    fn clock_failed(&self, why: String) {
        self.lock().report.clock.last_error = Some(why);
    }

    /// A clock measurement: `sample` the fastest of its round trips. Crossing the bound
    /// either way changes whether this host counts globally, with an event and a log line.
    fn clock_measured(&self, clock: &Clock, sample: ClockSample) {
        let (offset, rtt) = (sample.offset_ns(), sample.rtt_ns());
        let bound = clock.bound();
        let verdict = judge_clock(offset, rtt, bound);
        let mut i = self.lock();
        let c = &mut i.report.clock;
        if verdict == ClockVerdict::Untrusted {
            c.last_error = Some(format!(
                "the store's fastest answer took {:.1} ms, more than half of \
                 fleet.max_clock_skew ({}): the offset was not trusted",
                rtt as f64 / 1e6,
                config::format_duration(bound)
            ));
            return;
        }
        let now = SystemTime::now();
        let offset_ms = offset as f64 / 1e6;
        let first = c.measured_at.is_none();
        let was_over = c.over_bound;
        c.offset_ms = Some(offset_ms);
        c.rtt_ms = Some(rtt as f64 / 1e6);
        c.measured_at = Some(crate::clock::rfc3339(now));
        c.last_error = None;
        let over = verdict == ClockVerdict::Over;
        c.over_bound = over;
        c.counting = !over;
        clock.counting.store(!over, Ordering::Relaxed);
        let how = if offset >= 0 { "ahead of" } else { "behind" };
        let bound_s = config::format_duration(bound);
        let (store, host_id) = (i.report.store.clone(), i.report.host_id.clone());
        if over && (first || !was_over) {
            i.report.clock.over_since = Some(crate::clock::rfc3339(now));
            let why = format!(
                "this host's clock is {:.0} ms {how} the store's, beyond fleet.max_clock_skew \
                 ({bound_s}): global rules are enforced locally",
                offset_ms.abs()
            );
            warn!(offset_ms, rtt_ms = rtt as f64 / 1e6, "{why}");
            let since = i.report.clock.over_since.clone();
            self.events.fleet(events::FleetLine {
                time: crate::clock::rfc3339(now),
                event: "fleet_clock_skew",
                store,
                host_id,
                reason: Some(why),
                since,
                down_for_ms: None,
                outbox: 0,
                offset_ms: Some(offset_ms),
                max_skew_ms: Some(bound.as_millis() as u64),
            });
        } else if !over && was_over {
            let since = i.report.clock.over_since.take();
            info!(
                offset_ms,
                "this host's clock is within fleet.max_clock_skew ({bound_s}) of the store's \
                 again: global counting resumes"
            );
            self.events.fleet(events::FleetLine {
                time: crate::clock::rfc3339(now),
                event: "fleet_clock_restored",
                store,
                host_id,
                reason: None,
                since,
                down_for_ms: None,
                outbox: 0,
                offset_ms: Some(offset_ms),
                max_skew_ms: Some(bound.as_millis() as u64),
            });
        } else if first {
            info!(
                offset_ms,
                rtt_ms = rtt as f64 / 1e6,
                "this host's clock is within fleet.max_clock_skew ({bound_s}) of the store's"
            );
        }
    }

    /// The reader is connected and caught up: after a degraded spell, `fleet_restored`.
    fn restored(&self) {
        let outbox = self.outbox().len();
        let mut i = self.lock();
        if i.report.connected {
            return;
        }
        let now = SystemTime::now();
        let was_down = i.report.degraded_since.take();
        i.report.connected = true;
        i.report.connected_since = Some(crate::clock::rfc3339(now));
        let down_for = i.down_at.take().map(|t| t.elapsed().as_millis() as u64);
        if let Some(since) = was_down {
            info!(store = %i.report.store, "fleet store reachable again");
            self.events.fleet(events::FleetLine {
                time: crate::clock::rfc3339(now),
                event: "fleet_restored",
                store: i.report.store.clone(),
                host_id: i.report.host_id.clone(),
                reason: None,
                since: Some(since),
                down_for_ms: down_for,
                outbox,
                offset_ms: None,
                max_skew_ms: None,
            });
        } else {
            info!(store = %i.report.store, "fleet store connected");
        }
    }
}

/// The owner's side of the fleet: where its records go, and what the reports read.
#[derive(Clone)]
pub struct Link {
    pub settings: Arc<Settings>,
    pub shared: Arc<Shared>,
    /// Global thresholds' task state (`crate::fleet::global`).
    pub global: Arc<global::Shared>,
    tx: mpsc::UnboundedSender<Record>,
}

impl Link {
    /// Hand records to the publisher (never waits). Nothing when bans are not shared.
    pub fn publish(&self, records: Vec<Record>) {
        if !self.settings.share_bans {
            return;
        }
        for r in records {
            let _ = self.tx.send(r);
        }
    }

    pub fn record(&self, op: Op, net: String, exp_ms: u64, rule: Option<String>) -> Record {
        Record {
            op,
            net,
            exp_ms,
            at_ms: unix_ms(SystemTime::now()),
            host: self.settings.host_id.clone(),
            rule,
            reason: None,
        }
    }

    /// Write the reader's cursor to disk now if it moved since it was last written (at
    /// shutdown).
    pub fn save_cursor_now(&self) {
        let cursor = {
            let i = self.shared.lock();
            if i.report.cursor == i.saved_cursor {
                return;
            }
            i.report.cursor.clone()
        };
        if let Some(c) = cursor {
            match write_cursor(&self.settings, &self.shared, &c) {
                Ok(()) => self.shared.lock().saved_cursor = Some(c),
                Err(e) => warn!("saving the fleet cursor: {e:#}"),
            }
        }
    }
}

/// The saved cursor (`state_dir/fleet.json`).
#[derive(Serialize, Deserialize, Debug, Default)]
struct Saved {
    host_id: String,
    cursor: Option<String>,
}

fn load_saved(dir: &Path) -> Saved {
    std::fs::read(dir.join(STATE_FILE))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

fn load_outbox(dir: &Path) -> VecDeque<Record> {
    let path = dir.join(OUTBOX_FILE);
    match std::fs::read(&path) {
        Ok(b) => match serde_json::from_slice::<VecDeque<Record>>(&b) {
            Ok(v) => {
                if !v.is_empty() {
                    info!(
                        records = v.len(),
                        "fleet outbox read from {}: sent when the store is reachable",
                        path.display()
                    );
                }
                v
            }
            Err(e) => {
                let aside = crate::durable::set_aside(&path, "bad")
                    .map(|p| format!("moved to {}", p.display()))
                    .unwrap_or_else(|e| format!("could not be moved aside: {e:#}"));
                warn!(
                    "{} is not a fleet outbox ({e}); it was {aside}",
                    path.display()
                );
                VecDeque::new()
            }
        },
        Err(_) => VecDeque::new(),
    }
}

/// What the reader hands the owner to apply.
pub enum Received {
    /// Stream records, in order.
    Records(Vec<Record>),
    /// The snapshot: every ban of the fleet now, and the tombstones of recent `unban`s,
    /// which lift only bans received from the fleet. A ban held here that the snapshot lacks
    /// stays until its end (the store may have lost its data: a restart without
    /// persistence), so an `unban` whose tombstone was pruned before this host read it is
    /// missed.
    Snapshot(Vec<Record>),
}

/// What applying records did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Applied {
    pub bans: u64,
    pub unbans: u64,
    pub skipped: u64,
}

/// Start the fleet's tasks: the publisher and the reader, supervised. `apply` runs on the
/// owner task.
pub fn start<A, Fut>(
    settings: Settings,
    tasks: &Arc<supervise::Tasks>,
    events: events::Events,
    apply: A,
) -> Link
where
    A: Fn(Received) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = anyhow::Result<Applied>> + Send + 'static,
{
    let settings = Arc::new(settings);
    let saved = load_saved(&settings.state_dir);
    let outbox = load_outbox(&settings.state_dir);
    let shared = Arc::new(Shared {
        inner: Mutex::new(Inner {
            report: Report {
                store: settings.store.clone(),
                host_id: settings.host_id.clone(),
                share_bans: settings.share_bans,
                cursor: saved.cursor.clone(),
                clock: ClockReport {
                    max_skew_ms: settings.clock.bound().as_millis() as u64,
                    ..ClockReport::default()
                },
                duplicate_id: dup::DuplicateReport {
                    nonce: settings.id_guard.nonce().to_string(),
                    ..dup::DuplicateReport::default()
                },
                ..Report::default()
            },
            saved_cursor: saved.cursor,
            ..Inner::default()
        }),
        outbox: Mutex::new(outbox),
        outbox_gen: AtomicU64::new(0),
        cursor_file: Mutex::new(()),
        events,
        global: Arc::default(),
        trust: settings.trust.clone(),
    });
    if !settings.trust.authenticated() {
        warn!(
            fleet = %settings.trust.name,
            "no fleet.key_file: the fleet store is trusted (whoever can write to it can ban, \
             lift bans and add counts on every host, within fleet.remote_ban_min_prefix_* and \
             fleet.remote_ban_max_duration)"
        );
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let rx = Arc::new(tokio::sync::Mutex::new(rx));
    // The clock is measured whatever `share_bans` says: global thresholds depend on it.
    let (s, sh) = (settings.clone(), shared.clone());
    supervise::spawn(tasks, "fleet_clock", BACKOFF_FIRST, move || {
        clock_task(s.clone(), sh.clone())
    });
    // The heartbeat runs whatever `share_bans` says: it finds a duplicate host id, which
    // global counting depends on (and sweeps the snapshot only when bans are shared).
    let (s, sh) = (settings.clone(), shared.clone());
    supervise::spawn(tasks, "fleet_heartbeat", BACKOFF_FIRST, move || {
        heartbeat(s.clone(), sh.clone())
    });
    // With `share_bans = false` no ban is shared: neither the publisher nor the reader runs.
    if settings.share_bans {
        let (s, sh) = (settings.clone(), shared.clone());
        supervise::spawn(tasks, "fleet_publisher", BACKOFF_FIRST, move || {
            publisher(s.clone(), sh.clone(), rx.clone())
        });
        let (s, sh) = (settings.clone(), shared.clone());
        supervise::spawn(tasks, "fleet_reader", BACKOFF_FIRST, move || {
            reader(s.clone(), sh.clone(), apply.clone())
        });
    }
    Link {
        settings,
        global: shared.global.clone(),
        shared,
        tx,
    }
}

/// Publish one record: appended to the stream, and the snapshot's field for its prefix
/// updated (a ban that ends later, or never, is kept; an expired one or a tombstone is
/// replaced; an `unban` leaves its tombstone). With the fleet key, ARGV[7] is the snapshot
/// value's MAC (appended as `|<MAC>`) and ARGV[8] the record's (the stream entry's field
/// `m`); both empty without.
const PUBLISH_SCRIPT: &str = r#"
local suffix = ''
if ARGV[7] ~= '' then
  suffix = '|' .. ARGV[7]
end
local cur = redis.call('HGET', KEYS[2], ARGV[2])
if ARGV[3] == 'ban' then
  local keep = false
  if cur then
    local e = tonumber(string.match(cur, '^(%d+)|'))
    if e == 0 then
      keep = true
    elseif ARGV[4] ~= '0' and e and e >= tonumber(ARGV[4]) then
      keep = true
    end
  end
  if not keep then
    redis.call('HSET', KEYS[2], ARGV[2], ARGV[4] .. '|' .. ARGV[5] .. suffix)
  end
else
  redis.call('HSET', KEYS[2], ARGV[2], 't' .. ARGV[6] .. '|' .. ARGV[5] .. suffix)
end
if ARGV[8] ~= '' then
  return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'r', ARGV[5], 'm', ARGV[8])
end
return redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'r', ARGV[5])
"#;

/// Remove a snapshot field if it still holds the value the sweep saw.
const PRUNE_SCRIPT: &str = r#"
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"#;

/// A Lua script run by its SHA1 (`EVALSHA`): loaded once (`SCRIPT LOAD`, on every master of
/// a cluster), and again when the store answers that it does not know it (`NOSCRIPT`: a
/// store restarted, or its scripts flushed).
pub struct Lua {
    code: &'static str,
    sha: Option<String>,
}

impl Lua {
    pub const fn new(code: &'static str) -> Self {
        Self { code, sha: None }
    }

    /// Run the script once per item of `calls` in one pipeline (one round trip): `args`
    /// adds the keys and arguments of one call after `EVALSHA <sha>`.
    async fn run<T>(
        &mut self,
        conn: &mut Conn,
        calls: &[T],
        args: impl Fn(&mut redis::Cmd, &T) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        if calls.is_empty() {
            return Ok(());
        }
        let mut retried = false;
        loop {
            let sha = match &self.sha {
                Some(sha) => sha.clone(),
                None => {
                    let sha: String = redis::cmd("SCRIPT")
                        .arg("LOAD")
                        .arg(self.code)
                        .query_async(conn)
                        .await
                        .context("loading a script into the store")?;
                    self.sha = Some(sha.clone());
                    sha
                }
            };
            let mut pipe = redis::pipe();
            for c in calls {
                let mut cmd = redis::cmd("EVALSHA");
                cmd.arg(&sha);
                args(&mut cmd, c)?;
                pipe.add_command(cmd);
            }
            let replies: Vec<redis::Value> = match pipe.query_async(conn).await {
                Ok(v) => v,
                Err(e) if e.code() == Some("NOSCRIPT") && !retried => {
                    self.sha = None;
                    retried = true;
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let no_script = replies
                .iter()
                .any(|v| matches!(v, redis::Value::ServerError(e) if e.code() == "NOSCRIPT"));
            if no_script && !retried {
                // Replays are harmless: the calls that ran run again to the same effect.
                self.sha = None;
                retried = true;
                continue;
            }
            if let Some(redis::Value::ServerError(e)) = replies
                .iter()
                .find(|v| matches!(v, redis::Value::ServerError(_)))
            {
                bail!("the store refused a script: {e:?}");
            }
            return Ok(());
        }
    }
}

/// Publish one batch, in one round trip.
async fn publish_batch(
    settings: &Settings,
    conn: &mut Conn,
    lua: &mut Lua,
    batch: &[Record],
) -> anyhow::Result<()> {
    let trust = &settings.trust;
    lua.run(conn, batch, |cmd, r| {
        let json = serde_json::to_string(r)?;
        let snap_mac = trust.snapshot_mac(r, &json);
        let mac = trust.sign(trust::Kind::Record, &[json.as_bytes()]);
        cmd.arg(2)
            .arg(&settings.keys.stream)
            .arg(&settings.keys.snap)
            .arg(STREAM_MAXLEN)
            .arg(&r.net)
            .arg(match r.op {
                Op::Ban => "ban",
                Op::Unban => "unban",
            })
            .arg(r.exp_ms)
            .arg(&json)
            .arg(r.at_ms)
            .arg(snap_mac)
            .arg(mac);
        Ok(())
    })
    .await
}

/// Write the outbox whole (or remove the file when it is empty).
fn save_outbox(dir: &Path, records: &[Record]) -> anyhow::Result<()> {
    if records.is_empty() {
        match std::fs::remove_file(dir.join(OUTBOX_FILE)) {
            Ok(()) => crate::durable::sync_dir(dir),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).context("removing the fleet outbox"),
        }
    } else {
        crate::durable::write_atomically(dir, OUTBOX_FILE, &serde_json::to_vec(records)?)
    }
}

/// The publisher: takes the owner's records into the outbox and sends the outbox to the
/// store, oldest first. While the store cannot be reached the outbox is kept on disk.
async fn publisher(
    settings: Arc<Settings>,
    shared: Arc<Shared>,
    rx: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Record>>>,
) -> anyhow::Result<()> {
    let mut rx = rx.lock().await;
    let mut conn: Option<Conn> = None;
    let mut lua = Lua::new(PUBLISH_SCRIPT);
    // The outbox's generation as last written to disk (or read from it), to write on change.
    let mut on_disk = shared.outbox_gen.load(Ordering::Relaxed);
    let mut retry = tokio::time::interval(PUBLISH_RETRY);
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut backoff = BACKOFF_FIRST;
    let mut next_try = Instant::now();
    loop {
        tokio::select! {
            r = rx.recv() => {
                let Some(r) = r else { return Ok(()) };
                let mut fresh = vec![r];
                while let Ok(r) = rx.try_recv() {
                    fresh.push(r);
                }
                let over = shared.change_outbox(|ob| {
                    ob.extend(fresh);
                    let over = ob.len().saturating_sub(OUTBOX_MAX);
                    ob.drain(..over);
                    over
                });
                if over > 0 {
                    shared.lock().report.outbox_dropped += over as u64;
                    warn!(dropped = over, "fleet outbox full: the oldest records were dropped");
                }
            }
            _ = retry.tick() => {}
        }
        if shared.outbox().is_empty() {
            continue;
        }
        if Instant::now() < next_try {
            persist(&settings, &shared, &mut on_disk).await;
            continue;
        }
        let sent = send_outbox(&settings, &shared, &mut conn, &mut lua).await;
        match sent {
            Ok(()) => backoff = BACKOFF_FIRST,
            Err(e) => {
                conn = None;
                next_try = Instant::now() + backoff;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                shared.lock().report.last_error = Some(format!("{e:#}"));
            }
        }
        persist(&settings, &shared, &mut on_disk).await;
    }
}

/// Send the outbox, batch by batch, until it is empty or a batch fails.
async fn send_outbox(
    settings: &Settings,
    shared: &Shared,
    conn: &mut Option<Conn>,
    lua: &mut Lua,
) -> anyhow::Result<()> {
    loop {
        let batch: Vec<Record> = shared.outbox().iter().take(BATCH).cloned().collect();
        if batch.is_empty() {
            return Ok(());
        }
        if conn.is_none() {
            *conn = Some(settings.connect(REQUEST_TIMEOUT).await?);
        }
        let c = conn.as_mut().expect("connected above");
        let t0 = Instant::now();
        publish_batch(settings, c, lua, &batch)
            .await
            .with_context(|| format!("publishing to {}", settings.store))?;
        shared.rtt(t0);
        let (bans, unbans) = batch.iter().fold((0, 0), |(b, u), r| match r.op {
            Op::Ban => (b + 1, u),
            Op::Unban => (b, u + 1),
        });
        shared.change_outbox(|ob| {
            let n = batch.len().min(ob.len());
            ob.drain(..n);
        });
        let mut i = shared.lock();
        i.report.bans_published += bans;
        i.report.unbans_published += unbans;
    }
}

/// Write the outbox to disk if it changed since it was last written (`on_disk`: its
/// generation then).
async fn persist(settings: &Arc<Settings>, shared: &Arc<Shared>, on_disk: &mut u64) {
    let (records, generation): (Vec<Record>, u64) = {
        let ob = shared.outbox();
        let generation = shared.outbox_gen.load(Ordering::Relaxed);
        if generation == *on_disk {
            return;
        }
        (ob.iter().cloned().collect(), generation)
    };
    let dir = settings.state_dir.clone();
    let saved = tokio::task::spawn_blocking(move || save_outbox(&dir, &records)).await;
    match saved {
        Ok(Ok(())) => *on_disk = generation,
        Ok(Err(e)) => warn!("saving the fleet outbox: {e:#}"),
        Err(e) => warn!("saving the fleet outbox: {e}"),
    }
}

/// The heartbeat: every [`HEARTBEAT`], this host's [`Heartbeat`] into [`PEERS_KEY`], and the
/// others' read back within a bound ([`peers`]); then, when bans are shared, the next
/// [`SWEEP_COUNT`] fields of the snapshot looked at, and the stale ones pruned. A failure
/// waits for the next beat (the reader reports the store's health).
async fn heartbeat(settings: Arc<Settings>, shared: Arc<Shared>) -> anyhow::Result<()> {
    let mut conn: Option<Conn> = None;
    let mut tick = tokio::time::interval(HEARTBEAT);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut prune = Lua::new(PRUNE_SCRIPT);
    let mut scan: u64 = 0;
    let mut known = peers::Peers::default();
    loop {
        tick.tick().await;
        let res = match peers::beat(&settings, &shared, &mut conn, &mut known).await {
            Ok(()) if !settings.share_bans => Ok(()),
            Ok(()) => {
                let c = conn.as_mut().expect("connected by the beat");
                sweep_snapshot(&settings.keys, c, &mut prune, &mut scan).await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = res {
            conn = None;
            tracing::debug!("fleet heartbeat: {e:#}");
        }
    }
}

/// The clock task: this host's clock measured against the store's at once, and every
/// [`CLOCK_EVERY`]. A failed measurement changes nothing (and the next one connects again).
async fn clock_task(settings: Arc<Settings>, shared: Arc<Shared>) -> anyhow::Result<()> {
    let mut conn: Option<Conn> = None;
    let mut tick = tokio::time::interval(CLOCK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match measure_clock(&settings, &mut conn).await {
            Ok(sample) => shared.clock_measured(&settings.clock, sample),
            Err(e) => {
                conn = None;
                tracing::debug!("measuring the clock against the store's: {e:#}");
                shared.clock_failed(format!("{e:#}"));
            }
        }
    }
}

/// [`CLOCK_SAMPLES`] `TIME` round trips; the fastest.
async fn measure_clock(
    settings: &Settings,
    conn: &mut Option<Conn>,
) -> anyhow::Result<ClockSample> {
    if conn.is_none() {
        *conn = Some(settings.connect(REQUEST_TIMEOUT).await?);
    }
    let c = conn.as_mut().expect("connected above");
    let mut samples = Vec::with_capacity(CLOCK_SAMPLES);
    for _ in 0..CLOCK_SAMPLES {
        let sent_ns = crate::clock::wall_ns() as i64;
        let (secs, micros): (i64, i64) = redis::cmd("TIME")
            .query_async(c)
            .await
            .context("reading the store's clock (TIME)")?;
        let recv_ns = crate::clock::wall_ns() as i64;
        samples.push(ClockSample {
            sent_ns,
            recv_ns,
            store_ns: secs * 1_000_000_000 + micros * 1000,
        });
    }
    Ok(best_sample(&samples).expect("samples taken"))
}

/// Whether a snapshot value is stale at `now_ms`: a ban that has ended, or a tombstone older
/// than `first_ms`, the stream's first entry (`None`: the stream is empty; tombstones stay).
fn stale_in_snapshot(value: &str, now_ms: u64, first_ms: Option<u64>) -> bool {
    let Some((head, _)) = value.split_once('|') else {
        return true;
    };
    match head.strip_prefix('t') {
        Some(at) => match (at.parse::<u64>(), first_ms) {
            (Ok(at), Some(first)) => at < first,
            (Ok(_), None) => false,
            (Err(_), _) => true,
        },
        None => match head.parse::<u64>() {
            Ok(end) => end != 0 && end <= now_ms,
            Err(_) => true,
        },
    }
}

/// One step of the snapshot's sweep: the next fields from `scan` (an `HSCAN` cursor, 0 = a
/// new pass), and those stale removed unless they changed since.
async fn sweep_snapshot(
    keys: &Keys,
    c: &mut Conn,
    prune: &mut Lua,
    scan: &mut u64,
) -> anyhow::Result<()> {
    let (next, fields): (u64, Vec<(String, String)>) = redis::cmd("HSCAN")
        .arg(&keys.snap)
        .arg(*scan)
        .arg("COUNT")
        .arg(SWEEP_COUNT)
        .query_async(c)
        .await
        .context("scanning the ban snapshot")?;
    *scan = next;
    let first: Vec<(String, Vec<(String, String)>)> =
        if fields.iter().any(|(_, v)| v.starts_with('t')) {
            redis::cmd("XRANGE")
                .arg(&keys.stream)
                .arg("-")
                .arg("+")
                .arg("COUNT")
                .arg(1)
                .query_async(c)
                .await
                .context("reading the ban stream's first entry")?
        } else {
            Vec::new()
        };
    let first_ms = first
        .first()
        .and_then(|(id, _)| id.split('-').next()?.parse::<u64>().ok());
    let now_ms = unix_ms(SystemTime::now());
    let stale: Vec<(String, String)> = fields
        .into_iter()
        .filter(|(_, v)| stale_in_snapshot(v, now_ms, first_ms))
        .collect();
    prune
        .run(c, &stale, |cmd, (field, value)| {
            cmd.arg(1).arg(&keys.snap).arg(field).arg(value);
            Ok(())
        })
        .await
        .context("pruning the ban snapshot")
}

/// Records of a stream reply: `(last id, records)`.
type StreamReply = Option<Vec<(String, Vec<(String, Vec<(String, String)>)>)>>;

/// The records of stream entries this host accepts ([`Trust::stream_record`]: authenticated
/// with the fleet key if there is one, every field within its bounds), and the last entry's
/// id.
fn parse_entries(
    trust: &Trust,
    entries: Vec<(String, Vec<(String, String)>)>,
) -> (Option<String>, Vec<Record>) {
    let mut last = None;
    let mut out = Vec::with_capacity(entries.len());
    let now_ms = unix_ms(SystemTime::now());
    for (id, fields) in entries {
        let field = |name: &str| {
            fields
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        if let Some(r) = trust.stream_record(field("r"), field("m"), now_ms) {
            out.push(r);
        }
        last = Some(id);
    }
    (last, out)
}

/// The reader: keeps a connection to the store, resyncs from the snapshot when it has to,
/// and follows the stream from its cursor, handing other hosts' records to the owner.
async fn reader<A, Fut>(
    settings: Arc<Settings>,
    shared: Arc<Shared>,
    apply: A,
) -> anyhow::Result<()>
where
    A: Fn(Received) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = anyhow::Result<Applied>> + Send + 'static,
{
    let mut backoff = BACKOFF_FIRST;
    loop {
        match follow(&settings, &shared, &apply, &mut backoff).await {
            Ok(()) => backoff = BACKOFF_FIRST,
            Err(e) => {
                shared.degraded(&format!("{e:#}"));
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

/// Follow the stream until an error; `backoff` (the wait before the next connection) starts
/// over once a read succeeds.
async fn follow<A, Fut>(
    settings: &Settings,
    shared: &Shared,
    apply: &A,
    backoff: &mut Duration,
) -> anyhow::Result<()>
where
    A: Fn(Received) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = anyhow::Result<Applied>> + Send + 'static,
{
    let read_timeout = Duration::from_millis(READ_BLOCK_MS) + REQUEST_TIMEOUT;
    let mut conn = settings.connect(read_timeout).await?;
    let mut cursor = shared.lock().report.cursor.clone();
    // A cursor that the stream no longer holds: records may have been trimmed away (or the
    // store lost its data), so the snapshot is read; one it still holds is followed on.
    let mut cursor_found = false;
    if let Some(c) = &cursor {
        let t0 = Instant::now();
        let found: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
            .arg(&settings.keys.stream)
            .arg(c)
            .arg(c)
            .query_async(&mut conn)
            .await
            .context("reading the ban stream")?;
        shared.rtt(t0);
        cursor_found = !found.is_empty();
    }
    if !cursor_found {
        let last = resync::resync(settings, shared, &mut conn, apply).await?;
        save_cursor(settings, shared, &last).await;
        cursor = Some(last);
    }
    shared.restored();
    // When the cursor was last written to disk.
    let mut saved_at = Instant::now();
    loop {
        let from = cursor.clone().unwrap_or_else(|| "0-0".into());
        let reply: StreamReply = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(BATCH)
            .arg("BLOCK")
            .arg(READ_BLOCK_MS)
            .arg("STREAMS")
            .arg(&settings.keys.stream)
            .arg(&from)
            .query_async(&mut conn)
            .await
            .context("reading the ban stream")?;
        *backoff = BACKOFF_FIRST;
        // A blocked read's time is the wait for records, not the store's round trip.
        let Some(streams) = reply else {
            // Nothing new for a while: the cursor is written if it moved.
            save_cursor_if_moved(settings, shared).await;
            saved_at = Instant::now();
            continue;
        };
        for (_, entries) in streams {
            let (last, records) = parse_entries(&settings.trust, entries);
            let received_at = unix_ms(SystemTime::now());
            let theirs: Vec<Record> = records
                .into_iter()
                .filter(|r| r.host != settings.host_id)
                .collect();
            if let Some(r) = theirs.last() {
                shared.lock().report.lag_ms = Some(received_at.saturating_sub(r.at_ms));
            }
            let (bans, unbans) = theirs.iter().fold((0, 0), |(b, u), r| match r.op {
                Op::Ban => (b + 1, u),
                Op::Unban => (b, u + 1),
            });
            if !theirs.is_empty() {
                let applied = apply(Received::Records(theirs)).await?;
                let mut i = shared.lock();
                i.report.bans_received += bans;
                i.report.unbans_received += unbans;
                i.report.bans_skipped += applied.skipped;
            }
            if let Some(last) = last {
                shared.lock().report.cursor = Some(last.clone());
                cursor = Some(last);
            }
        }
        if saved_at.elapsed() >= CURSOR_SAVE {
            save_cursor_if_moved(settings, shared).await;
            saved_at = Instant::now();
        }
    }
}

/// Write the cursor to `state_dir` (a temporary file renamed over the old one, durably).
fn write_cursor(settings: &Settings, shared: &Shared, cursor: &str) -> anyhow::Result<()> {
    let _writing = shared.cursor_file.lock().unwrap_or_else(|e| e.into_inner());
    let saved = Saved {
        host_id: settings.host_id.clone(),
        cursor: Some(cursor.to_string()),
    };
    crate::durable::write_atomically(
        &settings.state_dir,
        STATE_FILE,
        &serde_json::to_vec(&saved)?,
    )
}

/// Take `cursor` as the reader's, and write it to disk now.
async fn save_cursor(settings: &Settings, shared: &Shared, cursor: &str) {
    shared.lock().report.cursor = Some(cursor.to_string());
    save_cursor_if_moved(settings, shared).await;
}

/// Write the reader's cursor to disk if it moved since it was last written.
async fn save_cursor_if_moved(settings: &Settings, shared: &Shared) {
    let cursor = {
        let i = shared.lock();
        if i.report.cursor == i.saved_cursor {
            return;
        }
        i.report.cursor.clone()
    };
    let Some(cursor) = cursor else { return };
    match tokio::task::block_in_place(|| write_cursor(settings, shared, &cursor)) {
        Ok(()) => shared.lock().saved_cursor = Some(cursor),
        Err(e) => warn!("saving the fleet cursor: {e:#}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_lands_in_one_bucket_each() {
        let mut l = Latency::default();
        l.observe(0.0001);
        l.observe(0.003);
        l.observe(5.0);
        let s = l.series();
        assert_eq!(s.len(), LATENCY_BUCKETS.len() + 1);
        assert_eq!(s[0], (0.0005, 1));
        assert_eq!(s[3], (0.005, 1));
        assert_eq!(s.last(), Some(&(f64::INFINITY, 1)));
        assert_eq!(l.count, 3);
    }

    #[test]
    fn peers_are_stale_after_ten_seconds_unseen() {
        let h = Heartbeat {
            host_id: "b".into(),
            version: "0.1.0".into(),
            seen_ms: 1_000_000,
            bans_published: 3,
            bans_received: 4,
            cursor: Some("5-0".into()),
            clock_offset_ms: Some(-2.5),
            nonce: Some("0123456789abcdef".into()),
        };
        let p = Peer::of(&h, "a", 1_009_999);
        assert!(!p.stale && !p.this_host && p.age_ms == 9_999, "{p:?}");
        assert_eq!(p.last_seen, "1970-01-01T00:16:40.000Z");
        let p = Peer::of(&h, "b", 1_010_000);
        assert!(p.stale && p.this_host, "{p:?}");
        // A peer's clock ahead of ours: age 0, not stale.
        assert_eq!(Peer::of(&h, "a", 999_000).age_ms, 0);
        let back: Heartbeat = serde_json::from_str(&serde_json::to_string(&h).unwrap()).unwrap();
        assert_eq!(back, h);
    }

    #[test]
    fn the_clock_offset_is_the_fastest_sample_s_midpoint_against_the_store() {
        const MS: i64 = 1_000_000;
        // Sent at 1000 ms, answered at 1010 ms; the store said 6005 ms (5 s ahead): the
        // answer arrived 5 ms after the store read its clock, so this host is 5000 ms behind.
        let a = ClockSample {
            sent_ns: 1000 * MS,
            recv_ns: 1010 * MS,
            store_ns: 6005 * MS,
        };
        assert_eq!((a.rtt_ns(), a.offset_ns()), (10 * MS, -5000 * MS));
        // A slower round trip, its answer delayed on the way back: a worse estimate.
        let b = ClockSample {
            sent_ns: 2000 * MS,
            recv_ns: 2200 * MS,
            store_ns: 7001 * MS,
        };
        assert_eq!(b.offset_ns(), -4901 * MS);
        assert_eq!(best_sample(&[b, a, b]), Some(a));
        assert_eq!(best_sample(&[]), None);
        // This host ahead.
        let c = ClockSample {
            sent_ns: 10_000 * MS,
            recv_ns: 10_002 * MS,
            store_ns: 9_700 * MS,
        };
        assert_eq!(c.offset_ns(), 301 * MS);
        // A clock stepped back during the round trip: no negative round trip.
        let d = ClockSample {
            sent_ns: 5 * MS,
            recv_ns: 3 * MS,
            store_ns: 3 * MS,
        };
        assert_eq!((d.rtt_ns(), d.offset_ns()), (0, 0));
    }

    #[test]
    fn the_clock_is_judged_against_the_bound_either_way_when_the_round_trip_is_short() {
        const MS: i64 = 1_000_000;
        let bound = Duration::from_millis(250);
        assert_eq!(judge_clock(0, MS, bound), ClockVerdict::Within);
        assert_eq!(judge_clock(250 * MS, MS, bound), ClockVerdict::Within);
        assert_eq!(judge_clock(-250 * MS, MS, bound), ClockVerdict::Within);
        assert_eq!(judge_clock(251 * MS, MS, bound), ClockVerdict::Over);
        assert_eq!(judge_clock(-5000 * MS, MS, bound), ClockVerdict::Over);
        // Up to half the bound of round trip is trusted; beyond, nothing is decided.
        assert_eq!(judge_clock(-5000 * MS, 125 * MS, bound), ClockVerdict::Over);
        assert_eq!(
            judge_clock(-5000 * MS, 126 * MS, bound),
            ClockVerdict::Untrusted
        );
        assert_eq!(judge_clock(0, 126 * MS, bound), ClockVerdict::Untrusted);
    }

    #[test]
    fn crossing_the_clock_bound_switches_global_counting_with_an_event_each_way() {
        const MS: i64 = 1_000_000;
        let dir = std::env::temp_dir().join(format!("rl-fleet-clock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("events.jsonl");
        let sink = config::EventsSink::File(file.clone());
        let shared = Shared {
            inner: Mutex::new(Inner::default()),
            outbox: Mutex::new(VecDeque::new()),
            outbox_gen: AtomicU64::new(0),
            cursor_file: Mutex::new(()),
            events: events::Events::start(Some(&sink), 1000, vec![]).unwrap(),
            global: Arc::default(),
            trust: Arc::new(Trust::new("default", None, Default::default())),
        };
        let clock = Clock::new(Duration::from_millis(250));
        let at = |offset_ms: i64, rtt_ms: i64| ClockSample {
            sent_ns: 1_000_000 * MS,
            recv_ns: (1_000_000 + rtt_ms) * MS,
            store_ns: (1_000_000 + rtt_ms - offset_ms) * MS - rtt_ms * MS / 2,
        };
        // Not counting until measured; a measurement not trusted changes nothing.
        assert!(!clock.counting());
        shared.clock_measured(&clock, at(0, 200));
        assert!(!clock.counting());
        assert!(
            shared
                .report()
                .clock
                .last_error
                .unwrap()
                .contains("not trusted")
        );
        shared.clock_measured(&clock, at(-30, 2));
        let r = shared.report().clock;
        assert!(clock.counting() && r.counting && !r.over_bound, "{r:?}");
        assert_eq!(r.offset_ms, Some(-30.0));
        shared.clock_measured(&clock, at(-5000, 2));
        let r = shared.report().clock;
        assert!(
            !clock.counting() && r.over_bound && r.over_since.is_some(),
            "{r:?}"
        );
        // Still over: no second event; a failed measurement keeps the state.
        shared.clock_measured(&clock, at(-4990, 2));
        shared.clock_failed("refused".into());
        assert!(!clock.counting());
        shared.clock_measured(&clock, at(100, 2));
        let r = shared.report().clock;
        assert!(
            clock.counting() && !r.over_bound && r.over_since.is_none(),
            "{r:?}"
        );
        let give_up = Instant::now() + Duration::from_secs(5);
        let lines = loop {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            let lines: Vec<serde_json::Value> = text
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            if lines.len() >= 2 || Instant::now() > give_up {
                break lines;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0]["event"], "fleet_clock_skew");
        assert_eq!(lines[0]["offset_ms"], -5000.0);
        assert_eq!(lines[0]["max_skew_ms"], 250);
        assert_eq!(lines[1]["event"], "fleet_clock_restored");
        assert_eq!(lines[1]["offset_ms"], 100.0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

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

    #[test]
    fn times_convert_between_clocks() {
        assert_eq!(mono_of_unix_ms(0), Some(0));
        assert_eq!(unix_ms_of_mono(0), 0);
        let now = unix_ms(SystemTime::now());
        assert_eq!(mono_of_unix_ms(now - 1000), None);
        let mono = mono_of_unix_ms(now + 60_000).unwrap();
        let back = unix_ms_of_mono(mono);
        assert!(
            back.abs_diff(now + 60_000) < 50,
            "{back} vs {}",
            now + 60_000
        );
    }

    #[test]
    fn records_round_trip_and_old_fields_default() {
        let r = Record {
            op: Op::Ban,
            net: "192.0.2.0/24".into(),
            exp_ms: 5,
            at_ms: 1,
            host: "a".into(),
            rule: Some("syn".into()),
            reason: None,
        };
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<Record>(&s).unwrap(), r);
        let u: Record =
            serde_json::from_str(r#"{"op":"unban","net":"::1/128","at_ms":2,"host":"b"}"#).unwrap();
        assert_eq!((u.op, u.exp_ms, u.rule), (Op::Unban, 0, None));
    }

    #[test]
    fn a_world_readable_password_file_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("rl-fleet-pw-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("pass");
        std::fs::write(&p, "s3cret\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_password(&p).unwrap_err().to_string();
        assert!(e.contains("readable by every user (mode 0644)"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_password(&p).unwrap(), "s3cret");
        let e = format!("{:#}", read_password(&dir.join("missing")).unwrap_err());
        assert!(e.contains("missing") && e.contains("No such file"), "{e}");
        std::fs::write(&p, "\n").unwrap();
        assert!(read_password(&p).unwrap_err().to_string().contains("empty"));
        std::fs::remove_dir_all(&dir).unwrap();
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

    #[test]
    fn stale_snapshot_entries_are_ended_bans_and_tombstones_before_the_stream() {
        let now = 10_000;
        // Bans: ended, not yet, until removed.
        assert!(stale_in_snapshot("9999|{}", now, None));
        assert!(stale_in_snapshot("10000|{}", now, Some(1)));
        assert!(!stale_in_snapshot("10001|{}", now, None));
        assert!(!stale_in_snapshot("0|{}", now, Some(20_000)));
        // Tombstones: kept while the stream reaches back to them, or is empty.
        assert!(stale_in_snapshot("t4999|{}", now, Some(5000)));
        assert!(!stale_in_snapshot("t5000|{}", now, Some(5000)));
        assert!(!stale_in_snapshot("t1|{}", now, None));
        // What is not ours.
        assert!(stale_in_snapshot("junk", now, None));
        assert!(stale_in_snapshot("tx|{}", now, Some(1)));
    }

    #[tokio::test]
    async fn the_outbox_is_written_whenever_it_changed_even_at_the_same_length() {
        let dir = std::env::temp_dir().join(format!("rl-fleet-obgen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let rec = |net: &str| Record {
            op: Op::Ban,
            net: net.into(),
            exp_ms: 0,
            at_ms: 1,
            host: "a".into(),
            rule: None,
            reason: None,
        };
        let settings = Arc::new(Settings {
            store: "redis://127.0.0.1:1".into(),
            host_id: "a".into(),
            share_bans: true,
            state_dir: dir.clone(),
            clock: Arc::new(Clock::new(config::DEFAULT_MAX_CLOCK_SKEW)),
            trust: Arc::new(Trust::new("default", None, Default::default())),
            keys: Keys::of("default"),
            id_guard: Arc::default(),
            client: Client::Single(redis::Client::open("redis://127.0.0.1:1").unwrap()),
        });
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner::default()),
            outbox: Mutex::new(VecDeque::new()),
            outbox_gen: AtomicU64::new(0),
            cursor_file: Mutex::new(()),
            events: events::Events::start(None, 1, vec![]).unwrap(),
            global: Arc::default(),
            trust: Arc::new(Trust::new("default", None, Default::default())),
        });
        let mut on_disk = shared.outbox_gen.load(Ordering::Relaxed);
        shared.change_outbox(|ob| ob.push_back(rec("192.0.2.1/32")));
        persist(&settings, &shared, &mut on_disk).await;
        assert_eq!(load_outbox(&dir), VecDeque::from(vec![rec("192.0.2.1/32")]));
        // One delivered and one added: the same length, other content.
        shared.change_outbox(|ob| {
            ob.pop_front();
            ob.push_back(rec("192.0.2.2/32"));
        });
        persist(&settings, &shared, &mut on_disk).await;
        assert_eq!(load_outbox(&dir), VecDeque::from(vec![rec("192.0.2.2/32")]));
        // Unchanged: not written again.
        std::fs::remove_file(dir.join(OUTBOX_FILE)).unwrap();
        persist(&settings, &shared, &mut on_disk).await;
        assert!(!dir.join(OUTBOX_FILE).exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_outbox_is_written_whole_and_removed_when_empty() {
        let dir = std::env::temp_dir().join(format!("rl-fleet-ob-{}", std::process::id()));
        let r = Record {
            op: Op::Unban,
            net: "192.0.2.1/32".into(),
            exp_ms: 0,
            at_ms: 1,
            host: "a".into(),
            rule: None,
            reason: None,
        };
        save_outbox(&dir, &[r.clone(), r.clone()]).unwrap();
        assert_eq!(load_outbox(&dir), VecDeque::from(vec![r.clone(), r]));
        save_outbox(&dir, &[]).unwrap();
        assert!(!dir.join(OUTBOX_FILE).exists());
        assert!(load_outbox(&dir).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
