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
//!   own test) is passed, and the kernel makes the connection from it. Its source is proven.
//! * **A packet of a connection the kernel holds** (half-open or established: the kernel checks
//!   its sequence numbers) is passed; one of an established connection proves its source.
//!
//! A packet passed this way has met every rule: only those that refused its source state
//! dropped it (`rules::evaluate_rules` goes on past them for such a packet). Only what is addressed to this host is looked at (a unicast
//! frame to a destination this host owns, from a source that is not an IPv4 martian: see
//! [`for_this_host`]), and at most
//! `GlobalConfig::syn_answer_tick_cap` packets a tick on each CPU: the rest are dropped as the
//! rules said. That bounds the SYN-ACKs a flood gets back (never more than one, no larger, per
//! SYN), what reaches the stack, and the socket lookups it costs.
//!
//! A proven source (`RL_PROVEN`, by its whole address) gets state of its own without the
//! admission budget (`admission::state_for`; this CPU's share of the tick still applies), for
//! [`PROVEN_TTL_NS`]. A handshake proves the one address it came from, whatever prefix a rule
//! keys its sources by: one client of an IPv6 /64 does not vouch for the rest of it (under a
//! rule with `ipv6_prefix` above 64 they would each get state past the budget). And one /64
//! proves at most [`PROVEN_PER_NET`] addresses in a [`PROVEN_TTL_NS`] (`RL_PROVEN_NETS`), so
//! a holder of a /64 completing handshakes from many of its addresses fills neither the store
//! past the budget nor `RL_PROVEN`.
//!
//! A cookie SYN-ACK carries one option, the MSS the cookie encodes (at most what the device's
//! MTU carries). So a connection made from
//! a cookie here has no window scaling, SACK or timestamps, like the kernel's own cookie
//! connections without timestamps; a proven source's later connections go through the
//! kernel's handshake with every option.

#![expect(
    clippy::needless_borrows_for_generic_args,
    reason = "map keys are passed by reference on purpose: a key read from this CPU's cookie buffer stays there (a copy by value would go on the stack, which 6.1's combined stack bound refuses here)"
)]

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_FWD_DISABLED, BPF_FIB_LKUP_RET_NOT_FWDED, bpf_fib_lookup as FibLookup,
        bpf_sock, bpf_sock_tuple, tcphdr, xdp_md,
    },
    helpers::{
        bpf_check_mtu, bpf_fib_lookup, bpf_sk_release, bpf_skc_lookup_tcp, bpf_tcp_check_syncookie,
        bpf_tcp_gen_syncookie, bpf_xdp_adjust_tail, bpf_xdp_load_bytes,
    },
    macros::map,
    maps::{Array, HashMap, LruHashMap, PerCpuArray},
    programs::XdpContext,
};
use ratelimit_common::{
    addr::IpKey,
    caps::{MAX_LOCAL_ADDRS, MAX_PROVEN_SOURCES},
    proto::*,
    stats::global,
};

use crate::{
    atomic,
    parse::{self, Parsed},
    scratch::RuleLoop,
};

/// Proven sources (a cookie's ACK, or an established connection) and when they were proven
/// (ns, coarse clock), by their whole address (the 16-byte `IpKey`).
#[map(name = "RL_PROVEN")]
static PROVEN: LruHashMap<[u8; 16], u64> = LruHashMap::with_max_entries(MAX_PROVEN_SOURCES, 0);

/// Per IPv6 /64 (its first 8 bytes): the addresses of it proven in the current span of
/// [`PROVEN_TTL_NS`] (see [`prove`]).
#[map(name = "RL_PROVEN_NETS")]
static PROVEN_NETS: LruHashMap<u64, ProvenNet> =
    LruHashMap::with_max_entries(MAX_PROVEN_SOURCES, 0);

#[repr(C)]
pub struct ProvenNet {
    /// When the span began (coarse ns).
    since: u64,
    /// Addresses proven in it.
    count: u64,
}

