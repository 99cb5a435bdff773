//! Handshake-proven admission: what happens to TCP from sources refused state.
//!
//! In a random-source flood the admission budget is spent by spoofed sources, so a new
//! legitimate client's SYN meets its rule's overflow state, which the flood keeps empty, and
//! waits for its retransmission (1 s) before a later one gets state. A source that completes
//! a TCP handshake has proven that it receives what is sent to its address; a spoofer has not.
//! So a TCP packet that the rules dropped only because its source was refused state
//! (`RuleLoop::cookie`) is looked at once more, against the kernel's own sockets:
//!
//! * **A SYN to a listening port** is handed to the listener while its SYN queue has room (the
//!   kernel answers it as it would with nothing attached, and the queue bounds what that
//!   costs). Once the queue is full, which is when the kernel itself would answer with SYN
//!   cookies, it is answered here instead: a SYN-ACK whose sequence number is a cookie of that
//!   listener (`bpf_tcp_gen_syncookie`, which also marks the listener as sending cookies, so
//!   the kernel accepts the handshake's ACK), sent back out of the device it came in on
//!   (`XDP_TX`), without a socket buffer. A SYN to a port nothing listens on is dropped.
//! * **An ACK carrying a valid cookie** of the listener (`bpf_tcp_check_syncookie`, the kernel's
//!   own test, tried only while this host sends cookies: [`COOKIE_ACTIVE_NS`]) is passed, and
//!   the kernel makes the connection from it. Its source is proven.
//! * **A packet of a connection the kernel holds** (half-open or established: the kernel checks
//!   its sequence numbers) is passed; one of an established connection proves its source.
//!
//! A proven source (`RL_PROVEN`) gets state of its own without the admission budget
//! (`admission::state_for`), for [`PROVEN_TTL_NS`].
//!
//! A cookie SYN-ACK carries one option, the MSS the cookie encodes. So a connection made from
//! a cookie here has no window scaling, SACK or timestamps, like the kernel's own cookie
//! connections without timestamps; a proven source's later connections go through the
//! kernel's handshake with every option.

use aya_ebpf::{
    bindings::{bpf_sock, bpf_sock_tuple, tcphdr, xdp_action, xdp_md},
    helpers::{
        bpf_sk_release, bpf_skc_lookup_tcp, bpf_tcp_check_syncookie, bpf_tcp_gen_syncookie,
        bpf_xdp_adjust_tail,
    },
    macros::map,
    maps::{Array, LruHashMap, PerCpuArray},
    programs::XdpContext,
};
use ratelimit_common::{addr::IpKey, caps::MAX_PROVEN_SOURCES, proto::*, stats::global};

use crate::{
    atomic,
    parse::{self, Parsed},
    stats::{self, Slot},
};

/// Proven sources (a cookie's ACK, or an established connection) and when they were proven
/// (ns, coarse clock).
#[map(name = "RL_PROVEN")]
static PROVEN: LruHashMap<[u8; 16], u64> = LruHashMap::with_max_entries(MAX_PROVEN_SOURCES, 0);

/// `[0]`: when this host last sent a cookie, `[1]`: when it last proved a source (coarse ns);
/// each written at most once a second.
#[map(name = "RL_COOKIE_TIME")]
static TIMES: Array<u64> = Array::with_max_entries(2, 0);
const SENT: u32 = 0;
const PROVED: u32 = 1;

/// Per CPU: the socket lookup's tuple and the SYN's TCP header as the cookie helper reads it.
#[map(name = "RL_COOKIE_BUF")]
static BUF: PerCpuArray<CookieBuf> = PerCpuArray::with_max_entries(1, 0);

#[repr(C)]
struct CookieBuf {
    tuple: bpf_sock_tuple,
    _pad: u32,
    /// A TCP header with one option, the SYN's MSS (`doff` = 6).
    th: [u8; 24],
}

/// How long after the last cookie sent an ACK may still carry a valid one (the kernel accepts
/// a cookie for about two minutes).
pub const COOKIE_ACTIVE_NS: u64 = 150_000_000_000;
/// How long a proven source skips the admission budget.
pub const PROVEN_TTL_NS: u64 = 600_000_000_000;

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

