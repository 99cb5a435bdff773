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

use std::{
    collections::{BTreeMap, VecDeque},
    fs::{File, OpenOptions},
    io::{self, Seek as _, SeekFrom, Write as _},
    os::fd::AsFd as _,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering},
        mpsc,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use ratelimit_common::{caps, event::*, maps::ClientKey};
use serde::Serialize;
use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::{
    clock::{mono_ns, rfc3339},
    config::EventsSink,
    policy::report::{client_label, key_name},
};

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

#[derive(Serialize, Debug, Clone)]
pub struct EventLine {
    pub time: String,
    pub event: &'static str,
    pub rule: String,
    pub key: &'static str,
    pub client: String,
    pub count: u64,
    pub threshold: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ban_expires: Option<String>,
    /// Fleet mode: the host that issued a ban installed (or an unban applied) here from the
    /// fleet; absent for this host's own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
}

/// A change of the pressure level (`crate::policy::pressure`):
/// `{"time":..,"event":"pressure_high","mode":"auto","cause":"signal","signals":[{"signal":
/// "cpu_busy","value":0.93,"mark":0.8,"above":true}]}`. `signals` are those above their marks
/// at the change (none when it falls after the hold).
#[derive(Serialize, Debug, Clone)]
pub struct PressureLine {
    pub time: String,
    /// `pressure_high` or `pressure_low`.
    pub event: &'static str,
    pub mode: crate::policy::pressure::Mode,
    pub cause: crate::policy::pressure::Cause,
    pub signals: Vec<crate::policy::pressure::Reading>,
}

/// A change of the fleet store's health (the fleet module): `fleet_degraded` when the store
/// cannot be reached (with why, and since when), `fleet_restored` when it can again (with how
/// long it was out and the bans still waiting in the outbox to be sent).
#[derive(Serialize, Debug, Clone)]
pub struct FleetLine {
    pub time: String,
    /// `fleet_degraded`, `fleet_restored`, `fleet_clock_skew`, `fleet_clock_restored`,
    /// `fleet_duplicate_id` or `fleet_duplicate_id_cleared`.
    pub event: &'static str,
    pub store: String,
    pub host_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub down_for_ms: Option<u64>,
    pub outbox: usize,
    /// `fleet_clock_skew`, `fleet_clock_restored`: this host's clock minus the store's (ms),
    /// and `fleet.max_clock_skew` (ms).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_skew_ms: Option<u64>,
}

/// The summary line of a second in which events were suppressed ([`SUMMARY_EVENT`]).
#[derive(Serialize, Debug)]
struct SummaryLine<'a> {
    time: String,
    event: &'static str,
    count: u64,
    threshold: u32,
    events: &'a Tally,
}

/// Suppressed events by their `event` name.
type Tally = BTreeMap<&'static str, u64>;

pub fn kind_name(kind: u32) -> &'static str {
    match kind {
        EV_BAN => "ban",
        EV_UNBAN => "unban",
        EV_SOFT_LIMIT => "soft_limit",
        EV_THROTTLE_START => "throttle_start",
        EV_THROTTLE_END => "throttle_end",
        _ => "unknown",
    }
}

/// The line of `e`, its times formatted by `time` (monotonic ns to RFC 3339), so a batch of
/// events at the same few times can format each once.
pub fn line_with(
    e: &Event,
    rule_names: &[String],
    time: &mut dyn FnMut(u64) -> String,
) -> EventLine {
    let key = ClientKey {
        rule: e.rule as u8,
        kind: e.key_kind as u8,
        _pad: [0; 2],
        prefix_len: e.prefix_len,
        addr: e.addr,
    };
    EventLine {
        time: time(e.ts_ns),
        event: kind_name(e.kind),
        // Empty for an operator's ban (`BAN_RULE_NONE`: no rule has that index).
        rule: rule_names.get(e.rule as usize).cloned().unwrap_or_default(),
        key: key_name(key.kind),
        client: client_label(&key),
        count: e.count,
        threshold: e.threshold,
        ban_expires: (e.kind == EV_BAN && e.expires_ns != 0).then(|| time(e.expires_ns)),
        origin: None,
    }
}

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

/// A reading of the counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Events waiting for the writer now.
    pub queued: u64,
    /// Event lines written (summary lines not included).
    pub written: u64,
    /// Events over the per-second cap, accounted for by summary lines.
    pub suppressed: u64,
    /// Events dropped because the queue was full.
    pub lost_queue: u64,
    /// Event lines that could not be written.
    pub lost_write: u64,
}

/// What `ratelimit status` shows of the events sink.
#[derive(Serialize, serde::Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The events file, `stdout`, or `none`.
    pub sink: String,
    /// `daemon.events_per_sec`.
    pub lines_per_sec: u32,
    pub queued: u64,
    pub written: u64,
    pub suppressed: u64,
    pub lost: Lost,
}

/// Events lost, by where they were lost.
#[derive(Serialize, serde::Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lost {
    /// The program found the ring buffer full.
    pub ring_buffer: u64,
    /// The daemon's queue to the writer was full.
    pub queue: u64,
    /// Writing the line failed.
    pub write: u64,
}

