//! Packet parsing: one bounds-checked accessor, one function per layer, explicit bounds on VLAN
//! depth and on the IPv6 extension-header walk (the verifier needs both, and a hostile chain
//! must not buy more work than a fixed budget).

use aya_ebpf::programs::XdpContext;
use network_types::{
    eth::EthHdr,
    ip::{Ipv4Hdr, Ipv6Hdr},
    tcp::TcpHdr,
    udp::UdpHdr,
    vlan::VlanHdr,
};
use ratelimit_common::{
    addr::{IpKey, is_v6_bogon},
    caps::{MAX_IPV6_EXT_HEADERS, MAX_VLAN_DEPTH, MAX_VLAN_WALK},
    proto::*,
    stats::global,
};

/// Furthest header offset the parser follows; keeps every offset provably bounded.
const MAX_L4_OFFSET: usize = 512;

/// What the policy needs from a packet.
#[repr(C)]
pub struct Parsed {
    pub src: IpKey,
    pub dport: u16,
    /// IP protocol of the upper layer (after IPv6 extension headers).
    pub proto: u8,
    pub tcp_flags: u8,
    pub v4: bool,
    /// The L4 header was parsed: ports (TCP/UDP) and flags (TCP) are valid.
    pub l4: bool,
    /// A non-first fragment: no L4 header, matched on L3 fields (port conditions count as
    /// met, TCP-flag conditions as not met).
    pub fragment: bool,
    /// The L4 header should be there but could not be read (truncated, beyond the parser's
    /// reach, or after an over-long IPv6 chain): port *and* flag conditions count as met, so a
    /// tiny first fragment cannot hide a SYN from a SYN rule.
    pub l4_cut: bool,
    /// Three facts in one word ([`NOTE_REASON`], [`NOTE_FRAGMENTED`], [`NOTE_L4_SHIFT`]): the
    /// entry keeps each field of this record in a stack slot of its own, and its stack is
    /// what the rules' call chain has least of. The other fields a rule may match on
    /// (destination, length, TTL, source port, ICMP type, ...) are read from the frame again
    /// when a rule asks for them (`matching::Ext`).
    pub note: u32,
}

/// `Parsed::note`: a `stats::global` reason to count for this packet (0 = none): a packet
/// whose fixed L3 header is valid is always judged (lists, bans, rules) even when what
/// follows is not.
pub const NOTE_REASON: u32 = 0xff;
/// `Parsed::note`: a fragment, first or later (IPv4: more-fragments or an offset; IPv6: a
/// fragment header).
pub const NOTE_FRAGMENTED: u32 = 1 << 8;
/// `Parsed::note >> NOTE_L4_SHIFT`: where the L4 header starts in the frame (with `l4`).
pub const NOTE_L4_SHIFT: u32 = 16;

const _: () = assert!(ratelimit_common::stats::global::COUNT <= NOTE_REASON);

impl Parsed {
    /// The reason to count for this packet, 0 for none.
    #[inline(always)]
    pub fn reason(&self) -> u32 {
        self.note & NOTE_REASON
    }

    #[inline(always)]
    pub fn fragmented(&self) -> bool {
        self.note & NOTE_FRAGMENTED != 0
    }

    /// Where the L4 header starts in the frame (with `l4`).
    #[inline(always)]
    pub fn l4_off(&self) -> usize {
        (self.note >> NOTE_L4_SHIFT) as usize
    }

    #[inline(always)]
    fn set_reason(&mut self, reason: u32) {
        self.note = (self.note & !NOTE_REASON) | reason;
    }
}

type Reason = u32;

