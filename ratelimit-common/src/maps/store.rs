//! The per-source store (`RL_CLIENTS`): sets of slots, their tags, and where a key may live.

use super::client::{ClientKey, ClientState};
use super::rule::KEY_IP;

/// Ways per set of the per-source store (`RL_CLIENTS`).
pub const STORE_WAYS: usize = 8;

/// A tag with this bit is in use (so a tag is never 0, the empty slot's).
pub const SLOT_USED: u32 = 1 << 0;
/// A tag with this bit is being written by the CPU that claimed its slot.
pub const SLOT_BUSY: u32 = 1 << 1;

/// One per-source state of the per-source store: the key's (masked) address and the state.
/// The rest of the key is in the set's tag for the slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slot {
    pub addr: [u8; 16],
    pub state: ClientState,
}

/// One set of the per-source store (`RL_CLIENTS`, an array of sets): [`STORE_WAYS`] slots
/// and their tags. 864 bytes, 108 per source, and nothing else per source: no hash-table
/// element header, no bucket array. The eight 4-byte tags start a set, at a multiple of 32
/// bytes from the map's page-aligned values, so they always share one cache line: a lookup
/// reads that line, then only the slot whose tag matches.
///
/// A key may live in either of two sets chosen by its hash ([`store_sets_of`]); a new key
/// goes to the one with more free slots, so the store fills evenly (two choices).
///
/// A tag is 0 for an empty slot; otherwise ([`slot_tag`]) bit 0 is [`SLOT_USED`], bit 1
/// [`SLOT_BUSY`] while a CPU writes the slot, bits 2..6 the rule, bits 6..14 the prefix
/// length (0..=128), and bits 14..32 the top 18 bits of the key's hash (a quick reject; the
/// address is compared in full). A CPU claims a slot by compare-and-swap of its tag to the
/// busy tag, writes the address and a zeroed state, and publishes the tag by an atomic swap;
/// see the program's `store.rs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreSet {
    pub tags: [u32; STORE_WAYS],
    pub slots: [Slot; STORE_WAYS],
}

const _: () = assert!(
    crate::caps::MAX_RULES <= 16,
    "the slot tag holds the rule in 4 bits"
);

/// The tag of a ready slot holding `rule`'s per-source key of prefix `prefix_len` whose hash
/// ([`known_hash`]) is `hash`.
///
/// [`known_hash`]: super::known_hash
#[inline(always)]
pub const fn slot_tag(rule: u8, prefix_len: u32, hash: u64) -> u32 {
    ((hash >> 46) as u32) << 14 | (prefix_len & 0xff) << 6 | (rule as u32 & 0xf) << 2 | SLOT_USED
}

/// The key of a ready slot's tag and address.
pub const fn slot_key(tag: u32, addr: [u8; 16]) -> ClientKey {
    ClientKey {
        rule: ((tag >> 2) & 0xf) as u8,
        kind: KEY_IP,
        proto: 0,
        fields: 0,
        prefix_len: (tag >> 6) & 0xff,
        addr,
        src: [0; 16],
    }
}

/// Whether a tag holds a key (not empty, not being written).
#[inline(always)]
pub const fn slot_ready(tag: u32) -> bool {
    tag & SLOT_USED != 0 && tag & SLOT_BUSY == 0
}

/// The two sets a key whose hash is `hash` may live in, in a store of `sets` sets: the low
/// half of the hash, and of a remix of it, scaled to `sets` (no division; the tag holds the
/// top bits). They may coincide.
#[inline(always)]
pub const fn store_sets_of(hash: u64, sets: u32) -> (u32, u32) {
    let b = (hash ^ (hash >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (
        (((hash & 0xffff_ffff) * sets as u64) >> 32) as u32,
        (((b >> 32) * sets as u64) >> 32) as u32,
    )
}

/// Sets of a store holding `max_sources` states: `max_sources` rounded up to whole sets.
pub const fn store_sets(max_sources: u32) -> u32 {
    let s = max_sources.div_ceil(STORE_WAYS as u32);
    if s == 0 { 1 } else { s }
}
