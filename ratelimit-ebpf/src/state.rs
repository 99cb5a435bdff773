//! Per-client state: the maps that hold the states not kept in the per-source store
//! (`store.rs`): the shared keys' states and each rule's overflow state, how a state is
//! found (without creating one: [`client_state`]), and the client keys. Which state a packet
//! is counted in, creating one if the admission budget allows, is `admission.rs`; this module
//! depends on neither it nor the fast-drop table, which looks states up here.
//!
//! Concurrency: per-client state (`store`, `SHARED`) is one shared entry per client, not
//! per-CPU, so a client whose packets arrive on several CPUs gets its threshold once, not once
//! per CPU. It is updated with atomic instructions only (`meters.rs`).

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, BPF_NOEXIST},
    macros::map,
    maps::{Array, HashMap},
};
use ratelimit_common::{
    caps::{MAX_KEYED_STATES, MAX_RULES, MAX_SHARED_STATES},
    maps::*,
    stats::global,
};

use crate::{rare, scratch::Env, stats, store};

/// `-EEXIST` from a map update with `BPF_NOEXIST`.
pub const EEXIST: i32 = -17;

/// The states of shared keys (`KEY_ALL`: one per rule; `KEY_REGION`: one per rule and
/// region), with their bans. Per-source states live in the per-source store (`store.rs`),
/// bounded by `tracking.max_sources`; which sources get one at all is decided by the
/// admission budget (`admission.rs`), so a random-source flood churns only its own entries.
/// Shared (not per-CPU): see the module comment. Not LRU: churn must not evict a shared key's
/// ban.
#[map(name = "RL_SHARED")]
static SHARED: HashMap<ClientKey, SharedState> = HashMap::pinned(MAX_SHARED_STATES, 0);

/// The states of `KEY_TUPLE` keys (destination, ports, protocol), each with its ban, as in
/// `SHARED`: a map of their own, so that however many of them a flood makes (a source port is
/// the sender's choice), the `key = "all"` and region states always find room. Allocated as
/// used (`BPF_F_NO_PREALLOC`): a host whose rules have no such key pays nothing. A key that
/// finds the map full is counted in the rule's overflow state.
#[map(name = "RL_KEYED")]
static KEYED: HashMap<ClientKey, SharedState> =
    HashMap::pinned(MAX_KEYED_STATES, BPF_F_NO_PREALLOC);

/// What the other hosts of the fleet counted for the shared keys of global rules (see
/// [`FleetAdd`]): written by the daemon, read here. Empty without a global shared-key rule.
#[map(name = "RL_FLEET_ADD")]
static FLEET_ADD: HashMap<ClientKey, FleetAdd> = HashMap::pinned(MAX_SHARED_STATES, 0);

/// What the other hosts counted for the packet's shared key (the scratch record's, see
/// [`scratch_key`]) of a global rule, if the daemon wrote it.
#[inline(always)]
pub fn fleet_add() -> Option<*const FleetAdd> {
    FLEET_ADD.get_ptr(scratch_key()?)
}

/// The packet's key in this CPU's scratch record (`RuleLoop::key`), reached through the map
/// rather than the pointer a global BPF function was given: as a map value, 6.1's verifier
/// takes it as a map key, so no copy of it on the stack (see [`on_stack`]), whose room the
/// rule evaluation's call chain cannot spare.
#[inline(always)]
fn scratch_key() -> Option<&'static ClientKey> {
    let p = crate::scratch::SCRATCH.get_ptr(0)?;
    // SAFETY: this CPU's scratch record, a live map value.
    Some(unsafe { &(*p).key })
}

/// Per rule: the one aggregate state shared by the sources that get no state of their own
/// (refused by the admission budget, or refused by a full map). An array, not entries of
/// `CLIENTS`: in a random-source flood nearly every packet lands here, and an indexed load
/// costs a fraction of a second hash lookup; nor can churn evict it.
#[map(name = "RL_OVERFLOW")]
static OVERFLOW: Array<ClientState> = Array::pinned(MAX_RULES, 0);