/// What the parser made of a frame.
pub enum Frame {
    /// Not IPv4 or IPv6 (ARP, LLDP, ...).
    NonIp,
    /// An IP frame whose source address cannot be read (a `stats::global::MALFORMED_*`
    /// reason): nothing to judge it by.
    Unreadable(Reason),
    /// An IPv6 frame from a bogon source (`addr::is_v6_bogon`): dropped before it reaches
    /// any list, ban or state.
    Bogon,
    /// A frame whose source could be read: judged by the lists, bans and rules, however
    /// malformed the rest of it is (`Parsed::note` says what was wrong).
    Ip(Parsed),
}

/// The one bounds check: a header of `len` bytes at `off`, or `reason`. Fields are then read
/// at constant offsets from the returned pointer (`field`, `field16`), which is the shape the
/// verifier can follow: a pointer it has range-checked plus a constant.
#[inline(always)]
fn hdr(ctx: &XdpContext, off: usize, len: usize, reason: Reason) -> Result<Hdr, Reason> {
    let start = ctx.data();
    if start + off + len > ctx.data_end() {
        return Err(reason);
    }
    Ok(Hdr((start + off) as *const u8))
}

/// A header of `len` bytes at `off`, if the frame holds it (for code after the parser that
/// reads or rewrites headers again).
#[inline(always)]
pub fn header(ctx: &XdpContext, off: usize, len: usize) -> Option<Hdr> {
    hdr(ctx, off, len, 0).ok()
}

/// Where an Ethernet frame's IP header starts (after its VLAN tags), if it can be read.
#[inline(always)]
pub fn l3_offset(ctx: &XdpContext) -> Option<usize> {
    parse_l2(ctx).ok().map(|(_, off, _)| off)
}

#[derive(Clone, Copy)]
pub struct Hdr(*const u8);

impl Hdr {
    /// The header's first byte.
    #[inline(always)]
    pub fn ptr(self) -> *const u8 {
        self.0
    }

    /// A `T` at byte `at` of a header whose length `hdr` checked to cover it.
    #[inline(always)]
    pub fn field<T: Copy>(self, at: usize) -> T {
        // SAFETY: callers only read inside the length `hdr` checked; unaligned because headers
        // sit at any offset.
        unsafe { core::ptr::read_unaligned(self.0.add(at) as *const T) }
    }

    #[inline(always)]
    pub fn field16(self, at: usize) -> u16 {
        u16::from_be_bytes(self.field::<[u8; 2]>(at))
    }
}

#[inline(always)]
pub fn parse(ctx: &XdpContext) -> Frame {
    let (ethertype, off, note) = match parse_l2(ctx) {
        Ok(l2) => l2,
        Err(reason) => return Frame::Unreadable(reason),
    };
    let parsed = match ethertype {
        ETH_P_IP => parse_ipv4(ctx, off),
        ETH_P_IPV6 => parse_ipv6(ctx, off),
        _ => return Frame::NonIp,
    };
    frame_of(parsed, note)
}

/// [`parse`] for a device without a link-layer header (tun, wireguard, ipip/sit/gre tunnels:
/// the frame starts at the IP header, whose version nibble says which).
#[inline(always)]
pub fn parse_l3(ctx: &XdpContext) -> Frame {
    // The version is read behind a bounds check of a whole IPv4 header, the shortest IP
    // header there is: a one-byte check compiles to a comparison the verifier cannot follow.
    let Ok(h) = hdr(ctx, 0, Ipv4Hdr::LEN, global::MALFORMED_IPV4) else {
        // Shorter than any IP header: malformed if it says it is IP.
        return match hdr(ctx, 0, 2, global::MALFORMED_IPV4) {
            Ok(h) => match h.field::<u8>(0) >> 4 {
                4 => Frame::Unreadable(global::MALFORMED_IPV4),
                6 => Frame::Unreadable(global::MALFORMED_IPV6),
                _ => Frame::NonIp,
            },
            Err(_) => Frame::NonIp,
        };
    };
    let parsed = match h.field::<u8>(0) >> 4 {
        4 => parse_ipv4(ctx, 0),
        6 => parse_ipv6(ctx, 0),
        _ => return Frame::NonIp,
    };
    frame_of(parsed, 0)
}

