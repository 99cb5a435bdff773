//! Bans: the four ban tables, the lookup that finds the ban deciding for a source, the
//! in-kernel expiry, and issuing a ban (into a ban table, into a shared key's state, or held
//! in the client's own state when the rules' table is full). See the glossary in `rules.rs`.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    macros::map,
    maps::{Array, LpmTrie, lpm_trie::Key},
};
use ratelimit_common::{
    addr::{FAMILY_V4, FAMILY_V6, IpKey, LpmAddr, lpm_prefix},
    caps::{MAX_BANS, MAX_OPERATOR_BANS, MAX_PASSING_BANS, MAX_REMOTE_BANS},
    event::{EV_BAN, EV_UNBAN},
    limiter,
    maps::*,
    stats::{global, rule as rc},
};

use crate::{
    atomic, events, rare,
    scratch::{Judge, SCRATCH},
    state::{EEXIST, client_key},
    stats::{self, Slot},
};

/// Active bans, in four tables by what they do (`maps::ban_table`): the operator's, rule
/// bans that drop, the fleet's (received from other hosts; they drop), and rule bans that let
/// packets on (preview, `exceed_action = pass`). Their
/// own bounded maps, so per-client churn cannot evict a ban; LPM tries so a ban may cover a
/// prefix. A ban that drops never shares a trie with one that passes, so no passing ban can
/// hide or block a dropping one; the operator's table is theirs alone, so rules filling
/// theirs never stop `ratelimit ban add`; the fleet's bans have a table of their own too, so
/// no number of them can either (one that finds it full goes into the rules' table that
/// drops, `BAN_SPILLED`, whose own overflow is held in state). Expiry is enforced here, in
/// the kernel: a ban ends on time with no daemon running. A rule ban that finds its table full is held in the
/// client's own state (`BAN_HELD_MARK`).
#[map(name = "RL_BANS_OPERATOR")]
static OPERATOR_BANS: LpmTrie<LpmAddr, BanEntry> = LpmTrie::pinned(MAX_OPERATOR_BANS, 0);

/// Rule-issued bans that drop (`BAN_TABLE_RULE`).
#[map(name = "RL_BANS")]
static BANS: LpmTrie<LpmAddr, BanEntry> = LpmTrie::pinned(MAX_BANS, 0);

/// Bans received from the fleet (`BAN_TABLE_REMOTE`); they drop.
#[map(name = "RL_BANS_REMOTE")]
static REMOTE_BANS: LpmTrie<LpmAddr, BanEntry> = LpmTrie::pinned(MAX_REMOTE_BANS, 0);

/// Rule-issued bans that let packets on to the rules (`BAN_TABLE_PASSING`).
#[map(name = "RL_BANS_PASSING")]
static PASSING_BANS: LpmTrie<LpmAddr, BanEntry> = LpmTrie::pinned(MAX_PASSING_BANS, 0);

/// `[table]`: non-zero when that ban table may hold an entry; zero only after the daemon saw
/// it empty. Whoever inserts a ban sets it *after* the insert; the daemon clears it only when
/// the table is empty, and sets it again if a ban arrived meanwhile. While it is zero that
/// table's lookup (an LPM-trie walk) is skipped.
#[map(name = "RL_BANS_PRESENT")]
static BANS_PRESENT: Array<u64> = Array::pinned(BAN_TABLES, 0);

/// `[0]`: bumped after every ban insert, the program's and the daemon's. A fast-drop entry
/// (made for a packet no ban matched) is void once it moved, so a source banned since is
/// dropped and counted as banned at once.
#[map(name = "RL_BAN_EPOCH")]
static BAN_EPOCH: Array<u64> = Array::pinned(1, 0);

/// The current ban epoch.
#[inline(always)]
pub fn ban_epoch() -> u64 {
    match BAN_EPOCH.get_ptr(0) {
        // SAFETY: a live array value.
        Some(p) => unsafe { atomic::load(p) },
        None => 0,
    }
}

/// `-ENOSPC` from an LPM trie update: the trie holds `max_entries` already.
const ENOSPC: i32 = -28;