/// Socket states (`include/net/tcp_states.h`).
const TCP_ESTABLISHED: u32 = 1;
const TCP_LISTEN: u32 = 10;
const TCP_NEW_SYN_RECV: u32 = 12;

/// The reply's TCP header: 20 bytes and the MSS option.
const REPLY_TCP_LEN: usize = 24;

/// Whether `TIMES[i]` is within `span` of `now`.
#[inline(always)]
fn recent(i: u32, now: u64, span: u64) -> bool {
    match TIMES.get_ptr(i) {
        Some(p) => {
            // SAFETY: a live array value, written with one 8-byte store.
            let t = unsafe { atomic::load(p) };
            t != 0 && now.wrapping_sub(t) < span
        }
        None => false,
    }
}

/// Set `TIMES[i]` to `now` (one store a second at most: every CPU reads the word).
#[inline(always)]
fn stamp(i: u32, now: u64) {
    if let Some(p) = TIMES.get_ptr_mut(i) {
        // SAFETY: a live array value; one 8-byte load and store.
        unsafe {
            if now.wrapping_sub(atomic::load(p)) >= 1_000_000_000 {
                atomic::store(p, now);
            }
        }
    }
}

/// Whether `src` was proven within [`PROVEN_TTL_NS`] (looked up only if some source was).
#[inline(always)]
pub fn is_proven(src: &IpKey, now: u64) -> bool {
    if !recent(PROVED, now, PROVEN_TTL_NS) {
        return false;
    }
    // SAFETY: a lookup; the value is copied out.
    match unsafe { PROVEN.get(src.addr) } {
        Some(&t) => now.wrapping_sub(t) < PROVEN_TTL_NS,
        None => false,
    }
}

#[inline(always)]
fn prove(src: &IpKey, slot: Slot, len: u64, now: u64) {
    // A full map evicts its least recently used source.
    let _ = PROVEN.insert(src.addr, now, 0);
    stamp(PROVED, now);
    stats::add(slot, global::SOURCES_PROVEN, len);
}

/// [`answer`]'s result when the caller is to drop the packet.
pub const NO_ANSWER: u32 = u32::MAX;