/// A parser's result as a [`Frame`]; `note` (from L2) counts when L3 noted nothing.
#[inline(always)]
fn frame_of(parsed: Result<Parsed, Reason>, note: Reason) -> Frame {
    match parsed {
        Ok(mut pkt) => {
            if pkt.reason() == 0 {
                pkt.set_reason(note);
            }
            Frame::Ip(pkt)
        }
        Err(global::DROP_BOGON) => Frame::Bogon,
        Err(reason) => Frame::Unreadable(reason),
    }
}

/// Ethernet and up to `MAX_VLAN_WALK` 802.1Q / 802.1ad tags: the inner ethertype, its offset,
/// and `MALFORMED_L2` as a note when there were more tags than the `MAX_VLAN_DEPTH` a valid
/// frame has (such a frame is still judged by its source: a tag more must not buy a pass).
#[inline(always)]
fn parse_l2(ctx: &XdpContext) -> Result<(u16, usize, Reason), Reason> {
    let mut ethertype = hdr(ctx, 0, EthHdr::LEN, global::MALFORMED_L2)?.field16(12);
    let mut off = EthHdr::LEN;
    let mut tags = 0usize;
    for _ in 0..MAX_VLAN_WALK {
        if ethertype != ETH_P_8021Q && ethertype != ETH_P_8021AD {
            break;
        }
        ethertype = hdr(ctx, off, VlanHdr::LEN, global::MALFORMED_L2)?.field16(2);
        off += VlanHdr::LEN;
        tags += 1;
    }
    if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
        return Err(global::MALFORMED_L2);
    }
    let note = if tags > MAX_VLAN_DEPTH {
        global::MALFORMED_L2
    } else {
        0
    };
    Ok((ethertype, off, note))
}

/// IPv4: the source is read from the fixed 20-byte header; a bad version, IHL or total
/// length is noted and the frame judged by L3 alone.
#[inline(always)]
fn parse_ipv4(ctx: &XdpContext, off: usize) -> Result<Parsed, Reason> {
    const R: Reason = global::MALFORMED_IPV4;
    let h = hdr(ctx, off, Ipv4Hdr::LEN, R)?;
    let ver_ihl: u8 = h.field(0);
    let ihl = ((ver_ihl & 0x0f) as usize) * 4;
    let mut pkt = Parsed {
        src: IpKey::from_v4(h.field(12)),
        dport: 0,
        proto: h.field(9),
        tcp_flags: 0,
        v4: true,
        l4: false,
        fragment: false,
        l4_cut: false,
        note: 0,
    };
    if ver_ihl >> 4 != 4 || ihl < Ipv4Hdr::LEN || (h.field16(2) as usize) < ihl {
        return Ok(cut(pkt, R));
    }
    let frag = h.field16(6);
    pkt.fragment = frag & 0x1fff != 0;
    if frag & 0x3fff != 0 {
        pkt.note |= NOTE_FRAGMENTED;
    }
    // The options must be present too; from here on the source is known, so problems are
    // noted and the packet is still judged.
    if hdr(ctx, off, ihl, R).is_err() {
        return Ok(cut(pkt, R));
    }
    if !pkt.fragment {
        parse_l4(ctx, off + ihl, &mut pkt);
    }
    Ok(pkt)
}

