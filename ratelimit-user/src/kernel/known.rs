//! The known-sources filter (`RL_KNOWN`): the daemon's side. The program sets a key's bit in
//! both halves before it inserts the key's state, and skips the per-client lookup of a key
//! whose bit is clear in the active half (see `ratelimit_common::maps::KNOWN_ENABLED`). Bits
//! of states that were evicted stay set, so the daemon rebuilds the inactive half from the
//! per-client map now and then and makes it the active one:
//!
//! 1. clear the inactive half (the program keeps setting bits in it for new states);
//! 2. wait [`SETTLE`]: an insert whose bit the clear wiped has reached the map by then;
//! 3. walk the map and set the bit of every per-source state in it. A state present for the
//!    whole walk is seen (the walk goes bucket by bucket); one inserted after step 2 set its
//!    own bit;
//! 4. make it the active half. The other half is left as it is — still a superset of the
//!    map, for a program that read the old control word — until the next rebuild clears it.
//!
//! So a clear bit in the active half always proves a source has no state. The filter is off
//! (every new source is looked up) from the daemon's start until its first rebuild.

use std::{
    os::fd::AsFd as _,
    ptr::NonNull,
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use aya::maps::MapData;
use ratelimit_common::maps::{
    ClientKey, HashKey, KNOWN_ENABLED, KNOWN_HALF, KNOWN_LOG2_SHIFT, KNOWN_MAX_LOG2,
    KNOWN_MIN_LOG2, known_bit, known_hash, slot_key,
};
use serde::Serialize;

/// Longer than any program run takes from setting a bit to finishing its insert.
pub const SETTLE: Duration = Duration::from_millis(50);

/// The filter map, mmapped.
pub struct KnownFilter {
    _map: MapData,
    base: NonNull<AtomicU64>,
    len_bytes: usize,
    log2: u64,
    /// The placement hash's key (`RL_HASH_KEY`): the filter indexes by the same hash.
    hash_key: HashKey,
}

// SAFETY: the mapping is shared memory that is only accessed through atomics.
unsafe impl Send for KnownFilter {}
// SAFETY: as above; every access is an atomic operation on the shared mapping.
unsafe impl Sync for KnownFilter {}

/// What a rebuild found.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct Rebuilt {
    /// Per-source states walked.
    pub states: u64,
    /// Bits set in the new active half (states whose hashes collide share one).
    pub bits_set: u64,
    /// Bits in a half.
    pub bits: u64,
    /// Wall time of the rebuild, the settle wait included.
    pub secs: f64,
    /// The active half now (0 or 1).
    pub half: u8,
}

impl KnownFilter {
    /// Map `RL_KNOWN` (an mmap-able array of u64 sized by `known_map_entries`), whose bits
    /// are indexed by the hash under `hash_key`.
    pub fn new(map: MapData, hash_key: HashKey) -> anyhow::Result<Self> {
        let info = map.info().context("reading RL_KNOWN's info")?;
        let entries = info.max_entries() as u64;
        let half = (entries.saturating_sub(1)) / 2;
        if entries < 3 || entries != 1 + 2 * half || !half.is_power_of_two() {
            bail!("RL_KNOWN has {entries} entries, not a control word and two halves");
        }
        let log2 = half.trailing_zeros() as u64 + KNOWN_MIN_LOG2;
        if log2 > KNOWN_MAX_LOG2 {
            bail!("RL_KNOWN is larger than the program can index");
        }
        let len_bytes = super::mmap::mapped_len(entries as usize * 8);
        let p = super::mmap::map_shared(map.fd().as_fd(), len_bytes, "RL_KNOWN")?;
        Ok(Self {
            _map: map,
            base: p.cast::<AtomicU64>(),
            len_bytes,
            log2,
            hash_key,
        })
    }

    fn word(&self, i: u64) -> &AtomicU64 {
        debug_assert!(i < 1 + 2 * self.half_words());
        // SAFETY: `i` is within the map's entries, all inside the mapping, 8-byte aligned.
        unsafe { &*self.base.as_ptr().add(i as usize) }
    }

    fn half_words(&self) -> u64 {
        1 << (self.log2 - KNOWN_MIN_LOG2)
    }

    pub fn control(&self) -> u64 {
        self.word(0).load(Ordering::SeqCst)
    }

    pub fn enabled(&self) -> bool {
        self.control() & KNOWN_ENABLED != 0
    }

    /// Turn the filter off (every new source is looked up), with the size the program needs
    /// to set bits. Done at every start: a pinned filter may have missed inserts by a
    /// program that ran without it.
    pub fn disable(&self) {
        self.word(0)
            .store(self.log2 << KNOWN_LOG2_SHIFT, Ordering::SeqCst);
    }

    /// Whether `key`'s bit is set in the active half (true while the filter is off).
    pub fn may_be_tracked(&self, key: &ClientKey) -> bool {
        let ctl = self.control();
        if ctl & KNOWN_ENABLED == 0 {
            return true;
        }
        let half = if ctl & KNOWN_HALF != 0 {
            self.half_words()
        } else {
            0
        };
        let (w, bit) = known_bit(
            known_hash(&self.hash_key, key.rule, key.prefix_len, &key.addr),
            self.log2,
        );
        self.word(1 + half + w).load(Ordering::Relaxed) >> bit & 1 != 0
    }

