//! A rule's match beyond protocol, TCP flags and destination ports (`RuleConfig::more` and
//! the flags `RULE_EXCEPT`, `RULE_DST_MATCH`, `RULE_TCP_STATE`), and what it asks of the frame.
//!
//! The rules run in a global BPF function without the frame ([`rl_rule`]). What only the frame
//! or a lookup answers (payload reads, the destinations trie, a socket lookup) is made once a
//! packet, before the rules, and only when some rule asks for it and the packet could meet it
//! ([`needs`], [`serve`]).
//!
//! L4 conditions (source ports, ICMP types and codes, payload) count as met by a non-first
//! fragment and by a packet whose L4 header could not be read, as destination ports do, so a
//! fragment flood cannot slip past them. `tcp_state` is judged like TCP flags: a non-first
//! fragment never meets it, a cut header always does.
//!
//! [`rl_rule`]: crate::rules::rl_rule

use aya_ebpf::{bindings::xdp_md, helpers::bpf_xdp_load_bytes, programs::XdpContext};
use ratelimit_common::{
    addr::IpKey,
    caps::{
        MAX_LENGTH_RANGES, MAX_PAYLOAD_FETCHES, MAX_PAYLOAD_MATCHES, MAX_RULES, MAX_SRC_PORT_RANGES,
    },
    maps::*,
};

use crate::{
    conn::{self, CONN_JUDGED_OK, CONN_NONE},
    parse::{self, Parsed},
    policy,
    scratch::{Ext, RuleLoop},
};

/// `RuleLoop::have`: the fields of [`Ext`], read from the frame.
pub const NEED_EXT: u32 = 1 << 3;
/// The payload reads of `GlobalConfig::fetches`.
pub const NEED_FETCH: u32 = 1 << 0;
/// The destinations trie's answer (`RuleLoop::dst_mask`).
pub const NEED_DST: u32 = 1 << 1;
/// Whether the TCP segment belongs to a connection (`RuleLoop::conn`).
pub const NEED_CONN: u32 = 1 << 2;

/// [`rl_match`]'s answer: the rule's other conditions hold.
pub const MATCHED: u64 = 1;

/// Whether rule `index` meets the packet in `rl` on its conditions beyond protocol, TCP flags
/// and destination ports, the source lists aside (`rules.rs` checks those): [`MATCHED`] or 0.
/// A global BPF function: verified once, and its stack is its own, not `rl_rule`'s.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_match(index: u64, rl: *const RuleLoop) -> u64 {
    if rl.is_null() || index >= MAX_RULES as u64 {
        return 0;
    }
    let Some(rule) = policy::rule(index as u32) else {
        return 0;
    };
    // SAFETY: non-null pointer to this CPU's scratch record.
    check(index as u32, rule, unsafe { &*rl }) as u64
}

#[inline(always)]
fn check(i: u32, rule: &RuleConfig, rl: &RuleLoop) -> bool {
    if rule.flags & RULE_MORE_MATCH != 0
        && (rl.have & NEED_EXT == 0 || !more(rule, &rl.pkt, &rl.ext))
    {
        return false;
    }
    let pkt = &rl.pkt;
    let l4_unknown = pkt.fragment || pkt.l4_cut;
    if rule.flags & RULE_MORE_MATCH != 0 && !l4_unknown && has_payload(&rule.more) {
        if !pkt.l4 {
            return false;
        }
        if rl.have & NEED_FETCH == 0 || !payload(&rule.more, rl) {
            return false;
        }
    }
    if rule.flags & RULE_DST_MATCH != 0
        && (rl.have & NEED_DST == 0 || rl.dst_mask & (1 << (i & 31)) == 0)
    {
        return false;
    }
    if rule.flags & RULE_TCP_STATE != 0 {
        let pkt = &rl.pkt;
        if pkt.proto != PROTO_TCP {
            return false;
        }
        if !pkt.l4_cut {
            if !pkt.l4 || pkt.fragment || pkt.tcp_flags & TCP_SYN != 0 {
                return false;
            }
            if rl.have & NEED_CONN == 0 || rl.conn != CONN_NONE {
                return false;
            }
        }
    }
    true
}

const TCP_SYN: u8 = 0x02;

#[inline(always)]
fn has_payload(m: &MoreMatch) -> bool {
    m.payload[0].fetch != 0 || m.payload[1].fetch != 0
}

/// Whether `v` lies in one of the first `n` of `ranges` (a bound the verifier can follow).
#[inline(always)]
fn in_ranges<const N: usize>(ranges: &[PortRange; N], n: u8, v: u16) -> bool {
    for (j, r) in ranges.iter().enumerate() {
        if j >= n as usize {
            break;
        }
        if r.holds(v) {
            return true;
        }
    }
    false
}

