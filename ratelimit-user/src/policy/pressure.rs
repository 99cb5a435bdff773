//! The pressure level: whether the host is under load, from the `[pressure]` signals and the
//! operator's mode (`ratelimit pressure set high|low|auto`).
//!
//! Signals, each a rate over the last sampling interval, from two readings of counters:
//! - **cpu_busy**: the kernel's share of the watched CPUs, from `/proc/stat`'s per-CPU lines:
//!   busy = system + irq + softirq + steal, out of every column (user, nice, system, idle,
//!   iowait, irq, softirq, steal). Receiving packets (XDP and the stack run in softirq) and
//!   serving sockets (system calls) is kernel time; user time is not counted, so no local
//!   user can raise the level with a busy loop. Steal counts as busy: time the hypervisor
//!   gave to someone else is time this host had no room. guest time is already in user. The
//!   watched CPUs are `pressure.cpus`, or else the receive CPUs of the attached interfaces
//!   (`crate::kernel::rx_cpus`: where their interrupts and RPS go), or else, when those are not known
//!   (a veth, a bridge), every CPU. A CPU missing from either reading (offline) is left out;
//!   so is a CPU whose counters went backwards (taken offline and brought back between
//!   readings).
//! - **listen_overflows_per_sec**: the rate of `TcpExt: ListenDrops` in `/proc/net/netstat`
//!   (of the daemon's network namespace). The kernel counts every listen-queue overflow in
//!   `ListenOverflows` *and* in `ListenDrops` (which also counts the other drops of a
//!   listener), so their sum would count an overflow twice; `ListenDrops` alone is
//!   "overflows and drops". `ListenOverflows` stands in where `ListenDrops` is missing.
//!
//! A counter that went backwards gives no value for that interval (its new reading is the
//! base of the next); so does the first reading. A signal without a value is not above its
//! mark.
//!
//! The level, with hysteresis: high as soon as any signal is above (strictly) its mark; low
//! again once `hold` has passed with no signal above. `cpu_busy = 1` can never be exceeded.
//! A forced mode (`high`, `low`) overrides the signals; the automatic level is kept up all
//! the same, so `set auto` returns at once to what the signals say.
//!
//! Everything here is pure: the caller passes the time ([`Instant`]) and the readings, so the
//! tests run on a fake clock.

use std::{
    collections::BTreeMap,
    fmt,
    str::FromStr,
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use crate::config;

/// How often the daemon samples the signals: a signal reaches the level within a second
/// (this period, plus a job's turn on the owner task).
pub const SAMPLE_PERIOD: Duration = Duration::from_millis(250);

/// The file in `state_dir` that keeps the operator's mode across restarts.
pub const FILE: &str = "pressure.json";

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

/// The signals, in the order they are shown.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum Signal {
    CpuBusy,
    ListenOverflowsPerSec,
}

impl Signal {
    pub const ALL: [Signal; 2] = [Signal::CpuBusy, Signal::ListenOverflowsPerSec];

    /// The config key of its mark, and its name in reports and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Signal::CpuBusy => "cpu_busy",
            Signal::ListenOverflowsPerSec => "listen_overflows_per_sec",
        }
    }
}

/// One CPU's counters from `/proc/stat` (USER_HZ ticks).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuTimes {
    pub busy: u64,
    pub total: u64,
}

/// One reading of the counters the signals are rates of.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Counters {
    /// Online CPUs by number.
    pub cpus: BTreeMap<u32, CpuTimes>,
    /// `TcpExt: ListenDrops` (or `ListenOverflows`); None if neither is there.
    pub listen_drops: Option<u64>,
}