#[inline(always)]
fn parse_ipv6(ctx: &XdpContext, off: usize) -> Result<Parsed, Reason> {
    const R: Reason = global::MALFORMED_IPV6;
    let h = hdr(ctx, off, Ipv6Hdr::LEN, R)?;
    let src: [u8; 16] = h.field(8);
    if is_v6_bogon(&src) {
        return Err(global::DROP_BOGON);
    }
    let mut pkt = Parsed {
        src: IpKey::from_v6(src),
        dport: 0,
        proto: h.field(6),
        tcp_flags: 0,
        v4: false,
        l4: false,
        fragment: false,
        l4_cut: false,
        note: 0,
    };
    if h.field::<u8>(0) >> 4 != 6 {
        // Not IPv6 after all, but the source is where IPv6 has it: judged by it.
        return Ok(cut(pkt, R));
    }
    let mut off = off + Ipv6Hdr::LEN;
    let mut done = false;
    for _ in 0..MAX_IPV6_EXT_HEADERS {
        let ext_len = match pkt.proto {
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_AH => {
                let Ok(e) = hdr(ctx, off, 2, R) else {
                    return Ok(cut(pkt, R));
                };
                let n = e.field::<u8>(1) as usize;
                let len = if pkt.proto == IPPROTO_AH {
                    (n + 2) * 4
                } else {
                    (n + 1) * 8
                };
                pkt.proto = e.field(0);
                len
            }
            IPPROTO_FRAGMENT => {
                let Ok(e) = hdr(ctx, off, 8, R) else {
                    return Ok(cut(pkt, R));
                };
                pkt.proto = e.field(0);
                pkt.note |= NOTE_FRAGMENTED;
                if e.field16(2) & 0xfff8 != 0 {
                    // A non-first fragment: what follows is payload, not headers.
                    pkt.fragment = true;
                    done = true;
                }
                8
            }
            _ => {
                done = true;
                0
            }
        };
        if pkt.fragment {
            return Ok(pkt);
        }
        if done {
            break;
        }
        // The whole extension header must be there, not just its first bytes.
        if hdr(ctx, off, ext_len, R).is_err() {
            return Ok(cut(pkt, R));
        }
        off += ext_len;
        if off > MAX_L4_OFFSET {
            return Ok(cut(pkt, global::IPV6_EXT_LIMIT));
        }
    }
    if !done && is_ipv6_ext(pkt.proto) {
        // Longer chain than we walk: judge it by its L3 fields.
        return Ok(cut(pkt, global::IPV6_EXT_LIMIT));
    }
    parse_l4(ctx, off, &mut pkt);
    Ok(pkt)
}

/// The L4 header cannot be reached: judge by L3, note why.
#[inline(always)]
fn cut(mut pkt: Parsed, note: Reason) -> Parsed {
    pkt.l4_cut = true;
    pkt.set_reason(note);
    pkt
}

#[inline(always)]
fn is_ipv6_ext(proto: u8) -> bool {
    matches!(
        proto,
        IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_AH | IPPROTO_FRAGMENT
    )
}

#[inline(always)]
fn parse_l4(ctx: &XdpContext, off: usize, pkt: &mut Parsed) {
    const R: Reason = global::MALFORMED_L4;
    if off > MAX_L4_OFFSET {
        pkt.l4_cut = true;
        pkt.set_reason(R);
        return;
    }
    // One bounds check per protocol, read in the same arm: with one check of a length chosen
    // by protocol and the reads after it, the 6.1 verifier (which loses the protocol when it
    // reloads it from the stack) also walks an ICMP header's 4 checked bytes as TCP's 20.
    let got = match pkt.proto {
        IPPROTO_TCP => hdr(ctx, off, TcpHdr::LEN, R).map(|h| {
            pkt.dport = h.field16(2);
            pkt.tcp_flags = h.field(13);
        }),
        IPPROTO_UDP => hdr(ctx, off, UdpHdr::LEN, R).map(|h| pkt.dport = h.field16(2)),
        IPPROTO_ICMP | IPPROTO_ICMPV6 => hdr(ctx, off, 4, R).map(drop),
        _ => return,
    };
    if got.is_err() {
        // Truncated (e.g. a tiny first fragment): judge by L3 with every L4 condition met.
        pkt.l4_cut = true;
        pkt.set_reason(R);
        return;
    }
    pkt.note |= (off as u32) << NOTE_L4_SHIFT;
    pkt.l4 = true;
}