/// The addresses of one IPv6 /64 proven in a [`PROVEN_TTL_NS`] at most: the most that a holder
/// of a /64 gets state for without the admission budget.
pub const PROVEN_PER_NET: u64 = 16;

/// The addresses this host owns (the 16-byte `IpKey` of each; kept by the daemon from the
/// addresses of its network namespace's interfaces): on a host that forwards nothing, the
/// only destinations answered (see [`for_this_host`]).
#[map(name = "RL_LOCAL_ADDRS")]
static LOCAL_ADDRS: HashMap<[u8; 16], u8> = HashMap::with_max_entries(MAX_LOCAL_ADDRS, 0);

/// `[0]`: when some source was last proven (coarse ns), written at most once a second.
#[map(name = "RL_COOKIE_TIME")]
static TIMES: Array<u64> = Array::with_max_entries(1, 0);
const PROVED: u32 = 0;

/// Per CPU: the socket lookup's tuple, the SYN's TCP header as the cookie helper reads it,
/// the route lookup's parameters, and this CPU's answers in its current tick.
#[map(name = "RL_COOKIE_BUF")]
pub(crate) static BUF: PerCpuArray<CookieBuf> = PerCpuArray::with_max_entries(1, 0);

#[repr(C)]
pub(crate) struct CookieBuf {
    tuple: bpf_sock_tuple,
    _pad: u32,
    /// A TCP header with one option, the SYN's MSS (`doff` = 6).
    th: [u8; 24],
    fib: FibLookup,
    /// The tick of `answers`, and how many packets this CPU looked at in it.
    tick: u64,
    answers: u64,
    /// The SYN's TCP options (at most 40 bytes), copied for [`rl_syn_mss`]; 64 so that any
    /// index masked with 63 is inside it.
    opts: [u8; 64],
    /// The packet's destination as an `IpKey`, the key of [`LOCAL_ADDRS`].
    dst: [u8; 16],
}

/// How long a proven source skips the admission budget.
pub const PROVEN_TTL_NS: u64 = 600_000_000_000;
/// A proven source's entry is renewed (an LRU update) at most this often.
const PROVEN_RENEW_NS: u64 = 60_000_000_000;

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
pub(crate) const TCP_ACK: u8 = 0x10;

/// Socket states (`include/net/tcp_states.h`).
const TCP_ESTABLISHED: u32 = 1;
const TCP_TIME_WAIT: u32 = 6;
pub(crate) const TCP_LISTEN: u32 = 10;
const TCP_NEW_SYN_RECV: u32 = 12;

/// `ENOENT`: `bpf_tcp_gen_syncookie` makes no cookie because the listener's SYN queue has room
/// (or its accept queue is full, where the kernel drops the SYN itself).
const ENOENT: i64 = 2;

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

#[inline(always)]
fn is_v4(src: &IpKey) -> bool {
    let p = &src.addr as *const [u8; 16] as *const u32;
    // SAFETY: 4-byte loads inside a 16-byte array (an IPv4 source is `::ffff:a.b.c.d`).
    unsafe {
        core::ptr::read_unaligned(p) == 0
            && core::ptr::read_unaligned(p.add(1)) == 0
            && core::ptr::read_unaligned(p.add(2)) == u32::from_be(0xffff)
    }
}

/// A pointer to `src`'s address copied into this CPU's buffer (a map value, which every
/// kernel takes as a map key, and costs no stack: the rules' global function, where `src` is
/// an argument the 6.1 verifier takes as no key, has no room left on its stack). `dst` is
/// free here: [`for_this_host`] writes it anew for each packet before it reads it.
#[inline(always)]
fn key_in_buf(src: &IpKey) -> Option<*const [u8; 16]> {
    let b = BUF.get_ptr_mut(0)?;
    // SAFETY: this CPU's buffer; two 8-byte copies from a live 16-byte array.
    unsafe {
        let s = &src.addr as *const [u8; 16] as *const u64;
        let d = &raw mut (*b).dst as *mut u64;
        core::ptr::write_unaligned(d, core::ptr::read_unaligned(s));
        core::ptr::write_unaligned(d.add(1), core::ptr::read_unaligned(s.add(1)));
        Some(&raw const (*b).dst)
    }
}

