//! The per-second cap of the data plane's (and the fleet's) lines.

use std::collections::VecDeque;

use super::Tally;

/// The per-second cap. A second is that of the event's time when it is the current second or
/// the one before (so lines are capped by the second they show), else the current one (an old
/// ban's expiry found late). A second is closed, and its summary due, once the next one has
/// passed too.
pub(super) struct Limiter {
    pub(super) per_sec: u32,
    /// At most two: the current second and the one before, oldest first.
    pub(super) windows: VecDeque<Window>,
}

pub(super) struct Window {
    pub(super) sec: u64,
    written: u32,
    pub(super) suppressed: Tally,
}

impl Limiter {
    pub(super) fn new(per_sec: u32) -> Self {
        Self {
            per_sec,
            windows: VecDeque::with_capacity(3),
        }
    }

    /// Move the seconds that ended before `now_sec - 1` into `closed`. A wall clock stepped
    /// back closes them all.
    pub(super) fn advance(&mut self, now_sec: u64, closed: &mut Vec<Window>) {
        if self.windows.back().is_some_and(|w| w.sec > now_sec) {
            closed.extend(self.windows.drain(..));
        }
        while self.windows.front().is_some_and(|w| w.sec + 1 < now_sec) {
            closed.extend(self.windows.pop_front());
        }
    }

    /// Whether an event of `kind` at wall second `sec` may be written now (`now_sec`).
    pub(super) fn admit(
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
    pub(super) fn next_summary_ns(&self) -> Option<u64> {
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