/// The per-CPU lines (`cpuN ...`) of `/proc/stat`; the `cpu` total line is skipped.
pub fn parse_stat(text: &str) -> BTreeMap<u32, CpuTimes> {
    let mut cpus = BTreeMap::new();
    for line in text.lines() {
        let mut fields = line.split_ascii_whitespace();
        let Some(n) = fields
            .next()
            .and_then(|f| f.strip_prefix("cpu"))
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        // user nice system idle iowait irq softirq steal (guest, guest_nice: within user).
        let v: Vec<u64> = fields.take(8).map_while(|f| f.parse().ok()).collect();
        if v.len() < 4 {
            continue;
        }
        let at = |i: usize| v.get(i).copied().unwrap_or(0);
        // The kernel's time (system, irq, softirq) and steal; not user or nice.
        let busy = [2, 5, 6, 7]
            .iter()
            .fold(0u64, |s, &i| s.wrapping_add(at(i)));
        let rest = [0, 1, 3, 4]
            .iter()
            .fold(0u64, |s, &i| s.wrapping_add(at(i)));
        cpus.insert(
            n,
            CpuTimes {
                busy,
                total: busy.wrapping_add(rest),
            },
        );
    }
    cpus
}

/// `ListenDrops` of the `TcpExt:` lines of `/proc/net/netstat` (a header line of names and a
/// line of values), or `ListenOverflows` where there is no `ListenDrops`.
pub fn parse_netstat(text: &str) -> Option<u64> {
    let mut lines = text.lines();
    while let Some(names) = lines.next() {
        let Some(names) = names.strip_prefix("TcpExt:") else {
            continue;
        };
        let values = lines.next()?.strip_prefix("TcpExt:")?;
        let row: BTreeMap<&str, u64> = names
            .split_ascii_whitespace()
            .zip(values.split_ascii_whitespace())
            .filter_map(|(k, v)| Some((k, v.parse().ok()?)))
            .collect();
        return row
            .get("ListenDrops")
            .or_else(|| row.get("ListenOverflows"))
            .copied();
    }
    None
}

/// The signals over one interval: None where there is no value (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Sample {
    pub cpu_busy: Option<f64>,
    pub listen_overflows_per_sec: Option<f64>,
}

impl Sample {
    /// The rates between two readings `elapsed` apart, over the CPUs in `watched` (empty =
    /// every CPU).
    pub fn between(
        before: &Counters,
        after: &Counters,
        elapsed: Duration,
        watched: &[u32],
    ) -> Self {
        let (mut busy, mut total) = (0u64, 0u64);
        for (n, now) in &after.cpus {
            if !watched.is_empty() && !watched.contains(n) {
                continue;
            }
            let Some(then) = before.cpus.get(n) else {
                continue;
            };
            if now.busy < then.busy || now.total < then.total {
                continue;
            }
            busy += now.busy - then.busy;
            total += now.total - then.total;
        }
        let cpu_busy = (total > 0).then(|| (busy as f64 / total as f64).min(1.0));
        let secs = elapsed.as_secs_f64();
        let listen_overflows_per_sec = match (before.listen_drops, after.listen_drops) {
            (Some(a), Some(b)) if b >= a && secs > 0.0 => Some((b - a) as f64 / secs),
            _ => None,
        };
        Sample {
            cpu_busy,
            listen_overflows_per_sec,
        }
    }

    pub fn value(&self, s: Signal) -> Option<f64> {
        match s {
            Signal::CpuBusy => self.cpu_busy,
            Signal::ListenOverflowsPerSec => self.listen_overflows_per_sec,
        }
    }
}

/// Read the counters: `/proc/stat` and the daemon's network namespace's `/proc/net/netstat`.
pub fn read_counters() -> anyhow::Result<Counters> {
    use anyhow::Context as _;
    let stat = std::fs::read_to_string("/proc/stat").context("reading /proc/stat")?;
    let netstat =
        std::fs::read_to_string("/proc/net/netstat").context("reading /proc/net/netstat")?;
    Ok(Counters {
        cpus: parse_stat(&stat),
        listen_drops: parse_netstat(&netstat),
    })
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

/// The answer to `pressure` and `pressure set`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Report {
    /// The level in force.
    pub level: Level,
    /// `auto`: the signals decide; `high` or `low`: forced by the operator.
    pub mode: Mode,
    /// What the signals alone say.
    pub auto_level: Level,
    /// Since when the level has been what it is (RFC 3339).
    pub since: String,
    /// When a signal was last above its mark (RFC 3339).
    pub last_above: Option<String>,
    /// How long the level stays high after the last signal above its mark.
    pub hold_secs: f64,
    /// The CPUs watched; empty = every online CPU.
    pub cpus: Vec<u32>,
    pub signals: Vec<Reading>,
    /// Changes of the level since the daemon started.
    pub transitions: u64,
    /// Why the operator's mode could not be saved (it is in force until the daemon stops).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_saved: Option<String>,
    /// The level the XDP program holds now, read back from its map: `low` puts the elastic
    /// limits of rules and overrides with `elastic` in force, `high` their thresholds.
    /// `None` if the map could not be read.
    #[serde(default)]
    pub data_plane: Option<Level>,
}