/// Length, TTL, fragments, source ports, ICMP types and codes.
#[inline(always)]
fn more(rule: &RuleConfig, pkt: &Parsed, ext: &Ext) -> bool {
    let m = &rule.more;
    if m.length_count != 0
        && !in_ranges::<MAX_LENGTH_RANGES>(&m.lengths, m.length_count, ext.ip_len)
    {
        return false;
    }
    if m.ttl_count != 0 && !in_ranges::<MAX_LENGTH_RANGES>(&m.ttls, m.ttl_count, ext.ttl as u16) {
        return false;
    }
    let frag_ok = match m.fragment {
        FRAGMENT_ANY => pkt.fragmented(),
        FRAGMENT_LATER => pkt.fragment,
        FRAGMENT_NONE => !pkt.fragmented(),
        _ => true,
    };
    if !frag_ok {
        return false;
    }
    if pkt.fragment || pkt.l4_cut {
        return true;
    }
    if m.src_port_count != 0 {
        if !pkt.l4 || (pkt.proto != PROTO_TCP && pkt.proto != PROTO_UDP) {
            return false;
        }
        if !in_ranges::<MAX_SRC_PORT_RANGES>(&m.src_ports, m.src_port_count, ext.sport) {
            return false;
        }
    }
    if rule.flags & (RULE_ICMP_TYPES | RULE_ICMP_CODES) != 0 {
        if !pkt.l4 || (pkt.proto != PROTO_ICMP && pkt.proto != PROTO_ICMPV6) {
            return false;
        }
        if rule.flags & RULE_ICMP_TYPES != 0 && !bit_set(&m.icmp_types, ext.icmp_type) {
            return false;
        }
        if rule.flags & RULE_ICMP_CODES != 0 && !bit_set(&m.icmp_codes, ext.icmp_code) {
            return false;
        }
    }
    true
}

/// Every payload condition of `m` against the reads the packet got.
#[inline(always)]
fn payload(m: &MoreMatch, rl: &RuleLoop) -> bool {
    for j in 0..MAX_PAYLOAD_MATCHES {
        let p = &m.payload[j];
        let f = p.fetch as usize;
        if f == 0 {
            continue;
        }
        let k = (f - 1) & (MAX_PAYLOAD_FETCHES - 1);
        if f > MAX_PAYLOAD_FETCHES || rl.fetched_ok & (1 << k) == 0 {
            return false;
        }
        if rl.fetched[k] & p.mask != p.value {
            return false;
        }
    }
    true
}

/// Whether any rule of `g` asks anything of a packet beyond the parser's facts ([`needs`]
/// answers 0 for every packet otherwise).
#[inline(always)]
pub fn any_needs(g: &GlobalConfig) -> bool {
    g.fetch_count != 0
        || g.flags & (GLOBAL_DST_MATCH | GLOBAL_MORE_MATCH | GLOBAL_KEY_TUPLE | GLOBAL_TCP_STATE)
            != 0
}

/// What the rules of `g` ask of a packet like `pkt` beyond the parser's facts (`NEED_*`):
/// payload reads for a packet whose L4 header was read; the destinations trie's answer; a
/// socket lookup for a TCP segment without SYN whose header was read.
#[inline(always)]
pub fn needs(g: &GlobalConfig, pkt: &Parsed) -> u32 {
    let l4_read = pkt.l4 && !pkt.fragment && !pkt.l4_cut;
    let mut need = 0;
    if g.fetch_count != 0 && l4_read {
        need |= NEED_FETCH | NEED_EXT;
    }
    if g.flags & GLOBAL_DST_MATCH != 0 {
        need |= NEED_DST | NEED_EXT;
    }
    if g.flags & (GLOBAL_MORE_MATCH | GLOBAL_KEY_TUPLE) != 0 {
        need |= NEED_EXT;
    }
    if g.flags & GLOBAL_TCP_STATE != 0
        && l4_read
        && pkt.proto == PROTO_TCP
        && pkt.tcp_flags & TCP_SYN == 0
    {
        need |= NEED_CONN;
    }
    need
}

/// Make what the rules ask of this packet ([`needs`]) into `rl` (`eth`: non-zero if the frame
/// has an Ethernet header; a socket lookup is made only then). A global BPF function: the
/// verifier walks it once, whatever the states its callers reach it in (as a static function
/// it was walked again for each, which cost 6.1's verifier 176,000 instructions), and its
/// stack is its own. Its parts are static functions, called one after the other, so that
/// neither one's stack adds to the other's.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn rl_prepare(ctx: *mut xdp_md, rl: *mut RuleLoop, eth: u64) -> u64 {
    if ctx.is_null() || rl.is_null() {
        return 0;
    }
    // SAFETY: this CPU's scratch record, used only during this packet.
    let need = needs(policy::global(), unsafe { &(*rl).pkt });
    if need & NEED_EXT != 0 {
        if eth != 0 {
            read_frame::<true>(ctx, rl, need);
        } else {
            read_frame::<false>(ctx, rl, need);
        }
    }
    if need & NEED_CONN != 0 {
        let conn = if eth != 0 {
            // SAFETY: the scratch record's packet, written by the entry for this packet.
            conn::connection(ctx, unsafe { &raw const (*rl).pkt })
        } else {
            CONN_JUDGED_OK
        };
        // SAFETY: this CPU's scratch record, used only during this packet.
        unsafe { (*rl).conn = conn };
    }
    // SAFETY: as above.
    unsafe { (*rl).have = need };
    0
}