/// How far the writer got: the last message it finished, and a count that moves with every
/// chunk it writes (so a waiter can tell a long write from a stalled one).
#[derive(Debug, Clone, Copy, Default)]
struct Progress {
    done: u64,
    chunks: u64,
}

/// The producers' side of the events sink. Cheap to clone; every method returns at once.
#[derive(Clone)]
pub struct Events(Arc<Shared>);

struct Shared {
    /// The queue and the sequence number of the last message sent, under one lock so that
    /// messages enter the queue in sequence order.
    tx: Mutex<(mpsc::Sender<(u64, Msg)>, u64)>,
    counters: Arc<Counters>,
    progress: watch::Receiver<Progress>,
    /// The rule names events are labelled with (a rule's index is its position).
    names: Mutex<Arc<[String]>>,
    /// Whether there is a sink at all (no events are queued otherwise).
    enabled: AtomicBool,
    sink: Mutex<String>,
    per_sec: AtomicU32,
    /// Disconnected when the writer thread has finished.
    finished: Mutex<Option<mpsc::Receiver<()>>>,
}

impl Events {
    /// Open `target` (an error if the file cannot be opened) and start the writer thread.
    pub fn start(
        target: Option<&EventsSink>,
        per_sec: u32,
        rule_names: Vec<String>,
    ) -> anyhow::Result<Events> {
        let out = Output::open(target)?;
        let (tx, rx) = mpsc::channel();
        let (progress_tx, progress) = watch::channel(Progress::default());
        let (finished_tx, finished) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        let shared = Shared {
            tx: Mutex::new((tx, 0)),
            counters: counters.clone(),
            progress,
            names: Mutex::new(rule_names.into()),
            enabled: AtomicBool::new(!out.is_none()),
            sink: Mutex::new(out.describe()),
            per_sec: AtomicU32::new(per_sec),
            finished: Mutex::new(Some(finished)),
        };
        let writer = Writer {
            out,
            torn: Vec::new(),
            limiter: Limiter::new(per_sec),
            chunk: Chunk::default(),
            carry: Tally::new(),
            counters,
            progress: progress_tx,
            failing_since: None,
            last_warn: None,
            failed: 0,
        };
        std::thread::Builder::new()
            .name("events".into())
            .spawn(move || {
                let _finished = finished_tx;
                writer.run(rx);
            })
            .context("starting the events writer thread")?;
        Ok(Events(Arc::new(shared)))
    }

    fn send(&self, msg: Msg) -> Option<u64> {
        let mut tx = lock(&self.0.tx);
        let seq = tx.1 + 1;
        tx.0.send((seq, msg)).ok()?;
        tx.1 = seq;
        Some(seq)
    }

    /// Events of the XDP program, or of the expiry sweep: capped per second.
    pub fn data_plane(&self, events: Vec<Event>) {
        self.push(events, Origin::DataPlane);
    }

    /// Events of the operator's own ban changes: always written.
    pub fn operator(&self, events: Vec<Event>) {
        self.push(events, Origin::Operator);
    }

    fn push(&self, mut events: Vec<Event>, origin: Origin) {
        if events.is_empty() || !self.0.enabled.load(Ordering::Relaxed) {
            return;
        }
        let Some(take) = self.reserve(events.len(), origin) else {
            return;
        };
        events.truncate(take);
        let names = lock(&self.0.names).clone();
        let sent = self.send(Msg::Events {
            events,
            names,
            origin,
        });
        if sent.is_none() {
            self.unreserve(take);
        }
    }

    /// Lines the daemon made itself (an `unban` whose rule is gone): always written, like the
    /// operator's.
    pub fn operator_lines(&self, lines: Vec<EventLine>) {
        self.push_lines(lines, Origin::Operator);
    }

    /// The lines of bans and unbans received from the fleet: capped per second and queued
    /// within the data plane's bound, as the data plane's own events are.
    pub fn fleet_lines(&self, lines: Vec<EventLine>) {
        self.push_lines(lines, Origin::DataPlane);
    }

    fn push_lines(&self, mut lines: Vec<EventLine>, origin: Origin) {
        if lines.is_empty() || !self.0.enabled.load(Ordering::Relaxed) {
            return;
        }
        let Some(take) = self.reserve(lines.len(), origin) else {
            return;
        };
        lines.truncate(take);
        if self.send(Msg::Lines { lines, origin }).is_none() {
            self.unreserve(take);
        }
    }