/// Whether `src` was proven within [`PROVEN_TTL_NS`] (looked up only if some source was).
#[inline(always)]
pub fn is_proven(src: &IpKey, now: u64) -> bool {
    if !recent(PROVED, now, PROVEN_TTL_NS) {
        return false;
    }
    let Some(key) = key_in_buf(src) else {
        return false;
    };
    // SAFETY: a lookup with a key in this CPU's buffer; the value is copied out.
    match unsafe { PROVEN.get(&*key) } {
        Some(&t) => now.wrapping_sub(t) < PROVEN_TTL_NS,
        None => false,
    }
}

/// Record `src` as proven; true if it was not already (within [`PROVEN_RENEW_NS`]). A new
/// proof of an IPv6 address counts against its /64's [`PROVEN_PER_NET`] (a renewal does not):
/// over it, the address is not recorded (its packets go on through the admission budget).
#[inline(always)]
fn prove(src: &IpKey, now: u64) -> bool {
    let Some(key) = key_in_buf(src) else {
        return false;
    };
    // SAFETY: a lookup with a key in this CPU's buffer; the value is copied out.
    let renewal = match unsafe { PROVEN.get(&*key) } {
        Some(&t) if now.wrapping_sub(t) < PROVEN_RENEW_NS => return false,
        Some(&t) => now.wrapping_sub(t) < PROVEN_TTL_NS,
        None => false,
    };
    if !renewal && !is_v4(src) && !net_has_room(src, now) {
        return false;
    }
    // A full map evicts its least recently used source.
    // SAFETY: the key in this CPU's buffer, unchanged since `key_in_buf`.
    let _ = PROVEN.insert(unsafe { &*key }, &now, 0);
    stamp(PROVED, now);
    true
}

/// Whether the /64 of the IPv6 source `src` may prove one more address now (and if so, that
/// one is counted): fewer than [`PROVEN_PER_NET`] in the current span.
#[inline(always)]
fn net_has_room(src: &IpKey, now: u64) -> bool {
    // SAFETY: the first 8 bytes of a 16-byte array.
    let net = unsafe { core::ptr::read_unaligned(&src.addr as *const [u8; 16] as *const u64) };
    match PROVEN_NETS.get_ptr_mut(&net) {
        // SAFETY: a live map value; 8-byte loads and stores (a race between CPUs may let a
        // proof or two more through, never fewer).
        Some(p) => unsafe {
            if now.wrapping_sub(atomic::load(&raw const (*p).since)) >= PROVEN_TTL_NS {
                atomic::store(&raw mut (*p).since, now);
                atomic::store(&raw mut (*p).count, 1);
                return true;
            }
            if atomic::load(&raw const (*p).count) >= PROVEN_PER_NET {
                return false;
            }
            atomic::add(&raw mut (*p).count, 1);
            true
        },
        None => {
            let _ = PROVEN_NETS.insert(
                &net,
                &ProvenNet {
                    since: now,
                    count: 1,
                },
                0,
            );
            true
        }
    }
}

/// Whether [`answer`] may answer or pass `pkt`: a TCP SYN (no other of SYN, ACK, RST, FIN),
/// or a TCP segment with ACK and without SYN, whose header was read.
#[inline(always)]
pub fn may_answer(pkt: &Parsed) -> bool {
    let f = pkt.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST | TCP_FIN);
    pkt.proto == IPPROTO_TCP
        && pkt.l4
        && !pkt.fragment
        && (f == TCP_SYN || (f & TCP_SYN == 0 && f & TCP_ACK != 0))
}