/// Initial state of a new shared key. A static, so the map update reads it from .rodata
/// instead of a stack copy the compiler would zero with a byte-wise memset loop.
static ZERO_SHARED: SharedState = SharedState {
    state: ClientState {
        stamp: 0,
        cur: 0,
        prev: 0,
        ban_stamp: 0,
        seen_cur: 0,
        seen_prev: 0,
        last_ns: 0,
        last_exceed_ns: 0,
        packets: 0,
        bytes: 0,
        drops: 0,
    },
    banned_until_ns: 0,
};

/// What `admission::state_for` found.
pub enum StateFor {
    /// The client's own state (found or created).
    State(*mut ClientState),
    /// A shared key's state (found or created).
    Shared(*mut SharedState),
    /// A new source the admission budget refused: the rule's overflow state.
    Refused(*mut ClientState),
    /// A new source refused in a tick whose overflow state already refused one
    /// (`fast::overflow_closed`): counted, to be dropped.
    Closed,
    /// The map refused even the aggregate state.
    Nothing,
}

/// The map of a key that is not per source: `KEYED` for `KEY_TUPLE`, else `SHARED`.
#[inline(always)]
fn shared_map(kind: u8) -> &'static HashMap<ClientKey, SharedState> {
    if kind == KEY_TUPLE { &KEYED } else { &SHARED }
}

/// The state of the packet's shared key `key` (the scratch record's, read through the map:
/// [`scratch_key`]), created on its first packet. A `KEY_TUPLE` key that finds its map full
/// gets the rule's overflow state (`key` rewritten to say so); another shared key that finds
/// no room passes unlimited ([`StateFor::Nothing`]), counted by the caller.
#[inline(always)]
pub fn shared_state(env: &Env, key: &mut ClientKey) -> StateFor {
    let map = shared_map(key.kind);
    let Some(k) = scratch_key() else {
        return StateFor::Nothing;
    };
    if let Some(p) = map.get_ptr_mut(k) {
        return StateFor::Shared(p);
    }
    #[expect(
        clippy::needless_borrows_for_generic_args,
        reason = "by value would copy the static onto the 512-byte BPF stack"
    )]
    let inserted = map.insert(k, &ZERO_SHARED, BPF_NOEXIST as u64);
    match inserted {
        Ok(()) => stats::add(env.slot, global::STATE_CREATED, 0),
        Err(EEXIST) => {}
        Err(_) if key.kind == KEY_TUPLE => {
            stats::add(env.slot, global::STATE_INSERT_FAILED, env.len);
            return refused(key);
        }
        Err(_) => {
            // Counted by the caller, as every `StateFor::Nothing` is: once.
            rare::note(rare::SHARED_REFUSED, key.rule as u32, 0, env.now);
            return StateFor::Nothing;
        }
    }
    match map.get_ptr_mut(k) {
        Some(p) => StateFor::Shared(p),
        None => StateFor::Nothing,
    }
}

/// A source refused a state of its own: the rule's overflow state.
#[inline(always)]
pub fn refused(key: &mut ClientKey) -> StateFor {
    match overflow_state(key) {
        Some(p) => StateFor::Refused(p),
        None => StateFor::Nothing,
    }
}

/// The rule's overflow state, for the fast-drop table's flush.
#[inline(always)]
pub fn overflow_of(rule: u32) -> Option<*mut ClientState> {
    OVERFLOW.get_ptr_mut(rule)
}

/// The rule's aggregate overflow state (`key.rule`), with `key` rewritten to say so.
#[inline(always)]
fn overflow_state(key: &mut ClientKey) -> Option<*mut ClientState> {
    overflow(key);
    OVERFLOW.get_ptr_mut(key.rule as u32)
}