/// [`Ext`], then the payload reads and the destinations trie's answer.
#[inline(never)]
fn read_frame<const ETH: bool>(ctx: *mut xdp_md, rl: *mut RuleLoop, need: u32) {
    // SAFETY: this CPU's scratch record, used only during this packet.
    let rl = unsafe { &mut *rl };
    let ctx = XdpContext::new(ctx);
    read_ext::<ETH>(&ctx, rl);
    if need & NEED_FETCH != 0 {
        fetch(&ctx, rl);
    }
    if need & NEED_DST != 0 {
        rl.dst_key.set(&rl.ext.dst, rl.pkt.v4);
        // The key on the stack: 6.1 takes no global function's argument as a map key.
        let key = rl.dst_key.on_stack();
        rl.dst_mask = policy::dests_at(key.key());
    }
}

/// The fields of [`Ext`] from the headers the parser read (a header that is not there leaves
/// its fields 0).
#[inline(always)]
fn read_ext<const ETH: bool>(ctx: &XdpContext, rl: &mut RuleLoop) {
    let e = &mut rl.ext;
    *e = Ext {
        dst: IpKey { addr: [0; 16] },
        ip_len: 0,
        sport: 0,
        l4_hdr: 0,
        ttl: 0,
        icmp_type: 0,
        icmp_code: 0,
        _pad: [0; 3],
    };
    let l3 = if ETH { parse::l3_offset(ctx) } else { Some(0) };
    let Some(l3) = l3 else { return };
    if rl.pkt.v4 {
        if let Some(h) = parse::header(ctx, l3, 20) {
            e.dst = IpKey::from_v4(h.field(16));
            e.ip_len = h.field16(2);
            e.ttl = h.field(8);
        }
    } else if let Some(h) = parse::header(ctx, l3, 40) {
        e.dst = IpKey::from_v6(h.field(24));
        e.ip_len = h.field16(4).saturating_add(40);
        e.ttl = h.field(7);
    }
    let pkt = &rl.pkt;
    if !pkt.l4 || pkt.fragment || pkt.l4_cut {
        return;
    }
    // Bounded for the verifier (the parser never goes past `MAX_L4_OFFSET`).
    let l4 = pkt.l4_off() & 0x3ff;
    match pkt.proto {
        PROTO_TCP => {
            if let Some(h) = parse::header(ctx, l4, 20) {
                e.sport = h.field16(0);
                let doff = ((h.field::<u8>(12) >> 4) as u16) * 4;
                e.l4_hdr = if doff < 20 { 20 } else { doff };
            }
        }
        PROTO_UDP => {
            if let Some(h) = parse::header(ctx, l4, 8) {
                e.sport = h.field16(0);
                e.l4_hdr = 8;
            }
        }
        PROTO_ICMP | PROTO_ICMPV6 => {
            if let Some(h) = parse::header(ctx, l4, 4) {
                e.icmp_type = h.field(0);
                e.icmp_code = h.field(1);
                e.l4_hdr = 8;
            }
        }
        _ => {}
    }
}

/// The payload reads of `GlobalConfig::fetches` (big-endian, right-aligned in
/// `RuleLoop::fetched`); a read the frame is too short for is left out of `fetched_ok`.
#[inline(always)]
fn fetch(ctx: &XdpContext, rl: &mut RuleLoop) {
    let g = policy::global();
    rl.fetched_ok = 0;
    for j in 0..MAX_PAYLOAD_FETCHES {
        if j >= g.fetch_count as usize {
            break;
        }
        let f = &g.fetches[j];
        let base = rl.pkt.l4_off() as u32
            + if f.from == FROM_L4_PAYLOAD {
                rl.ext.l4_hdr as u32
            } else {
                0
            };
        let at = base + f.offset as u32;
        let buf = &raw mut rl.fetch_buf as *mut core::ffi::c_void;
        // One call per length, each with a constant size, as the helper's checker wants.
        // SAFETY: the helper copies at most 4 bytes of the frame into the record's buffer.
        let rc = unsafe {
            match f.len {
                1 => bpf_xdp_load_bytes(ctx.ctx, at, buf, 1),
                2 => bpf_xdp_load_bytes(ctx.ctx, at, buf, 2),
                3 => bpf_xdp_load_bytes(ctx.ctx, at, buf, 3),
                _ => bpf_xdp_load_bytes(ctx.ctx, at, buf, 4),
            }
        };
        if rc != 0 {
            continue;
        }
        let b = rl.fetch_buf;
        let v = u32::from_be_bytes(b);
        let len = if f.len == 0 || f.len > 4 {
            4
        } else {
            f.len as u32
        };
        rl.fetched[j] = if len == 4 { v } else { v >> (8 * (4 - len)) };
        rl.fetched_ok |= 1 << j;
    }
}
