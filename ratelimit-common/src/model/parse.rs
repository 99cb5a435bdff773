//! The parser's stages (`ratelimit-ebpf/src/parse.rs`): L2 (with VLANs), IPv4, IPv6 (with
//! extension headers), L4.

use crate::{
    addr::{IpKey, is_v6_bogon},
    caps::{MAX_IPV6_EXT_HEADERS, MAX_VLAN_DEPTH, MAX_VLAN_WALK},
    stats::global,
};

use crate::proto::*;

/// The parser's furthest header offset (`parse.rs`).
pub const MAX_L4_OFFSET: usize = 512;

const ETH_LEN: usize = 14;
const VLAN_LEN: usize = 4;
const IPV4_LEN: usize = 20;
const IPV6_LEN: usize = 40;

/// What the parser hands the policy (`parse::Parsed`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Parsed {
    pub src: IpKey,
    pub dst: IpKey,
    pub dport: u16,
    pub sport: u16,
    pub ip_len: u16,
    pub proto: u8,
    pub tcp_flags: u8,
    pub ttl: u8,
    pub icmp_type: u8,
    pub icmp_code: u8,
    pub v4: bool,
    pub l4: bool,
    pub fragment: bool,
    pub fragmented: bool,
    pub l4_cut: bool,
    pub note: u32,
    /// Where the L4 header starts in the frame, and its length up to the payload.
    pub l4_off: usize,
    pub l4_hdr: usize,
}

type Reason = u32;

/// The parser's one bounds check: `len` bytes at `off`.
fn hdr(f: &[u8], off: usize, len: usize) -> bool {
    off + len <= f.len()
}

fn be16(f: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([f[at], f[at + 1]])
}

/// What the parser made of a frame (`parse::Frame`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame {
    NonIp,
    /// An IP frame whose source cannot be read: the `MALFORMED_*` reason.
    Unreadable(Reason),
    /// An IPv6 frame from a bogon source.
    Bogon,
    Ip(Parsed),
}

pub fn parse(f: &[u8]) -> Frame {
    let (ethertype, off, note) = match parse_l2(f) {
        Ok(l2) => l2,
        Err(reason) => return Frame::Unreadable(reason),
    };
    let parsed = match ethertype {
        ETH_P_IP => parse_ipv4(f, off),
        ETH_P_IPV6 => parse_ipv6(f, off),
        _ => return Frame::NonIp,
    };
    match parsed {
        Ok(mut pkt) => {
            if pkt.note == 0 {
                pkt.note = note;
            }
            Frame::Ip(pkt)
        }
        Err(global::DROP_BOGON) => Frame::Bogon,
        Err(reason) => Frame::Unreadable(reason),
    }
}

/// Ethernet and up to `MAX_VLAN_WALK` tags: (inner ethertype, its offset, `MALFORMED_L2` as a
/// note when there were more than `MAX_VLAN_DEPTH`).
pub fn parse_l2(f: &[u8]) -> Result<(u16, usize, Reason), Reason> {
    if !hdr(f, 0, ETH_LEN) {
        return Err(global::MALFORMED_L2);
    }
    let is_vlan = |t: u16| t == ETH_P_8021Q || t == ETH_P_8021AD;
    let mut ethertype = be16(f, 12);
    let mut off = ETH_LEN;
    let mut tags = 0;
    for _ in 0..MAX_VLAN_WALK {
        if !is_vlan(ethertype) {
            break;
        }
        if !hdr(f, off, VLAN_LEN) {
            return Err(global::MALFORMED_L2);
        }
        ethertype = be16(f, off + 2);
        off += VLAN_LEN;
        tags += 1;
    }
    if is_vlan(ethertype) {
        return Err(global::MALFORMED_L2);
    }
    let note = if tags > MAX_VLAN_DEPTH {
        global::MALFORMED_L2
    } else {
        0
    };
    Ok((ethertype, off, note))
}