/// The answer to a TCP packet the rules dropped because its source was refused state (see the
/// module's documentation): `XDP_TX` for a SYN answered with a cookie, `XDP_PASS` for one
/// passed, each with its verdict counted; [`NO_ANSWER`] for the caller's drop. A function of
/// its own (not inlined): its stack is not added to the entry's, which the rules' call chain
/// needs.
#[inline(never)]
pub fn answer(ctx: *mut xdp_md, pkt: *const Parsed, slot: Slot, len: u64, now: u64) -> u32 {
    let ctx = XdpContext::new(ctx);
    // SAFETY: the packet's facts in this CPU's scratch record.
    let pkt = unsafe { &*pkt };
    if pkt.proto != IPPROTO_TCP || !pkt.l4 || pkt.fragment {
        return NO_ANSWER;
    }
    let Some((l3, ip_len)) = headers(&ctx, pkt.v4) else {
        return NO_ANSWER;
    };
    let Some(b) = BUF.get_ptr_mut(0) else {
        return NO_ANSWER;
    };
    let f = pkt.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST | TCP_FIN);
    let syn = f == TCP_SYN;
    if !syn && (f & TCP_SYN != 0 || f & TCP_ACK == 0) {
        return NO_ANSWER;
    }
    if syn && !syn_header(&ctx, b, l3 + ip_len, pkt.v4) {
        return NO_ANSWER;
    }
    let sk = lookup(&ctx, b, l3, pkt.v4);
    if sk.is_null() {
        return NO_ANSWER;
    }
    // SAFETY: a socket the lookup returned; `state` is a field its type allows reading.
    let state = unsafe { core::ptr::read_volatile(&raw const (*(sk as *const bpf_sock)).state) };
    let mut cookie = -1i64;
    let mut valid_ack = false;
    if state == TCP_LISTEN
        && let (Some(ip), Some(th)) = (
            parse::header(&ctx, l3, if pkt.v4 { 20 } else { 40 }),
            parse::header(&ctx, l3 + ip_len, 20),
        )
    {
        let (iph, iph_len) = (ip.ptr() as *mut core::ffi::c_void, ip_len as u32);
        if syn {
            // SAFETY: `sk` is the lookup's reference; the helper reads the checked IP header
            // and the buffer's 24 bytes.
            cookie = unsafe {
                bpf_tcp_gen_syncookie(sk, iph, iph_len, &raw mut (*b).th as *mut tcphdr, 24)
            };
        } else if recent(SENT, now, COOKIE_ACTIVE_NS) {
            // SAFETY: as above; the helper reads the checked headers.
            valid_ack =
                unsafe { bpf_tcp_check_syncookie(sk, iph, iph_len, th.ptr() as *mut tcphdr, 20) }
                    == 0;
        }
    }
    // SAFETY: the reference the lookup returned, released once.
    unsafe { bpf_sk_release(sk) };
    if syn {
        if state != TCP_LISTEN {
            // A retransmitted SYN of a handshake the kernel holds: it answers it again.
            return pass(
                slot,
                len,
                if state == TCP_NEW_SYN_RECV {
                    0
                } else {
                    NOT_PASSED
                },
            );
        }
        if cookie < 0 {
            // The listener's SYN queue has room (the kernel sends no cookie): its turn.
            return pass(slot, len, global::SYN_TO_LISTENER);
        }
        if !write_reply(&ctx, l3, pkt.v4, cookie as u32, (cookie >> 32) as u16) {
            return NO_ANSWER;
        }
        stamp(SENT, now);
        stats::add(slot, global::SYN_COOKIES_SENT, len);
        stats::add(slot, global::DROP_RULE, len);
        return xdp_action::XDP_TX;
    }
    if state == TCP_LISTEN {
        if !valid_ack {
            return NO_ANSWER;
        }
        prove(&pkt.src, slot, len, now);
        return pass(slot, len, 0);
    }
    if state == TCP_ESTABLISHED {
        prove(&pkt.src, slot, len, now);
    }
    pass(slot, len, global::CONNECTION_PASSED)
}

/// [`pass`] with this: the caller drops the packet.
const NOT_PASSED: u32 = u32::MAX;

/// Count a pass (and `reason`, if not 0) and return `XDP_PASS`; [`NO_ANSWER`] for
/// [`NOT_PASSED`].
#[inline(always)]
fn pass(slot: Slot, len: u64, reason: u32) -> u32 {
    if reason == NOT_PASSED {
        return NO_ANSWER;
    }
    if reason != 0 {
        stats::add(slot, reason, len);
    }
    stats::add(slot, global::PASS, len);
    xdp_action::XDP_PASS
}

/// Where the IP header starts and its length, for a packet whose TCP header follows a fixed
/// IP header directly (no IPv4 options, no IPv6 extension header): anything else is not
/// answered.
#[inline(always)]
fn headers(ctx: &XdpContext, v4: bool) -> Option<(usize, usize)> {
    let l3 = parse::l3_offset(ctx)?;
    if v4 {
        let h = parse::header(ctx, l3, 20)?;
        if h.field::<u8>(0) != 0x45 || h.field::<u8>(9) != IPPROTO_TCP {
            return None;
        }
        Some((l3, 20))
    } else {
        let h = parse::header(ctx, l3, 40)?;
        if h.field::<u8>(0) >> 4 != 6 || h.field::<u8>(6) != IPPROTO_TCP {
            return None;
        }
        Some((l3, 40))
    }
}

