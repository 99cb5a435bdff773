//! The per-source store (`RL_CLIENTS`): the state of every `KEY_IP` client, in an array of
//! sets of `STORE_WAYS` slots (see `ratelimit_common::maps::StoreSet`). A key may live in
//! either of two sets chosen by its hash; a lookup reads a set's line of tags, then the
//! address of the slot whose tag matches: no hash-table element header, bucket array or
//! chain. A new key takes a free slot of the set with more of them; when both are full, the
//! slot of the state idle the longest (the oldest `last_ns`) in the two sets that is not
//! protected: their least recently used, counted in `STATE_EVICTED`.
//!
//! Where a key lives is keyed per load (`known_hash` under `RL_HASH_KEY`), so no one outside
//! can compute sources that share a client's sets. Eviction can still be forced by chance
//! (a flood of new sources lands in every set sooner or later), and it must not reset a
//! client that is being limited: a state is protected while it is in a throttle episode
//! (`last_exceed_ns != 0`) or its ban meter holds a count (`seen_cur` or `seen_prev`), and
//! its last packet is less than its rule's `protect_ms` ago. That bound is what the state
//! can still remember (`state_memory_ns`: two intervals for a sliding window, the burst for
//! a token bucket, two ban intervals for the ban meter, the longest over the rule and its
//! overrides): a state idle longer is worth no more than a fresh one, so evicting it resets
//! nothing, and a spoofed source that was throttled once and never returns holds its slot
//! no longer than that. A new source whose 16 candidates are all protected gets no state
//! (`STATE_PROTECTED`): it is limited in its rule's overflow state, as one the admission
//! budget refused.
//!
//! Concurrency, without locks:
//! * A CPU claims a slot by compare-and-swap of its tag (the old tag, or 0 for an empty slot)
//!   to the busy tag of the new key, writes the address and a zeroed state, and publishes the
//!   key's tag by an atomic swap (a full barrier). A lookup matches only a published tag and
//!   the full address, so it never sees a half-written slot as a client.
//! * Two CPUs inserting the same new source at once: both choose the same slot from the same
//!   view, and the one whose claim fails (or that finds the slot busy with the key's tag)
//!   waits a bounded number of reads for the other to publish, then uses that slot. Should
//!   their views differ (a third CPU filled a slot in between, so they choose different
//!   slots), each looks at the two sets again after its claim, and one that sees the other's
//!   claim gives its slot back: the claims are atomic and each look follows its own claim,
//!   so at least the later of the two sees the other, and a key is never held twice. A packet
//!   whose CPU gave way or waited in vain is limited in its rule's overflow state
//!   (`STATE_INSERT_FAILED`).
//! * A CPU that found a state before it was evicted may add one packet to the slot's next
//!   state (as with the kernel's LRU hash, which reuses an element without a grace period):
//!   eviction takes the state idle longest in 16 slots, so this needs a packet of a source
//!   idle longer than the 15 others at the moment a new source takes its slot. Likewise a
//!   state whose client is refused (and so becomes protected) between an insert's scan and
//!   its claim may still be evicted: the claim compares the tag, not the state.

use aya_ebpf::{bindings::BPF_F_MMAPABLE, macros::map, maps::Array};
use ratelimit_common::{
    caps::DEFAULT_MAX_SOURCES,
    maps::BAN_HELD_MARK,
    maps::{
        ClientKey, ClientState, HashKey, SLOT_BUSY, STORE_WAYS, StoreSet, known_hash, slot_tag,
        store_sets, store_sets_of,
    },
    stats::global,
};

use crate::{atomic, policy, stats};

/// Sized at load for `tracking.max_sources` (`store_sets`). Mmap-able, so the daemon can
/// retire a state with an atomic compare-and-swap of its tag.
#[map(name = "RL_CLIENTS")]
static CLIENTS: Array<StoreSet> = Array::pinned(store_sets(DEFAULT_MAX_SOURCES), BPF_F_MMAPABLE);

/// `[0]`: the key of the placement hash, drawn by the daemon when it creates the maps and
/// never changed while they are pinned (see `HashKey`). Zero until then, when the store has
/// no sets (`GlobalConfig::store_sets` is written after the key) and holds no state.
#[map(name = "RL_HASH_KEY")]
static HASH_KEY: Array<HashKey> = Array::pinned(1, 0);