/// [`answer`]: drop the packet (as the rules said).
pub const ANSWER_NONE: u64 = 0;
/// [`answer`]: the frame is now a SYN-ACK with a cookie; send it back out (`XDP_TX`).
pub const ANSWER_TX: u64 = 1;
/// [`answer`]: pass the packet (every rule but those that refused its source state passed
/// it); the reason to count (a `stats::global` index, 0 for none) is in the bits above 8, and
/// [`ANSWER_PROVEN`] if the packet proved its source.
pub const ANSWER_PASS: u64 = 2;
pub const ANSWER_PROVEN: u64 = 1 << 40;

/// A second look at a TCP packet the rules dropped because its source was refused state (see
/// the module's documentation): [`ANSWER_NONE`], [`ANSWER_TX`] or [`ANSWER_PASS`]. Counts
/// nothing itself. At most `GlobalConfig::syn_answer_tick_cap` packets a tick on each CPU
/// are looked at (the rest are dropped as the rules said): that bounds the replies a flood
/// gets, the packets handed to the stack, and the socket lookups it costs.
///
/// A static function (not inlined, and not a global BPF function: it resizes the frame,
/// which the verifier tracks through global functions only from 6.13): its stack is not added
/// to the entry's, which the rules' call chain needs.
#[inline(never)]
pub fn answer(ctx: *mut xdp_md, rl: *const RuleLoop, cap: u64) -> u64 {
    let ctx = XdpContext::new(ctx);
    // SAFETY: this CPU's scratch record, written by the rules for this packet.
    let rl = unsafe { &*rl };
    if !may_answer(&rl.pkt) {
        return ANSWER_NONE;
    }
    // One copy per family: the verifier walks each without the other's branches (a family
    // flag tested at every step, and reloaded from the stack between, doubles its paths at
    // each test).
    if rl.pkt.v4 {
        answer_af::<true>(&ctx, rl, cap)
    } else {
        answer_af::<false>(&ctx, rl, cap)
    }
}

#[inline(always)]
fn answer_af<const V4: bool>(ctx: &XdpContext, rl: &RuleLoop, cap: u64) -> u64 {
    let pkt = &rl.pkt;
    let syn = pkt.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST | TCP_FIN) == TCP_SYN;
    let Some(b) = BUF.get_ptr_mut(0) else {
        return ANSWER_NONE;
    };
    // SAFETY: this CPU's buffer; an XDP program runs to completion on its CPU.
    unsafe {
        if (*b).tick != rl.tick {
            (*b).tick = rl.tick;
            (*b).answers = 0;
        }
        if (*b).answers >= cap {
            return ANSWER_NONE;
        }
        (*b).answers += 1;
    }
    let Some((l3, ip_len)) = headers::<V4>(ctx) else {
        return ANSWER_NONE;
    };
    if syn && !syn_header::<V4>(ctx, b, l3 + ip_len) {
        return ANSWER_NONE;
    }
    // Only what is addressed to this host: a unicast frame, to an address the host's routes
    // call local (or on a host that forwards nothing, one of its interfaces' addresses).
    if for_this_host::<V4>(ctx, b, l3) != Dest::Here {
        return ANSWER_NONE;
    }
    let sk = lookup::<V4>(ctx, b, l3);
    if sk.is_null() {
        return ANSWER_NONE;
    }
    // SAFETY: a socket the lookup returned; `state` is a field its type allows reading.
    let state = unsafe { core::ptr::read_volatile(&raw const (*(sk as *const bpf_sock)).state) };
    let mut cookie = -1i64;
    let mut valid_ack = false;
    if state == TCP_LISTEN
        && let (Some(ip), Some(th)) = (
            parse::header(ctx, l3, if V4 { 20 } else { 40 }),
            parse::header(ctx, l3 + ip_len, 20),
        )
    {
        let (iph, iph_len) = (ip.ptr() as *mut core::ffi::c_void, ip_len as u32);
        if syn {
            // SAFETY: `sk` is the lookup's reference; the helper reads the checked IP header
            // and the buffer's 24 bytes.
            cookie = unsafe {
                bpf_tcp_gen_syncookie(sk, iph, iph_len, &raw mut (*b).th as *mut tcphdr, 24)
            };
        } else {
            // The kernel's own test: the listener sent cookies lately (ours or its own) and
            // this one is valid.
            // SAFETY: as above; the helper reads the checked headers.
            valid_ack =
                unsafe { bpf_tcp_check_syncookie(sk, iph, iph_len, th.ptr() as *mut tcphdr, 20) }
                    == 0;
        }
    }
    // SAFETY: the reference the lookup returned, released once.
    unsafe { bpf_sk_release(sk) };
    if syn {
        return match state {
            TCP_LISTEN if cookie >= 0 => {
                let mss = clamp_mss::<V4>(ctx, (cookie >> 32) as u16);
                if write_reply::<V4>(ctx, l3, cookie as u32, mss) {
                    ANSWER_TX
                } else {
                    ANSWER_NONE
                }
            }
            // The listener's SYN queue has room (the kernel makes no cookie): its turn. Any
            // other failure (syncookies off, no IPv6 in this kernel's cookies): dropped.
            TCP_LISTEN if cookie == -ENOENT => pass(global::SYN_TO_LISTENER, false),
            // A retransmitted SYN of a handshake the kernel holds, or a new one on a tuple in
            // TIME_WAIT: the kernel answers it.
            TCP_NEW_SYN_RECV | TCP_TIME_WAIT => pass(global::CONNECTION_PASSED, false),
            _ => ANSWER_NONE,
        };
    }
    if state == TCP_LISTEN {
        if !valid_ack {
            return ANSWER_NONE;
        }
        return pass(0, prove(&pkt.src, rl.coarse_now));
    }
    // A packet of a connection the kernel holds, which checks its sequence numbers (an
    // established connection proves its source).
    let proved = state == TCP_ESTABLISHED && prove(&pkt.src, rl.coarse_now);
    pass(global::CONNECTION_PASSED, proved)
}

