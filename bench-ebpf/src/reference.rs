//! Reference programs: what any XDP program pays (XDP_PASS, XDP_DROP), what our parser
//! costs, and floors: the least a per-client limiter can do per packet (the clock, one lookup
//! of the per-client store, one atomic add), and below any keyed store, a line per source in
//! a directly indexed array. The limiter's cost is reported over each, split into what any
//! design pays and what ours adds. They use the program's own parser, clock and store lookup.

use aya_ebpf::{
    bindings::xdp_action,
    helpers::bpf_ktime_get_ns,
    macros::{map, xdp},
    maps::Array,
    programs::XdpContext,
};
use ratelimit::{
    atomic, clock,
    parse::{self, Frame},
    policy,
};
use ratelimit_common::{addr::IpKey, maps::KEY_IP};

use crate::vary::vary_source;

/// Memory-latency floors of any per-client store: one line per tracked source in an array
/// indexed directly by the source's place in the populated set (no hashing, no key to
/// compare), a 64-byte cache line or a 16-byte sliver of one (`max_entries` set at load, to
/// the per-client map's).
#[map(name = "RL_BENCH_LINES64")]
static LINES64: Array<[u64; 8]> = Array::with_max_entries(1, 0);
#[map(name = "RL_BENCH_LINES16")]
static LINES16: Array<[u64; 2]> = Array::with_max_entries(1, 0);

/// Return XDP_PASS.
#[xdp]
pub fn ref_pass(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// Return XDP_DROP.
#[xdp]
pub fn ref_drop(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_DROP
}

/// Our parser, then XDP_DROP: the floor of any filter that reads a frame's headers (in a live
/// flood the frame's first line arrives cold from the CPU that wrote it, which XDP_DROP alone
/// never reads).
#[xdp]
pub fn ref_parse_drop(ctx: XdpContext) -> u32 {
    if let Frame::Ip(p) = parse::parse(&ctx) {
        // Keep the parse from being optimised away.
        core::hint::black_box(p.src.addr);
        core::hint::black_box(p.dport);
    }
    xdp_action::XDP_DROP
}

/// Our parser, then XDP_PASS.
#[xdp]
pub fn ref_parse(ctx: XdpContext) -> u32 {
    match parse::parse(&ctx) {
        Frame::Ip(p) => {
            // Keep the parse from being optimised away.
            core::hint::black_box(p.dport);
            xdp_action::XDP_PASS
        }
        Frame::NonIp => xdp_action::XDP_PASS,
        Frame::Bogon | Frame::Unreadable(_) => xdp_action::XDP_ABORTED,
    }
}

/// The `cur` counter of rule 0's state of `src` as a /32 (/128) key: the lookup every
/// per-client design makes, as the program makes it.
#[inline(always)]
fn client_counter(src: &IpKey) -> Option<*mut u64> {
    let key = ratelimit::client_key(0, KEY_IP, 128, src.addr);
    let st = ratelimit::client_state(&key, policy::global().store_sets)?;
    // SAFETY: a live map value.
    Some(unsafe { &raw mut (*st).cur })
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
    core::hint::black_box(clock::coarse_tick().0);
    xdp_action::XDP_PASS
}

/// Floor without a clock: parse, one lookup of the per-client map, one atomic add; drop.
#[xdp]
pub fn ref_lookup(ctx: XdpContext) -> u32 {
    vary_source(&ctx);
    let Frame::Ip(p) = parse::parse(&ctx) else {
        return xdp_action::XDP_ABORTED;
    };
    if let Some(c) = client_counter(&p.src) {
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
    if !matches!(parse::parse(&ctx), Frame::Ip(_)) {
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
    if !matches!(parse::parse(&ctx), Frame::Ip(_)) {
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
    let Frame::Ip(p) = parse::parse(&ctx) else {
        return xdp_action::XDP_ABORTED;
    };
    // SAFETY: a helper without arguments that reads the clock.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(c) = client_counter(&p.src) {
        // SAFETY: a live map value.
        unsafe { atomic::add(c, now & 1) };
    }
    xdp_action::XDP_DROP
}