/// No slot. A slot is named by `set * STORE_WAYS + way`.
pub const NONE: u64 = u64::MAX;

/// No slot for a new key: every state in its two sets is protected from eviction.
pub const PROTECTED: u64 = u64::MAX - 1;

/// The keyed hash of per-source `key` (`known_hash` under `RL_HASH_KEY`). Inline: seven
/// multiplies and no branch cost less than a call of a global function would.
#[inline(always)]
pub fn hash(key: &ClientKey) -> u64 {
    // Index 0 of a one-entry array: always there.
    let Some(k) = HASH_KEY.get(0) else {
        return 0;
    };
    known_hash(k, key.rule, key.prefix_len, &key.addr)
}

/// Where per-source `key` lives in a store of `sets` sets: its keyed hash (for the
/// known-sources filter), its tag and its two sets.
#[inline(always)]
pub fn place(key: &ClientKey, sets: u32) -> (u64, u32, (u32, u32)) {
    let hash = hash(key);
    (
        hash,
        slot_tag(key.rule, key.prefix_len, hash),
        store_sets_of(hash, sets),
    )
}

const WAYS: u32 = STORE_WAYS as u32;

/// Whether slot `w` of set `s` holds the address `addr` (two 8-byte loads each).
#[inline(always)]
fn same_addr(s: *const StoreSet, w: usize, addr: &[u8; 16]) -> bool {
    let a = addr as *const [u8; 16] as *const u64;
    // SAFETY: `s` is a live map value, `w` a way; both addresses are 8-aligned 16-byte arrays.
    unsafe {
        let b = &raw const (*s).slots[w].addr as *const u64;
        core::ptr::read_volatile(b) == core::ptr::read_unaligned(a)
            && core::ptr::read_volatile(b.add(1)) == core::ptr::read_unaligned(a.add(1))
    }
}

#[inline(always)]
fn tag_of(s: *const StoreSet, w: usize) -> u32 {
    // SAFETY: a live map value, `w` a way.
    unsafe { atomic::load32(&raw const (*s).tags[w]) }
}

/// The slot of `key` (whose tag is `tag`) in `set`, or `NONE`.
#[inline(always)]
fn find_in(set: u32, key: &ClientKey, tag: u32) -> u64 {
    let Some(s) = CLIENTS.get_ptr(set) else {
        return NONE;
    };
    for w in 0..STORE_WAYS {
        if tag_of(s, w) == tag && same_addr(s, w, &key.addr) {
            return set as u64 * WAYS as u64 + w as u64;
        }
    }
    NONE
}

/// The slot of `key` (whose tag is `tag`) in either of its sets (`sets`: the first in the low
/// 32 bits, the second in the high), or `NONE`. (A global BPF function: verified once, not
/// at each caller.)
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_store_find(key: *const ClientKey, tag: u64, sets: u64) -> u64 {
    if key.is_null() {
        return NONE;
    }
    // SAFETY: non-null pointer to the caller's key.
    let key = unsafe { &*key };
    let tag = tag as u32;
    let (a, b) = (sets as u32, (sets >> 32) as u32);
    let i = find_in(a, key, tag);
    if i != NONE || a == b {
        return i;
    }
    find_in(b, key, tag)
}

/// Both sets in one word, as [`rl_store_find`] and [`rl_store_insert`] take them.
#[inline(always)]
pub fn pack(sets: (u32, u32)) -> u64 {
    sets.0 as u64 | (sets.1 as u64) << 32
}

/// The state of `key` (whose tag is `tag`), in either of its sets.
#[inline(always)]
pub fn lookup(key: &ClientKey, tag: u32, sets: (u32, u32)) -> Option<*mut ClientState> {
    state(rl_store_find(key, tag as u64, pack(sets)))
}

/// The state in slot `i` (as [`rl_store_insert`] names it).
#[inline(always)]
pub fn state(i: u64) -> Option<*mut ClientState> {
    if i == NONE {
        return None;
    }
    let s = CLIENTS.get_ptr_mut((i / WAYS as u64) as u32)?;
    let w = (i % WAYS as u64) as usize;
    if w >= STORE_WAYS {
        return None;
    }
    // SAFETY: a field of a live map value, `w` a way.
    Some(unsafe { &raw mut (*s).slots[w].state })
}

