//! The live-frames flood generator.
//!
//! `gen_flood` is run by the benchmark with BPF_PROG_TEST_RUN in XDP live-frames mode
//! (`BPF_F_TEST_XDP_LIVE_FRAMES`) from the sending namespace, with `ingress_ifindex` the sending
//! veth: it returns XDP_TX, which that mode turns into a transmit out of that interface, so each
//! run puts one frame on the wire to the peer (the receiver under test).
//!
//! The frame user space hands in is a valid Ethernet/IPv4 or IPv6 UDP frame (receiver's real
//! MAC and address, correct checksums). Per run the program rewrites only three fields: the
//! low 32 bits of the source address, the UDP destination port and the checksums those two
//! enter (the IPv4 header checksum, and the UDP checksum, whose pseudo-header covers the
//! source). The kernel recycles the frame pages without resetting their contents, so a run may
//! see the original frame or one an earlier run rewrote: the program therefore writes the
//! fields and the checksum from scratch every time, from a partial sum over the fixed words
//! that user space computed (`csum_base`), never incrementally from what is in the page.
//!
//! Per run, in order:
//! * a legitimate client's frame, when its pacing says one is due (`legit_n` clients in turn,
//!   one frame every `legit_period_ns` across all of them, so each client offers
//!   1 / (legit_n * period) frames per second), counted per client in `RL_BENCH_GEN_LEGIT`;
//! * otherwise a flood frame: source `flood_base` when `flood_n` is 1 (one heavy source), or a
//!   scrambled walk of `flood_base .. flood_base + flood_n` (a new source each frame until the
//!   walk wraps, when `flood_n` is a power of two); with `flood_period_ns` set, only when the
//!   flood's pacing says one is due;
//! * otherwise nothing: the run returns XDP_DROP (an idle run, counted).
//!
//! Only one thread runs the generator, so its state is per-CPU and updated without atomics.

use aya_ebpf::{
    bindings::xdp_action,
    helpers::bpf_ktime_get_ns,
    macros::{map, xdp},
    maps::{Array, PerCpuArray},
    programs::XdpContext,
};

/// Configuration, written by the benchmark before each flood. `[u64; 16]`:
const C_FAMILY: usize = 0; // 4 or 6
const C_FLOOD_BASE: usize = 1; // low 32 bits of the first flood source (host order)
const C_FLOOD_N: usize = 2; // number of flood sources (1: one heavy source)
const C_FLOOD_PORT: usize = 3; // UDP destination port of flood frames
const C_LEGIT_N: usize = 4; // legitimate clients (0: none), at most LEGIT_MAX
const C_LEGIT_BASE: usize = 5; // low 32 bits of the first legitimate client
const C_LEGIT_PORT: usize = 6; // UDP destination port of legitimate frames
const C_LEGIT_PERIOD: usize = 7; // ns between two legitimate frames (all clients in turn)
const C_CSUM_BASE: usize = 8; // one's-complement sum of the fixed words (see module doc)
const C_FLOOD_ONLY: usize = 9; // 1: never send legitimate frames
const C_LEGIT_ONLY: usize = 10; // 1: send legitimate frames only, returning XDP_DROP when none is due
const C_FLOOD_PERIOD: usize = 11; // ns between two flood frames (0: as fast as the CPU goes)
const C_UDP_CSUM_BASE: usize = 12; // IPv4: the UDP checksum's fixed words (C_CSUM_BASE: IP header's)

#[map(name = "RL_BENCH_GEN_CFG")]
static CFG: Array<[u64; 16]> = Array::with_max_entries(1, 0);

/// Per-CPU state: `[seq, next_legit_ns, legit_seq, flood_sent, legit_sent, idle,
/// next_flood_ns]`.
const S_SEQ: usize = 0;
const S_NEXT: usize = 1;
const S_LEGIT_SEQ: usize = 2;
const S_FLOOD_SENT: usize = 3;
const S_LEGIT_SENT: usize = 4;
const S_IDLE: usize = 5;
const S_NEXT_FLOOD: usize = 6;

#[map(name = "RL_BENCH_GEN_STATE")]
static STATE: PerCpuArray<[u64; 8]> = PerCpuArray::with_max_entries(1, 0);

/// Most legitimate clients the generator paces.
const LEGIT_MAX: u32 = 1024;

/// Frames sent per legitimate client (index: client number).
#[map(name = "RL_BENCH_GEN_LEGIT")]
static LEGIT: PerCpuArray<u64> = PerCpuArray::with_max_entries(LEGIT_MAX, 0);

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;

/// Folds a 32-bit one's-complement sum to 16 bits.
#[inline(always)]
fn fold(mut s: u64) -> u16 {
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s as u16
}

