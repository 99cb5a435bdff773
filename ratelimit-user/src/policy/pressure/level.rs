//! The level and how it comes about: the operator's mode, the signals against their marks,
//! and the hysteresis (high at once, low again after `hold`).

use std::{
    fmt,
    str::FromStr,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use super::signals::{Sample, Signal};
use crate::config;

/// Under pressure or not.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    #[default]
    Low,
    High,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Level::Low => "low",
            Level::High => "high",
        }
    }
}

/// Who decides the level: the signals (`auto`), or the operator (`high`, `low`).
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    #[default]
    Auto,
    High,
    Low,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Auto => "auto",
            Mode::High => "high",
            Mode::Low => "low",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Mode::Auto),
            "high" => Ok(Mode::High),
            "low" => Ok(Mode::Low),
            _ => Err(format!(
                "{s:?} is not a pressure mode; expected high, low or auto"
            )),
        }
    }
}

/// The marks and the hold, from `[pressure]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Marks {
    pub cpu_busy: f64,
    pub listen_overflows_per_sec: f64,
    pub hold: Duration,
}

impl Marks {
    pub fn of(c: &config::Pressure) -> Self {
        Marks {
            cpu_busy: c.cpu_busy,
            listen_overflows_per_sec: c.listen_overflows_per_sec,
            hold: c.hold,
        }
    }

    pub fn mark(&self, s: Signal) -> f64 {
        match s {
            Signal::CpuBusy => self.cpu_busy,
            Signal::ListenOverflowsPerSec => self.listen_overflows_per_sec,
        }
    }
}

/// A signal's value against its mark.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    pub signal: Signal,
    /// None until there is a value (the first interval, a counter that went backwards).
    pub value: Option<f64>,
    pub mark: f64,
    pub above: bool,
}

/// Why the level changed.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// A signal went above its mark.
    Signal,
    /// `hold` passed with no signal above its mark.
    Hold,
    /// The operator set the mode.
    Operator,
}

/// A change of the level.
#[derive(Debug, Clone, PartialEq)]
pub struct Transition {
    pub level: Level,
    pub cause: Cause,
    pub mode: Mode,
    /// The signals above their marks at the change.
    pub above: Vec<Reading>,
}

/// The level and how it came about.
#[derive(Debug, Clone)]
pub struct Pressure {
    marks: Marks,
    mode: Mode,
    /// What the signals say, whatever the mode.
    auto: Level,
    /// When a signal was last above its mark.
    last_above: Option<Instant>,
    /// The level in force (the mode's, or `auto`'s) and since when.
    level: Level,
    since: Instant,
    transitions: u64,
    last: Sample,
}

impl Pressure {
    /// Low (or what `mode` forces) from `now`.
    pub fn new(marks: Marks, mode: Mode, now: Instant) -> Self {
        let mut p = Pressure {
            marks,
            mode,
            auto: Level::Low,
            last_above: None,
            level: Level::Low,
            since: now,
            transitions: 0,
            last: Sample::default(),
        };
        p.level = p.effective();
        p
    }

    /// As [`Pressure::new`], for a daemon that takes over pinned state whose level was high
    /// (`was_high`): the automatic level starts high, as if a signal had been above its mark
    /// at `now`, so a restart does not relax the data plane until the signals have been read
    /// again; it falls after `hold` without a signal, as it would have.
    pub fn resume(marks: Marks, mode: Mode, now: Instant, was_high: bool) -> Self {
        let mut p = Self::new(marks, mode, now);
        if was_high {
            p.auto = Level::High;
            p.last_above = Some(now);
            p.level = p.effective();
        }
        p
    }

    fn effective(&self) -> Level {
        match self.mode {
            Mode::Auto => self.auto,
            Mode::High => Level::High,
            Mode::Low => Level::Low,
        }
    }

    /// Each signal of the last sample against its mark.
    pub fn readings(&self) -> Vec<Reading> {
        Signal::ALL
            .iter()
            .map(|&signal| {
                let value = self.last.value(signal);
                let mark = self.marks.mark(signal);
                Reading {
                    signal,
                    value,
                    mark,
                    above: value.is_some_and(|v| v > mark),
                }
            })
            .collect()
    }

    fn above(&self) -> Vec<Reading> {
        self.readings().into_iter().filter(|r| r.above).collect()
    }

    /// Take a sample at `now`.
    pub fn observe(&mut self, sample: Sample, now: Instant) -> Option<Transition> {
        self.last = sample;
        self.update(now, Cause::Signal)
    }

    /// The operator's mode, from `now`.
    pub fn set_mode(&mut self, mode: Mode, now: Instant) -> Option<Transition> {
        self.mode = mode;
        self.update(now, Cause::Operator)
    }

    /// New marks (a reload), judged from the next sample on.
    pub fn set_marks(&mut self, marks: Marks) {
        self.marks = marks;
    }

    fn update(&mut self, now: Instant, cause: Cause) -> Option<Transition> {
        if self.readings().iter().any(|r| r.above) {
            self.last_above = Some(now);
            self.auto = Level::High;
        } else if self.auto == Level::High
            && self
                .last_above
                .is_none_or(|t| now.saturating_duration_since(t) >= self.marks.hold)
        {
            self.auto = Level::Low;
        }
        let level = self.effective();
        if level == self.level {
            return None;
        }
        self.level = level;
        self.since = now;
        self.transitions += 1;
        Some(Transition {
            level,
            cause: match (cause, level) {
                (Cause::Signal, Level::Low) => Cause::Hold,
                (c, _) => c,
            },
            mode: self.mode,
            above: self.above(),
        })
    }

    pub fn level(&self) -> Level {
        self.level
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// What the signals alone say.
    pub fn auto_level(&self) -> Level {
        self.auto
    }

    pub fn since(&self) -> Instant {
        self.since
    }

    pub fn last_above(&self) -> Option<Instant> {
        self.last_above
    }

    pub fn transitions(&self) -> u64 {
        self.transitions
    }

    pub fn marks(&self) -> Marks {
        self.marks
    }
}