/// What [`rl_store_scan`] found in a set; in the caller's per-CPU scratch record, so the
/// verifier does not carry each way's outcome into the next way as a state of its own.
#[repr(C)]
pub struct Scan {
    /// The slot holding the key, or `NONE`.
    pub found: u64,
    /// A slot of the set being written for the key's tag (most likely this key, by another
    /// CPU), or `NONE`.
    pub busy: u64,
    /// Free slots in the set, and the first of them (`NONE` if none).
    pub free: u64,
    pub first_free: u64,
    /// The ready slot idle longest so far (over the sets scanned into this record) and not
    /// protected, its last-seen time and its tag.
    pub oldest_slot: u64,
    pub oldest_ns: u64,
    pub oldest_tag: u64,
    /// The packet's time, set by [`insert`].
    pub now: u64,
    /// The first set's `free` and `first_free`, kept while the second is scanned.
    pub free_a: u64,
    pub first_free_a: u64,
}

/// Whether the ready state `st` of a key of rule `rule` may not be evicted at `now` (see the
/// module comment).
#[inline(always)]
fn protected(st: *const ClientState, rule: u32, last: u64, now: u64) -> bool {
    // SAFETY: fields of a live map value.
    let limited = unsafe {
        core::ptr::read_volatile(&raw const (*st).last_exceed_ns) != 0
            || core::ptr::read_volatile(&raw const (*st).seen_cur) != 0
            || core::ptr::read_volatile(&raw const (*st).seen_prev) != 0
    };
    if !limited {
        return false;
    }
    // A ban held in the state (its table was full) keeps it until the ban ends, however long
    // the client stays away: evicting it would lift the ban.
    // SAFETY: fields of a live map value.
    unsafe {
        if core::ptr::read_volatile(&raw const (*st).ban_stamp) == BAN_HELD_MARK {
            return now < core::ptr::read_volatile(&raw const (*st).seen_prev);
        }
    }
    match policy::rule(rule) {
        Some(r) => now.saturating_sub(last) < r.protect_ms as u64 * 1_000_000,
        None => false,
    }
}

#[inline(always)]
fn put(p: *mut u64, v: u64) {
    // SAFETY: a field of the caller's scratch record.
    unsafe { core::ptr::write_volatile(p, v) }
}

#[inline(always)]
fn get(p: *const u64) -> u64 {
    // SAFETY: a field of the caller's scratch record.
    unsafe { core::ptr::read_volatile(p) }
}

/// Scan `set` for `key` (tag `tag`) into `sc` (its `oldest_*` carried over from an earlier
/// set). A global BPF function, verified once.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_store_scan(set: u64, key: *const ClientKey, tag: u64, sc: *mut Scan) -> u64 {
    if key.is_null() || sc.is_null() || set > u32::MAX as u64 {
        return 0;
    }
    // SAFETY: non-null pointers to the caller's key and scratch record.
    let (key, sc) = unsafe { (&*key, &mut *sc) };
    let tag = tag as u32;
    put(&raw mut sc.found, NONE);
    put(&raw mut sc.busy, NONE);
    put(&raw mut sc.free, 0);
    put(&raw mut sc.first_free, NONE);
    let Some(s) = CLIENTS.get_ptr(set as u32) else {
        return 0;
    };
    let busy = tag | SLOT_BUSY;
    for w in 0..STORE_WAYS {
        let t = tag_of(s, w);
        let i = set * WAYS as u64 + w as u64;
        if t == tag && same_addr(s, w, &key.addr) {
            put(&raw mut sc.found, i);
            return 1;
        }
        if t == busy {
            put(&raw mut sc.busy, i);
            return 1;
        }
        if t == 0 {
            put(&raw mut sc.free, get(&raw const sc.free) + 1);
            if get(&raw const sc.first_free) == NONE {
                put(&raw mut sc.first_free, i);
            }
        } else if t & SLOT_BUSY == 0 {
            // SAFETY: a field of a live map value.
            let st = unsafe { &raw const (*s).slots[w].state };
            // SAFETY: as above.
            let last = unsafe { core::ptr::read_volatile(&raw const (*st).last_ns) };
            if last < get(&raw const sc.oldest_ns)
                && !protected(st, (t >> 2) & 0xf, last, get(&raw const sc.now))
            {
                put(&raw mut sc.oldest_ns, last);
                put(&raw mut sc.oldest_slot, i);
                put(&raw mut sc.oldest_tag, t as u64);
            }
        }
    }
    1
}

