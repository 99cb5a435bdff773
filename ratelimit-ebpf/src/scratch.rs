//! The per-packet working record of the rule evaluation ([`RuleLoop`], one per CPU) and the
//! records passed by pointer to the global BPF functions ([`Env`], [`Judge`]).

use aya_ebpf::{macros::map, maps::lpm_trie::Key};
use ratelimit_common::{addr::LpmAddr, maps::*};

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
    pub admission_inc_ns: u64,
    pub admission_burst_ns: u64,
    /// `GlobalConfig::admission_tick_cap`.
    pub admission_tick_cap: u32,
    /// `GlobalConfig::store_sets`.
    pub store_sets: u32,
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
    pub src_mask: u32,
    pub src_mask_known: u32,
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
    pub src_key: Key<LpmAddr>,
}

#[map(name = "RL_SCRATCH")]
pub static SCRATCH: aya_ebpf::maps::PerCpuArray<RuleLoop> =
    aya_ebpf::maps::PerCpuArray::with_max_entries(1, 0);

/// Per-packet facts the verifier-isolated stages (`meters.rs`, `bans.rs`) share. Lives in the
/// scratch record ([`RuleLoop::judge`]) and is passed by pointer (global BPF functions take
/// scalars or pointers to plain memory).
#[repr(C)]
pub struct Judge {
    pub now: u64,
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
}
