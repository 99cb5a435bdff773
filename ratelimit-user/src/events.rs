//! Event lines for L7 systems (`ban`, `unban`, `soft_limit`, `throttle_start`,
//! `throttle_end`): JSON lines appended to a file or written to stdout.
//!
//! A thread of its own writes them, so nothing else waits for the sink: not the state lock, not
//! the control socket, not the ring-buffer reader. A disk that is slow or full, or a stdout pipe
//! whose reader stalled, costs events, never the control plane. Producers hand events over a
//! bounded queue and never block; every event that does not become a line is counted:
//!
//! * `lost.queue`: the queue was full (the writer is behind: a stalled pipe, a slow disk);
//! * `lost.write`: the line could not be written (ENOSPC, EIO, EPIPE). The file holds whole
//!   lines only: a write that fails partway is cut back to the last whole line (ftruncate);
//!   where that is impossible (a pipe) the next write completes the torn line first;
//! * `suppressed`: over `daemon.events_per_sec` lines in one second. Each second with
//!   suppressed events gets one summary line once it has passed (see [`SUMMARY_EVENT`]), and
//!   the summaries add up exactly to this count.
//!
//! The cap applies to the events the data plane issues (and the `unban` lines of the expiry
//! sweep, which follow from them): a flood under a low-threshold rule turns attacker packets
//! into events. It applies as well to the `ban` / `unban` lines of bans received from the
//! fleet ([`Events::fleet_lines`]): a fleet-wide ban wave is the same flood seen from every
//! host, and goes through the same bounded queue and the same per-second summaries. The operator's own `ban add` / `ban del` / rule-ban lifts are always written
//! (they are bounded by the ban tables and are what the operator asked for).
//!
//! The daemon's own `pressure_high` / `pressure_low` lines ([`PressureLine`]) are always
//! written too: one per change of the pressure level.
//!
//! The file is reopened on SIGUSR1 and SIGHUP so logrotate can move it away.
//!
//! The producers' side and its counts are in [`queue`], the writer thread in [`writer`], the
//! per-second cap in [`cap`], the lines' shapes in [`line`], and the file or stdout with its
//! reopening and whole-line writes in [`sink`].

mod cap;
mod line;
mod queue;
mod sink;
mod writer;

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize},
    },
    time::Duration,
};

use ratelimit_common::{caps, event::Event};

pub use line::{EventLine, FleetLine, PressureLine, kind_name, line_with};
pub use queue::{Counts, Events, Lost, Status};
pub use sink::{Output, Target};

/// `daemon.events_per_sec`'s default and bound (the config's).
pub use crate::config::{
    EVENTS_PER_SEC_DEFAULT as DEFAULT_PER_SEC, EVENTS_PER_SEC_MAX as MAX_PER_SEC,
};
/// The `event` of the summary line written for a second in which events were suppressed:
/// `{"time":"<the second>","event":"suppressed","count":N,"threshold":<events_per_sec>,
/// "events":{"<event>":n,...}}`, `count` being the sum of `events`.
pub const SUMMARY_EVENT: &str = "suppressed";

/// Events of the data plane waiting for the writer at most (about 5 MB): at the default cap
/// that is a minute of lines. More are dropped (`lost.queue`).
const QUEUE: usize = 65_536;
/// Events waiting for the writer at most when the operator's commands add theirs: one
/// `ban del` over every ban table always fits behind a queue the writer keeps up with.
const QUEUE_OPERATOR: usize =
    (caps::MAX_BANS + caps::MAX_OPERATOR_BANS + caps::MAX_PASSING_BANS) as usize;
/// Lines are written a chunk at a time.
const CHUNK: usize = 64 << 10;
/// How long [`Events::written`] waits for a writer that makes no progress.
pub const STALL: Duration = Duration::from_millis(250);
/// Write failures are logged at most this often (they are counted every time).
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Suppressed events by their `event` name.
type Tally = BTreeMap<&'static str, u64>;

/// Who caused a batch of events, which decides whether the per-second cap applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Origin {
    /// The XDP program (through the ring buffer) or the expiry sweep: capped.
    DataPlane,
    /// The operator's own ban changes: always written.
    Operator,
}

enum Msg {
    Events {
        events: Vec<Event>,
        names: Arc<[String]>,
        origin: Origin,
    },
    /// Lines made by the daemon itself: always written when `origin` is the operator's
    /// (bans lifted because their rule is gone, whose rule has no index any more), capped as
    /// the data plane's when they are the fleet's.
    Lines {
        lines: Vec<EventLine>,
        origin: Origin,
    },
    Pressure(PressureLine),
    Fleet(FleetLine),
    Reopen,
    Replace(Output),
    Rate(u32),
    Close,
}

/// Counts shared by the producers, the writer and the readers of `status` and `/metrics`.
#[derive(Default)]
struct Counters {
    queued: AtomicUsize,
    written: AtomicU64,
    suppressed: AtomicU64,
    lost_queue: AtomicU64,
    lost_write: AtomicU64,
}

/// How far the writer got: the last message it finished, and a count that moves with every
/// chunk it writes (so a waiter can tell a long write from a stalled one).
#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    done: u64,
    chunks: u64,
}

#[cfg(test)]
mod tests;