/// Slot `i` is being written for `key`'s tag by another CPU: wait (a bounded number of
/// reads, a fraction of a microsecond) for it to publish `key` there, and return `i`; `NONE`
/// if it does not (it gave the slot back, or is slow), and this packet is limited in its
/// rule's overflow state. A global BPF function, verified once.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_store_await(i: u64, key: *const ClientKey, tag: u64) -> u64 {
    if key.is_null() || i == NONE {
        return NONE;
    }
    // SAFETY: non-null pointer to the caller's key.
    let key = unsafe { &*key };
    let tag = tag as u32;
    let Some(s) = CLIENTS.get_ptr((i / WAYS as u64) as u32) else {
        return NONE;
    };
    let w = (i % WAYS as u64) as usize;
    if w >= STORE_WAYS {
        return NONE;
    }
    for _ in 0..1024 {
        let t = tag_of(s, w);
        if t == tag {
            return if same_addr(s, w, &key.addr) { i } else { NONE };
        }
        if t != tag | SLOT_BUSY {
            return NONE;
        }
    }
    NONE
}

/// Whether another slot of `set` than `mine` holds `key` (tag `tag`) or is being written for
/// its tag: the slot, or `NONE` if none. A global BPF function, verified once.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_store_rival(set: u64, key: *const ClientKey, tag: u64, mine: u64) -> u64 {
    if key.is_null() || set > u32::MAX as u64 {
        return NONE;
    }
    // SAFETY: non-null pointer to the caller's key.
    let key = unsafe { &*key };
    let tag = tag as u32;
    let Some(s) = CLIENTS.get_ptr(set as u32) else {
        return NONE;
    };
    for w in 0..STORE_WAYS {
        let i = set * WAYS as u64 + w as u64;
        let t = tag_of(s, w);
        if i != mine && (t == tag | SLOT_BUSY || (t == tag && same_addr(s, w, &key.addr))) {
            return i;
        }
    }
    NONE
}

/// Give `key` (tag `tag`) a slot in one of its sets (`sets` as for [`rl_store_find`]) at
/// time `now` (the clock the rules write `last_ns` with): the slot already holding it
/// (another CPU inserted it since the caller's lookup), else an empty slot of the set with
/// more of them, else the slot of the state idle longest in the two sets that is not
/// protected (see the module comment); `PROTECTED` if every state there is. `NONE` if
/// another CPU is inserting the same key, or won a race for the slot. Counts
/// `STATE_CREATED`, and `STATE_EVICTED` when the slot held another client. `sc` is scratch
/// space.
///
/// The two scans run here, in the caller's frame, and the claim in [`rl_store_insert`]: a
/// scan called from the claim would be a fourth frame under the XDP entry and the rule
/// evaluation, past the 512-byte stack.
#[inline(always)]
pub fn insert(
    key: &ClientKey,
    tag: u32,
    sets: (u32, u32),
    slot: u32,
    now: u64,
    sc: *mut Scan,
) -> u64 {
    if sc.is_null() {
        return NONE;
    }
    let (a, b) = sets;
    let tag = tag as u64;
    // SAFETY: non-null pointer to the caller's scratch record.
    unsafe {
        put(&raw mut (*sc).now, now);
        put(&raw mut (*sc).oldest_slot, NONE);
        put(&raw mut (*sc).oldest_ns, u64::MAX);
        put(&raw mut (*sc).oldest_tag, 0);
        put(&raw mut (*sc).free_a, 0);
        put(&raw mut (*sc).first_free_a, NONE);
    }
    for (k, set) in [a, b].into_iter().enumerate() {
        if k == 1 && b == a {
            // One set: nothing free in a second one.
            // SAFETY: the caller's scratch record.
            unsafe { put(&raw mut (*sc).free, 0) };
            break;
        }
        if rl_store_scan(set as u64, key, tag, sc) == 0 {
            return NONE;
        }
        // SAFETY: the caller's scratch record.
        unsafe {
            let found = get(&raw const (*sc).found);
            if found != NONE {
                return found;
            }
            let busy = get(&raw const (*sc).busy);
            if busy != NONE {
                return rl_store_await(busy, key, tag);
            }
            if k == 0 {
                put(&raw mut (*sc).free_a, get(&raw const (*sc).free));
                put(
                    &raw mut (*sc).first_free_a,
                    get(&raw const (*sc).first_free),
                );
            }
        }
    }
    rl_store_insert(key, tag, pack(sets), slot as u64, sc)
}

