//! The producers' side of the events sink ([`Events`]): a bounded queue to the writer thread
//! that never blocks, and the counts of what became of every event.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU32, Ordering},
        mpsc,
    },
    time::Duration,
};

use anyhow::Context as _;
use ratelimit_common::event::Event;
use serde::Serialize;
use tokio::sync::watch;
use tracing::warn;

use super::{
    Counters, Msg, Origin, Progress, QUEUE, QUEUE_OPERATOR, STALL,
    line::{EventLine, FleetLine, PressureLine},
    sink::Output,
    writer::Writer,
};
use crate::config::EventsSink;

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
        let writer = Writer::new(out, per_sec, counters, progress_tx);
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