/// The socket for the packet's 4-tuple (an established or half-open connection, else the
/// listener), looked up with the tuple in `b`; null if none. Its reference is the caller's to
/// release.
#[inline(always)]
fn lookup(ctx: &XdpContext, b: *mut CookieBuf, l3: usize, v4: bool) -> *mut core::ffi::c_void {
    let Some(ip) = parse::header(ctx, l3, if v4 { 20 } else { 40 }) else {
        return core::ptr::null_mut();
    };
    let Some(th) = parse::header(ctx, l3 + if v4 { 20 } else { 40 }, 20) else {
        return core::ptr::null_mut();
    };
    // SAFETY: `b` is this CPU's buffer; the union's fields are plain bytes.
    let size = unsafe {
        let t = &raw mut (*b).tuple.__bindgen_anon_1;
        if v4 {
            (*t).ipv4.saddr = ip.field(12);
            (*t).ipv4.daddr = ip.field(16);
            (*t).ipv4.sport = th.field(0);
            (*t).ipv4.dport = th.field(2);
            12
        } else {
            (*t).ipv6.saddr = ip.field(8);
            (*t).ipv6.daddr = ip.field(24);
            (*t).ipv6.sport = th.field(0);
            (*t).ipv6.dport = th.field(2);
            36
        }
    };
    // SAFETY: the helper reads `size` bytes of the tuple; its result is released by the
    // caller. `u32::MAX` as the netns: the device's own.
    unsafe {
        bpf_skc_lookup_tcp(
            ctx.ctx as *mut _,
            &raw mut (*b).tuple,
            size,
            u32::MAX as u64,
            0,
        ) as *mut core::ffi::c_void
    }
}

/// The SYN's TCP header at `l4` as the cookie helper reads it, in `b`: its 20 bytes, with its
/// MSS (or what the kernel assumes without one) as the one option (the helper takes the
/// header's whole length from `doff`).
#[inline(always)]
fn syn_header(ctx: &XdpContext, b: *mut CookieBuf, l4: usize, v4: bool) -> bool {
    let Some(th) = parse::header(ctx, l4, 20) else {
        return false;
    };
    let doff = ((th.field::<u8>(12) >> 4) as usize) * 4;
    let mss = syn_mss(ctx, l4, doff, if v4 { 536 } else { 1220 });
    let Some(th) = parse::header(ctx, l4, 20) else {
        return false;
    };
    // SAFETY: this CPU's buffer, written byte-wise from a checked header.
    unsafe {
        let d = &raw mut (*b).th as *mut u8;
        for i in 0..20 {
            *d.add(i) = th.field(i);
        }
        *d.add(12) = 0x60;
        *d.add(20) = 2;
        *d.add(21) = 4;
        core::ptr::write_unaligned(d.add(22) as *mut [u8; 2], mss.to_be_bytes());
    }
    true
}

/// The MSS option of the SYN whose TCP header is at `l4`, or `default`. The first few options
/// are looked at, as a listener would find them.
#[inline(always)]
fn syn_mss(ctx: &XdpContext, l4: usize, doff: usize, default: u16) -> u16 {
    let mut o = 20usize;
    for _ in 0..8 {
        if o + 4 > doff || o > 56 {
            break;
        }
        let Some(p) = parse::header(ctx, l4 + o, 4) else {
            break;
        };
        let kind: u8 = p.field(0);
        if kind == 0 {
            break;
        }
        if kind == 1 {
            o += 1;
            continue;
        }
        let l = p.field::<u8>(1) as usize;
        if kind == 2 && l == 4 {
            return p.field16(2);
        }
        if l < 2 {
            break;
        }
        o += l;
    }
    default
}