/// The claim of [`insert`], after its scans of both sets into `sc`: take the victim they
/// chose, publish `key` there, and check for a rival claim. (A global BPF function: its
/// branches are verified once.)
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_store_insert(
    key: *const ClientKey,
    tag: u64,
    sets: u64,
    slot: u64,
    sc: *mut Scan,
) -> u64 {
    if key.is_null() || sc.is_null() {
        return NONE;
    }
    let (a, b) = (sets & 0xffff_ffff, sets >> 32);
    // SAFETY: the caller's scratch record.
    let (victim, victim_tag): (u64, u64) = unsafe {
        let (free_a, free_b) = (get(&raw const (*sc).free_a), get(&raw const (*sc).free));
        if free_a != 0 && free_a >= free_b {
            (get(&raw const (*sc).first_free_a), 0)
        } else if free_b != 0 {
            (get(&raw const (*sc).first_free), 0)
        } else {
            (
                get(&raw const (*sc).oldest_slot),
                get(&raw const (*sc).oldest_tag),
            )
        }
    };
    if victim == NONE {
        // Both sets full (a free slot would have been chosen), and every state in them
        // protected (or, rarely, being written by another CPU).
        stats::add(slot as u32, global::STATE_PROTECTED, 0);
        return PROTECTED;
    }
    let Some(s) = CLIENTS.get_ptr_mut((victim / WAYS as u64) as u32) else {
        return NONE;
    };
    let vw = (victim % WAYS as u64) as usize;
    if vw >= STORE_WAYS {
        return NONE;
    }
    // SAFETY: non-null key; a live map value, which the claim makes this CPU's alone to
    // write until it publishes.
    unsafe {
        let key = &*key;
        let vtag = &raw mut (*s).tags[vw];
        let tag32 = tag as u32;
        if !atomic::cas32(vtag, victim_tag as u32, tag32 | SLOT_BUSY) {
            // Another CPU took the slot first: most likely for this key.
            return rl_store_await(victim, key, tag);
        }
        let src = &key.addr as *const [u8; 16] as *const u64;
        let dst = &raw mut (*s).slots[vw].addr as *mut u64;
        core::ptr::write_volatile(dst, core::ptr::read_unaligned(src));
        core::ptr::write_volatile(dst.add(1), core::ptr::read_unaligned(src.add(1)));
        let st = &raw mut (*s).slots[vw].state;
        atomic::store(&raw mut (*st).stamp, 0);
        atomic::store(&raw mut (*st).cur, 0);
        atomic::store(&raw mut (*st).prev, 0);
        atomic::store(&raw mut (*st).packets, 0);
        atomic::store(&raw mut (*st).bytes, 0);
        atomic::store(&raw mut (*st).last_ns, 0);
        atomic::store(&raw mut (*st).drops, 0);
        atomic::store(&raw mut (*st).last_exceed_ns, 0);
        atomic::store(&raw mut (*st).ban_stamp, 0);
        atomic::store(&raw mut (*st).seen_cur, 0);
        atomic::store(&raw mut (*st).seen_prev, 0);
        // Another CPU may have claimed another slot for the same key since the scan.
        let mut rival = rl_store_rival(a, key, tag, victim);
        if rival == NONE && b != a {
            rival = rl_store_rival(b, key, tag, victim);
        }
        if rival != NONE {
            atomic::store32(vtag, 0);
            // Published already: use it (busy: give way, this packet goes to the overflow).
            return match state(rival) {
                Some(_) if rl_store_find(key, tag, sets) == rival => rival,
                _ => NONE,
            };
        }
        atomic::swap32(vtag, tag32);
    }
    stats::add(slot as u32, global::STATE_CREATED, 0);
    if victim_tag != 0 {
        stats::add(slot as u32, global::STATE_EVICTED, 0);
    }
    victim
}