/// The flags of the active ban that decides for the source whose full-length trie key is
/// `key` (`policy::full`), removing expired ones on the way: the
/// operator's, the rules' and the fleet's bans, which drop, first, so a ban that drops always
/// wins; then the bans that pass (whose flags tell the caller so). Inline in the entry, its key in the
/// entry's scratch record (`SrcTrieKey`; the map helpers take no key passed into a global
/// function on 6.1): as a global function of its own, the call cost the pass path some 20 ns
/// (BENCHMARKS.md, "Data-plane hardening: before and after").
#[inline(always)]
pub fn active_ban(slot: Slot, key: &Key<LpmAddr>, now: u64) -> Option<u32> {
    if table_present(BAN_TABLE_OPERATOR)
        && let Some(flags) = find_ban(&OPERATOR_BANS, BAN_TABLE_OPERATOR, slot, key, now)
    {
        return Some(flags);
    }
    if table_present(BAN_TABLE_RULE)
        && let Some(flags) = find_ban(&BANS, BAN_TABLE_RULE, slot, key, now)
    {
        return Some(flags);
    }
    if table_present(BAN_TABLE_REMOTE)
        && let Some(flags) = find_ban(&REMOTE_BANS, BAN_TABLE_REMOTE, slot, key, now)
    {
        return Some(flags);
    }
    if table_present(BAN_TABLE_PASSING)
        && let Some(flags) = find_ban(&PASSING_BANS, BAN_TABLE_PASSING, slot, key, now)
    {
        return Some(flags);
    }
    None
}

#[inline(always)]
fn table_present(table: u32) -> bool {
    !matches!(BANS_PRESENT.get(table), Some(&0))
}

/// Expired bans a lookup removes before it gives up for this packet (the next packets go on
/// removing). Only bans at nested prefixes of one source, all expired and not yet swept, can
/// need more.
const EXPIRED_PER_LOOKUP: u32 = 4;

/// The longest active ban of one table covering `key`, removing expired ones on the way.
#[inline(always)]
fn find_ban(
    trie: &LpmTrie<LpmAddr, BanEntry>,
    table: u32,
    slot: Slot,
    key: &Key<LpmAddr>,
    now: u64,
) -> Option<u32> {
    for _ in 0..EXPIRED_PER_LOOKUP {
        let entry = trie.get(key)?;
        if limiter::ban_active(entry.expires_ns, now) {
            return Some(entry.flags);
        }
        // Expired: remove exactly the entry that matched, then look again.
        rl_unban(slot as u64, now, entry as *const BanEntry, table as u64);
    }
    None
}

/// Write the trie key (`LpmAddr::of`, `lpm_prefix`) of the prefix of `prefix_len` bits over
/// the 16-byte `addr` at `dst` in place, field by field: built by value (`Key::new`), it is a
/// copy on the stack of the frames that call this, which the 512-byte stack of their call
/// chain has no room for (the verifier refuses it).
///
/// # Safety
/// `dst` is valid for writes of a `Key<LpmAddr>`.
#[inline(always)]
unsafe fn write_trie_key(dst: *mut Key<LpmAddr>, prefix_len: u32, addr: &[u8; 16]) {
    // SAFETY: `IpKey` is `repr(C)` around one `[u8; 16]`: the same layout.
    let v4 = unsafe { &*(addr as *const [u8; 16] as *const IpKey) }.is_v4();
    let p = dst as *mut u8;
    // SAFETY: the caller's contract; `Key<LpmAddr>` is packed: its prefix length at 0, the
    // family at 4, the address at 5..21.
    unsafe {
        core::ptr::write_unaligned(p as *mut u32, lpm_prefix(v4, prefix_len));
        if v4 {
            core::ptr::write(p.add(4), FAMILY_V4);
            core::ptr::write_unaligned(
                p.add(5) as *mut [u8; 4],
                [addr[12], addr[13], addr[14], addr[15]],
            );
            core::ptr::write_unaligned(p.add(9) as *mut u32, 0);
            core::ptr::write_unaligned(p.add(13) as *mut u64, 0);
        } else {
            core::ptr::write(p.add(4), FAMILY_V6);
            core::ptr::write_unaligned(p.add(5) as *mut [u8; 16], *addr);
        }
    }
}