    /// Room in the queue for up to `n` messages of `origin` (its bound): the number taken,
    /// the rest counted as lost; `None` when none could be.
    fn reserve(&self, n: usize, origin: Origin) -> Option<usize> {
        let limit = match origin {
            Origin::DataPlane => QUEUE,
            Origin::Operator => QUEUE_OPERATOR,
        };
        let c = &self.0.counters;
        let before = c
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                Some(q + n.min(limit.saturating_sub(q)))
            })
            .unwrap_or_else(|q| q);
        let take = n.min(limit.saturating_sub(before));
        if take < n {
            c.lost_queue.fetch_add((n - take) as u64, Ordering::Relaxed);
        }
        (take > 0).then_some(take)
    }

    /// `n` reserved messages that could not be sent (the writer is gone: it panicked): lost.
    fn unreserve(&self, n: usize) {
        let c = &self.0.counters;
        c.queued.fetch_sub(n, Ordering::AcqRel);
        c.lost_queue.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// A change of the pressure level: always written.
    pub fn pressure(&self, line: PressureLine) {
        if !self.0.enabled.load(Ordering::Relaxed) {
            return;
        }
        let c = &self.0.counters;
        c.queued.fetch_add(1, Ordering::AcqRel);
        if self.send(Msg::Pressure(line)).is_none() {
            c.queued.fetch_sub(1, Ordering::AcqRel);
            c.lost_queue.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A change of the fleet store's health: always written.
    pub fn fleet(&self, line: FleetLine) {
        if !self.0.enabled.load(Ordering::Relaxed) {
            return;
        }
        let c = &self.0.counters;
        c.queued.fetch_add(1, Ordering::AcqRel);
        if self.send(Msg::Fleet(line)).is_none() {
            c.queued.fetch_sub(1, Ordering::AcqRel);
            c.lost_queue.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The rule names (by position) of events queued from now on.
    pub fn set_rule_names(&self, names: Vec<String>) {
        *lock(&self.0.names) = names.into();
    }

    /// Reopen the file (after log rotation), after the lines queued before.
    pub fn reopen(&self) {
        self.send(Msg::Reopen);
    }

    /// Write to `target` from now on (after the lines queued before). The new file is opened
    /// here, so a bad path is an error for the caller, and the old sink stays.
    pub fn retarget(&self, target: Option<&EventsSink>) -> anyhow::Result<()> {
        self.replace(Output::open(target)?);
        Ok(())
    }

    /// Write the lines queued from now on to `out`, opened beforehand ([`Output::open`]: a
    /// reload opens the new sink before it changes anything).
    pub fn replace(&self, out: Output) {
        *lock(&self.0.sink) = out.describe();
        let enabled = !out.is_none();
        self.send(Msg::Replace(out));
        self.0.enabled.store(enabled, Ordering::Relaxed);
    }

    /// Change `daemon.events_per_sec`.
    pub fn set_per_sec(&self, per_sec: u32) {
        self.0.per_sec.store(per_sec, Ordering::Relaxed);
        self.send(Msg::Rate(per_sec));
    }

    /// The sequence number of the last message queued; see [`Events::written`].
    pub fn last_seq(&self) -> u64 {
        lock(&self.0.tx).1
    }

    /// Wait until the writer has handled message `seq` and everything before it. Gives up
    /// (false) once the writer makes no progress for [`STALL`]: a stalled sink delays the
    /// caller by that much at most.
    pub async fn written(&self, seq: u64) -> bool {
        let mut rx = self.0.progress.clone();
        loop {
            if rx.borrow_and_update().done >= seq {
                return true;
            }
            match tokio::time::timeout(STALL, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return false,
            }
        }
    }

    pub fn counts(&self) -> Counts {
        let c = &self.0.counters;
        Counts {
            queued: c.queued.load(Ordering::Relaxed) as u64,
            written: c.written.load(Ordering::Relaxed),
            suppressed: c.suppressed.load(Ordering::Relaxed),
            lost_queue: c.lost_queue.load(Ordering::Relaxed),
            lost_write: c.lost_write.load(Ordering::Relaxed),
        }
    }

    /// The sink and its counts; `ring_buffer_lost` is the program's count of events that
    /// found the ring buffer full.
    pub fn status(&self, ring_buffer_lost: u64) -> Status {
        let c = self.counts();
        Status {
            sink: lock(&self.0.sink).clone(),
            lines_per_sec: self.0.per_sec.load(Ordering::Relaxed),
            queued: c.queued,
            written: c.written,
            suppressed: c.suppressed,
            lost: Lost {
                ring_buffer: ring_buffer_lost,
                queue: c.lost_queue,
                write: c.lost_write,
            },
        }
    }

    /// Write what is queued (and the summaries of the seconds not closed yet), waiting at
    /// most `timeout`: at shutdown, a stalled sink must not hold the daemon.
    pub fn close(&self, timeout: Duration) {
        let Some(finished) = lock(&self.0.finished).take() else {
            return;
        };
        if self.send(Msg::Close).is_none() {
            return;
        }
        if let Err(mpsc::RecvTimeoutError::Timeout) = finished.recv_timeout(timeout) {
            warn!(
                queued = self.counts().queued,
                "the events sink did not take the last lines within {timeout:?}; they are lost"
            );
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where event lines go.
pub enum Output {
    None,
    Stdout(Target),
    File { path: PathBuf, target: Target },
}

/// An open file, pipe or terminal to write lines to.
pub struct Target {
    file: File,
    /// A regular file, whose torn tail can be cut off.
    regular: bool,
}

impl Target {
    fn new(file: File) -> Target {
        let regular = file.metadata().is_ok_and(|m| m.file_type().is_file());
        Target { file, regular }
    }
}

impl Output {
    pub fn open(target: Option<&EventsSink>) -> anyhow::Result<Output> {
        Ok(match target {
            None => Output::None,
            Some(EventsSink::Stdout) => {
                // Our own descriptor of stdout: written without the process-wide stdout lock.
                let fd = std::io::stdout()
                    .as_fd()
                    .try_clone_to_owned()
                    .context("duplicating stdout for events")?;
                Output::Stdout(Target::new(File::from(fd)))
            }
            Some(EventsSink::File(path)) => Output::File {
                path: path.clone(),
                target: Target::new(open_append(path)?),
            },
        })
    }

    fn is_none(&self) -> bool {
        matches!(self, Output::None)
    }

    fn describe(&self) -> String {
        match self {
            Output::None => "none".into(),
            Output::Stdout(_) => "stdout".into(),
            Output::File { path, .. } => path.display().to_string(),
        }
    }

    fn reopen(&mut self) -> anyhow::Result<()> {
        if let Output::File { path, target } = self {
            *target = Target::new(open_append(path)?);
        }
        Ok(())
    }

    fn target(&mut self) -> Option<&mut Target> {
        match self {
            Output::None => None,
            Output::Stdout(t) | Output::File { target: t, .. } => Some(t),
        }
    }
}

fn open_append(path: &std::path::Path) -> anyhow::Result<File> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).ok();
    }
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening events file {}", path.display()))
}

/// Lines formatted and not written yet.
#[derive(Default)]
struct Chunk {
    bytes: Vec<u8>,
    /// Each line's end offset in `bytes`, and what it is.
    lines: Vec<(usize, Line)>,
}

enum Line {
    Event,
    /// A summary line and the counts it carries.
    Summary(Tally),
}

/// How a write of whole lines ended.
struct Written {
    /// Bytes of whole lines now in the output (all of them on success).
    whole: usize,
    /// The rest of a line the output holds only the start of, to be completed by the next
    /// write (empty when nothing is torn: the write succeeded or the tail was cut off).
    torn_rest: Vec<u8>,
    error: Option<io::Error>,
}

/// An output that lines are appended to.
trait LineOutput: io::Write {
    /// Where the next write lands, if the output is a file that can be cut back.
    fn end(&mut self) -> Option<u64>;
    /// Cut the output back to `len` bytes.
    fn cut(&mut self, len: u64) -> io::Result<()>;
}

impl io::Write for Target {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl LineOutput for Target {
    fn end(&mut self) -> Option<u64> {
        // Appends go to the end of the file.
        self.regular
            .then(|| self.file.seek(SeekFrom::End(0)).ok())
            .flatten()
    }
    fn cut(&mut self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }
}

/// Write `bytes` (whole lines ending at `ends`) to `out`. A write that fails partway leaves no
/// torn line behind if it can help it: a file is cut back to its last whole line; any other
/// output (a pipe) gets the rest of the torn line at the next write.
fn write_lines(out: &mut impl LineOutput, bytes: &[u8], ends: &[usize]) -> Written {
    let start = out.end();
    let mut off = 0;
    let mut error = None;
    while off < bytes.len() {
        match out.write(&bytes[off..]) {
            Ok(0) => {
                error = Some(io::Error::from(io::ErrorKind::WriteZero));
                break;
            }
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                error = Some(e);
                break;
            }
        }
    }
    let whole = ends
        .iter()
        .copied()
        .take_while(|&e| e <= off)
        .last()
        .unwrap_or(0);
    let mut torn_rest = Vec::new();
    if whole < off {
        let cut = start.is_some_and(|s| out.cut(s + whole as u64).is_ok());
        if !cut {
            let end = ends
                .iter()
                .copied()
                .find(|&e| e > off)
                .unwrap_or(bytes.len());
            torn_rest = bytes[off..end].to_vec();
        }
    }
    Written {
        whole,
        torn_rest,
        error,
    }
}

/// The per-second cap. A second is that of the event's time when it is the current second or
/// the one before (so lines are capped by the second they show), else the current one (an old
/// ban's expiry found late). A second is closed, and its summary due, once the next one has
/// passed too.
struct Limiter {
    per_sec: u32,
    /// At most two: the current second and the one before, oldest first.
    windows: VecDeque<Window>,
}

struct Window {
    sec: u64,
    written: u32,
    suppressed: Tally,
}

impl Limiter {
    fn new(per_sec: u32) -> Self {
        Self {
            per_sec,
            windows: VecDeque::with_capacity(3),
        }
    }

    /// Move the seconds that ended before `now_sec - 1` into `closed`. A wall clock stepped
    /// back closes them all.
    fn advance(&mut self, now_sec: u64, closed: &mut Vec<Window>) {
        if self.windows.back().is_some_and(|w| w.sec > now_sec) {
            closed.extend(self.windows.drain(..));
        }
        while self.windows.front().is_some_and(|w| w.sec + 1 < now_sec) {
            closed.extend(self.windows.pop_front());
        }
    }

    /// Whether an event of `kind` at wall second `sec` may be written now (`now_sec`).
    fn admit(
        &mut self,
        sec: u64,
        now_sec: u64,
        kind: &'static str,
        closed: &mut Vec<Window>,
    ) -> bool {
        self.advance(now_sec, closed);
        let sec = if sec + 1 >= now_sec && sec <= now_sec {
            sec
        } else {
            now_sec
        };
        let at = match self.windows.iter().position(|w| w.sec >= sec) {
            Some(i) if self.windows[i].sec == sec => i,
            Some(i) => {
                self.windows.insert(i, Window::new(sec));
                i
            }
            None => {
                self.windows.push_back(Window::new(sec));
                self.windows.len() - 1
            }
        };
        let w = &mut self.windows[at];
        if w.written < self.per_sec {
            w.written += 1;
            true
        } else {
            *w.suppressed.entry(kind).or_default() += 1;
            false
        }
    }

    /// When the oldest second with suppressed events closes (wall ns).
    fn next_summary_ns(&self) -> Option<u64> {
        self.windows
            .iter()
            .find(|w| !w.suppressed.is_empty())
            .map(|w| (w.sec + 2) * 1_000_000_000)
    }
}

impl Window {
    fn new(sec: u64) -> Self {
        Self {
            sec,
            written: 0,
            suppressed: Tally::new(),
        }
    }
}

fn wall_now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn rfc3339_ns(wall_ns: u64) -> String {
    rfc3339(UNIX_EPOCH + Duration::from_nanos(wall_ns))
}

/// The writer thread's state.
struct Writer {
    out: Output,
    /// The rest of a torn line (see [`Written::torn_rest`]).
    torn: Vec<u8>,
    limiter: Limiter,
    chunk: Chunk,
    /// Counts of summary lines that could not be written, carried into the next one.
    carry: Tally,
    counters: Arc<Counters>,
    progress: watch::Sender<Progress>,
    /// Since when writes fail (for the log line when they work again).
    failing_since: Option<Instant>,
    last_warn: Option<Instant>,
    /// Lines that failed since the last warning.
    failed: u64,
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<(u64, Msg)>) {
        loop {
            let msg = match self.wait() {
                Some(d) => match rx.recv_timeout(d) {
                    Ok(m) => Some(m),
                    Err(mpsc::RecvTimeoutError::Timeout) => None,
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                },
                None => match rx.recv() {
                    Ok(m) => Some(m),
                    Err(_) => break,
                },
            };
            if let Some((seq, msg)) = msg {
                let close = matches!(msg, Msg::Close);
                self.handle(msg);
                if close {
                    break;
                }
                self.close_seconds(false);
                self.flush();
                self.progress.send_modify(|p| p.done = seq);
            } else {
                self.close_seconds(false);
                self.flush();
            }
        }
        self.close_seconds(true);
        self.flush();
        let _ = self.out.target().map(|t| t.file.flush());
    }

    /// How long to wait for the next message before a summary is due (None: no summary is).
    fn wait(&self) -> Option<Duration> {
        let due = match (self.limiter.next_summary_ns(), self.carry.is_empty()) {
            (Some(t), _) => t,
            (None, false) => wall_now_ns() + 1_000_000_000,
            (None, true) => return None,
        };
        // A little after the second ends, so the clock has passed it.
        Some(Duration::from_nanos(due.saturating_sub(wall_now_ns())) + Duration::from_millis(5))
    }

    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Events {
                events,
                names,
                origin,
            } => {
                let n = events.len();
                self.format(&events, &names, origin);
                self.counters.queued.fetch_sub(n, Ordering::AcqRel);
            }
            Msg::Lines { lines, origin } => {
                let n = lines.len();
                let now_sec = wall_now_ns() / 1_000_000_000;
                for line in &lines {
                    if self.out.is_none() {
                        break;
                    }
                    if origin == Origin::DataPlane && !self.admit(now_sec, now_sec, line.event) {
                        continue;
                    }
                    self.push_line(line);
                }
                self.counters.queued.fetch_sub(n, Ordering::AcqRel);
            }
            Msg::Pressure(line) => {
                if !self.out.is_none() {
                    self.push_line(&line);
                }
                self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            }
            Msg::Fleet(line) => {
                if !self.out.is_none() {
                    self.push_line(&line);
                }
                self.counters.queued.fetch_sub(1, Ordering::AcqRel);
            }
            Msg::Reopen => {
                self.flush();
                if let Err(e) = self.out.reopen() {
                    error!("reopening the events file: {e:#}");
                }
            }
            Msg::Replace(out) => {
                self.flush();
                self.out = out;
                self.torn.clear();
            }
            Msg::Rate(per_sec) => self.limiter.per_sec = per_sec,
            Msg::Close => {}
        }
    }

    fn format(&mut self, events: &[Event], names: &[String], origin: Origin) {
        // Monotonic to wall time, once for the batch.
        let offset = wall_now_ns() as i128 - mono_ns() as i128;
        let wall = |ns: u64| (ns as i128 + offset).max(0) as u64;
        let mut cache: Option<(u64, String)> = None;
        let mut time = |ns: u64| {
            let ms = wall(ns) / 1_000_000;
            match &cache {
                Some((at, s)) if *at == ms => s.clone(),
                _ => {
                    let s = rfc3339_ns(ms * 1_000_000);
                    cache = Some((ms, s.clone()));
                    s
                }
            }
        };
        let now_sec = wall_now_ns() / 1_000_000_000;
        for e in events {
            if self.out.is_none() {
                break;
            }
            if origin == Origin::DataPlane
                && !self.admit(wall(e.ts_ns) / 1_000_000_000, now_sec, kind_name(e.kind))
            {
                continue;
            }
            let line = line_with(e, names, &mut time);
            self.push_line(&line);
        }
    }

    /// Whether a capped line of `kind` at wall second `sec` is written (`now_sec`): the
    /// seconds the cap closes meanwhile get their summaries, and a line over it is counted
    /// as suppressed.
    fn admit(&mut self, sec: u64, now_sec: u64, kind: &'static str) -> bool {
        let mut closed = Vec::new();
        let admitted = self.limiter.admit(sec, now_sec, kind, &mut closed);
        if !closed.is_empty() {
            self.summaries(closed);
        }
        if !admitted {
            self.counters.suppressed.fetch_add(1, Ordering::Relaxed);
        }
        admitted
    }

    /// Add an event line to the chunk, writing the chunk once it is full.
    fn push_line(&mut self, line: &impl Serialize) {
        if serde_json::to_writer(&mut self.chunk.bytes, line).is_ok() {
            self.chunk.bytes.push(b'\n');
            self.chunk.lines.push((self.chunk.bytes.len(), Line::Event));
        }
        if self.chunk.bytes.len() >= CHUNK {
            self.flush();
        }
    }

    /// Summary lines for the seconds that closed (all of them when `all`).
    fn close_seconds(&mut self, all: bool) {
        let mut closed = Vec::new();
        if all {
            closed.extend(self.limiter.windows.drain(..));
        } else {
            self.limiter
                .advance(wall_now_ns() / 1_000_000_000, &mut closed);
        }
        self.summaries(closed);
        if !self.carry.is_empty() {
            // Counts of a summary that could not be written, with no second closing to take
            // them: a line of their own.
            let now = wall_now_ns() / 1_000_000_000;
            self.summary(now, Tally::new());
        }
    }

    fn summaries(&mut self, closed: Vec<Window>) {
        for w in closed {
            if !w.suppressed.is_empty() {
                self.summary(w.sec, w.suppressed);
            }
        }
    }

    fn summary(&mut self, sec: u64, mut tally: Tally) {
        for (k, n) in std::mem::take(&mut self.carry) {
            *tally.entry(k).or_default() += n;
        }
        if self.out.is_none() {
            return;
        }
        let line = SummaryLine {
            time: rfc3339_ns(sec * 1_000_000_000),
            event: SUMMARY_EVENT,
            count: tally.values().sum(),
            threshold: self.limiter.per_sec,
            events: &tally,
        };
        if serde_json::to_writer(&mut self.chunk.bytes, &line).is_ok() {
            self.chunk.bytes.push(b'\n');
            self.chunk
                .lines
                .push((self.chunk.bytes.len(), Line::Summary(tally)));
        }
    }

    /// Write the formatted lines; count what was written and what was lost.
    fn flush(&mut self) {
        if self.chunk.lines.is_empty() && self.torn.is_empty() {
            return;
        }
        let mut chunk = std::mem::take(&mut self.chunk);
        let Some(target) = self.out.target() else {
            return;
        };
        // The rest of a torn line first, so the lines after it are whole.
        let lead = std::mem::take(&mut self.torn);
        let (bytes, ends): (std::borrow::Cow<[u8]>, Vec<usize>) = if lead.is_empty() {
            let ends = chunk.lines.iter().map(|(e, _)| *e).collect();
            (std::borrow::Cow::Borrowed(&chunk.bytes), ends)
        } else {
            let mut b = lead.clone();
            b.extend_from_slice(&chunk.bytes);
            let ends = std::iter::once(lead.len())
                .chain(chunk.lines.iter().map(|(e, _)| e + lead.len()))
                .collect();
            (std::borrow::Cow::Owned(b), ends)
        };
        let w = write_lines(target, &bytes, &ends);
        let mut written = 0;
        let mut lost = 0;
        for (end, line) in chunk.lines.drain(..) {
            match (line, end + lead.len() <= w.whole) {
                (Line::Event, true) => written += 1,
                (Line::Event, false) => lost += 1,
                (Line::Summary(_), true) => {}
                (Line::Summary(tally), false) => {
                    for (k, n) in tally {
                        *self.carry.entry(k).or_default() += n;
                    }
                }
            }
        }
        self.torn = w.torn_rest;
        self.counters.written.fetch_add(written, Ordering::Relaxed);
        self.counters.lost_write.fetch_add(lost, Ordering::Relaxed);
        self.progress.send_modify(|p| p.chunks += 1);
        match w.error {
            Some(e) => self.failing(&e, lost),
            None => {
                if let Some(since) = self.failing_since.take() {
                    info!(
                        lines_lost = self.failed,
                        "events are written again after {:.0?} of failed writes",
                        since.elapsed()
                    );
                    self.failed = 0;
                }
            }
        }
    }

    fn failing(&mut self, e: &io::Error, lost: u64) {
        self.failing_since.get_or_insert_with(Instant::now);
        self.failed += lost;
        if self.last_warn.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            warn!(
                sink = %self.out.describe(),
                lines_lost = self.failed,
                "writing events failed: {e}; the lines are counted as lost (status: events.lost.write)"
            );
            self.last_warn = Some(Instant::now());
            self.failed = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: u32, ts_ns: u64) -> Event {
        Event {
            kind,
            rule: 0,
            key_kind: ratelimit_common::maps::KEY_IP as u32,
            prefix_len: 128,
            addr: [0; 16],
            ts_ns,
            count: 1,
            threshold: 1,
            expires_ns: 0,
        }
    }

    #[test]
    fn events_limiter_caps_each_second_and_closes_it_after_the_next() {
        let mut l = Limiter::new(2);
        let mut closed = Vec::new();
        let admitted: Vec<bool> = (0..5)
            .map(|_| l.admit(100, 100, "soft_limit", &mut closed))
            .collect();
        assert_eq!(admitted, [true, true, false, false, false]);
        // A late event of the second before still counts there.
        assert!(l.admit(99, 100, "ban", &mut closed));
        assert!(closed.is_empty());
        assert_eq!(l.next_summary_ns(), Some(102_000_000_000));
        // Second 101: 99 closes (nothing suppressed), 100 stays open for late events.
        assert!(l.admit(101, 101, "ban", &mut closed));
        assert_eq!(closed.iter().map(|w| w.sec).collect::<Vec<_>>(), [99]);
        closed.clear();
        l.advance(102, &mut closed);
        assert_eq!(closed.len(), 1);
        assert_eq!(closed[0].sec, 100);
        assert_eq!(closed[0].suppressed, Tally::from([("soft_limit", 3)]));
        // An event far in the past (an old ban's expiry) counts in the current second.
        closed.clear();
        assert!(l.admit(5, 102, "unban", &mut closed));
        assert!(l.admit(5, 102, "unban", &mut closed));
        assert!(!l.admit(102, 102, "unban", &mut closed));
        // The wall clock stepped back: everything open closes.
        closed.clear();
        assert!(l.admit(50, 50, "ban", &mut closed));
        assert_eq!(closed.iter().map(|w| w.sec).collect::<Vec<_>>(), [101, 102]);
    }

    fn temp_file(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rl-events-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        let _ = std::fs::remove_file(&p);
        p
    }

    /// An output that takes `room` more bytes, then fails like a full disk; a file (which can
    /// be cut back) or not (a pipe).
    struct Full {
        data: Vec<u8>,
        room: usize,
        file: bool,
    }

    impl io::Write for Full {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if self.room == 0 {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
            // Short writes, as a filesystem does when it fills.
            let n = buf.len().min(self.room).min(5);
            self.data.extend_from_slice(&buf[..n]);
            self.room -= n;
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl LineOutput for Full {
        fn end(&mut self) -> Option<u64> {
            self.file.then_some(self.data.len() as u64)
        }
        fn cut(&mut self, len: u64) -> io::Result<()> {
            self.room += self.data.len() - len as usize;
            self.data.truncate(len as usize);
            Ok(())
        }
    }

    #[test]
    fn events_a_write_that_fails_partway_leaves_whole_lines() {
        let bytes = b"{\"a\":1}\n{\"b\":2}\n{\"c\":3}\n";
        let ends = [8, 16, 24];
        // A file: cut back to the last whole line.
        let mut f = Full {
            data: b"{\"old\":1}\n".to_vec(),
            room: 20,
            file: true,
        };
        let w = write_lines(&mut f, bytes, &ends);
        assert_eq!(w.whole, 16);
        assert!(w.torn_rest.is_empty());
        assert_eq!(
            w.error.unwrap().raw_os_error(),
            Some(libc::ENOSPC),
            "the error is reported"
        );
        assert_eq!(f.data, b"{\"old\":1}\n{\"a\":1}\n{\"b\":2}\n");
        // A pipe: the torn line's rest comes first at the next write.
        let mut p = Full {
            data: Vec::new(),
            room: 12,
            file: false,
        };
        let w = write_lines(&mut p, bytes, &ends);
        assert_eq!((w.whole, w.torn_rest.as_slice()), (8, &b":2}\n"[..]));
        p.room = 100;
        let mut next = w.torn_rest.clone();
        next.extend_from_slice(b"{\"d\":4}\n");
        let w = write_lines(&mut p, &next, &[4, 12]);
        assert!(w.error.is_none() && w.whole == 12);
        assert_eq!(p.data, b"{\"a\":1}\n{\"b\":2}\n{\"d\":4}\n");
        // Everything fits: all of it, no error.
        let mut ok = Full {
            data: Vec::new(),
            room: 100,
            file: true,
        };
        let w = write_lines(&mut ok, bytes, &ends);
        assert!(w.error.is_none() && w.whole == 24 && ok.data == bytes);
    }

    #[test]
    fn events_writer_caps_summarizes_and_keeps_operator_lines() {
        let path = temp_file("writer.jsonl");
        let sink = EventsSink::File(path.clone());
        let events = Events::start(Some(&sink), 3, vec!["r".into()]).unwrap();
        let now = mono_ns();
        events.data_plane((0..10).map(|_| ev(EV_SOFT_LIMIT, now)).collect());
        events.data_plane((0..2).map(|_| ev(EV_THROTTLE_START, now)).collect());
        let mut op = ev(EV_BAN, now);
        op.rule = ratelimit_common::maps::BAN_RULE_NONE;
        events.operator(vec![op; 5]);
        events.close(Duration::from_secs(5));
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let of = |e: &str| lines.iter().filter(|l| l["event"] == e).count();
        // The batch may straddle a second: at most 3 capped lines a second.
        let capped = of("soft_limit") + of("throttle_start");
        assert!((3..=6).contains(&capped), "{text}");
        assert_eq!(of("ban"), 5, "the operator's lines are not capped");
        let summaries: Vec<_> = lines
            .iter()
            .filter(|l| l["event"] == "suppressed")
            .collect();
        let suppressed: u64 = summaries.iter().map(|s| s["count"].as_u64().unwrap()).sum();
        assert_eq!(capped as u64 + suppressed, 12, "{text}");
        assert!(summaries.iter().all(|s| s["threshold"] == 3), "{text}");
        let c = events.counts();
        assert_eq!(
            (c.written, c.suppressed, c.queued),
            (capped as u64 + 5, suppressed, 0)
        );
        let b = lines.iter().find(|l| l["event"] == "ban").unwrap();
        assert_eq!(b["rule"], "");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn events_queue_is_bounded_and_counts_what_it_drops() {
        let path = temp_file("queue.jsonl");
        let sink = EventsSink::File(path.clone());
        let events = Events::start(Some(&sink), MAX_PER_SEC, vec![]).unwrap();
        // Fill the queue beyond its bound while the writer is busy: whatever it took is
        // written or queued, the rest is counted.
        let now = mono_ns();
        let n = QUEUE + 10_000;
        events.data_plane(vec![ev(EV_SOFT_LIMIT, now); n]);
        let c = events.counts();
        assert_eq!(c.lost_queue, 10_000);
        events.close(Duration::from_secs(30));
        let c = events.counts();
        assert_eq!(c.written + c.suppressed + c.lost_queue, n as u64);
        std::fs::remove_file(&path).unwrap();
    }

    /// The lines of a fleet-wide ban wave share the data plane's cap, summaries and queue
    /// bound; the operator's own lines are never capped.
    #[test]
    fn events_fleet_lines_are_capped_and_bounded() {
        let path = temp_file("fleet.jsonl");
        let sink = EventsSink::File(path.clone());
        let events = Events::start(Some(&sink), 3, vec![]).unwrap();
        let line = |event: &'static str| EventLine {
            time: rfc3339(SystemTime::now()),
            event,
            rule: String::new(),
            key: "ip",
            client: "198.51.100.7/32".into(),
            count: 0,
            threshold: 0,
            ban_expires: None,
            origin: Some("edge-2".into()),
        };
        events.fleet_lines((0..40).map(|_| line("ban")).collect());
        events.fleet_lines((0..10).map(|_| line("unban")).collect());
        events.operator_lines((0..4).map(|_| line("unban")).collect());
        events.close(Duration::from_secs(5));
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let of = |e: &str| lines.iter().filter(|l| l["event"] == e).count();
        let fleet = of("ban") + of("unban") - 4;
        assert!((3..=6).contains(&fleet), "at most 3 a second:\n{text}");
        let suppressed: u64 = lines
            .iter()
            .filter(|l| l["event"] == "suppressed")
            .map(|s| s["count"].as_u64().unwrap())
            .sum();
        assert_eq!(fleet as u64 + suppressed, 50, "{text}");
        assert_eq!(events.counts().suppressed, suppressed);
        std::fs::remove_file(&path).unwrap();

        // The queue: a wave beyond the data plane's bound is cut to it and counted.
        let path = temp_file("fleet-queue.jsonl");
        let sink = EventsSink::File(path.clone());
        let events = Events::start(Some(&sink), MAX_PER_SEC, vec![]).unwrap();
        let n = QUEUE + 5_000;
        events.fleet_lines(vec![line("ban"); n]);
        assert_eq!(events.counts().lost_queue, 5_000);
        events.close(Duration::from_secs(30));
        let c = events.counts();
        assert_eq!(c.written + c.suppressed + c.lost_queue, n as u64);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn events_line_shape() {
        let mut e = ev(EV_BAN, 1_000_000_000);
        e.expires_ns = 2_000_000_000;
        let line = line_with(&e, &["r".into()], &mut |ns| ns.to_string());
        let v = serde_json::to_value(&line).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "time": "1000000000", "event": "ban", "rule": "r", "key": "ip",
                "client": "::/128", "count": 1, "threshold": 1, "ban_expires": "2000000000"
            })
        );
        let tally = Tally::from([("ban", 2), ("soft_limit", 5)]);
        let s = SummaryLine {
            time: rfc3339_ns(1_700_000_000_000_000_000),
            event: SUMMARY_EVENT,
            count: 7,
            threshold: 1000,
            events: &tally,
        };
        assert_eq!(
            serde_json::to_string(&s).unwrap(),
            "{\"time\":\"2023-11-14T22:13:20.000Z\",\"event\":\"suppressed\",\"count\":7,\
             \"threshold\":1000,\"events\":{\"ban\":2,\"soft_limit\":5}}"
        );
    }
}