/// The source from the fixed header; a bad version, IHL or total length is noted and the
/// frame judged by L3 alone.
pub fn parse_ipv4(f: &[u8], off: usize) -> Result<Parsed, Reason> {
    const R: Reason = global::MALFORMED_IPV4;
    if !hdr(f, off, IPV4_LEN) {
        return Err(R);
    }
    let ver_ihl = f[off];
    let ihl = ((ver_ihl & 0x0f) as usize) * 4;
    let mut pkt = Parsed {
        src: IpKey::from_v4([f[off + 12], f[off + 13], f[off + 14], f[off + 15]]),
        dst: IpKey::from_v4([f[off + 16], f[off + 17], f[off + 18], f[off + 19]]),
        ip_len: be16(f, off + 2),
        ttl: f[off + 8],
        proto: f[off + 9],
        v4: true,
        ..Parsed::default()
    };
    if ver_ihl >> 4 != 4 || ihl < IPV4_LEN || (be16(f, off + 2) as usize) < ihl {
        return Ok(cut(pkt, R));
    }
    let frag = be16(f, off + 6);
    pkt.fragment = frag & 0x1fff != 0;
    pkt.fragmented = frag & 0x3fff != 0;
    if !hdr(f, off, ihl) {
        return Ok(cut(pkt, R));
    }
    if !pkt.fragment {
        parse_l4(f, off + ihl, &mut pkt);
    }
    Ok(pkt)
}

fn is_ipv6_ext(proto: u8) -> bool {
    matches!(
        proto,
        IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_AH | IPPROTO_FRAGMENT
    )
}

fn cut(mut pkt: Parsed, note: Reason) -> Parsed {
    pkt.l4_cut = true;
    pkt.note = note;
    pkt
}

pub fn parse_ipv6(f: &[u8], off: usize) -> Result<Parsed, Reason> {
    const R: Reason = global::MALFORMED_IPV6;
    if !hdr(f, off, IPV6_LEN) {
        return Err(R);
    }
    let mut src = [0u8; 16];
    src.copy_from_slice(&f[off + 8..off + 24]);
    if is_v6_bogon(&src) {
        return Err(global::DROP_BOGON);
    }
    let mut dst = [0u8; 16];
    dst.copy_from_slice(&f[off + 24..off + 40]);
    let pkt = Parsed {
        src: IpKey::from_v6(src),
        dst: IpKey::from_v6(dst),
        ip_len: be16(f, off + 4).saturating_add(IPV6_LEN as u16),
        ttl: f[off + 7],
        proto: f[off + 6],
        ..Parsed::default()
    };
    if f[off] >> 4 != 6 {
        return Ok(cut(pkt, R));
    }
    let mut pkt = pkt;
    let mut off = off + IPV6_LEN;
    let mut done = false;
    for _ in 0..MAX_IPV6_EXT_HEADERS {
        let ext_len = match pkt.proto {
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_AH => {
                if !hdr(f, off, 2) {
                    return Ok(cut(pkt, R));
                }
                let n = f[off + 1] as usize;
                let len = if pkt.proto == IPPROTO_AH {
                    (n + 2) * 4
                } else {
                    (n + 1) * 8
                };
                pkt.proto = f[off];
                len
            }
            IPPROTO_FRAGMENT => {
                if !hdr(f, off, 8) {
                    return Ok(cut(pkt, R));
                }
                pkt.proto = f[off];
                pkt.fragmented = true;
                if be16(f, off + 2) & 0xfff8 != 0 {
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
        if !hdr(f, off, ext_len) {
            return Ok(cut(pkt, R));
        }
        off += ext_len;
        if off > MAX_L4_OFFSET {
            return Ok(cut(pkt, global::IPV6_EXT_LIMIT));
        }
    }
    if !done && is_ipv6_ext(pkt.proto) {
        return Ok(cut(pkt, global::IPV6_EXT_LIMIT));
    }
    parse_l4(f, off, &mut pkt);
    Ok(pkt)
}

pub fn parse_l4(f: &[u8], off: usize, pkt: &mut Parsed) {
    const R: Reason = global::MALFORMED_L4;
    if off > MAX_L4_OFFSET {
        pkt.l4_cut = true;
        pkt.note = R;
        return;
    }
    let need = match pkt.proto {
        IPPROTO_TCP => 20,
        IPPROTO_UDP => 8,
        IPPROTO_ICMP | IPPROTO_ICMPV6 => 4,
        _ => return,
    };
    if !hdr(f, off, need) {
        pkt.l4_cut = true;
        pkt.note = R;
        return;
    }
    pkt.l4_off = off;
    match pkt.proto {
        IPPROTO_TCP => {
            pkt.sport = be16(f, off);
            pkt.dport = be16(f, off + 2);
            pkt.tcp_flags = f[off + 13];
            pkt.l4_hdr = ((f[off + 12] >> 4) as usize * 4).max(20);
        }
        IPPROTO_UDP => {
            pkt.sport = be16(f, off);
            pkt.dport = be16(f, off + 2);
            pkt.l4_hdr = 8;
        }
        _ => {
            pkt.icmp_type = f[off];
            pkt.icmp_code = f[off + 1];
            pkt.l4_hdr = 8;
        }
    }
    pkt.l4 = true;
}
