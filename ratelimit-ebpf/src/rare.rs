//! Rare data-plane conditions, written to the daemon's log through aya-log: a rule ban that
//! found its table full (held in the client's state), a ban insert that failed otherwise, a
//! per-source state the store could not place, a shared-key state its map refused, events
//! lost to a full ring. Each also has its counter (`stats::global`), which counts every one.
//!
//! Never per packet. Where a condition happens, [`note`] only counts it (a global function: a
//! call at each site). After the verdict the XDP entry calls [`flush`]: one load when nothing
//! is pending; when a condition is due it writes one line for it, with the number of
//! occurrences it stands for, the span they came in, and the last one's rule and family. A
//! condition writes at most one line a second per CPU; the first after a quiet second is
//! written at once. Per CPU, so no atomics: every CPU has its own second.
//!
//! Verifier cost: aya-log's formatting expands to hundreds of instructions a line, so every
//! line is written in one global function ([`rl_rare_log`]), verified once on its own whatever
//! the paths that lead to it. aya-log-ebpf 0.2 writes to a ring buffer (`AYA_LOGS`) and needs
//! no context pointer, which a global function could not pass.
//!
//! A line the log ring has no room for (no daemon reading it) is lost with its count; the
//! counters are not. The lines point the operator at the counters, they are not a record.

use aya_ebpf::{helpers::bpf_get_smp_processor_id, macros::map, maps::PerCpuArray};
use aya_log_ebpf::warn;
use ratelimit_common::addr::{FAMILY_V4, FAMILY_V6, IpKey};

/// A rule ban found the rules' ban table full: held in the client's state.
pub const BAN_HELD: u64 = 0;
/// A ban insert failed for another reason: the client is throttled, not banned.
pub const BAN_INSERT_FAILED: u64 = 1;
/// A new source's state could not be placed in the store (no sets, or another CPU won the
/// slot): limited in aggregate.
pub const STATE_NOT_PLACED: u64 = 2;
/// A shared key's state (key = all, region) was refused by its map: the packet passes.
pub const SHARED_REFUSED: u64 = 3;
/// An event was lost: the events ring was full.
pub const EVENTS_LOST: u64 = 4;
const CONDITIONS: usize = 5;

/// At most one line a second per condition and CPU.
const LINE_INTERVAL_NS: u64 = 1_000_000_000;

/// One condition's occurrences since its last line, on this CPU.
#[repr(C)]
#[derive(Clone, Copy)]
struct Pending {
    count: u64,
    /// When the first of `count` happened.
    first_ns: u64,
    /// When the last line was written; 0: never (the next is due at once).
    last_line_ns: u64,
    /// The last occurrence's rule, and its address family (4, 6; 0: none).
    rule: u32,
    family: u32,
}

#[repr(C)]
struct Rare {
    /// A bit per condition with occurrences not written yet.
    pending: u64,
    /// When the earliest of them is due.
    due_ns: u64,
    conditions: [Pending; CONDITIONS],
}

/// Per CPU: what [`flush`] has not written yet. Not pinned: a restarted daemon's program
/// starts with nothing pending and writes to the ring of its own load (see
/// `ratelimit-user/src/kernel/log.rs`).
#[map(name = "RL_RARE")]
static RARE: PerCpuArray<Rare> = PerCpuArray::with_max_entries(1, 0);

/// The family of a state or ban key's address, as [`note`] takes it.
#[inline(always)]
pub fn family_of(addr: &[u8; 16]) -> u64 {
    (if (IpKey { addr: *addr }).is_v4() {
        FAMILY_V4
    } else {
        FAMILY_V6
    }) as u64
}

