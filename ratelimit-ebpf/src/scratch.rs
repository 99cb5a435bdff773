//! The per-packet working record of the rule evaluation ([`RuleLoop`], one per CPU) and the
//! records passed by pointer to the global BPF functions ([`Env`], [`Judge`]).

use aya_ebpf::{macros::map, maps::lpm_trie::Key};
use ratelimit_common::{
    addr::{FAMILY_V4, FAMILY_V6, IpKey, LpmAddr, lpm_prefix},
    caps::MAX_PAYLOAD_FETCHES,
    maps::*,
};

use crate::{parse::Parsed, stats::Slot, store};

/// What a rule evaluation needs besides the rule and the packet (one pointer for the call).
#[repr(C)]
pub struct Env {
    pub slot: Slot,
    pub len: u64,
    pub now: u64,
    pub preview_all: u32,
    /// `GLOBAL_ADMISSION_FINE_CLOCK` set: the budget needs the precise clock.
    pub admission_fine: u32,
    /// `GlobalConfig::generation` this packet was judged under.
    pub generation: u32,
    /// `GlobalConfig::relaxed`: elastic limits are in force.
    pub relaxed: u32,
    pub admission_inc_ns: u64,
    pub admission_burst_ns: u64,
    /// `GlobalConfig::admission_tick_cap`.
    pub admission_tick_cap: u32,
    /// `GlobalConfig::store_sets`.
    pub store_sets: u32,
    /// `GlobalConfig::wall_offset_ns`.
    pub wall_offset_ns: u64,
}

/// What rules may match on beyond the parser's facts, read from the frame once a packet when
/// some rule asks ([`RuleLoop::ext`]).
#[repr(C)]
pub struct Ext {
    pub dst: IpKey,
    /// The IP packet's length as its header says: IPv4 total length, IPv6 payload length + 40.
    pub ip_len: u16,
    /// TCP/UDP source port (with `Parsed::l4`).
    pub sport: u16,
    /// The L4 header's length up to its payload: TCP's with its options, UDP's 8, ICMP's 8.
    pub l4_hdr: u16,
    /// IPv4 TTL / IPv6 hop limit.
    pub ttl: u8,
    /// ICMP / ICMPv6 type and code (with `Parsed::l4`).
    pub icmp_type: u8,
    pub icmp_code: u8,
    pub _pad: [u8; 3],
}

/// New states this CPU inserted in its current tick (kept across packets in the scratch
/// record, which is per CPU).
#[repr(C)]
pub struct TickInserts {
    pub tick: u64,
    pub count: u64,
}

/// Per-packet working record of the rule evaluation: the packet facts, the environment, and
/// scratch space for the stages. It lives in a per-CPU array, not on the stack: the BPF stack
/// is 512 bytes for the whole call chain, and values in a map cost the verifier nothing to
/// track. Per-CPU is safe: an XDP program runs to completion on its CPU without preemption.
/// Plain data only, because global BPF functions see pointer arguments as untyped memory.
#[repr(C)]
pub struct RuleLoop {
    pub env: Env,
    pub pkt: Parsed,
    pub key: ClientKey,
    pub judge: Judge,
    /// The sources trie's answer for the rules (their source lists, their `except` lists),
    /// once looked up (`src_mask_known`).
    pub src_mask: u32,
    pub src_except: u32,
    pub src_mask_known: u32,
    /// What was made for this packet beyond the parser's facts (`matching::NEED_*`,
    /// `matching::serve`): the payload reads, the destinations trie's answer, the socket
    /// lookup's. Reset per packet.
    pub have: u32,
    pub dst_mask: u32,
    /// With `NEED_EXT` in `have`.
    pub ext: Ext,
    /// `matching::CONN_*`, with `NEED_CONN` in `have`.
    pub conn: u32,
    pub fetched: [u32; MAX_PAYLOAD_FETCHES],
    pub fetched_ok: u32,
    pub fetch_buf: [u8; 4],
    /// The destination's full-length key in the destinations trie.
    pub dst_key: SrcTrieKey,
    /// The packet's coarse time, and its precise time once a rule has needed it (0 before).
    pub coarse_now: u64,
    pub fine_now: u64,
    /// The tick (jiffies) of `coarse_now`.
    pub tick: u64,
    /// `RL_BAN_EPOCH` read before this packet's ban lookup.
    pub ban_epoch: u64,
    /// Not reset per packet: see [`TickInserts`].
    pub inserts: TickInserts,
    /// The ban end of the rule's shared key when it has one, else a word no one reads (so the
    /// ban stages always get a valid pointer).
    pub no_ban: u64,
    /// Scratch space of the per-source store's insert.
    pub scan: store::Scan,
    /// Scratch space of a ban insert ([`rl_ban`](crate::bans::rl_ban)): the entry and its
    /// trie key live here, not on the stack, which the rule evaluation's call chain has little
    /// of.
    pub ban_entry: BanEntry,
    pub ban_key: Key<LpmAddr>,
    /// The source's full-length key in the list and ban tries, built once per packet for
    /// both lookups: here and not on the entry's stack, which the call chain below it fills.
    pub src_key: SrcTrieKey,
    /// Non-zero if the rule that dropped this packet judged it in its overflow state (its
    /// source was refused state): that rule's position + 1. A TCP packet then gets a second
    /// look (`cookies.rs`). Reset per packet.
    pub cookie: u32,
    /// `GlobalConfig::flags` has `GLOBAL_SYN_COOKIES`: proven sources skip the admission
    /// budget (`admission::state_for`).
    pub cookies_on: u32,
}