#[inline(always)]
pub fn overflow(key: &mut ClientKey) {
    key.kind = KEY_OVERFLOW;
    key.proto = 0;
    key.fields = 0;
    key.prefix_len = 0;
    zero_addr(&mut key.addr);
    zero_addr(&mut key.src);
}

/// Builds a key with explicit stores. A struct literal with zeroed fields becomes a call to
/// the byte-wise `memset`, whose loop the verifier walks byte by byte at every call site.
#[inline(always)]
pub fn client_key(rule: u8, kind: u8, prefix_len: u32, addr: [u8; 16]) -> ClientKey {
    let mut k = core::mem::MaybeUninit::<ClientKey>::uninit();
    let p = k.as_mut_ptr();
    // SAFETY: every field (and the padding bytes) is written before `assume_init`.
    unsafe {
        core::ptr::write_volatile(p as *mut u32, u32::from_ne_bytes([rule, kind, 0, 0]));
        core::ptr::write_volatile(&raw mut (*p).prefix_len, prefix_len);
        let a = &raw mut (*p).addr as *mut u32;
        let w = |i: usize| u32::from_ne_bytes([addr[i], addr[i + 1], addr[i + 2], addr[i + 3]]);
        core::ptr::write_volatile(a, w(0));
        core::ptr::write_volatile(a.add(1), w(4));
        core::ptr::write_volatile(a.add(2), w(8));
        core::ptr::write_volatile(a.add(3), w(12));
        zero_addr(&mut (*p).src);
        k.assume_init()
    }
}

/// A copy of `key` on the stack, for a map helper. Inside a global BPF function every pointer
/// argument (and what is derived from it) is untyped memory, which 6.1's verifier does not
/// take as a map key: only the stack, a packet or a map ("R2 type=mem expected=fp, pkt,
/// pkt_meta, map_key, map_value"; 6.12 takes it). Ten word stores: no memcpy, no byte
/// loop.
#[inline(always)]
fn on_stack(key: &ClientKey) -> ClientKey {
    let mut k = client_key(key.rule, key.kind, key.prefix_len, key.addr);
    k.proto = key.proto;
    k.fields = key.fields;
    copy_addr(&mut k.src, &key.src);
    k
}

/// `*to = *from`, as four word loads and stores.
#[inline(always)]
pub fn copy_addr(to: &mut [u8; 16], from: &[u8; 16]) {
    masked_copy(to, from, u32::MAX);
}

/// `*to = *from & mask`, word by word (`mask` all ones or zero).
#[inline(always)]
pub fn masked_copy(to: &mut [u8; 16], from: &[u8; 16], mask: u32) {
    let s = from as *const [u8; 16] as *const u32;
    let d = to as *mut [u8; 16] as *mut u32;
    // SAFETY: 16 bytes each side, as four words (both fields are 4-aligned).
    unsafe {
        for w in 0..4 {
            core::ptr::write_volatile(d.add(w), core::ptr::read_volatile(s.add(w)) & mask);
        }
    }
}

#[inline(always)]
pub fn zero_addr(addr: &mut [u8; 16]) {
    let a = addr as *mut [u8; 16] as *mut u32;
    // SAFETY: 16 bytes, written as four (possibly unaligned-free: the field is 4-aligned) words.
    unsafe {
        core::ptr::write_volatile(a, 0);
        core::ptr::write_volatile(a.add(1), 0);
        core::ptr::write_volatile(a.add(2), 0);
        core::ptr::write_volatile(a.add(3), 0);
    }
}

/// The state of `key`, if it has one (no admission, no insert), in a store of `sets` sets.
#[inline(always)]
pub fn client_state(key: &ClientKey, sets: u32) -> Option<*mut ClientState> {
    if key.kind == KEY_IP {
        let (_, tag, sets) = store::place(key, sets);
        store::lookup(key, tag, sets)
    } else {
        let p = shared_map(key.kind).get_ptr_mut(on_stack(key))?;
        // SAFETY: a field of a live map value.
        Some(unsafe { &raw mut (*p).state })
    }
}