#[inline(always)]
fn pass(reason: u32, proved: bool) -> u64 {
    ANSWER_PASS | (reason as u64) << 8 | if proved { ANSWER_PROVEN } else { 0 }
}

/// Where [`for_this_host`] says a packet goes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dest {
    /// To this host, from a source its stack takes.
    Here,
    /// Elsewhere: not to this host (forwarded, or not unicast to it), or unreadable.
    Elsewhere,
    /// An IPv4 source the stack discards as a martian (`ip_route_input_slow`: 0/8, 127/8,
    /// multicast 224/4, the limited broadcast 255.255.255.255; not class E 240/4, which it
    /// takes).
    Martian,
}

/// Whether the packet at `l3` is addressed to this host: a unicast destination MAC, and a
/// destination the routing table calls local (`BPF_FIB_LKUP_RET_NOT_FWDED`), or, on a device
/// that forwards nothing (`BPF_FIB_LKUP_RET_FWD_DISABLED`: the route lookup says nothing
/// more there), an address of this host's interfaces ([`LOCAL_ADDRS`], which the daemon
/// keeps). A listener bound to the wildcard address matches any destination, so the socket
/// lookup alone would have a SYN to any address that reaches the NIC answered from it.
/// An IPv4 source the stack would discard as a martian is [`Dest::Martian`].
#[inline(always)]
pub(crate) fn for_this_host<const V4: bool>(
    ctx: &XdpContext,
    b: *mut CookieBuf,
    l3: usize,
) -> Dest {
    let Some(eth) = parse::header(ctx, 0, 6) else {
        return Dest::Elsewhere;
    };
    if eth.field::<u8>(0) & 1 != 0 {
        return Dest::Elsewhere;
    }
    // SAFETY: this CPU's buffer; plain data for the helper. Each family checks its own header
    // length in its own branch (a length chosen by a flag reloaded from the stack is one the
    // verifier cannot follow).
    unsafe {
        let p = &raw mut (*b).fib;
        core::ptr::write_bytes(p as *mut u8, 0, core::mem::size_of::<FibLookup>());
        (*p).ifindex = ctx.ingress_ifindex() as u32;
        (*p).l4_protocol = IPPROTO_TCP;
        if V4 {
            let Some(ip) = parse::header(ctx, l3, 20) else {
                return Dest::Elsewhere;
            };
            let a: u8 = ip.field(12);
            if a == 0 || a == 127 || a & 0xf0 == 224 || ip.field::<u32>(12) == u32::MAX {
                return Dest::Martian;
            }
            (*p).family = 2; // AF_INET
            (*p).__bindgen_anon_3.ipv4_src = ip.field(12);
            (*p).__bindgen_anon_4.ipv4_dst = ip.field(16);
            // `::ffff:a.b.c.d`, as an `IpKey` holds it.
            let d = &raw mut (*b).dst as *mut u8;
            core::ptr::write_unaligned(d as *mut u64, 0);
            core::ptr::write_unaligned(d.add(8) as *mut u32, u32::from_be(0xffff));
            core::ptr::write_unaligned(d.add(12) as *mut u32, ip.field::<u32>(16));
        } else {
            let Some(ip) = parse::header(ctx, l3, 40) else {
                return Dest::Elsewhere;
            };
            (*p).family = 10; // AF_INET6
            (*p).__bindgen_anon_3.ipv6_src = ip.field(8);
            (*p).__bindgen_anon_4.ipv6_dst = ip.field(24);
            core::ptr::write_unaligned(
                &raw mut (*b).dst as *mut [u32; 4],
                ip.field::<[u32; 4]>(24),
            );
        }
        let rc = bpf_fib_lookup(
            ctx.ctx as *mut _,
            p,
            core::mem::size_of::<FibLookup>() as i32,
            0,
        );
        if rc == BPF_FIB_LKUP_RET_NOT_FWDED as i64
            || (rc == BPF_FIB_LKUP_RET_FWD_DISABLED as i64 && LOCAL_ADDRS.get(&(*b).dst).is_some())
        {
            Dest::Here
        } else {
            Dest::Elsewhere
        }
    }
}