    /// Rebuild the inactive half from `clients` and make it the active one (see the module
    /// comment).
    pub fn rebuild(
        &self,
        clients: &crate::kernel::clients::ClientStore,
    ) -> anyhow::Result<Rebuilt> {
        let t = Instant::now();
        let ctl = self.control();
        if (ctl >> KNOWN_LOG2_SHIFT) & 0xff != self.log2 {
            self.disable();
        }
        let ctl = self.control();
        let target = u64::from(ctl & KNOWN_ENABLED != 0 && ctl & KNOWN_HALF == 0);
        let base = 1 + target * self.half_words();
        for i in 0..self.half_words() {
            self.word(base + i).store(0, Ordering::Relaxed);
        }
        std::sync::atomic::fence(Ordering::SeqCst);
        std::thread::sleep(SETTLE);
        let mut states = 0u64;
        clients.walk_slots(&mut |_, tag, s| {
            let k = slot_key(tag, s.addr);
            let (w, bit) = known_bit(clients.hash(&k), self.log2);
            self.word(base + w).fetch_or(1 << bit, Ordering::Relaxed);
            states += 1;
        })?;
        std::sync::atomic::fence(Ordering::SeqCst);
        let half_flag = if target == 1 { KNOWN_HALF } else { 0 };
        self.word(0).store(
            KNOWN_ENABLED | half_flag | (self.log2 << KNOWN_LOG2_SHIFT),
            Ordering::SeqCst,
        );
        let bits_set = (0..self.half_words())
            .map(|i| u64::from(self.word(base + i).load(Ordering::Relaxed).count_ones()))
            .sum();
        Ok(Rebuilt {
            states,
            bits_set,
            bits: 1 << self.log2,
            secs: t.elapsed().as_secs_f64(),
            half: target as u8,
        })
    }
}

impl Drop for KnownFilter {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once.
        unsafe { libc::munmap(self.base.as_ptr() as *mut libc::c_void, self.len_bytes) };
    }
}

/// Bits set in the active half now (a scan of the mapping: 16 MiB for 10M sources, a few
/// ms).
impl KnownFilter {
    pub fn active_bits_set(&self) -> u64 {
        let ctl = self.control();
        let base = 1 + if ctl & KNOWN_HALF != 0 {
            self.half_words()
        } else {
            0
        };
        (0..self.half_words())
            .map(|i| u64::from(self.word(base + i).load(Ordering::Relaxed).count_ones()))
            .sum()
    }
}

/// Whether the active half has gathered enough new bits since its rebuild (`at_rebuild`
/// set then, `now` set now, of `bits`) for stale ones to be worth clearing: bits are only
/// added by new states, and each new state in a full map evicts one whose bit stays. Also
/// once `max_age` has passed (states the daemon itself removed leave bits too).
pub fn needs_rebuild(
    at_rebuild: u64,
    now: u64,
    bits: u64,
    age: Duration,
    max_age: Duration,
) -> bool {
    age >= max_age || now.saturating_sub(at_rebuild) >= (bits / 100).max(1024)
}

/// The daemon's rebuild loop, on a thread of its own (a walk of a large map takes seconds),
/// supervised ([`crate::supervise::spawn_thread`]): the first rebuild at once; then, every
/// `period` (at least 10 times the last rebuild's time), a rebuild if [`needs_rebuild`] says
/// so. A rebuild that fails ends the run, which is retried after a backoff starting at
/// `period`; meanwhile the filter keeps its last active half (still a superset) or stays off.
pub fn spawn_rebuilder(
    tasks: &std::sync::Arc<crate::supervise::Tasks>,
    filter: KnownFilter,
    clients: crate::kernel::clients::ClientStore,
    period: Duration,
    status: std::sync::Arc<std::sync::Mutex<Option<Rebuilt>>>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    const MAX_AGE: Duration = Duration::from_secs(600);
    let mut last: Option<(Rebuilt, Instant)> = None;
    crate::supervise::spawn_thread(tasks, "known_filter", period, move || {
        loop {
            let due = match &last {
                None => true,
                Some((r, at)) => needs_rebuild(
                    r.bits_set,
                    filter.active_bits_set(),
                    r.bits,
                    at.elapsed(),
                    MAX_AGE,
                ),
            };
            let mut wait = period;
            if due {
                let r = filter
                    .rebuild(&clients)
                    .context("rebuilding the known-sources filter")?;
                if last.is_none() {
                    tracing::info!(
                        states = r.states,
                        bits_set = r.bits_set,
                        bits = r.bits,
                        secs = r.secs,
                        "known-sources filter on"
                    );
                } else {
                    tracing::debug!(
                        states = r.states,
                        bits_set = r.bits_set,
                        secs = r.secs,
                        "known-sources filter rebuilt"
                    );
                }
                wait = period.max(Duration::from_secs_f64(r.secs * 10.0));
                *status.lock().unwrap_or_else(|e| e.into_inner()) = Some(r.clone());
                last = Some((r, Instant::now()));
            }
            std::thread::sleep(wait);
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rebuilds_when_new_bits_pile_up_or_it_is_old() {
        let s = Duration::from_secs;
        // 2^23 bits: 1% is 83886.
        let bits = 1 << 23;
        assert!(!needs_rebuild(1000, 1000, bits, s(10), s(600)));
        assert!(!needs_rebuild(1000, 1000 + 83_885, bits, s(10), s(600)));
        assert!(needs_rebuild(1000, 1000 + 83_886, bits, s(10), s(600)));
        assert!(needs_rebuild(1000, 1000, bits, s(600), s(600)));
        // Small filters: at least 1024 new bits.
        assert!(!needs_rebuild(0, 1023, 1 << 15, s(10), s(600)));
        assert!(needs_rebuild(0, 1024, 1 << 15, s(10), s(600)));
    }
}