/// Turn the SYN at `l3` into its SYN-ACK: addresses and ports swapped, sequence number
/// `cookie`, the MSS option, checksums; the frame cut (or grown) to fit.
#[inline(always)]
fn write_reply(ctx: &XdpContext, l3: usize, v4: bool, cookie: u32, mss: u16) -> bool {
    let ip_len = if v4 { 20 } else { 40 };
    let want = l3 + ip_len + REPLY_TCP_LEN;
    let have = ctx.data_end() - ctx.data();
    if have != want {
        // SAFETY: the helper moves the frame's end; every pointer is taken anew after it.
        if unsafe { bpf_xdp_adjust_tail(ctx.ctx, want as i32 - have as i32) } != 0 {
            return false;
        }
    }
    let Some(eth) = parse::header(ctx, 0, 12) else {
        return false;
    };
    let Some(ip) = parse::header(ctx, l3, ip_len) else {
        return false;
    };
    let Some(tcp) = parse::header(ctx, l3 + ip_len, REPLY_TCP_LEN) else {
        return false;
    };
    let (e, i, t) = (
        eth.ptr() as *mut u8,
        ip.ptr() as *mut u8,
        tcp.ptr() as *mut u8,
    );
    // SAFETY: writes inside the three headers the checks above cover.
    unsafe {
        swap::<6>(e, e.add(6));
        let peer_seq = u32::from_be_bytes(tcp.field(4));
        swap::<2>(t, t.add(2));
        put(t.add(4), &cookie.to_be_bytes());
        put(t.add(8), &peer_seq.wrapping_add(1).to_be_bytes());
        // doff 6, SYN|ACK, a window of ten segments, no urgent pointer, the MSS option.
        let window = (mss as u32 * 10).min(65535) as u16;
        put(t.add(12), &[0x60, 0x12]);
        put(t.add(14), &window.to_be_bytes());
        put(t.add(16), &[0, 0, 0, 0]);
        put(t.add(20), &[2, 4]);
        put(t.add(22), &mss.to_be_bytes());
        let mut sum: u64 = IPPROTO_TCP as u64 + REPLY_TCP_LEN as u64;
        if v4 {
            swap::<4>(i.add(12), i.add(16));
            put(
                i,
                &[
                    0x45,
                    0,
                    0,
                    (20 + REPLY_TCP_LEN) as u8,
                    0,
                    0,
                    0x40,
                    0,
                    64,
                    IPPROTO_TCP,
                ],
            );
            put(i.add(10), &[0, 0]);
            let ip_sum = fold(words::<20>(i));
            put(i.add(10), &ip_sum.to_be_bytes());
            sum += words::<8>(i.add(12));
        } else {
            swap::<16>(i.add(8), i.add(24));
            put(i, &[0x60, 0, 0, 0, 0, REPLY_TCP_LEN as u8, IPPROTO_TCP, 64]);
            sum += words::<32>(i.add(8));
        }
        sum += words::<REPLY_TCP_LEN>(t);
        put(t.add(16), &fold(sum).to_be_bytes());
    }
    true
}

/// Swap `N` bytes at `a` and `b`.
///
/// # Safety
/// Both ranges are inside checked packet headers and do not overlap.
#[inline(always)]
unsafe fn swap<const N: usize>(a: *mut u8, b: *mut u8) {
    // SAFETY: the caller's ranges.
    unsafe {
        let x = core::ptr::read_unaligned(a as *const [u8; N]);
        core::ptr::write_unaligned(
            a as *mut [u8; N],
            core::ptr::read_unaligned(b as *const [u8; N]),
        );
        core::ptr::write_unaligned(b as *mut [u8; N], x);
    }
}

/// Write `bytes` at `p`.
///
/// # Safety
/// The range is inside a checked packet header.
#[inline(always)]
unsafe fn put<const N: usize>(p: *mut u8, bytes: &[u8; N]) {
    // SAFETY: the caller's range.
    unsafe { core::ptr::write_unaligned(p as *mut [u8; N], *bytes) }
}

/// The sum of the `N / 2` big-endian 16-bit words at `p`.
///
/// # Safety
/// The range is inside a checked packet header.
#[inline(always)]
unsafe fn words<const N: usize>(p: *const u8) -> u64 {
    let mut s = 0u64;
    for k in 0..N / 2 {
        // SAFETY: the caller's range.
        s += u16::from_be_bytes(unsafe {
            core::ptr::read_unaligned(p.add(2 * k) as *const [u8; 2])
        }) as u64;
    }
    s
}

/// The Internet checksum of a one's-complement sum.
#[inline(always)]
fn fold(mut s: u64) -> u16 {
    s = (s & 0xffff_ffff) + (s >> 32);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    !(s as u16)
}
