//! Global thresholds (`scope = "global"`): a rule whose threshold holds across the fleet.
//!
//! The program counts a global rule's clients in windows of the wall clock
//! (`RULE_GLOBAL`, `GlobalConfig::wall_offset_ns`), so window W is the same span of time on
//! every host. This task, every `fleet.sync_interval`:
//!
//! 1. reads each synced client's window meters from the per-source store's mapping (the
//!    admitted count `cur`/`prev` and, for `rate_based_ban`, the offered count
//!    `seen_cur`/`seen_prev`), takes off what it added itself, and publishes this host's own
//!    count of the window as an absolute value (`<key>|<host>` in a hash per rule, meter,
//!    bucket and window); the store's script adds the change into the key's fleet total and
//!    answers the totals (absolute values make a retry or a replay harmless);
//! 2. adds what the other hosts counted (`total - own - already added`) into the client's
//!    state with an atomic add, the program's own operation, so the program's next verdict
//!    for that client measures the fleet's count against the threshold. It only ever adds.
//!
//! Nothing on the packet path waits for the store. Without it the hosts keep what they were
//! given (it ages out with its window) and each enforces its threshold alone (fail-static).
//! A client is synced once its own count reaches [`PUBLISH_ABOVE_PERMILLE`] of the
//! threshold on this host (found by a walk of the store every [`SCAN_EVERY`]), or once
//! another host announces it, and at most [`MAX_SYNCED_KEYS`] are.
//!
//! The fleet admits about `L * (1 + e)`, where `e` is about `(delay / interval) *
//! (hosts - 1) / hosts` (delay = the sync interval plus the store's round trip): the counts a
//! host has not heard of yet.

use std::{sync::Mutex, time::Duration};

use serde::{Deserialize, Serialize};

mod counts;
mod keys;
mod round;
mod rule;
mod run;
mod shared_keys;
mod synced;
#[cfg(test)]
mod tests;

pub use counts::{Announce, Call, CountStore, MemoryCounts, RedisCounts, Scripts};
pub use keys::{announce_set, bucket_of, fnv32, hash_name, key_name, shared_key_name};
pub use round::round;
pub use rule::{GlobalRule, announce_sets_now};
pub use run::run;
pub use shared_keys::{SharedStates, shared_round};
pub use synced::{SlotStates, Synced};

/// Buckets the keys of a rule are spread over (one hash per bucket and window, each in a
/// slot of its own on a Redis Cluster).
pub const BUCKETS: u64 = 16;
/// A client is synced once this host counted this share (per mille) of its threshold in a
/// window: the many clients far below it cost the store nothing.
pub const PUBLISH_ABOVE_PERMILLE: u64 = 50;
/// A client whose fleet total reaches this share (per mille) of its threshold in a window is
/// announced: every host that holds a state for it syncs it from its next walk of the store,
/// however little of it that host sees (the hosts below [`PUBLISH_ABOVE_PERMILLE`] would
/// otherwise each let it have their own threshold).
pub const NEAR_LIMIT_PERMILLE: u64 = 500;
/// At most this many clients are synced; the rest are held to the threshold per host.
pub const MAX_SYNCED_KEYS: usize = 100_000;
/// How often the store is walked for clients to sync.
pub const SCAN_EVERY: Duration = Duration::from_secs(1);
/// How often the wall clock's offset is checked (an NTP step moves it), and how far it may
/// drift before it is rewritten.
const CLOCK_CHECK_EVERY: Duration = Duration::from_secs(10);
pub const CLOCK_TOLERANCE_NS: u64 = 1_000_000;
/// The longest wait between two connection attempts to a store that failed: a store back
/// is in use again within about this long.
const RECONNECT_MAX: Duration = Duration::from_secs(1);
/// How many clients one script call carries at most.
const CALL_KEYS: usize = 500;
/// How many members of one announcement set a walk reads at most (a random choice of them:
/// `SRANDMEMBER`): a flood of sources each near its limit makes the sets large (each host
/// announces each of its synced clients once a window, up to [`MAX_SYNCED_KEYS`]), and every
/// host reads every set every [`SCAN_EVERY`]; this bounds what a walk costs the store and
/// the host, 16 sets a rule and meter.
pub const ANNOUNCED_READ_MAX: usize = 2_000;

/// What `fleet status` shows of global thresholds.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
pub struct GlobalReport {
    /// Global rules in force, by name.
    pub rules: Vec<String>,
    /// Clients whose counts are shared now.
    pub synced_keys: usize,
    /// Shared keys (`key = "all"`, `"region"`) of global rules shared in the last round.
    #[serde(default)]
    pub shared_keys: usize,
    /// Clients left to their host's own count because [`MAX_SYNCED_KEYS`] were synced.
    pub capped_keys: u64,
    /// Sync rounds done, and store calls made (each one script call).
    pub rounds: u64,
    pub store_calls: u64,
    pub store_errors: u64,
    /// Client counts the calls carried (one key of a hash each, read and, when it grew,
    /// written).
    #[serde(default)]
    pub keys_published: u64,
    /// Counts of other hosts added into this host's states, in all (admitted and offered).
    pub added_total: u64,
    /// The last round's duration (ms), and when it ran (ms ago at the time of the report).
    pub last_round_ms: Option<f64>,
    pub last_error: Option<String>,
}

/// The task's state shared with the reports.
#[derive(Default)]
pub struct Shared {
    report: Mutex<GlobalReport>,
}

impl Shared {
    pub fn report(&self) -> GlobalReport {
        self.report
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn update(&self, f: impl FnOnce(&mut GlobalReport)) {
        f(&mut self.report.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

/// Where the task gets the rules in force and has the wall clock's offset checked: the
/// daemon's owner task.
pub trait Owner: Send + Sync + 'static {
    fn rules(&self) -> impl std::future::Future<Output = anyhow::Result<Vec<GlobalRule>>> + Send;
    fn check_clock(&self) -> impl std::future::Future<Output = anyhow::Result<bool>> + Send;
}

/// What a round did.
#[derive(Debug, Clone, Default)]
pub struct Round {
    pub calls: u64,
    /// Client counts the calls carried.
    pub keys: u64,
    /// Calls that failed (their clients were not synced this round).
    pub failed: u64,
    pub added: u64,
    pub last_error: Option<String>,
    /// Shared keys synced ([`shared_round`]).
    pub shared_keys: usize,
}
