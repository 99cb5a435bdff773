//! Per-run source variation. BPF_PROG_TEST_RUN replays one frame, so without help every run
//! hits the same client. With `RL_BENCH_VARY` set, [`vary_source`] rewrites the IPv4 source of
//! the frame before anything reads it: spread over the `n` populated sources in a scrambled
//! order (so lookups miss the cache as real traffic does), or a new source on every packet
//! (churn). [`ratelimit_varied`] is the daemon's Ethernet entry behind it.

use aya_ebpf::{
    helpers::bpf_get_smp_processor_id,
    macros::{map, xdp},
    maps::{Array, PerCpuArray},
    programs::XdpContext,
};

/// `[mode, n, base]`: mode 0 off, 1 spread over `base .. base + n`, 2 churn.
#[map(name = "RL_BENCH_VARY")]
static VARY: Array<[u64; 3]> = Array::with_max_entries(1, 0);

/// Per-CPU packet sequence number.
#[map(name = "RL_BENCH_SEQ")]
static SEQ: PerCpuArray<u64> = PerCpuArray::with_max_entries(1, 0);

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

/// The daemon's Ethernet entry (`ratelimit`), entered after [`vary_source`]: the program's own
/// code (`ratelimit::program::ethernet`, the body of `ratelimit`), on the rewritten frame.
#[xdp]
pub fn ratelimit_varied(ctx: XdpContext) -> u32 {
    vary_source(&ctx);
    ratelimit::program::ethernet(&ctx)
}
