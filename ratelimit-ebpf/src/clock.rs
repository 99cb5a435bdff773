//! The coarse clock, read once per timer tick and CPU.

use aya_ebpf::{
    helpers::{bpf_jiffies64, bpf_ktime_get_coarse_ns},
    macros::map,
    maps::PerCpuArray,
};

/// Per CPU: `[jiffies, CLOCK_MONOTONIC_COARSE ns]` when this CPU last read the coarse clock.
#[map(name = "RL_TICK")]
static TICK: PerCpuArray<[u64; 2]> = PerCpuArray::with_max_entries(1, 0);

/// CLOCK_MONOTONIC_COARSE in ns. That clock only moves when the timer tick does, so it
/// is read once per tick and CPU (`bpf_ktime_get_coarse_ns` costs a seqlock read and a
/// timespec conversion); every other packet of the tick compares `jiffies` (one load) and
/// reuses the value. The same ns `bpf_ktime_get_coarse_ns` would return within the tick,
/// give or take the tick in which jiffies moves a moment before the clock does (then the
/// value is one tick old: the coarse clock's own resolution).
///
/// Returns (that ns, the tick it belongs to in jiffies).
#[inline(always)]
pub fn coarse_tick() -> (u64, u64) {
    // SAFETY: a helper without arguments that reads the tick count.
    let jiffies = unsafe { bpf_jiffies64() };
    let Some(t) = TICK.get_ptr_mut(0) else {
        // SAFETY: a helper without arguments that reads the clock.
        return (unsafe { bpf_ktime_get_coarse_ns() }, jiffies);
    };
    // SAFETY: this CPU's slot; an XDP program runs to completion on its CPU.
    unsafe {
        if (*t)[0] == jiffies && (*t)[1] != 0 {
            return ((*t)[1], jiffies);
        }
        let now = bpf_ktime_get_coarse_ns();
        (*t)[0] = jiffies;
        (*t)[1] = now;
        (now, jiffies)
    }
}