/// The operator's mode as saved in `state_dir`.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Saved {
    pub mode: Mode,
}

/// Keeps the level the data plane holds equal to the daemon's: on every tick of the sampler
/// the daemon compares what the global entry holds with the level it wants, and writes it again
/// where they differ (a write that failed at a change of the level, or an entry someone else
/// wrote). One warning an episode of disagreement, not one a tick, and one line when it ends
/// if it outlived its first rewrite.
#[derive(Debug, Default)]
pub struct LevelSync {
    /// Since the first tick of the current disagreement, until a tick finds them agreeing.
    disagreeing: bool,
    /// A rewrite in the current episode failed.
    failed: bool,
    /// Lines logged, for the tests.
    lines: u64,
}

/// What one [`LevelSync::tick`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synced {
    /// The data plane holds the level: nothing written.
    Agrees,
    /// It held the other level, or could not be read, and the level was written.
    Rewritten,
    /// As `Rewritten`, but the write failed: the next tick tries again.
    Failed,
}

impl LevelSync {
    /// Compare `held` (the data plane's level: `Some(true)` relaxed, `None` unreadable) with
    /// `relaxed` (the daemon's), and `write` the daemon's where they differ.
    pub fn tick(
        &mut self,
        relaxed: bool,
        held: Option<bool>,
        write: impl FnOnce(bool) -> anyhow::Result<()>,
    ) -> Synced {
        let name = |relaxed: bool| if relaxed { Level::Low } else { Level::High }.name();
        if held == Some(relaxed) {
            if self.disagreeing && self.failed {
                tracing::info!(
                    "the data plane holds the pressure level {} again",
                    name(relaxed)
                );
                self.lines += 1;
            }
            self.disagreeing = false;
            self.failed = false;
            return Synced::Agrees;
        }
        let first = !self.disagreeing;
        self.disagreeing = true;
        let held = held.map_or("an unreadable level", name);
        let result = write(relaxed);
        if first {
            self.lines += 1;
            match &result {
                Ok(()) => tracing::warn!(
                    "the data plane held {held} while the pressure level is {}: written again",
                    name(relaxed)
                ),
                Err(e) => tracing::error!(
                    "the data plane holds {held} while the pressure level is {}, and writing it \
                     failed: {e:#}; retrying every {} ms",
                    name(relaxed),
                    SAMPLE_PERIOD.as_millis()
                ),
            }
        }
        match result {
            Ok(()) => Synced::Rewritten,
            Err(_) => {
                self.failed = true;
                Synced::Failed
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn marks() -> Marks {
        Marks {
            cpu_busy: 0.8,
            listen_overflows_per_sec: 1.0,
            hold: Duration::from_secs(10),
        }
    }

    fn cpu(v: f64) -> Sample {
        Sample {
            cpu_busy: Some(v),
            listen_overflows_per_sec: Some(0.0),
        }
    }

    fn listen(v: f64) -> Sample {
        Sample {
            cpu_busy: Some(0.1),
            listen_overflows_per_sec: Some(v),
        }
    }

    #[test]
    fn the_first_sample_has_no_rates_and_the_level_starts_low() {
        let t0 = Instant::now();
        let mut p = Pressure::new(marks(), Mode::Auto, t0);
        assert_eq!(p.level(), Level::Low);
        assert_eq!(p.since(), t0);
        // No earlier reading: no values.
        let first = Counters {
            cpus: BTreeMap::from([(
                0,
                CpuTimes {
                    busy: 90,
                    total: 100,
                },
            )]),
            listen_drops: Some(1_000_000),
        };
        let s = Sample::between(&Counters::default(), &first, SAMPLE_PERIOD, &[]);
        assert_eq!(s, Sample::default());
        assert_eq!(p.observe(s, t0 + 250 * MS), None);
        assert!(p.readings().iter().all(|r| r.value.is_none() && !r.above));
        assert_eq!(p.level(), Level::Low);
    }

    /// A daemon that takes over a high level stays high (no relaxed gap before its first
    /// readings), and falls after the hold without a signal; a forced mode still decides.
    #[test]
    fn a_resumed_high_level_holds_until_the_hold_has_passed() {
        let t0 = Instant::now();
        let mut p = Pressure::resume(marks(), Mode::Auto, t0, true);
        assert_eq!((p.level(), p.transitions()), (Level::High, 0));
        assert_eq!(p.observe(cpu(0.1), t0 + 9_999 * MS), None);
        let t = p
            .observe(cpu(0.1), t0 + 10_000 * MS)
            .expect("low after the hold");
        assert_eq!((t.level, t.cause), (Level::Low, Cause::Hold));
        assert_eq!(
            Pressure::resume(marks(), Mode::Low, t0, true).level(),
            Level::Low
        );
        assert_eq!(
            Pressure::resume(marks(), Mode::Auto, t0, false).level(),
            Level::Low
        );
    }

    #[test]
    fn exactly_at_the_mark_is_not_above_it_and_just_over_is() {
        let t0 = Instant::now();
        let mut p = Pressure::new(marks(), Mode::Auto, t0);
        assert_eq!(p.observe(cpu(0.8), t0 + 250 * MS), None);
        assert_eq!(p.observe(listen(1.0), t0 + 500 * MS), None);
        assert_eq!(p.level(), Level::Low);
        let t = p.observe(listen(1.0001), t0 + 750 * MS).unwrap();
        assert_eq!(t.level, Level::High);
        assert_eq!(t.cause, Cause::Signal);
        assert_eq!(t.above.len(), 1);
        assert_eq!(t.above[0].signal, Signal::ListenOverflowsPerSec);
        assert_eq!(t.above[0].value, Some(1.0001));
        assert_eq!(p.since(), t0 + 750 * MS);
        assert_eq!(p.transitions(), 1);
    }

    #[test]
    fn cpu_busy_of_1_is_never_exceeded() {
        let t0 = Instant::now();
        let mut p = Pressure::new(
            Marks {
                cpu_busy: 1.0,
                ..marks()
            },
            Mode::Auto,
            t0,
        );
        // Every tick busy: the share is 1, not above 1.
        let a = Counters {
            cpus: BTreeMap::from([(
                0,
                CpuTimes {
                    busy: 10,
                    total: 10,
                },
            )]),
            listen_drops: Some(0),
        };
        let b = Counters {
            cpus: BTreeMap::from([(
                0,
                CpuTimes {
                    busy: 35,
                    total: 35,
                },
            )]),
            listen_drops: Some(0),
        };
        let s = Sample::between(&a, &b, SAMPLE_PERIOD, &[]);
        assert_eq!(s.cpu_busy, Some(1.0));
        assert_eq!(p.observe(s, t0 + 250 * MS), None);
        assert_eq!(p.level(), Level::Low);
    }

    #[test]
    fn the_level_falls_exactly_hold_after_the_last_signal_above() {
        let t0 = Instant::now();
        let mut p = Pressure::new(marks(), Mode::Auto, t0);
        p.observe(cpu(0.9), t0 + 1000 * MS).unwrap();
        // Above again later: the hold counts from the last time.
        assert_eq!(p.observe(cpu(0.95), t0 + 2000 * MS), None);
        assert_eq!(p.last_above(), Some(t0 + 2000 * MS));
        assert_eq!(p.observe(cpu(0.1), t0 + 2250 * MS), None);
        assert_eq!(p.observe(cpu(0.1), t0 + 11_999 * MS), None);
        assert_eq!(p.level(), Level::High);
        let t = p.observe(cpu(0.1), t0 + 12_000 * MS).unwrap();
        assert_eq!(t.level, Level::Low);
        assert_eq!(t.cause, Cause::Hold);
        assert!(t.above.is_empty());
        assert_eq!(p.since(), t0 + 12_000 * MS);
        assert_eq!(p.transitions(), 2);
        // A sample without values does not hold the level up either.
        p.observe(cpu(0.9), t0 + 13_000 * MS).unwrap();
        assert_eq!(p.observe(Sample::default(), t0 + 22_999 * MS), None);
        assert_eq!(
            p.observe(Sample::default(), t0 + 23_000 * MS)
                .unwrap()
                .level,
            Level::Low
        );
    }

    #[test]
    fn a_zero_hold_falls_at_the_first_sample_below() {
        let t0 = Instant::now();
        let mut p = Pressure::new(
            Marks {
                hold: Duration::ZERO,
                ..marks()
            },
            Mode::Auto,
            t0,
        );
        p.observe(cpu(0.9), t0 + 250 * MS).unwrap();
        assert_eq!(
            p.observe(cpu(0.2), t0 + 500 * MS).unwrap().level,
            Level::Low
        );
    }

    #[test]
    fn a_forced_mode_overrides_the_signals_and_auto_returns_to_them() {
        let t0 = Instant::now();
        let mut p = Pressure::new(marks(), Mode::Auto, t0);
        let t = p.set_mode(Mode::High, t0 + 100 * MS).unwrap();
        assert_eq!(
            (t.level, t.cause, t.mode),
            (Level::High, Cause::Operator, Mode::High)
        );
        // Signals below: still high, and no transition.
        assert_eq!(p.observe(cpu(0.1), t0 + 20_000 * MS), None);
        assert_eq!(p.level(), Level::High);
        assert_eq!(p.auto_level(), Level::Low);
        // Back to auto: the signals' level at once.
        let t = p.set_mode(Mode::Auto, t0 + 20_100 * MS).unwrap();
        assert_eq!((t.level, t.cause), (Level::Low, Cause::Operator));
        // Forced low against a signal above.
        p.observe(listen(50.0), t0 + 20_250 * MS).unwrap();
        let t = p.set_mode(Mode::Low, t0 + 20_300 * MS).unwrap();
        assert_eq!(t.level, Level::Low);
        assert_eq!(t.above.len(), 1, "the signal above is reported");
        assert_eq!(p.observe(listen(50.0), t0 + 20_500 * MS), None);
        // Auto while the hold still runs: high.
        let t = p.set_mode(Mode::Auto, t0 + 21_000 * MS).unwrap();
        assert_eq!(t.level, Level::High);
        // Setting the mode in force changes nothing.
        assert_eq!(p.set_mode(Mode::Auto, t0 + 21_100 * MS), None);
        assert_eq!(p.transitions(), 5);
        // Started forced.
        let p = Pressure::new(marks(), Mode::High, t0);
        assert_eq!((p.level(), p.transitions()), (Level::High, 0));
    }

    const STAT: &str = "cpu  400 0 200 1000 0 0 0 0 0 0\n\
                        cpu0 100 10 50 500 20 5 15 3 7 0\n\
                        cpu1 300 0 150 500 0 0 0 0 0 0\n\
                        intr 1 2 3\nctxt 5\n";

    #[test]
    fn proc_stat_lines_give_busy_and_total_per_cpu() {
        let cpus = parse_stat(STAT);
        assert_eq!(cpus.len(), 2, "the total line is skipped");
        // busy = system + irq + softirq + steal; total adds user, nice, idle and iowait.
        assert_eq!(
            cpus[&0],
            CpuTimes {
                busy: 73,
                total: 703
            }
        );
        assert_eq!(
            cpus[&1],
            CpuTimes {
                busy: 150,
                total: 950
            }
        );
        // An old kernel's 4 columns.
        assert_eq!(
            parse_stat("cpu3 1 2 3 4\n")[&3],
            CpuTimes { busy: 3, total: 10 }
        );
    }

    /// A local user's busy loop (all user and nice time) is not pressure: only the kernel's
    /// work on the CPU (system, irq, softirq) and steal count, out of every column.
    #[test]
    fn user_and_nice_time_are_not_busy_and_kernel_time_is() {
        // user nice system idle iowait irq softirq steal guest guest_nice
        let cpus = parse_stat("cpu0 900 50 20 0 0 5 15 10 0 0\ncpu1 0 0 300 600 0 0 100 0 0 0\n");
        assert_eq!(
            cpus[&0],
            CpuTimes {
                busy: 50,
                total: 1000
            },
            "a CPU spinning in user space is 5% busy (its kernel time)"
        );
        assert_eq!(
            cpus[&1],
            CpuTimes {
                busy: 400,
                total: 1000
            },
            "system and softirq time count whole"
        );
        // Two samples of a user busy loop on every CPU: far below any mark.
        let a = Counters {
            cpus: parse_stat("cpu0 1000 0 10 0 0 0 5 0 0 0\ncpu1 1000 0 10 0 0 0 5 0 0 0\n"),
            listen_drops: Some(0),
        };
        let b = Counters {
            cpus: parse_stat("cpu0 1025 0 10 0 0 0 5 0 0 0\ncpu1 1024 0 11 0 0 0 5 0 0 0\n"),
            listen_drops: Some(0),
        };
        assert_eq!(
            Sample::between(&a, &b, SAMPLE_PERIOD, &[]).cpu_busy,
            Some(1.0 / 50.0)
        );
    }

    const NETSTAT: &str = "TcpExt: SyncookiesSent ListenOverflows ListenDrops TCPTimeouts\n\
                           TcpExt: 0 7 9 3\n\
                           IpExt: InNoRoutes\nIpExt: 0\n";

    #[test]
    fn netstat_gives_listen_drops_or_else_overflows() {
        assert_eq!(parse_netstat(NETSTAT), Some(9));
        assert_eq!(
            parse_netstat("TcpExt: ListenOverflows\nTcpExt: 4\n"),
            Some(4)
        );
        assert_eq!(parse_netstat("IpExt: InNoRoutes\nIpExt: 0\n"), None);
        assert_eq!(parse_netstat(""), None);
    }

    fn reading(cpus: &[(u32, u64, u64)], drops: u64) -> Counters {
        Counters {
            cpus: cpus
                .iter()
                .map(|&(n, busy, total)| (n, CpuTimes { busy, total }))
                .collect(),
            listen_drops: Some(drops),
        }
    }

    #[test]
    fn rates_come_from_deltas_of_the_watched_cpus() {
        let a = reading(&[(0, 100, 200), (1, 0, 100), (2, 50, 100)], 10);
        let b = reading(&[(0, 190, 300), (1, 10, 200), (2, 150, 200)], 15);
        let s = Sample::between(&a, &b, SAMPLE_PERIOD, &[]);
        // (90 + 10 + 100) / 300.
        assert!((s.cpu_busy.unwrap() - 200.0 / 300.0).abs() < 1e-12);
        assert_eq!(s.listen_overflows_per_sec, Some(20.0), "5 in 250 ms");
        let s = Sample::between(&a, &b, SAMPLE_PERIOD, &[1]);
        assert_eq!(s.cpu_busy, Some(0.1));
        // A watched CPU that is not online: no value.
        let s = Sample::between(&a, &b, SAMPLE_PERIOD, &[7]);
        assert_eq!(s.cpu_busy, None);
    }

    #[test]
    fn a_cpu_going_offline_or_a_counter_reset_drops_out_of_one_interval() {
        let a = reading(&[(0, 100, 200), (1, 50, 100)], 10);
        // CPU 1 offline: only CPU 0 counts.
        let b = reading(&[(0, 150, 300)], 12);
        assert_eq!(
            Sample::between(&a, &b, SAMPLE_PERIOD, &[]).cpu_busy,
            Some(0.5)
        );
        // CPU 1 back, with counters reset; the drops counter wrapped.
        let c = reading(&[(0, 250, 400), (1, 5, 10)], 3);
        let s = Sample::between(&b, &c, SAMPLE_PERIOD, &[]);
        assert_eq!(s.cpu_busy, Some(1.0), "CPU 0 alone (CPU 1 was not in b)");
        assert_eq!(s.listen_overflows_per_sec, None);
        let s = Sample::between(&a, &c, SAMPLE_PERIOD, &[]);
        assert_eq!(
            s.cpu_busy,
            Some(150.0 / 200.0),
            "CPU 1 went backwards: left out"
        );
        // The next interval counts from the new readings.
        let d = reading(&[(0, 250, 500), (1, 15, 20)], 4);
        let s = Sample::between(&c, &d, SAMPLE_PERIOD, &[]);
        assert_eq!(s.cpu_busy, Some(10.0 / 110.0));
        assert_eq!(s.listen_overflows_per_sec, Some(4.0));
        // Every CPU gone: no value, not "idle".
        let none = reading(&[], 4);
        assert_eq!(
            Sample::between(&d, &none, SAMPLE_PERIOD, &[]).cpu_busy,
            None
        );
    }

    #[test]
    fn modes_parse_and_print() {
        for m in [Mode::Auto, Mode::High, Mode::Low] {
            assert_eq!(m.to_string().parse::<Mode>(), Ok(m));
        }
        assert_eq!(
            "on".parse::<Mode>(),
            Err("\"on\" is not a pressure mode; expected high, low or auto".into())
        );
        assert_eq!(
            serde_json::to_string(&Saved { mode: Mode::High }).unwrap(),
            r#"{"mode":"high"}"#
        );
    }

    /// A level the data plane does not hold (a write that failed, or an entry written by
    /// someone else) is written again on the next tick, and logged once an episode.
    #[test]
    fn the_data_plane_level_is_rewritten_until_it_holds() {
        struct Plane {
            held: Option<bool>,
            failures: u32,
            writes: u32,
        }
        impl Plane {
            fn write(&mut self, relaxed: bool) -> anyhow::Result<()> {
                self.writes += 1;
                if self.failures > 0 {
                    self.failures -= 1;
                    anyhow::bail!("injected failure");
                }
                self.held = Some(relaxed);
                Ok(())
            }
        }
        let mut sync = LevelSync::default();
        let mut plane = Plane {
            held: Some(false),
            failures: 0,
            writes: 0,
        };
        let tick = |sync: &mut LevelSync, plane: &mut Plane, relaxed: bool| {
            let held = plane.held;
            sync.tick(relaxed, held, |r| plane.write(r))
        };
        // Agreeing: nothing written, nothing logged.
        assert_eq!(tick(&mut sync, &mut plane, false), Synced::Agrees);
        assert_eq!((plane.writes, sync.lines), (0, 0));
        // The level went low and its write failed twice: rewritten on every tick until it
        // holds, one line when it starts and one when it ends.
        plane.failures = 2;
        assert_eq!(tick(&mut sync, &mut plane, true), Synced::Failed);
        assert_eq!(tick(&mut sync, &mut plane, true), Synced::Failed);
        assert_eq!(sync.lines, 1, "once an episode");
        assert_eq!(plane.held, Some(false));
        assert_eq!(tick(&mut sync, &mut plane, true), Synced::Rewritten);
        assert_eq!(plane.held, Some(true));
        assert_eq!(tick(&mut sync, &mut plane, true), Synced::Agrees);
        assert_eq!((plane.writes, sync.lines), (3, 2));
        assert_eq!(tick(&mut sync, &mut plane, true), Synced::Agrees);
        assert_eq!((plane.writes, sync.lines), (3, 2));
        // Someone else writes the entry: put back at once, one line.
        plane.held = Some(false);
        assert_eq!(tick(&mut sync, &mut plane, true), Synced::Rewritten);
        assert_eq!(tick(&mut sync, &mut plane, true), Synced::Agrees);
        assert_eq!((plane.held, plane.writes, sync.lines), (Some(true), 4, 3));
        // An entry that cannot be read is written.
        plane.held = None;
        assert_eq!(tick(&mut sync, &mut plane, true), Synced::Rewritten);
        assert_eq!(plane.held, Some(true));
    }
}