/// Remove an expired ban from its table and report it (a global BPF function: verified once,
/// and its stack is not added to the XDP entry's).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_unban(slot: u64, now: u64, entry: *const BanEntry, table: u64) -> u64 {
    if entry.is_null() {
        return 0;
    }
    // SAFETY: non-null pointer to a live map value.
    let entry = unsafe { &*entry };
    let slot = slot as u32 & (ratelimit_common::caps::MAX_IFACES - 1);
    let ck = client_key(entry.rule as u8, KEY_IP, entry.prefix_len, entry.addr);
    let expires = entry.expires_ns;
    // The trie key in this CPU's scratch record, not on this frame, which the entry's stack
    // and the event's leave little room for (the caller's key is the record's `src_key`).
    let Some(rl) = SCRATCH.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: a field of this CPU's scratch record, used only during this packet.
    let key = unsafe {
        let key = &raw mut (*rl).ban_key;
        write_trie_key(key, entry.prefix_len, &entry.addr);
        &*key
    };
    // By reference: by value would copy the key onto the stack.
    let removed = match table as u32 {
        BAN_TABLE_OPERATOR => OPERATOR_BANS.remove(key).is_ok(),
        BAN_TABLE_RULE => BANS.remove(key).is_ok(),
        BAN_TABLE_REMOTE => REMOTE_BANS.remove(key).is_ok(),
        _ => PASSING_BANS.remove(key).is_ok(),
    };
    if removed {
        stats::add(slot, global::BANS_EXPIRED, 0);
        events::emit(slot, EV_UNBAN, &ck, now, 0, 0, expires);
        return 1;
    }
    0
}

/// [`rl_aggregate_ban`]: no ban in force.
pub const NOT_BANNED: u64 = 0;
/// [`rl_aggregate_ban`]: banned now.
pub const AGGREGATE_BANNED: u64 = 1;

/// Aggregate (key all/region) bans live in the state itself: [`AGGREGATE_BANNED`] if banned
/// now. Clears an expired one and reports the unban.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_aggregate_ban(
    until: *mut u64,
    st: *mut ClientState,
    key: *const ClientKey,
    j: *mut Judge,
) -> u64 {
    if until.is_null() || st.is_null() || key.is_null() || j.is_null() {
        return NOT_BANNED;
    }
    // SAFETY: non-null pointers to a live map value and to the caller's stack.
    unsafe {
        let u = atomic::load(until);
        if u == 0 {
            return NOT_BANNED;
        }
        if (*j).now < u {
            atomic::add(&raw mut (*st).drops, 1);
            return AGGREGATE_BANNED;
        }
        if atomic::cas(until, u, 0) {
            events::emit((*j).slot, EV_UNBAN, &*key, (*j).now, 0, 0, u);
        }
    }
    NOT_BANNED
}

/// [`rl_ban`]: the ban could not be recorded (the client is throttled by its rule instead).
pub const BAN_NOT_RECORDED: u64 = 0;
/// [`rl_ban`]: this call issued the ban.
pub const BAN_ISSUED: u64 = 1;
/// [`rl_ban`]: the ban was already there (another CPU, or another rule of the same kind).
pub const BAN_ALREADY: u64 = 2;

