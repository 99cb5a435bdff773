//! The writer thread: it formats what the queue hands it, applies the cap, writes the lines a
//! chunk at a time, and writes each capped second's summary once it has passed.

use std::{
    io::{self, Write as _},
    sync::{Arc, atomic::Ordering, mpsc},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use ratelimit_common::event::Event;
use serde::Serialize;
use tokio::sync::watch;
use tracing::{error, info, warn};

use super::{
    CHUNK, Counters, Msg, Origin, Progress, SUMMARY_EVENT, Tally, WARN_EVERY,
    cap::{Limiter, Window},
    line::{SummaryLine, kind_name, line_with},
    sink::{Output, write_lines},
};
use crate::clock::{mono_ns, rfc3339};

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

fn wall_now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

pub(super) fn rfc3339_ns(wall_ns: u64) -> String {
    rfc3339(UNIX_EPOCH + Duration::from_nanos(wall_ns))
}

/// The writer thread's state.
pub(super) struct Writer {
    out: Output,
    /// The rest of a torn line (see
    /// [`Written::torn_rest`](super::sink::Written::torn_rest)).
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
    pub(super) fn new(
        out: Output,
        per_sec: u32,
        counters: Arc<Counters>,
        progress: watch::Sender<Progress>,
    ) -> Writer {
        Writer {
            out,
            torn: Vec::new(),
            limiter: Limiter::new(per_sec),
            chunk: Chunk::default(),
            carry: Tally::new(),
            counters,
            progress,
            failing_since: None,
            last_warn: None,
            failed: 0,
        }
    }

    pub(super) fn run(mut self, rx: mpsc::Receiver<(u64, Msg)>) {
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