#[xdp]
pub fn gen_flood(ctx: XdpContext) -> u32 {
    let Some(cfg) = CFG.get(0) else {
        return xdp_action::XDP_ABORTED;
    };
    let Some(st) = STATE.get_ptr_mut(0) else {
        return xdp_action::XDP_ABORTED;
    };
    // SAFETY: this CPU's slot of a per-CPU map; the generator runs on one thread.
    let st = unsafe { &mut *st };
    let seq = st[S_SEQ];
    st[S_SEQ] = seq + 1;

    let flood_period = cfg[C_FLOOD_PERIOD];
    let legit_n = cfg[C_LEGIT_N];
    let paced = flood_period != 0 || (legit_n != 0 && cfg[C_FLOOD_ONLY] == 0);
    let now = if paced {
        // SAFETY: a helper without arguments that reads the clock.
        unsafe { bpf_ktime_get_ns() }
    } else {
        0
    };
    // A legitimate client's frame when one is due.
    let mut legit: Option<u32> = None;
    if legit_n != 0 && legit_n <= LEGIT_MAX as u64 && cfg[C_FLOOD_ONLY] == 0 {
        let period = cfg[C_LEGIT_PERIOD];
        if now >= st[S_NEXT] {
            // Never catch up more than a few frames after a stall: each client stays well
            // inside its burst.
            st[S_NEXT] = if now - st[S_NEXT] > 4 * period {
                now + period
            } else {
                st[S_NEXT] + period
            };
            let client = (st[S_LEGIT_SEQ] % legit_n) as u32;
            st[S_LEGIT_SEQ] += 1;
            legit = Some(client);
        }
    }
    if legit.is_none() && cfg[C_LEGIT_ONLY] != 0 {
        st[S_IDLE] += 1;
        return xdp_action::XDP_DROP;
    }
    // A paced flood: nothing to send before the next flood frame is due (the run is spent
    // idle). After a stall, at most 64 frames go out back to back.
    if legit.is_none() && flood_period != 0 {
        let next = st[S_NEXT_FLOOD];
        if now < next {
            st[S_IDLE] += 1;
            return xdp_action::XDP_DROP;
        }
        st[S_NEXT_FLOOD] = if now - next > 64 * flood_period {
            now + flood_period
        } else {
            next + flood_period
        };
    }
    let (low, port) = match legit {
        Some(client) => (
            (cfg[C_LEGIT_BASE] as u32).wrapping_add(client),
            cfg[C_LEGIT_PORT],
        ),
        None => {
            let n = cfg[C_FLOOD_N];
            let off = if n <= 1 {
                0
            } else {
                // Knuth's multiplicative hash: a bijection modulo a power of two.
                (seq.wrapping_mul(2_654_435_761) % n) as u32
            };
            (
                (cfg[C_FLOOD_BASE] as u32).wrapping_add(off),
                cfg[C_FLOOD_PORT],
            )
        }
    };
    let port = port as u16;
    // The source's two words enter every checksum rewritten here; the port enters the UDP one.
    let src = (low >> 16) as u64 + (low & 0xffff) as u64;
    let sum = cfg[C_CSUM_BASE] + src; // IPv4 header; for IPv6, the UDP checksum's base
    // A UDP checksum of 0 means "none" (and is invalid over IPv6): 0xffff stands for it.
    let udp_csum = |base: u64| -> u16 {
        let c = !fold(base + src + port as u64);
        if c == 0 { 0xffff } else { c }
    };

    let start = ctx.data();
    let end = ctx.data_end();
    if start + 14 > end {
        return xdp_action::XDP_ABORTED;
    }
    // SAFETY: every access below is bounds-checked against data_end first.
    unsafe {
        let ethertype = u16::from_be(*((start + 12) as *const u16));
        if cfg[C_FAMILY] == 6 {
            if ethertype != ETH_P_IPV6 || start + 62 > end {
                return xdp_action::XDP_ABORTED;
            }
            // IPv6 source 22..38 (low 32 bits at 34), UDP at 54: dport 56, checksum 60.
            *((start + 34) as *mut [u8; 4]) = low.to_be_bytes();
            *((start + 56) as *mut [u8; 2]) = port.to_be_bytes();
            *((start + 60) as *mut [u8; 2]) = udp_csum(cfg[C_CSUM_BASE]).to_be_bytes();
        } else {
            if ethertype != ETH_P_IP || start + 42 > end {
                return xdp_action::XDP_ABORTED;
            }
            // IPv4 header checksum at 24, source at 26; UDP dport at 36, checksum at 40.
            *((start + 26) as *mut [u8; 4]) = low.to_be_bytes();
            *((start + 24) as *mut [u8; 2]) = (!fold(sum)).to_be_bytes();
            *((start + 36) as *mut [u8; 2]) = port.to_be_bytes();
            *((start + 40) as *mut [u8; 2]) = udp_csum(cfg[C_UDP_CSUM_BASE]).to_be_bytes();
        }
    }
    match legit {
        Some(client) => {
            st[S_LEGIT_SENT] += 1;
            if let Some(c) = LEGIT.get_ptr_mut(client) {
                // SAFETY: this CPU's slot.
                unsafe { *c += 1 };
            }
        }
        None => st[S_FLOOD_SENT] += 1,
    }
    xdp_action::XDP_TX
}
