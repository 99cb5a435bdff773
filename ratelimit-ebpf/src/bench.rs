//! Benchmark-only code (the `bench` feature; `cargo xtask bench` builds it into its own
//! object, the daemon's object never has it).
//!
//! * Per-run source variation: BPF_PROG_TEST_RUN replays one frame, so without help every run
//!   hits the same client. With `RL_BENCH_VARY` set, the limiter first rewrites the IPv4
//!   source of the frame: spread over the `n` populated sources in a scrambled order (so
//!   lookups miss the cache as real traffic does), or a new source on every packet (churn).
//! * Floor references: the least a per-client limiter can do per packet (clock, one lookup of
//!   the per-client map, one atomic add), so the limiter's cost can be split into what any
//!   design pays and what ours adds.

use aya_ebpf::{
    bindings::xdp_action,
    helpers::{bpf_get_smp_processor_id, bpf_ktime_get_ns},
    macros::{map, xdp},
    maps::{Array, PerCpuArray},
    programs::XdpContext,
};

use crate::{atomic, parse, state};

/// `[mode, n, base]`: mode 0 off, 1 spread over `base .. base + n`, 2 churn.
#[map(name = "RL_BENCH_VARY")]
static VARY: Array<[u64; 3]> = Array::with_max_entries(1, 0);

/// Per-CPU packet sequence number.
#[map(name = "RL_BENCH_SEQ")]
static SEQ: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

/// Memory-latency floors of any per-client store: one line per tracked source in an array
/// indexed directly by the source's place in the populated set (no hashing, no key to
/// compare), a 64-byte cache line or a 16-byte sliver of one (`max_entries` set at load, to
/// the per-client map's).
#[map(name = "RL_BENCH_LINES64")]
static LINES64: Array<[u64; 8]> = Array::with_max_entries(1, 0);
#[map(name = "RL_BENCH_LINES16")]
static LINES16: Array<[u64; 2]> = Array::with_max_entries(1, 0);

const MODE_SPREAD: u64 = 1;
const MODE_CHURN: u64 = 2;

/// Rewrite the IPv4 source address of the frame as `RL_BENCH_VARY` says; the source's place
/// in the populated set when spreading over it (else 0).
#[inline(always)]
pub fn vary_source(ctx: &XdpContext) -> u32 {
    let Some(cfg) = VARY.get(0) else {
        return 0;
    };
    let mode = cfg[0];
    if mode == 0 {
        return 0;
    }
    let Some(seq) = SEQ.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: this CPU's slot.
    let i = unsafe {
        let i = *seq;
        *seq = i + 1;
        i
    };
    let mut place = 0u32;
    let addr: u32 = if mode == MODE_SPREAD {
        // A scrambled walk of the populated set: Knuth's multiplicative hash, modulo n.
        let n = if cfg[1] == 0 { 1 } else { cfg[1] };
        place = (i.wrapping_mul(2_654_435_761) % n) as u32;
        (cfg[2] as u32).wrapping_add(place)
    } else if mode == MODE_CHURN {
        // A new source on every packet: 24 bits of sequence under a per-CPU first octet.
        // SAFETY: a helper without arguments.
        let cpu = unsafe { bpf_get_smp_processor_id() };
        ((12 + cpu) << 24) | (i as u32 & 0x00ff_ffff)
    } else {
        return 0;
    };
    let start = ctx.data();
    if start + 30 > ctx.data_end() {
        return place;
    }
    // SAFETY: bounds checked above; ethertype at 12, IPv4 source at 26.
    unsafe {
        if *((start + 12) as *const u16) != u16::to_be(0x0800) {
            return place;
        }
        *((start + 26) as *mut [u8; 4]) = addr.to_be_bytes();
    }
    place
}

/// Floor: the clock.
#[xdp]
pub fn ref_clock(_ctx: XdpContext) -> u32 {
    // SAFETY: a helper without arguments that reads the clock.
    core::hint::black_box(unsafe { bpf_ktime_get_ns() });
    xdp_action::XDP_PASS
}

/// Floor: the coarse clock (the last timer tick; no clock-source read).
#[xdp]
pub fn ref_clock_coarse(_ctx: XdpContext) -> u32 {
    // SAFETY: a helper without arguments that reads the clock.
    core::hint::black_box(unsafe { aya_ebpf::helpers::bpf_ktime_get_coarse_ns() });
    xdp_action::XDP_PASS
}

/// Floor: the coarse clock as the program reads it (`clock::coarse_tick`: once per tick and
/// CPU, otherwise a jiffies compare).
#[xdp]
pub fn ref_clock_tick(_ctx: XdpContext) -> u32 {
    core::hint::black_box(crate::clock::coarse_tick().0);
    xdp_action::XDP_PASS
}

/// Floor without a clock: parse, one lookup of the per-client map, one atomic add; drop.
#[xdp]
pub fn ref_lookup(ctx: XdpContext) -> u32 {
    vary_source(&ctx);
    let parse::Frame::Ip(p) = parse::parse(&ctx) else {
        return xdp_action::XDP_ABORTED;
    };
    if let Some(c) = state::bench_client_counter(&p.src) {
        // SAFETY: a live map value.
        unsafe { atomic::add(c, 1) };
    }
    xdp_action::XDP_DROP
}

/// Memory floor of any per-client store holding a 64-byte line per source: parse, then one
/// atomic add to the source's line, found by its place in the populated set; drop.
#[xdp]
pub fn ref_line64(ctx: XdpContext) -> u32 {
    let place = vary_source(&ctx);
    if !matches!(parse::parse(&ctx), parse::Frame::Ip(_)) {
        return xdp_action::XDP_ABORTED;
    }
    if let Some(line) = LINES64.get_ptr_mut(place) {
        // SAFETY: a live map value.
        unsafe { atomic::add(&raw mut (*line)[0], 1) };
    }
    xdp_action::XDP_DROP
}

/// The same with 16 bytes per source (four sources to a cache line).
#[xdp]
pub fn ref_line16(ctx: XdpContext) -> u32 {
    let place = vary_source(&ctx);
    if !matches!(parse::parse(&ctx), parse::Frame::Ip(_)) {
        return xdp_action::XDP_ABORTED;
    }
    if let Some(line) = LINES16.get_ptr_mut(place) {
        // SAFETY: a live map value.
        unsafe { atomic::add(&raw mut (*line)[0], 1) };
    }
    xdp_action::XDP_DROP
}

/// Floor of a per-client limiter: parse, the clock, one lookup of the per-client map, one
/// atomic add to the client's counter; drop.
#[xdp]
pub fn ref_floor(ctx: XdpContext) -> u32 {
    vary_source(&ctx);
    let parse::Frame::Ip(p) = parse::parse(&ctx) else {
        return xdp_action::XDP_ABORTED;
    };
    // SAFETY: a helper without arguments that reads the clock.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(c) = state::bench_client_counter(&p.src) {
        // SAFETY: a live map value.
        unsafe { atomic::add(c, now & 1) };
    }
    xdp_action::XDP_DROP
}
