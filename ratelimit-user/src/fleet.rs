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
    collections::VecDeque,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use tokio::sync::mpsc;
use tracing::warn;

use crate::{events, supervise};

mod clock;
mod credentials;
pub mod dup;
pub mod global;
mod heartbeat;
pub mod key;
pub mod key_reads;
pub mod peers;
mod publisher;
mod reader;
mod record;
mod report;
pub mod resync;
mod settings;
mod store;
pub mod trust;

pub use clock::{Clock, ClockSample, ClockVerdict, best_sample, judge_clock};
pub use credentials::{check_files, read_password, read_tls};
pub use record::{Applied, Op, Received, Record, mono_of_unix_ms, unix_ms, unix_ms_of_mono};
pub use report::{ClockReport, Heartbeat, LATENCY_BUCKETS, Latency, Peer, Report};
pub use settings::hostname;
pub use store::{Conn, Lua};
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
    client: store::Client,
}

/// `url` with any password replaced by `***` (the config's, which shows store URLs too).
pub use crate::config::redacted;

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
}

/// A line of the events log about the fleet: `event` at `now`, on `store` by `host_id`, why
/// and since when; the fields other events carry empty (`..` them in).
fn fleet_line(
    now: SystemTime,
    event: &'static str,
    (store, host_id): (String, String),
    reason: Option<String>,
    since: Option<String>,
) -> events::FleetLine {
    events::FleetLine {
        time: crate::clock::rfc3339(now),
        event,
        store,
        host_id,
        reason,
        since,
        down_for_ms: None,
        outbox: 0,
        offset_ms: None,
        max_skew_ms: None,
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
            match reader::write_cursor(&self.settings, &self.shared, &c) {
                Ok(()) => self.shared.lock().saved_cursor = Some(c),
                Err(e) => warn!("saving the fleet cursor: {e:#}"),
            }
        }
    }
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
    let saved = reader::load_saved(&settings.state_dir);
    let outbox = publisher::load_outbox(&settings.state_dir);
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
        clock::clock_task(s.clone(), sh.clone())
    });
    // The heartbeat runs whatever `share_bans` says: it finds a duplicate host id, which
    // global counting depends on (and sweeps the snapshot only when bans are shared).
    let (s, sh) = (settings.clone(), shared.clone());
    supervise::spawn(tasks, "fleet_heartbeat", BACKOFF_FIRST, move || {
        heartbeat::heartbeat(s.clone(), sh.clone())
    });
    // With `share_bans = false` no ban is shared: neither the publisher nor the reader runs.
    if settings.share_bans {
        let (s, sh) = (settings.clone(), shared.clone());
        supervise::spawn(tasks, "fleet_publisher", BACKOFF_FIRST, move || {
            publisher::publisher(s.clone(), sh.clone(), rx.clone())
        });
        let (s, sh) = (settings.clone(), shared.clone());
        supervise::spawn(tasks, "fleet_reader", BACKOFF_FIRST, move || {
            reader::reader(s.clone(), sh.clone(), apply.clone())
        });
    }
    Link {
        settings,
        global: shared.global.clone(),
        shared,
        tx,
    }
}
