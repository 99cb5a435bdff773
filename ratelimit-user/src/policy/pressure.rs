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
//! Everything here is pure: the caller passes the time ([`Instant`](std::time::Instant)) and the readings, so the
//! tests run on a fake clock.
//!
//! The parts: the signals and the counters they are rates of ([`signals`]), the level and its
//! hysteresis ([`level`]), the answer to `pressure` and the saved mode ([`report`]), and the
//! data plane kept at the level ([`sync`]).

use std::time::Duration;

pub mod level;
pub mod report;
pub mod signals;
pub mod sync;

pub use level::{Cause, Level, Marks, Mode, Pressure, Reading, Transition};
pub use report::{Report, Saved};
pub use signals::{Counters, CpuTimes, Sample, Signal, parse_netstat, parse_stat, read_counters};
pub use sync::{LevelSync, Synced};

/// How often the daemon samples the signals: a signal reaches the level within a second
/// (this period, plus a job's turn on the owner task).
pub const SAMPLE_PERIOD: Duration = Duration::from_millis(250);

/// The file in `state_dir` that keeps the operator's mode across restarts.
pub const FILE: &str = "pressure.json";

#[cfg(test)]
mod tests;
