//! The clocks: CLOCK_MONOTONIC (the program's, `bpf_ktime_get_ns`) and the wall clock, and
//! the one text form of a time (RFC 3339, milliseconds). The bottom layer: imports nothing of
//! the crate.

use std::time::{Duration, SystemTime};

/// CLOCK_MONOTONIC now, the clock of `bpf_ktime_get_ns`.
pub fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The wall clock (CLOCK_REALTIME) now, in ns since the Unix epoch (0 before it).
pub fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Wall-clock time of a CLOCK_MONOTONIC timestamp.
pub fn wall_of(mono: u64) -> SystemTime {
    let now_mono = mono_ns();
    let now = SystemTime::now();
    if mono >= now_mono {
        now + Duration::from_nanos(mono - now_mono)
    } else {
        now - Duration::from_nanos(now_mono - mono)
    }
}

pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}
