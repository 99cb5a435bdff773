//! The known-sources filter (see `ratelimit_common::maps::KNOWN_ENABLED` for the layout and
//! the daemon's rebuild). A clear bit in the active half proves a per-source key has no
//! state, so its per-client lookup is skipped; a set bit only says "look it up".

use aya_ebpf::{bindings::BPF_F_MMAPABLE, macros::map, maps::Array};
use ratelimit_common::{
    caps::DEFAULT_MAX_SOURCES,
    maps::{
        KNOWN_ENABLED, KNOWN_HALF, KNOWN_LOG2_SHIFT, KNOWN_MAX_LOG2, KNOWN_MIN_LOG2, known_bit,
        known_map_entries,
    },
};

use crate::atomic;

/// Sized at load for `tracking.max_sources` (`known_map_entries`). Mmap-able, so the daemon
/// rebuilds a half with plain stores instead of a system call per word.
#[map(name = "RL_KNOWN")]
static KNOWN: Array<u64> = Array::pinned(known_map_entries(DEFAULT_MAX_SOURCES), BPF_F_MMAPABLE);

/// log2(bits per half) from the control word, or 0 if it holds none the program can use.
#[inline(always)]
fn log2_of(ctl: u64) -> u64 {
    let log2 = (ctl >> KNOWN_LOG2_SHIFT) & 0xff;
    if (KNOWN_MIN_LOG2..=KNOWN_MAX_LOG2).contains(&log2) {
        log2
    } else {
        0
    }
}

#[inline(always)]
fn control() -> u64 {
    match KNOWN.get_ptr(0) {
        // SAFETY: a live array value; the daemon writes it with one 8-byte store.
        Some(p) => unsafe { atomic::load(p) },
        None => 0,
    }
}

/// False only if the `KEY_IP` key whose hash (`known_hash`) is `hash` certainly has no
/// per-client state.
#[inline(always)]
pub fn may_be_tracked(hash: u64) -> bool {
    let ctl = control();
    let log2 = log2_of(ctl);
    if ctl & KNOWN_ENABLED == 0 || log2 == 0 {
        return true;
    }
    let (word, bit) = known_bit(hash, log2);
    let half = if ctl & KNOWN_HALF != 0 {
        1u64 << (log2 - KNOWN_MIN_LOG2)
    } else {
        0
    };
    match KNOWN.get_ptr(1 + (half + word) as u32) {
        // SAFETY: a live array value.
        Some(p) => unsafe { (atomic::load(p) >> bit) & 1 != 0 },
        None => true,
    }
}

/// Before the state of the key whose hash is `hash` is inserted: set its bit in both halves
/// (the one being rebuilt too).
#[inline(always)]
pub fn note(hash: u64) {
    let log2 = log2_of(control());
    if log2 == 0 {
        return;
    }
    let (word, bit) = known_bit(hash, log2);
    let words = 1u64 << (log2 - KNOWN_MIN_LOG2);
    for half in [0, words] {
        if let Some(p) = KNOWN.get_ptr_mut(1 + (half + word) as u32) {
            // SAFETY: a live array value, updated atomically.
            unsafe { atomic::fetch_or(p, 1 << bit) };
        }
    }
}