/// Issue a ban for `key` (rate_based_ban crossed `ban_threshold`): [`BAN_ISSUED`] if this
/// call issued it, [`BAN_ALREADY`] if it was already there (another CPU, or another rule of
/// the same kind), [`BAN_NOT_RECORDED`] if it could not be recorded (then the client is
/// throttled by its rule, not banned). A full table holds
/// the ban in the client's state instead ([`BAN_HELD_MARK`]).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_ban(
    st: *mut ClientState,
    until: *mut u64,
    lim: *const Limit,
    key: *const ClientKey,
    j: *mut Judge,
) -> u64 {
    if st.is_null() || until.is_null() || lim.is_null() || key.is_null() || j.is_null() {
        return BAN_NOT_RECORDED;
    }
    // SAFETY: non-null pointers to live map values and the caller's stack.
    unsafe {
        let j = &*j;
        let key = &*key;
        let now = j.now;
        let expires = limiter::ban_expiry(now, (*lim).ban_duration_ns);
        let mut held = false;
        let issued = if key.kind == KEY_IP {
            // The entry and its key in this CPU's scratch record (a map value, which every
            // kernel accepts as a helper's key and value).
            let Some(rl) = SCRATCH.get_ptr_mut(0) else {
                return BAN_NOT_RECORDED;
            };
            let entry = &raw mut (*rl).ban_entry;
            (*entry).expires_ns = expires;
            (*entry).since_ns = now;
            (*entry).rule = j.rule;
            (*entry).flags = j.ban_flags;
            (*entry).prefix_len = key.prefix_len;
            (*entry)._pad = 0;
            (*entry).addr = key.addr;
            let lpm = &raw mut (*rl).ban_key;
            write_trie_key(lpm, key.prefix_len, &key.addr);
            let table = ban_table(j.ban_flags);
            #[expect(
                clippy::needless_borrows_for_generic_args,
                reason = "the entry lives in the scratch map: by value would copy it onto the \
                          512-byte BPF stack, which this call chain has little of"
            )]
            let inserted = if table == BAN_TABLE_PASSING {
                PASSING_BANS.insert(&*lpm, &*entry, BPF_NOEXIST as u64)
            } else {
                BANS.insert(&*lpm, &*entry, BPF_NOEXIST as u64)
            };
            match inserted {
                Ok(()) => {
                    if let Some(p) = BANS_PRESENT.get_ptr_mut(table)
                        && atomic::load(p) == 0
                    {
                        atomic::store(p, 1);
                    }
                    if let Some(p) = BAN_EPOCH.get_ptr_mut(0) {
                        atomic::add(p, 1);
                    }
                    true
                }
                Err(EEXIST) => return BAN_ALREADY,
                // The rules' table is full: hold the ban in the client's own state, which
                // this rule checks before its meter (`meters::rl_ban_meter`).
                Err(ENOSPC) => {
                    held = true;
                    true
                }
                Err(_) => {
                    stats::add(j.slot, global::BAN_INSERT_FAILED, 0);
                    let family = rare::family_of(&key.addr);
                    rare::note(rare::BAN_INSERT_FAILED, j.rule, family, now);
                    return BAN_NOT_RECORDED;
                }
            }
        } else {
            atomic::cas(until, 0, if expires == 0 { u64::MAX } else { expires })
        };
        if !issued {
            return BAN_ALREADY;
        }
        if held {
            // The end first, then the mark that makes it read (a CPU that sees the mark
            // sees the end); the swap tells a second CPU holding the same ban that it was
            // not the one to issue it. The ban ends on its own (`rl_ban_meter`).
            atomic::store(
                &raw mut (*st).seen_prev,
                if expires == 0 { u64::MAX } else { expires },
            );
            atomic::store(&raw mut (*st).seen_cur, 0);
            if atomic::swap(&raw mut (*st).ban_stamp, BAN_HELD_MARK) == BAN_HELD_MARK {
                return BAN_ALREADY;
            }
            stats::add(j.slot, global::BAN_HELD_IN_STATE, 0);
            rare::note(rare::BAN_HELD, j.rule, rare::family_of(&key.addr), now);
        } else {
            atomic::store(&raw mut (*st).seen_cur, 0);
            atomic::store(&raw mut (*st).seen_prev, 0);
        }
        // The client starts clean when the ban ends.
        atomic::store(&raw mut (*st).cur, 0);
        atomic::store(&raw mut (*st).prev, 0);
        if j.algorithm == ALG_TOKEN_BUCKET as u32 {
            atomic::store(&raw mut (*st).stamp, 0);
        }
        atomic::add(&raw mut (*st).drops, 1);
        stats::add(j.slot, global::BANS_ISSUED, 0);
        stats::add_rule(j.slot, j.rule, rc::BANS, 0);
        events::emit(
            j.slot,
            EV_BAN,
            key,
            now,
            j.seen,
            (*lim).ban_threshold,
            expires,
        );
    }
    BAN_ISSUED
}
