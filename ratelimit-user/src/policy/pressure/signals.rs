//! The signals and the counters they are rates of: `/proc/stat`'s per-CPU lines and
//! `/proc/net/netstat`'s listen drops, parsed, and the rates between two readings.

use std::{collections::BTreeMap, time::Duration};

use serde::{Deserialize, Serialize};

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
