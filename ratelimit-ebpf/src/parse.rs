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
    addr::IpKey,
    caps::{MAX_IPV6_EXT_HEADERS, MAX_VLAN_DEPTH},
    stats::global,
};

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;

const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_ICMP: u8 = 1;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_AH: u8 = 51;
const IPPROTO_ICMPV6: u8 = 58;
const IPPROTO_DSTOPTS: u8 = 60;

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
    /// A `stats::global` reason to count for this packet (0 = none): a packet whose fixed L3
    /// header is valid is always judged (lists, bans, rules) even when what follows is not.
    pub note: u32,
}

type Reason = u32;

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

#[derive(Clone, Copy)]
struct Hdr(*const u8);

impl Hdr {
    /// A `T` at byte `at` of a header whose length `hdr` checked to cover it.
    #[inline(always)]
    fn field<T: Copy>(self, at: usize) -> T {
        // SAFETY: callers only read inside the length `hdr` checked; unaligned because headers
        // sit at any offset.
        unsafe { core::ptr::read_unaligned(self.0.add(at) as *const T) }
    }

    #[inline(always)]
    fn field16(self, at: usize) -> u16 {
        u16::from_be_bytes(self.field::<[u8; 2]>(at))
    }
}

/// `Ok(None)`: not IP. `Err(reason)`: an IP frame the parser could not read (a
/// `stats::global::MALFORMED_*` reason).
#[inline(always)]
pub fn parse(ctx: &XdpContext) -> Result<Option<Parsed>, Reason> {
    let (ethertype, off) = parse_l2(ctx)?;
    match ethertype {
        ETH_P_IP => parse_ipv4(ctx, off).map(Some),
        ETH_P_IPV6 => parse_ipv6(ctx, off).map(Some),
        _ => Ok(None),
    }
}

/// [`parse`] for a device without a link-layer header (tun, wireguard, ipip/sit/gre tunnels:
/// the frame starts at the IP header, whose version nibble says which). `Ok(None)`: not IP.
#[inline(always)]
pub fn parse_l3(ctx: &XdpContext) -> Result<Option<Parsed>, Reason> {
    // The version is read behind a bounds check of a whole IPv4 header, the shortest IP
    // header there is: a one-byte check compiles to a comparison the verifier cannot follow.
    let Ok(h) = hdr(ctx, 0, Ipv4Hdr::LEN, global::MALFORMED_IPV4) else {
        // Shorter than any IP header: malformed if it says it is IP.
        return match hdr(ctx, 0, 2, global::MALFORMED_IPV4) {
            Ok(h) => match h.field::<u8>(0) >> 4 {
                4 => Err(global::MALFORMED_IPV4),
                6 => Err(global::MALFORMED_IPV6),
                _ => Ok(None),
            },
            Err(_) => Ok(None),
        };
    };
    match h.field::<u8>(0) >> 4 {
        4 => parse_ipv4(ctx, 0).map(Some),
        6 => parse_ipv6(ctx, 0).map(Some),
        _ => Ok(None),
    }
}

/// Ethernet and up to `MAX_VLAN_DEPTH` 802.1Q / 802.1ad tags: the inner ethertype and offset.
#[inline(always)]
fn parse_l2(ctx: &XdpContext) -> Result<(u16, usize), Reason> {
    let mut ethertype = hdr(ctx, 0, EthHdr::LEN, global::MALFORMED_L2)?.field16(12);
    let mut off = EthHdr::LEN;
    for _ in 0..MAX_VLAN_DEPTH {
        if ethertype != ETH_P_8021Q && ethertype != ETH_P_8021AD {
            break;
        }
        ethertype = hdr(ctx, off, VlanHdr::LEN, global::MALFORMED_L2)?.field16(2);
        off += VlanHdr::LEN;
    }
    if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
        return Err(global::MALFORMED_L2);
    }
    Ok((ethertype, off))
}

#[inline(always)]
fn parse_ipv4(ctx: &XdpContext, off: usize) -> Result<Parsed, Reason> {
    const R: Reason = global::MALFORMED_IPV4;
    let h = hdr(ctx, off, Ipv4Hdr::LEN, R)?;
    let ver_ihl: u8 = h.field(0);
    let ihl = ((ver_ihl & 0x0f) as usize) * 4;
    if ver_ihl >> 4 != 4 || ihl < Ipv4Hdr::LEN || (h.field16(2) as usize) < ihl {
        return Err(R);
    }
    let mut pkt = Parsed {
        src: IpKey::from_v4(h.field(12)),
        dport: 0,
        proto: h.field(9),
        tcp_flags: 0,
        v4: true,
        l4: false,
        fragment: h.field16(6) & 0x1fff != 0,
        l4_cut: false,
        note: 0,
    };
    // The options must be present too; from here on the source is known, so problems are
    // noted and the packet is still judged.
    if hdr(ctx, off, ihl, R).is_err() {
        pkt.l4_cut = true;
        pkt.note = R;
        return Ok(pkt);
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
    if h.field::<u8>(0) >> 4 != 6 {
        return Err(R);
    }
    let mut pkt = Parsed {
        src: IpKey::from_v6(h.field(8)),
        dport: 0,
        proto: h.field(6),
        tcp_flags: 0,
        v4: false,
        l4: false,
        fragment: false,
        l4_cut: false,
        note: 0,
    };
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
    pkt.note = note;
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
        pkt.note = R;
        return;
    }
    let need = match pkt.proto {
        IPPROTO_TCP => TcpHdr::LEN,
        IPPROTO_UDP => UdpHdr::LEN,
        IPPROTO_ICMP | IPPROTO_ICMPV6 => 4,
        _ => return,
    };
    let Ok(h) = hdr(ctx, off, need, R) else {
        // Truncated (e.g. a tiny first fragment): judge by L3 with every L4 condition met.
        pkt.l4_cut = true;
        pkt.note = R;
        return;
    };
    if pkt.proto == IPPROTO_TCP || pkt.proto == IPPROTO_UDP {
        pkt.dport = h.field16(2);
    }
    if pkt.proto == IPPROTO_TCP {
        pkt.tcp_flags = h.field(13);
    }
    pkt.l4 = true;
}