/// The MSS the SYN-ACK offers: the cookie's (what the client can take), at most what the
/// ingress device's MTU carries (what the kernel would offer: MTU - 40, or - 60 for IPv6).
#[inline(always)]
fn clamp_mss<const V4: bool>(ctx: &XdpContext, mss: u16) -> u16 {
    let mut mtu: u32 = 0;
    // SAFETY: the helper writes the device's MTU into `mtu`.
    let rc = unsafe { bpf_check_mtu(ctx.ctx as *mut _, 0, &mut mtu, 0, 0) };
    let hdrs = if V4 { 40 } else { 60 };
    if rc < 0 || mtu <= hdrs {
        return mss;
    }
    mss.min((mtu - hdrs).min(u16::MAX as u32) as u16)
}

/// Where the IP header starts and its length, for a packet whose TCP header follows a fixed
/// IP header directly (no IPv4 options, no IPv6 extension header): anything else is not
/// answered.
#[inline(always)]
pub(crate) fn headers<const V4: bool>(ctx: &XdpContext) -> Option<(usize, usize)> {
    let l3 = parse::l3_offset(ctx)?;
    if V4 {
        let h = parse::header(ctx, l3, 20)?;
        // No options, TCP, and not a fragment (neither more fragments nor an offset).
        if h.field::<u8>(0) != 0x45 || h.field::<u8>(9) != IPPROTO_TCP || h.field16(6) & 0x3fff != 0
        {
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
pub(crate) fn lookup<const V4: bool>(
    ctx: &XdpContext,
    b: *mut CookieBuf,
    l3: usize,
) -> *mut core::ffi::c_void {
    let Some(ip) = parse::header(ctx, l3, if V4 { 20 } else { 40 }) else {
        return core::ptr::null_mut();
    };
    let Some(th) = parse::header(ctx, l3 + if V4 { 20 } else { 40 }, 20) else {
        return core::ptr::null_mut();
    };
    // SAFETY: `b` is this CPU's buffer; the union's fields are plain bytes.
    let size = unsafe {
        let t = &raw mut (*b).tuple.__bindgen_anon_1;
        if V4 {
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
/// header's whole length from `doff`). False for a SYN signed with TCP-MD5 or TCP-AO, which a
/// reply without the signature would not serve.
#[inline(always)]
fn syn_header<const V4: bool>(ctx: &XdpContext, b: *mut CookieBuf, l4: usize) -> bool {
    let Some(th) = parse::header(ctx, l4, 20) else {
        return false;
    };
    let doff = ((th.field::<u8>(12) >> 4) as usize) * 4;
    let Some(mss) = syn_mss(ctx, b, l4, doff, if V4 { 536 } else { 1220 }) else {
        return false;
    };
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

/// The MSS option of the SYN whose TCP header is at `l4`, or `default`; `None` if it carries
/// a TCP-MD5 (19) or TCP-AO (29) option. The options are copied into `b` and walked there by
/// [`rl_syn_mss`], a global BPF function, which the verifier walks once instead of on every
/// path into it.
#[inline(always)]
fn syn_mss(
    ctx: &XdpContext,
    b: *mut CookieBuf,
    l4: usize,
    doff: usize,
    default: u16,
) -> Option<u16> {
    if doff <= 20 {
        return Some(default);
    }
    // Masked: a length the verifier can bound (1 to 40) for the copy.
    let len = (doff - 20) & 0x3f;
    if len == 0 || len > 40 {
        return None;
    }
    // SAFETY: the helper copies `len` (1 to 40) bytes of the frame into this CPU's buffer.
    let rc = unsafe {
        bpf_xdp_load_bytes(
            ctx.ctx,
            (l4 + 20) as u32,
            &raw mut (*b).opts as *mut core::ffi::c_void,
            len as u32,
        )
    };
    if rc != 0 {
        return None;
    }
    match rl_syn_mss(b, len as u64) {
        SIGNED => None,
        0 => Some(default),
        mss => Some(mss as u16),
    }
}

/// [`rl_syn_mss`]: the SYN carries TCP-MD5 or TCP-AO.
const SIGNED: u64 = u64::MAX;

/// The MSS in the first `len` bytes of TCP options at `b.opts` (0 for none), or [`SIGNED`].
/// Eight options at most are looked at.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_syn_mss(b: *mut CookieBuf, len: u64) -> u64 {
    if b.is_null() {
        return 0;
    }
    // SAFETY: this CPU's buffer; every index is masked into the array (a bound the verifier
    // follows, where a comparison made on a copy of the index is lost to it).
    let opts = unsafe { &(*b).opts };
    // The index read back through a volatile load, so that the compiler keeps the mask (it
    // would drop it as implied by the loop's comparisons, which the verifier sees on a copy).
    let at = |i: usize| {
        // SAFETY: a volatile read of a local.
        opts[unsafe { core::ptr::read_volatile(&i) } & 63]
    };
    let len = (len as usize).min(40);
    let mut mss = 0u64;
    let mut o = 0usize;
    for _ in 0..8 {
        if o >= len {
            break;
        }
        let kind = at(o);
        if kind == 0 {
            break;
        }
        if kind == 1 {
            o += 1;
            continue;
        }
        if kind == 19 || kind == 29 {
            return SIGNED;
        }
        if o + 1 >= len {
            break;
        }
        let l = at(o + 1) as usize;
        if kind == 2 && l == 4 && o + 3 < len {
            mss = u16::from_be_bytes([at(o + 2), at(o + 3)]) as u64;
        }
        if l < 2 {
            break;
        }
        o += l;
    }
    mss
}

/// Turn the SYN at `l3` into its SYN-ACK: addresses and ports swapped, sequence number
/// `cookie`, the MSS option, checksums; the frame cut (or grown) to fit.
#[inline(always)]
fn write_reply<const V4: bool>(ctx: &XdpContext, l3: usize, cookie: u32, mss: u16) -> bool {
    let ip_len = if V4 { 20 } else { 40 };
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
        if V4 {
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