/// A full-length key of the list and ban tries (`Key<LpmAddr>`: the prefix length, the
/// family byte, the address; 21 bytes, packed), written in the pieces the kernel's LPM trie
/// reads it in. Its lookup compares a node's data with the key's as one 8-byte load at the
/// data's start, then 4-byte loads, then one byte (`longest_prefix_match`); a load that spans
/// two stores (or part of one) waits for them to reach the cache instead of being forwarded
/// from them. Here the key starts 4 bytes into an 8-aligned record, so each load the lookup
/// makes reads exactly one aligned store.
#[repr(C, align(8))]
pub struct SrcTrieKey {
    _pad: u32,
    prefix_len: u32,
    /// Data bytes 0..8: the family, then address bytes 0..7 (`LpmAddr::addr`).
    w0: u64,
    /// Address bytes 7..11, then 11..15, then 15.
    w1: u32,
    w2: u32,
    w3: u8,
    _tail: [u8; 7],
}

impl SrcTrieKey {
    /// The key of `src` (`policy::full`), an IPv4-mapped address when `v4` (the parser gives
    /// no IPv6 source in that range a key: it is a bogon).
    #[inline(always)]
    pub fn set(&mut self, src: &IpKey, v4: bool) {
        let a = &src.addr;
        let lo = u64::from_le_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]);
        let hi = u64::from_le_bytes([a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]]);
        // Branch-free (a branch here would split every path of the entry after it in two
        // for the verifier, and keep both halves' values in registers).
        let m = (v4 as u64).wrapping_neg();
        self.prefix_len = lpm_prefix(v4, 128);
        self.w0 = (FAMILY_V4 as u64 | (hi >> 32) << 8) & m | (FAMILY_V6 as u64 | lo << 8) & !m;
        self.w1 = ((lo >> 56 | hi << 8) & !m) as u32;
        self.w2 = ((hi >> 24) & !m) as u32;
        self.w3 = ((hi >> 56) & !m) as u8;
    }

    /// A copy on the stack (word by word), for a lookup from a global function, whose
    /// argument's memory 6.1's verifier takes as no map key.
    #[inline(always)]
    pub fn on_stack(&self) -> SrcTrieKey {
        SrcTrieKey {
            _pad: 0,
            prefix_len: self.prefix_len,
            w0: self.w0,
            w1: self.w1,
            w2: self.w2,
            w3: self.w3,
            _tail: [0; 7],
        }
    }

    /// The key as the trie's map type has it.
    #[inline(always)]
    pub fn key(&self) -> &Key<LpmAddr> {
        // SAFETY: `Key<LpmAddr>` is packed (alignment 1) and 21 bytes; those from
        // `prefix_len` on are its prefix length and its data in order, all within `self`.
        unsafe { &*(&raw const self.prefix_len as *const Key<LpmAddr>) }
    }
}

const _: () = assert!(core::mem::size_of::<Key<LpmAddr>>() == 21);
const _: () = assert!(core::mem::offset_of!(SrcTrieKey, w3) + 1 - 4 == 21);

#[map(name = "RL_SCRATCH")]
pub static SCRATCH: aya_ebpf::maps::PerCpuArray<RuleLoop> =
    aya_ebpf::maps::PerCpuArray::with_max_entries(1, 0);

/// Per-packet facts the verifier-isolated stages (`meters.rs`, `bans.rs`) share. Lives in the
/// scratch record ([`RuleLoop::judge`]) and is passed by pointer (global BPF functions take
/// scalars or pointers to plain memory).
#[repr(C)]
pub struct Judge {
    pub now: u64,
    /// The clock of the rule's window meters: `now`, or for a global rule (`RULE_GLOBAL`) the
    /// wall clock's `now + wall_offset_ns`, whose windows every host of the fleet shares.
    pub wnow: u64,
    pub cost: u64,
    /// Limiter usage after this packet, and what it is measured against.
    pub usage: u64,
    pub capacity: u64,
    /// Ban meter estimate.
    pub seen: u64,
    pub slot: u32,
    pub rule: u32,
    pub algorithm: u32,
    pub soft_permille: u32,
    /// `BAN_PREVIEW` / `BAN_EXCEED_PASS` for bans this rule issues.
    pub ban_flags: u32,
    /// Non-zero when the limiter refused because it lost every compare-and-swap retry.
    pub contended: u32,
    /// Non-zero for a global rule (`RULE_GLOBAL`): a token bucket counts what it admits in
    /// windows of the wall clock for the fleet.
    pub global: u32,
    /// Non-zero when `add` holds what the other hosts counted for this shared key of a
    /// global rule (`RL_FLEET_ADD`): the window meters judge by their own counts and these.
    pub fleet: u32,
    pub add: FleetAdd,
}