/// Count one occurrence of `condition` (for `rule`, of address `family`: 4, 6, 0 for none)
/// at `now`. A global function: each site pays a call, not the bookkeeping.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_rare_note(condition: u64, rule: u64, family: u64, now: u64) -> u64 {
    if condition >= CONDITIONS as u64 {
        return 0;
    }
    let Some(r) = RARE.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: this CPU's value; an XDP program runs to completion on its CPU.
    unsafe {
        let c = &raw mut (*r).conditions[condition as usize];
        if (*c).count == 0 {
            (*c).first_ns = now;
            let due = match (*c).last_line_ns {
                0 => 0,
                last => last + LINE_INTERVAL_NS,
            };
            if (*r).pending == 0 || due < (*r).due_ns {
                (*r).due_ns = due;
            }
            (*r).pending |= 1 << condition;
        }
        (*c).count += 1;
        (*c).rule = rule as u32;
        (*c).family = family as u32;
    }
    0
}

/// [`rl_rare_note`], for call sites.
#[inline(always)]
pub fn note(condition: u64, rule: u32, family: u64, now: u64) {
    rl_rare_note(condition, rule as u64, family, now);
}

/// After the verdict: write the lines that are due. One per-CPU load when none is.
#[inline(always)]
pub fn flush(now: u64) {
    let Some(r) = RARE.get_ptr(0) else {
        return;
    };
    // SAFETY: this CPU's value.
    let (pending, due) = unsafe { ((*r).pending, (*r).due_ns) };
    if pending != 0 && now >= due {
        rl_rare_log(now);
    }
}

/// Write a line for every condition that is due, and set when the next one is. Each
/// condition is a call of the global function [`rl_rare_line`], verified once: inlined, this
/// loop's outcomes (written, not due, none) would multiply the paths through the lines after.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_rare_log(now: u64) -> u64 {
    let mut pending = 0u64;
    let mut due = u64::MAX;
    for condition in 0..CONDITIONS as u64 {
        let d = rl_rare_line(condition, now);
        if d != 0 {
            pending |= 1 << condition;
            due = due.min(d);
        }
    }
    let Some(r) = RARE.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: this CPU's value.
    unsafe {
        (*r).pending = pending;
        (*r).due_ns = due;
    }
    0
}

/// Write `condition`'s line if it has occurrences and its second is up. Returns 0 when
/// nothing of it is left pending, else when its next line is due.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_rare_line(condition: u64, now: u64) -> u64 {
    if condition >= CONDITIONS as u64 {
        return 0;
    }
    let Some(r) = RARE.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: this CPU's value.
    let c = unsafe { &mut (*r).conditions[condition as usize] };
    if c.count == 0 {
        return 0;
    }
    if c.last_line_ns != 0 && now < c.last_line_ns + LINE_INTERVAL_NS {
        return c.last_line_ns + LINE_INTERVAL_NS;
    }
    let (n, ms, rule, family) = (
        c.count,
        now.saturating_sub(c.first_ns) / 1_000_000,
        c.rule,
        c.family,
    );
    c.count = 0;
    c.last_line_ns = now;
    // SAFETY: a helper with no arguments and no preconditions.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    // One literal format string per condition (aya-log takes only literals).
    match condition {
        BAN_HELD => warn!(
            &(),
            "rule ban table full: {} bans held in client state in the last {} ms (last: rule {}, IPv{}; CPU {})",
            n,
            ms,
            rule,
            family,
            cpu
        ),
        BAN_INSERT_FAILED => warn!(
            &(),
            "ban insert failed: {} bans not recorded, clients throttled instead, in the last {} ms (last: rule {}, IPv{}; CPU {})",
            n,
            ms,
            rule,
            family,
            cpu
        ),
        STATE_NOT_PLACED => warn!(
            &(),
            "per-source state not placed: {} new sources limited in aggregate in the last {} ms (last: rule {}, IPv{}; CPU {})",
            n,
            ms,
            rule,
            family,
            cpu
        ),
        SHARED_REFUSED => warn!(
            &(),
            "shared-key state map refused a key: {} packets passed unlimited in the last {} ms (last: rule {}; CPU {})",
            n,
            ms,
            rule,
            cpu
        ),
        _ => warn!(
            &(),
            "events ring full: {} events lost in the last {} ms (last: rule {}; CPU {}); is the daemon reading them?",
            n,
            ms,
            rule,
            cpu
        ),
    }
    0
}
