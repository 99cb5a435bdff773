//! Crafted Ethernet frames for end-to-end tests.
//!
//! The XDP parser under test drops or misclassifies anything that is not
//! byte-exact, so a test failure must never be caused by a sloppy frame. Every
//! frame built here therefore carries correct length fields and correct IPv4,
//! TCP, UDP, ICMP and ICMPv6 checksums. The module is std-only so it can be
//! used from any test binary without pulling in a packet library whose own
//! parsing would hide the bugs we are looking for.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// TCP flag bits for [`Frame::tcp`], OR them together (e.g. `SYN | ACK`).
pub mod tcp_flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const PSH: u8 = 0x08;
    pub const ACK: u8 = 0x10;
    pub const URG: u8 = 0x20;
}

const ETH_P_IPV4: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_ARP: u16 = 0x0806;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;

const IPPROTO_ICMP: u8 = 1;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;
const IPPROTO_ICMPV6: u8 = 58;
const IPPROTO_NONE: u8 = 59;
/// RFC 3692 experimentation number: used when IPv4 carries no chosen L4 so the
/// frame can never be mistaken for a real protocol.
const IPPROTO_EXPERIMENT: u8 = 253;

const IPV6_EXT_ROUTING: u8 = 43;
const IPV6_EXT_FRAGMENT: u8 = 44;
const IPV6_EXT_AH: u8 = 51;

/// Identification used for every IPv4 fragment, so tests can match fragments
/// of one datagram without configuring it.
const IPV4_FRAGMENT_ID: u16 = 0x1234;
const DEFAULT_TTL: u8 = 64;

#[derive(Clone, Debug)]
enum L3 {
    None,
    Ipv4 { src: Ipv4Addr, dst: Ipv4Addr },
    Ipv6 { src: Ipv6Addr, dst: Ipv6Addr },
    Raw(u16),
}

#[derive(Clone, Copy, Debug)]
enum L4 {
    None,
    Tcp { sport: u16, dport: u16, flags: u8 },
    Udp { sport: u16, dport: u16 },
    IcmpEcho { id: u16, seq: u16 },
    Raw(u8),
}

impl L4 {
    fn protocol(self, v6: bool) -> u8 {
        match self {
            L4::None if v6 => IPPROTO_NONE,
            L4::None => IPPROTO_EXPERIMENT,
            L4::Tcp { .. } => IPPROTO_TCP,
            L4::Udp { .. } => IPPROTO_UDP,
            L4::IcmpEcho { .. } if v6 => IPPROTO_ICMPV6,
            L4::IcmpEcho { .. } => IPPROTO_ICMP,
            L4::Raw(proto) => proto,
        }
    }

    fn header_len(self) -> usize {
        match self {
            L4::None | L4::Raw(_) => 0,
            L4::Tcp { .. } => 20,
            L4::Udp { .. } | L4::IcmpEcho { .. } => 8,
        }
    }
}

/// Source of the L4 pseudo-header; ICMPv4 is the only L4 here without one.
#[derive(Clone, Copy)]
enum Pseudo {
    V4(Ipv4Addr, Ipv4Addr),
    V6(Ipv6Addr, Ipv6Addr),
}

impl Pseudo {
    fn bytes(self, proto: u8, upper_len: usize) -> Vec<u8> {
        match self {
            Pseudo::V4(src, dst) => {
                let len = u16::try_from(upper_len).expect("IPv4 upper-layer length exceeds 65535");
                let mut p = Vec::with_capacity(12);
                p.extend_from_slice(&src.octets());
                p.extend_from_slice(&dst.octets());
                p.extend_from_slice(&[0, proto]);
                p.extend_from_slice(&len.to_be_bytes());
                p
            }
            Pseudo::V6(src, dst) => {
                let len = u32::try_from(upper_len).expect("IPv6 upper-layer length exceeds u32");
                let mut p = Vec::with_capacity(40);
                p.extend_from_slice(&src.octets());
                p.extend_from_slice(&dst.octets());
                p.extend_from_slice(&len.to_be_bytes());
                p.extend_from_slice(&[0, 0, 0, proto]);
                p
            }
        }
    }
}

/// Builder for one Ethernet frame.
///
/// Layer setters may be called in any order; the last call for a layer wins,
/// which lets a test derive variants from a shared base with `.clone()`.
/// Misuse that could only produce a frame the caller did not intend (e.g. an
/// IPv4 option on an IPv6 frame) panics in [`Frame::build`] rather than being
/// silently ignored.
#[derive(Clone, Debug)]
pub struct Frame {
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    vlans: Vec<(u16, u16)>,
    l3: L3,
    ipv4_options: Option<Vec<u8>>,
    ipv4_fragment: Option<(bool, u16)>,
    ipv4_ttl: Option<u8>,
    ipv6_exts: Vec<(u8, Vec<u8>)>,
    l4: L4,
    payload: Vec<u8>,
    min_len: usize,
}

/// A frame's bytes, for what takes frames (a fixture table's rows, say).
impl From<Frame> for Vec<u8> {
    fn from(f: Frame) -> Vec<u8> {
        f.build()
    }
}

impl Frame {
    /// Starts a frame; a network layer must be chosen before [`Frame::build`].
    pub fn new(src_mac: [u8; 6], dst_mac: [u8; 6]) -> Self {
        Frame {
            src_mac,
            dst_mac,
            vlans: Vec::new(),
            l3: L3::None,
            ipv4_options: None,
            ipv4_fragment: None,
            ipv4_ttl: None,
            ipv6_exts: Vec::new(),
            l4: L4::None,
            payload: Vec::new(),
            min_len: 0,
        }
    }

    /// Pushes a VLAN tag (PCP and DEI zero). Tags are emitted in call order,
    /// outermost first, so QinQ is `.vlan(0x88a8, outer).vlan(0x8100, inner)`.
    /// The TPID is free-form so tests can also send unusual stackings.
    pub fn vlan(mut self, tpid: u16, vid: u16) -> Self {
        assert!(vid < 0x1000, "VLAN id {vid} does not fit in 12 bits");
        self.vlans.push((tpid, vid));
        self
    }

    /// Selects IPv4 (TTL 64, DF clear, id 0) so the defaults never trigger
    /// parser special cases unless a test asks for them.
    pub fn ipv4(mut self, src: Ipv4Addr, dst: Ipv4Addr) -> Self {
        self.l3 = L3::Ipv4 { src, dst };
        self
    }

    /// Adds IPv4 options, zero-padded (EOL) to a 4-byte boundary because IHL
    /// counts 32-bit words; IHL and checksums account for them, so the only
    /// thing under test is whether the parser honours IHL.
    pub fn ipv4_options(mut self, options: &[u8]) -> Self {
        self.ipv4_options = Some(options.to_vec());
        self
    }

    /// Marks the datagram as a fragment (id 0x1234). With a non-zero offset
    /// the payload is sent raw and no L4 header is built, because non-first
    /// fragments carry no ports; the protocol field still names the chosen L4.
    pub fn ipv4_fragment(mut self, more_fragments: bool, offset_units_of_8: u16) -> Self {
        assert!(
            offset_units_of_8 < 0x2000,
            "fragment offset {offset_units_of_8} does not fit in 13 bits"
        );
        self.ipv4_fragment = Some((more_fragments, offset_units_of_8));
        self
    }

    /// Overrides the IPv4 TTL, e.g. to check that TTL 0/1 frames are not special-cased.
    pub fn ipv4_ttl(mut self, ttl: u8) -> Self {
        self.ipv4_ttl = Some(ttl);
        self
    }

    /// Selects IPv6 (hop limit 64, traffic class and flow label 0).
    pub fn ipv6(mut self, src: Ipv6Addr, dst: Ipv6Addr) -> Self {
        self.l3 = L3::Ipv6 { src, dst };
        self
    }

    /// Appends an IPv6 extension header so tests can walk the parser through
    /// arbitrary chains. `body` is everything after the next-header and length
    /// bytes; the builder links next-header fields and fills the length in the
    /// unit each type uses (AH: 4-byte units minus 2; fragment (44): fixed
    /// 8 bytes, body at most 6; all others: 8-byte units minus 1). The body is
    /// zero-padded to an 8-byte multiple: in hop-by-hop and destination
    /// options zero bytes are Pad1 options, so the header stays valid.
    pub fn ipv6_ext(mut self, next_header_type: u8, body: &[u8]) -> Self {
        self.ipv6_exts.push((next_header_type, body.to_vec()));
        self
    }

    /// Appends an IPv6 fragment header. As with IPv4, a non-zero offset means
    /// the payload is sent raw with no L4 header.
    pub fn ipv6_fragment(self, more: bool, offset_units_of_8: u16, id: u32) -> Self {
        assert!(
            offset_units_of_8 < 0x2000,
            "fragment offset {offset_units_of_8} does not fit in 13 bits"
        );
        let off_flags = (offset_units_of_8 << 3) | u16::from(more);
        let mut body = off_flags.to_be_bytes().to_vec();
        body.extend_from_slice(&id.to_be_bytes());
        self.ipv6_ext(IPV6_EXT_FRAGMENT, &body)
    }

    /// Adds a TCP header (seq 1, ack 1 only with ACK, window 65535, no
    /// options) so the ports sit at the offset a parser expects.
    pub fn tcp(mut self, sport: u16, dport: u16, flags: u8) -> Self {
        self.l4 = L4::Tcp {
            sport,
            dport,
            flags,
        };
        self
    }

    /// Adds a UDP header; a computed checksum of 0 is sent as 0xffff because
    /// 0 means "no checksum" (and is illegal on IPv6).
    pub fn udp(mut self, sport: u16, dport: u16) -> Self {
        self.l4 = L4::Udp { sport, dport };
        self
    }

    /// Adds an echo request: ICMP type 8 over IPv4, ICMPv6 type 128 over IPv6,
    /// so one test body can cover both families.
    pub fn icmp_echo(mut self, id: u16, seq: u16) -> Self {
        self.l4 = L4::IcmpEcho { id, seq };
        self
    }

    /// Uses an arbitrary IP protocol (e.g. 47 GRE) with the payload as its
    /// only content, for protocols the parser must pass through without ports.
    pub fn raw_l4(mut self, proto: u8) -> Self {
        self.l4 = L4::Raw(proto);
        self
    }

    /// Makes a non-IP frame (e.g. ARP 0x0806, or 0x88B5) whose body is the
    /// payload, to check that the program leaves non-IP traffic alone.
    pub fn ethertype_raw(mut self, ethertype: u16) -> Self {
        self.l3 = L3::Raw(ethertype);
        self
    }

    /// Sets (replaces) the innermost payload.
    pub fn payload(mut self, bytes: &[u8]) -> Self {
        self.payload = bytes.to_vec();
        self
    }

    /// Zero-pads the payload until the whole frame is at least `total_len`
    /// bytes (e.g. 60, the Ethernet minimum without FCS). The padding is part
    /// of the payload, so IP/UDP lengths and checksums cover it and the frame
    /// has no trailer that a length check could trip over.
    pub fn pad_to(mut self, total_len: usize) -> Self {
        self.min_len = total_len;
        self
    }

    /// Serialises the frame without FCS (AF_PACKET and veth never carry one).
    ///
    /// # Panics
    ///
    /// If no network layer was chosen, if settings of one family are used
    /// with another, or if a length field would overflow.
    pub fn build(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.payload.len());
        out.extend_from_slice(&self.dst_mac);
        out.extend_from_slice(&self.src_mac);
        for &(tpid, vid) in &self.vlans {
            out.extend_from_slice(&tpid.to_be_bytes());
            out.extend_from_slice(&vid.to_be_bytes());
        }
        let l2_len = out.len() + 2;
        let ipv4_settings =
            self.ipv4_options.is_some() || self.ipv4_fragment.is_some() || self.ipv4_ttl.is_some();
        match self.l3 {
            L3::None => panic!("Frame::build: call ipv4(), ipv6() or ethertype_raw() first"),
            L3::Raw(ethertype) => {
                assert!(
                    matches!(self.l4, L4::None),
                    "Frame::build: an L4 header needs ipv4() or ipv6(), not ethertype_raw()"
                );
                assert!(
                    !ipv4_settings && self.ipv6_exts.is_empty(),
                    "Frame::build: IP settings used on an ethertype_raw() frame"
                );
                out.extend_from_slice(&ethertype.to_be_bytes());
                out.extend_from_slice(&self.padded_payload(l2_len));
            }
            L3::Ipv4 { src, dst } => {
                assert!(
                    self.ipv6_exts.is_empty(),
                    "Frame::build: IPv6 extension headers on an IPv4 frame"
                );
                out.extend_from_slice(&ETH_P_IPV4.to_be_bytes());
                out.extend_from_slice(&self.ipv4_packet(src, dst, l2_len));
            }
            L3::Ipv6 { src, dst } => {
                assert!(
                    !ipv4_settings,
                    "Frame::build: IPv4 settings on an IPv6 frame"
                );
                out.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
                out.extend_from_slice(&self.ipv6_packet(src, dst, l2_len));
            }
        }
        out
    }

    fn padded_payload(&self, headers_len: usize) -> Vec<u8> {
        let mut p = self.payload.clone();
        let total = headers_len + p.len();
        if total < self.min_len {
            p.resize(p.len() + self.min_len - total, 0);
        }
        p
    }

    fn ipv4_packet(&self, src: Ipv4Addr, dst: Ipv4Addr, l2_len: usize) -> Vec<u8> {
        let mut options = self.ipv4_options.clone().unwrap_or_default();
        options.resize(options.len().next_multiple_of(4), 0);
        assert!(options.len() <= 40, "IPv4 options exceed 40 bytes");
        let hdr_len = 20 + options.len();

        let (more, offset) = self.ipv4_fragment.unwrap_or((false, 0));
        let id = if self.ipv4_fragment.is_some() {
            IPV4_FRAGMENT_ID
        } else {
            0
        };
        let with_l4 = offset == 0;
        let l4_hdr_len = if with_l4 { self.l4.header_len() } else { 0 };
        let payload = self.padded_payload(l2_len + hdr_len + l4_hdr_len);
        let segment = if with_l4 {
            self.l4_segment(&payload, Pseudo::V4(src, dst), false)
        } else {
            payload
        };
        let total_len =
            u16::try_from(hdr_len + segment.len()).expect("IPv4 total length exceeds 65535");
        let flags_frag = (u16::from(more) << 13) | offset;

        let mut p = Vec::with_capacity(usize::from(total_len));
        // hdr_len <= 60, so the IHL fits in the low nibble.
        p.push(0x40 | (hdr_len / 4) as u8);
        p.push(0);
        p.extend_from_slice(&total_len.to_be_bytes());
        p.extend_from_slice(&id.to_be_bytes());
        p.extend_from_slice(&flags_frag.to_be_bytes());
        p.push(self.ipv4_ttl.unwrap_or(DEFAULT_TTL));
        p.push(self.l4.protocol(false));
        p.extend_from_slice(&[0, 0]);
        p.extend_from_slice(&src.octets());
        p.extend_from_slice(&dst.octets());
        p.extend_from_slice(&options);
        let csum = checksum(&p);
        p[10..12].copy_from_slice(&csum.to_be_bytes());
        p.extend_from_slice(&segment);
        p
    }

    fn ipv6_packet(&self, src: Ipv6Addr, dst: Ipv6Addr, l2_len: usize) -> Vec<u8> {
        let upper = self.l4.protocol(true);
        let mut exts = Vec::new();
        for (i, (ty, body)) in self.ipv6_exts.iter().enumerate() {
            let next = self.ipv6_exts.get(i + 1).map_or(upper, |e| e.0);
            exts.extend_from_slice(&encode_ipv6_ext(*ty, next, body));
        }
        let first = self.ipv6_exts.first().map_or(upper, |e| e.0);

        let with_l4 = !self
            .ipv6_exts
            .iter()
            .any(|(ty, body)| *ty == IPV6_EXT_FRAGMENT && fragment_offset(body) != 0);
        let l4_hdr_len = if with_l4 { self.l4.header_len() } else { 0 };
        let payload = self.padded_payload(l2_len + 40 + exts.len() + l4_hdr_len);
        let segment = if with_l4 {
            let final_dst = self.ipv6_final_destination().unwrap_or(dst);
            self.l4_segment(&payload, Pseudo::V6(src, final_dst), true)
        } else {
            payload
        };
        let payload_len =
            u16::try_from(exts.len() + segment.len()).expect("IPv6 payload length exceeds 65535");

        let mut p = Vec::with_capacity(40 + usize::from(payload_len));
        p.extend_from_slice(&[0x60, 0, 0, 0]);
        p.extend_from_slice(&payload_len.to_be_bytes());
        p.push(first);
        p.push(DEFAULT_TTL);
        p.extend_from_slice(&src.octets());
        p.extend_from_slice(&dst.octets());
        p.extend_from_slice(&exts);
        p.extend_from_slice(&segment);
        p
    }

    /// RFC 8200 8.1: with a routing header still to be processed, the
    /// pseudo-header uses the last hop, not the IPv6 destination field.
    fn ipv6_final_destination(&self) -> Option<Ipv6Addr> {
        let (_, body) = self
            .ipv6_exts
            .iter()
            .find(|(ty, body)| *ty == IPV6_EXT_ROUTING && body.len() >= 2 && body[1] > 0)?;
        // Body starts at the routing type; addresses start after 4 more bytes.
        let addrs = body.get(6..)?;
        let bytes = match body[0] {
            // RH0 and Mobile IPv6 type 2: the final hop is the last address.
            0 | 2 => {
                let n = addrs.len() / 16;
                addrs.get(n.checked_sub(1)? * 16..n * 16)?
            }
            // SRH: segment list is reversed, Segment List[0] is the final hop.
            4 => addrs.get(..16)?,
            _ => return None,
        };
        let octets: [u8; 16] = bytes.try_into().ok()?;
        Some(Ipv6Addr::from(octets))
    }

    fn l4_segment(&self, payload: &[u8], pseudo: Pseudo, v6: bool) -> Vec<u8> {
        let proto = self.l4.protocol(v6);
        let mut s = Vec::with_capacity(self.l4.header_len() + payload.len());
        let csum_at = match self.l4 {
            L4::None | L4::Raw(_) => None,
            L4::Tcp {
                sport,
                dport,
                flags,
            } => {
                let ack: u32 = if flags & tcp_flags::ACK != 0 { 1 } else { 0 };
                s.extend_from_slice(&sport.to_be_bytes());
                s.extend_from_slice(&dport.to_be_bytes());
                s.extend_from_slice(&1u32.to_be_bytes());
                s.extend_from_slice(&ack.to_be_bytes());
                s.extend_from_slice(&[0x50, flags]);
                s.extend_from_slice(&u16::MAX.to_be_bytes());
                s.extend_from_slice(&[0, 0, 0, 0]);
                Some(16)
            }
            L4::Udp { sport, dport } => {
                let len = u16::try_from(8 + payload.len()).expect("UDP length exceeds 65535");
                s.extend_from_slice(&sport.to_be_bytes());
                s.extend_from_slice(&dport.to_be_bytes());
                s.extend_from_slice(&len.to_be_bytes());
                s.extend_from_slice(&[0, 0]);
                Some(6)
            }
            L4::IcmpEcho { id, seq } => {
                s.push(if v6 { 128 } else { 8 });
                s.push(0);
                s.extend_from_slice(&[0, 0]);
                s.extend_from_slice(&id.to_be_bytes());
                s.extend_from_slice(&seq.to_be_bytes());
                Some(2)
            }
        };
        s.extend_from_slice(payload);
        if let Some(at) = csum_at {
            let icmpv4 = matches!(self.l4, L4::IcmpEcho { .. }) && !v6;
            let mut csum = if icmpv4 {
                checksum(&s)
            } else {
                // The pseudo-header is 12 or 40 bytes, so summing it separately
                // keeps 16-bit word alignment for the segment.
                fold(sum_words(sum_words(0, &pseudo.bytes(proto, s.len())), &s))
            };
            if csum == 0 && matches!(self.l4, L4::Udp { .. }) {
                csum = 0xffff;
            }
            s[at..at + 2].copy_from_slice(&csum.to_be_bytes());
        }
        s
    }
}

fn fragment_offset(body: &[u8]) -> u16 {
    match body {
        [hi, lo, ..] => u16::from_be_bytes([*hi, *lo]) >> 3,
        _ => 0,
    }
}

fn encode_ipv6_ext(ty: u8, next: u8, body: &[u8]) -> Vec<u8> {
    let mut h = vec![next, 0];
    h.extend_from_slice(body);
    match ty {
        IPV6_EXT_FRAGMENT => {
            assert!(body.len() <= 6, "IPv6 fragment header body exceeds 6 bytes");
            h.resize(8, 0);
        }
        IPV6_EXT_AH => {
            // Fixed part is 12 bytes; over IPv6 the whole header is 8-aligned.
            h.resize(h.len().max(12).next_multiple_of(8), 0);
            h[1] = u8::try_from(h.len() / 4 - 2).expect("AH header too long");
        }
        _ => {
            h.resize(h.len().next_multiple_of(8), 0);
            h[1] = u8::try_from(h.len() / 8 - 1).expect("IPv6 extension header too long");
        }
    }
    h
}

fn sum_words(mut acc: u64, data: &[u8]) -> u64 {
    let mut chunks = data.chunks_exact(2);
    for w in &mut chunks {
        acc += u64::from(u16::from_be_bytes([w[0], w[1]]));
    }
    if let [last] = chunks.remainder() {
        acc += u64::from(u16::from_be_bytes([*last, 0]));
    }
    acc
}

fn fold(mut acc: u64) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    // The loop leaves acc <= 0xffff.
    !(acc as u16)
}

/// RFC 1071 internet checksum (odd length padded with a zero byte), returned
/// as a number to store big-endian. Summing a block that already contains a
/// correct checksum yields 0, which is how tests verify received frames.
pub fn checksum(data: &[u8]) -> u16 {
    fold(sum_words(0, data))
}

/// Cuts a frame to at most `len` bytes, for parser bounds-check tests; the
/// length fields inside keep claiming the full size, which is the point.
pub fn truncate(frame: &[u8], len: usize) -> Vec<u8> {
    frame[..len.min(frame.len())].to_vec()
}

/// A broadcast ARP who-has request, the most common non-IP frame a rate
/// limiter must pass untouched. It is 42 bytes (not padded to 60), as the
/// kernel hands it to AF_PACKET before any NIC padding.
pub fn arp_request(src_mac: [u8; 6], src_ip: Ipv4Addr, target_ip: Ipv4Addr) -> Vec<u8> {
    let mut body = Vec::with_capacity(28);
    body.extend_from_slice(&1u16.to_be_bytes()); // HTYPE Ethernet
    body.extend_from_slice(&ETH_P_IPV4.to_be_bytes()); // PTYPE
    body.extend_from_slice(&[6, 4]); // HLEN, PLEN
    body.extend_from_slice(&1u16.to_be_bytes()); // OPER request
    body.extend_from_slice(&src_mac);
    body.extend_from_slice(&src_ip.octets());
    body.extend_from_slice(&[0; 6]);
    body.extend_from_slice(&target_ip.octets());
    Frame::new(src_mac, [0xff; 6])
        .ethertype_raw(ETH_P_ARP)
        .payload(&body)
        .build()
}

/// Returns the IP source of a received frame so receivers can count frames
/// per sender. Skips up to two 802.1Q/802.1ad tags (0x8100/0x88a8); anything
/// else, including non-IP and frames too short for the address, gives `None`.
pub fn parse_src_ip(frame: &[u8]) -> Option<IpAddr> {
    let be16 = |at: usize| {
        frame
            .get(at..at + 2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]))
    };
    let mut at = 12;
    let mut ethertype = be16(at)?;
    for _ in 0..2 {
        if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
            at += 4;
            ethertype = be16(at)?;
        }
    }
    let ip = frame.get(at + 2..)?;
    match ethertype {
        ETH_P_IPV4 if ip.len() >= 20 && ip[0] >> 4 == 4 => {
            let src: [u8; 4] = ip[12..16].try_into().ok()?;
            Some(IpAddr::V4(Ipv4Addr::from(src)))
        }
        ETH_P_IPV6 if ip.len() >= 40 && ip[0] >> 4 == 6 => {
            let src: [u8; 16] = ip[8..24].try_into().ok()?;
            Some(IpAddr::V6(Ipv6Addr::from(src)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::tcp_flags::*;
    use super::*;

    const SMAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
    const DMAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
    const V4_SRC: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
    const V4_DST: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
    const V6_SRC: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1);
    const V6_DST: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2);
    const V6_FINAL: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0xff, 0, 0, 0, 0, 9);

    fn base() -> Frame {
        Frame::new(SMAC, DMAC)
    }

    fn be16(b: &[u8], at: usize) -> u16 {
        u16::from_be_bytes([b[at], b[at + 1]])
    }

    /// Offset of the L3 header, skipping any number of 0x8100/0x88a8 tags.
    fn l3_offset(f: &[u8]) -> usize {
        let mut at = 12;
        while matches!(be16(f, at), ETH_P_8021Q | ETH_P_8021AD) {
            at += 4;
        }
        at + 2
    }

    /// Verifies the IPv4 header and L4 checksums and lengths; returns (ip header, segment).
    fn check_v4(f: &[u8]) -> (&[u8], &[u8]) {
        let ip = &f[l3_offset(f)..];
        assert_eq!(ip[0] >> 4, 4);
        let ihl = usize::from(ip[0] & 0x0f) * 4;
        assert_eq!(usize::from(be16(ip, 2)), ip.len(), "IPv4 total length");
        assert_eq!(checksum(&ip[..ihl]), 0, "IPv4 header checksum");
        let seg = &ip[ihl..];
        let non_first_fragment = be16(ip, 6) & 0x1fff != 0;
        if !non_first_fragment {
            let proto = ip[9];
            match proto {
                IPPROTO_TCP | IPPROTO_UDP => {
                    let mut pseudo = ip[12..20].to_vec();
                    pseudo.extend_from_slice(&[0, proto]);
                    pseudo.extend_from_slice(&(seg.len() as u16).to_be_bytes());
                    pseudo.extend_from_slice(seg);
                    assert_eq!(checksum(&pseudo), 0, "L4 checksum with pseudo-header");
                    if proto == IPPROTO_UDP {
                        assert_eq!(usize::from(be16(seg, 4)), seg.len(), "UDP length");
                    }
                }
                IPPROTO_ICMP => assert_eq!(checksum(seg), 0, "ICMP checksum"),
                _ => {}
            }
        }
        (&ip[..ihl], seg)
    }

    /// Walks the IPv6 chain, verifying lengths and the L4 checksum against
    /// `pseudo_dst`; returns (next-header chain, upper-layer segment).
    fn check_v6(f: &[u8], pseudo_dst: Ipv6Addr) -> (Vec<u8>, &[u8]) {
        let ip = &f[l3_offset(f)..];
        assert_eq!(ip[0] >> 4, 6);
        assert_eq!(
            usize::from(be16(ip, 4)),
            ip.len() - 40,
            "IPv6 payload length"
        );
        let mut chain = vec![ip[6]];
        let mut at = 40;
        let mut non_first_fragment = false;
        loop {
            let nh = *chain.last().unwrap();
            let len = match nh {
                0 | 43 | 60 => (usize::from(ip[at + 1]) + 1) * 8,
                44 => {
                    assert_eq!(ip[at + 1], 0, "fragment header reserved byte");
                    non_first_fragment |= be16(ip, at + 2) >> 3 != 0;
                    8
                }
                51 => (usize::from(ip[at + 1]) + 2) * 4,
                _ => break,
            };
            assert_eq!(len % 8, 0, "extension header not 8-aligned");
            chain.push(ip[at]);
            at += len;
        }
        let seg = &ip[at..];
        let proto = *chain.last().unwrap();
        if !non_first_fragment && matches!(proto, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_ICMPV6) {
            let mut pseudo = ip[8..24].to_vec();
            pseudo.extend_from_slice(&pseudo_dst.octets());
            pseudo.extend_from_slice(&(seg.len() as u32).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, proto]);
            pseudo.extend_from_slice(seg);
            assert_eq!(checksum(&pseudo), 0, "L4 checksum with IPv6 pseudo-header");
            if proto == IPPROTO_UDP {
                assert_eq!(usize::from(be16(seg, 4)), seg.len(), "UDP length");
            }
        }
        (chain, seg)
    }

    #[test]
    fn checksum_published_vectors() {
        // RFC 1071 section 3 example: sum is 0xddf2.
        assert_eq!(
            checksum(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]),
            !0xddf2
        );
        // Widely published IPv4 header example; checksum field zeroed.
        let hdr = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(checksum(&hdr), 0xb861);
        // Odd length pads with a trailing zero byte.
        assert_eq!(checksum(&[0x01]), !0x0100);
        assert_eq!(checksum(&[]), 0xffff);
    }

    #[test]
    fn ipv4_udp_matches_hand_computed_bytes() {
        let f = base()
            .ipv4(V4_SRC, V4_DST)
            .udp(12345, 53)
            .payload(b"hi")
            .build();
        // IPv4 checksum: 4500+001e+0000+0000+4011+c000+0201+c633+6402 = 0x27165
        //   -> fold 0x7167 -> !0x8e98.
        // UDP checksum: pseudo c000+0201+c633+6402+0011+000a plus
        //   3039+0035+000a+6869 = 0x28532 -> fold 0x8534 -> !0x7acb.
        #[rustfmt::skip]
        let expected: [u8; 44] = [
            0x02, 0x00, 0x00, 0x00, 0x00, 0x02, // dst mac
            0x02, 0x00, 0x00, 0x00, 0x00, 0x01, // src mac
            0x08, 0x00,                         // IPv4
            0x45, 0x00, 0x00, 0x1e,             // v4 ihl5, tos, total 30
            0x00, 0x00, 0x00, 0x00,             // id 0, no flags
            0x40, 0x11, 0x8e, 0x98,             // ttl 64, UDP, checksum
            0xc0, 0x00, 0x02, 0x01,             // 192.0.2.1
            0xc6, 0x33, 0x64, 0x02,             // 198.51.100.2
            0x30, 0x39, 0x00, 0x35,             // 12345 -> 53
            0x00, 0x0a, 0x7a, 0xcb,             // len 10, checksum
            0x68, 0x69,                         // "hi"
        ];
        assert_eq!(f, expected);
        check_v4(&f);
    }

    #[test]
    fn ipv4_checksums_and_lengths_for_every_l4() {
        let frames = [
            base().ipv4(V4_SRC, V4_DST).tcp(1000, 80, SYN).build(),
            base()
                .ipv4(V4_SRC, V4_DST)
                .tcp(1000, 80, PSH | ACK)
                .payload(b"GET / HTTP/1.0\r\n\r\n")
                .build(),
            base()
                .ipv4(V4_SRC, V4_DST)
                .udp(1, 2)
                .payload(b"odd")
                .build(),
            base()
                .ipv4(V4_SRC, V4_DST)
                .icmp_echo(7, 9)
                .payload(b"ping!")
                .build(),
            base()
                .ipv4(V4_SRC, V4_DST)
                .raw_l4(47)
                .payload(&[0; 4])
                .build(),
            base().ipv4(V4_SRC, V4_DST).payload(b"x").build(),
        ];
        let protos = [6, 6, 17, 1, 47, 253];
        for (f, proto) in frames.iter().zip(protos) {
            let (hdr, _) = check_v4(f);
            assert_eq!(hdr[9], proto);
            assert_eq!(hdr[8], 64, "default TTL");
            assert_eq!(be16(hdr, 4), 0, "default id");
            assert_eq!(be16(hdr, 6), 0, "DF/MF/offset clear");
        }
    }

    #[test]
    fn tcp_header_defaults() {
        let syn = base().ipv4(V4_SRC, V4_DST).tcp(1000, 80, SYN).build();
        let (_, seg) = check_v4(&syn);
        assert_eq!(seg.len(), 20);
        assert_eq!((be16(seg, 0), be16(seg, 2)), (1000, 80));
        assert_eq!(&seg[4..8], &1u32.to_be_bytes(), "seq");
        assert_eq!(&seg[8..12], &0u32.to_be_bytes(), "ack without ACK");
        assert_eq!(seg[12], 0x50, "data offset 5");
        assert_eq!(seg[13], SYN);
        assert_eq!(be16(seg, 14), 65535, "window");
        assert_eq!(be16(seg, 18), 0, "urgent pointer");

        let ack = base().ipv4(V4_SRC, V4_DST).tcp(1000, 80, SYN | ACK).build();
        let (_, seg) = check_v4(&ack);
        assert_eq!(&seg[8..12], &1u32.to_be_bytes(), "ack with ACK");
        assert_eq!(seg[13], 0x12);
    }

    #[test]
    fn icmp_echo_layout() {
        let f = base()
            .ipv4(V4_SRC, V4_DST)
            .icmp_echo(0x0102, 0x0304)
            .build();
        let (_, seg) = check_v4(&f);
        assert_eq!(&seg[..2], &[8, 0]);
        assert_eq!(&seg[4..8], &[1, 2, 3, 4]);

        let f = base()
            .ipv6(V6_SRC, V6_DST)
            .icmp_echo(0x0102, 0x0304)
            .build();
        let (chain, seg) = check_v6(&f, V6_DST);
        assert_eq!(chain, [58]);
        assert_eq!(&seg[..2], &[128, 0]);
        assert_eq!(&seg[4..8], &[1, 2, 3, 4]);
    }

    #[test]
    fn ipv4_options_are_padded_and_checksummed() {
        // Router alert (4 bytes) plus a 3-byte option that needs one EOL byte.
        let f = base()
            .ipv4(V4_SRC, V4_DST)
            .ipv4_options(&[0x94, 0x04, 0x00, 0x00, 0x01, 0x01, 0x01])
            .tcp(1, 2, ACK)
            .payload(b"data")
            .build();
        let (hdr, seg) = check_v4(&f);
        assert_eq!(hdr[0], 0x47, "IHL 7 = 28 bytes");
        assert_eq!(&hdr[20..], &[0x94, 0x04, 0, 0, 1, 1, 1, 0]);
        assert_eq!(seg.len(), 24);
        assert_eq!(f.len(), 14 + 28 + 20 + 4);

        let f = base()
            .ipv4(V4_SRC, V4_DST)
            .ipv4_options(&[0x01; 40])
            .udp(5, 6)
            .build();
        let (hdr, _) = check_v4(&f);
        assert_eq!(hdr[0], 0x4f);
    }

    #[test]
    fn ipv4_fragments() {
        let first = base()
            .ipv4(V4_SRC, V4_DST)
            .ipv4_fragment(true, 0)
            .udp(7, 8)
            .payload(&[0xaa; 16])
            .build();
        let (hdr, seg) = check_v4(&first);
        assert_eq!(be16(hdr, 4), 0x1234);
        assert_eq!(be16(hdr, 6), 0x2000, "MF, offset 0");
        assert_eq!(seg.len(), 8 + 16, "first fragment carries the UDP header");

        let later = base()
            .ipv4(V4_SRC, V4_DST)
            .ipv4_fragment(false, 3)
            .tcp(1, 2, SYN)
            .payload(&[0xbb; 5])
            .build();
        let (hdr, seg) = check_v4(&later);
        assert_eq!(be16(hdr, 4), 0x1234);
        assert_eq!(be16(hdr, 6), 3, "no MF, offset 3");
        assert_eq!(hdr[9], IPPROTO_TCP, "protocol still names the L4");
        assert_eq!(seg, &[0xbb; 5], "non-first fragment is raw payload");

        let mid = base()
            .ipv4(V4_SRC, V4_DST)
            .ipv4_fragment(true, 0x1fff)
            .build();
        let (hdr, _) = check_v4(&mid);
        assert_eq!(be16(hdr, 6), 0x3fff);
    }

    #[test]
    fn ipv4_ttl_override() {
        let f = base().ipv4(V4_SRC, V4_DST).ipv4_ttl(1).udp(1, 2).build();
        let (hdr, _) = check_v4(&f);
        assert_eq!(hdr[8], 1);
    }

    #[test]
    fn udp_zero_checksum_is_sent_as_ffff() {
        let probe = base()
            .ipv4(V4_SRC, V4_DST)
            .udp(1, 2)
            .payload(&[0, 0])
            .build();
        let c = be16(&probe, 14 + 20 + 6);
        // Putting the checksum into the payload makes the real sum 0xffff,
        // i.e. a computed checksum of 0.
        let f = base()
            .ipv4(V4_SRC, V4_DST)
            .udp(1, 2)
            .payload(&c.to_be_bytes())
            .build();
        assert_eq!(be16(&f, 14 + 20 + 6), 0xffff);
        check_v4(&f);
    }

    #[test]
    fn pad_to_extends_payload_and_lengths() {
        let f = base().ipv4(V4_SRC, V4_DST).udp(1, 2).pad_to(60).build();
        assert_eq!(f.len(), 60);
        let (_, seg) = check_v4(&f);
        assert_eq!(seg.len(), 60 - 14 - 20);
        assert!(seg[8..].iter().all(|&b| b == 0));

        let big = base()
            .ipv4(V4_SRC, V4_DST)
            .udp(1, 2)
            .payload(&[1; 100])
            .pad_to(60)
            .build();
        assert_eq!(big.len(), 14 + 20 + 8 + 100, "never shrinks");

        let v6 = base()
            .ipv6(V6_SRC, V6_DST)
            .tcp(1, 2, RST)
            .pad_to(90)
            .build();
        assert_eq!(v6.len(), 90);
        check_v6(&v6, V6_DST);

        let raw = base()
            .ethertype_raw(0x88b5)
            .payload(b"abc")
            .pad_to(60)
            .build();
        assert_eq!(raw.len(), 60);
        assert_eq!(&raw[14..17], b"abc");
    }

    #[test]
    fn vlan_double_tag_layout() {
        let f = base()
            .vlan(0x88a8, 100)
            .vlan(0x8100, 0xfff)
            .ipv4(V4_SRC, V4_DST)
            .udp(1, 2)
            .build();
        #[rustfmt::skip]
        let l2: [u8; 22] = [
            0x02, 0, 0, 0, 0, 0x02,
            0x02, 0, 0, 0, 0, 0x01,
            0x88, 0xa8, 0x00, 0x64, // S-tag, VID 100
            0x81, 0x00, 0x0f, 0xff, // C-tag, VID 4095
            0x08, 0x00,
        ];
        assert_eq!(&f[..22], &l2);
        assert_eq!(f.len(), 22 + 20 + 8);
        check_v4(&f);

        let single = base()
            .vlan(0x8100, 5)
            .ipv6(V6_SRC, V6_DST)
            .udp(1, 2)
            .build();
        assert_eq!(&single[12..18], &[0x81, 0x00, 0x00, 0x05, 0x86, 0xdd]);
        check_v6(&single, V6_DST);
    }

    #[test]
    fn ipv6_extension_chain_linkage_and_final_destination() {
        // SRH (type 4) with segments left 1: Segment List[0] is the final hop.
        let mut srh = vec![4, 1, 1, 0, 0, 0];
        srh.extend_from_slice(&V6_FINAL.octets());
        srh.extend_from_slice(&V6_DST.octets());
        let f = base()
            .ipv6(V6_SRC, V6_DST)
            .ipv6_ext(0, &[])
            .ipv6_ext(43, &srh)
            .ipv6_fragment(true, 0, 0xdeadbeef)
            .ipv6_ext(60, &[1, 4, 0, 0, 0, 0, 0xaa])
            .tcp(1234, 443, SYN)
            .payload(b"abc")
            .build();
        let (chain, seg) = check_v6(&f, V6_FINAL);
        assert_eq!(chain, [0, 43, 44, 60, 6]);
        assert_eq!(seg.len(), 20 + 3);

        let ip = &f[14..];
        // hop-by-hop: empty body -> 8 bytes of Pad1, length 0.
        assert_eq!(&ip[40..48], &[43, 0, 0, 0, 0, 0, 0, 0]);
        // routing: 2 + 38 bytes -> 40, length 4.
        assert_eq!(&ip[48..50], &[44, 4]);
        assert_eq!(&ip[50..56], &[4, 1, 1, 0, 0, 0]);
        // fragment: fixed 8 bytes.
        assert_eq!(&ip[88..96], &[60, 0, 0x00, 0x01, 0xde, 0xad, 0xbe, 0xef]);
        // dest opts: 2 + 7 bytes -> 16, length 1, zero padded.
        assert_eq!(
            &ip[96..112],
            &[6, 1, 1, 4, 0, 0, 0, 0, 0xaa, 0, 0, 0, 0, 0, 0, 0]
        );
        assert_eq!(usize::from(be16(ip, 4)), 8 + 40 + 8 + 16 + 23);
    }

    #[test]
    fn ipv6_routing_final_destination_variants() {
        // RH0 with two addresses: the last one is the final hop.
        let mut rh0 = vec![0, 2, 0, 0, 0, 0];
        rh0.extend_from_slice(&V6_DST.octets());
        rh0.extend_from_slice(&V6_FINAL.octets());
        let f = base()
            .ipv6(V6_SRC, V6_DST)
            .ipv6_ext(43, &rh0)
            .udp(1, 2)
            .build();
        check_v6(&f, V6_FINAL);

        // Segments left 0: the routing header is spent, destination field is final.
        let mut spent = vec![4, 0, 0, 0, 0, 0];
        spent.extend_from_slice(&V6_FINAL.octets());
        let f = base()
            .ipv6(V6_SRC, V6_DST)
            .ipv6_ext(43, &spent)
            .icmp_echo(1, 1)
            .build();
        check_v6(&f, V6_DST);
    }

    #[test]
    fn ipv6_ext_length_units() {
        // AH with a 12-byte ICV: 12 + 12 = 24 bytes -> 24/4 - 2 = 4.
        let mut ah = vec![0, 0, 0, 0, 0, 1, 0, 0, 0, 1];
        ah.extend_from_slice(&[0x5a; 12]);
        let f = base()
            .ipv6(V6_SRC, V6_DST)
            .ipv6_ext(51, &ah)
            .ipv6_ext(0, &[0; 6])
            .ipv6_ext(0, &[0; 7])
            .udp(1, 2)
            .build();
        let (chain, _) = check_v6(&f, V6_DST);
        assert_eq!(chain, [51, 0, 0, 17]);
        let ip = &f[14..];
        assert_eq!(&ip[40..42], &[0, 4]);
        assert_eq!(&ip[64..66], &[0, 0], "2 + 6 bytes fits in 8");
        assert_eq!(&ip[72..74], &[17, 1], "2 + 7 bytes needs 16");

        // AH without ICV still occupies an 8-aligned 16 bytes: 16/4 - 2 = 2.
        let f = base().ipv6(V6_SRC, V6_DST).ipv6_ext(51, &[0; 10]).build();
        let (chain, _) = check_v6(&f, V6_DST);
        assert_eq!(chain, [51, 59]);
        assert_eq!(f[14 + 41], 2);
        assert_eq!(f.len(), 14 + 40 + 16);
    }

    #[test]
    fn ipv6_non_first_fragment_is_raw() {
        let f = base()
            .ipv6(V6_SRC, V6_DST)
            .ipv6_fragment(false, 185, 7)
            .udp(1, 2)
            .payload(&[0xcc; 9])
            .build();
        let (chain, seg) = check_v6(&f, V6_DST);
        assert_eq!(chain, [44, 17]);
        assert_eq!(seg, &[0xcc; 9]);
        assert_eq!(be16(&f, 14 + 42), 185 << 3);
    }

    #[test]
    fn ethertype_raw_and_arp() {
        let f = base().ethertype_raw(0x88b5).payload(b"hello").build();
        assert_eq!(&f[12..14], &[0x88, 0xb5]);
        assert_eq!(&f[14..], b"hello");

        let ip = Ipv4Addr::new(10, 0, 0, 1);
        let target = Ipv4Addr::new(10, 0, 0, 2);
        let arp = arp_request(SMAC, ip, target);
        #[rustfmt::skip]
        let expected: [u8; 42] = [
            0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
            0x02, 0, 0, 0, 0, 0x01,
            0x08, 0x06,
            0x00, 0x01, 0x08, 0x00, 6, 4, 0x00, 0x01,
            0x02, 0, 0, 0, 0, 0x01, 10, 0, 0, 1,
            0, 0, 0, 0, 0, 0, 10, 0, 0, 2,
        ];
        assert_eq!(arp, expected);
    }

    #[test]
    fn truncate_cuts_but_never_extends() {
        let f = base().ipv4(V4_SRC, V4_DST).tcp(1, 2, SYN).build();
        assert_eq!(truncate(&f, 20), f[..20].to_vec());
        assert_eq!(truncate(&f, 1000), f);
        assert!(truncate(&f, 0).is_empty());
    }

    #[test]
    fn parse_src_ip_all_variants() {
        let v4 = IpAddr::V4(V4_SRC);
        let v6 = IpAddr::V6(V6_SRC);
        let cases: Vec<(Vec<u8>, Option<IpAddr>)> = vec![
            (base().ipv4(V4_SRC, V4_DST).udp(1, 2).build(), Some(v4)),
            (
                base()
                    .ipv4(V4_SRC, V4_DST)
                    .ipv4_options(&[1; 8])
                    .tcp(1, 2, SYN)
                    .build(),
                Some(v4),
            ),
            (
                base().ipv4(V4_SRC, V4_DST).ipv4_fragment(false, 10).build(),
                Some(v4),
            ),
            (base().ipv6(V6_SRC, V6_DST).tcp(1, 2, SYN).build(), Some(v6)),
            (
                base()
                    .ipv6(V6_SRC, V6_DST)
                    .ipv6_ext(0, &[])
                    .ipv6_fragment(false, 1, 1)
                    .build(),
                Some(v6),
            ),
            (
                base()
                    .vlan(0x8100, 1)
                    .ipv4(V4_SRC, V4_DST)
                    .icmp_echo(1, 1)
                    .build(),
                Some(v4),
            ),
            (
                base()
                    .vlan(0x88a8, 1)
                    .vlan(0x8100, 2)
                    .ipv6(V6_SRC, V6_DST)
                    .icmp_echo(1, 1)
                    .build(),
                Some(v6),
            ),
            (
                base()
                    .vlan(0x88a8, 1)
                    .vlan(0x8100, 2)
                    .ipv4(V4_SRC, V4_DST)
                    .raw_l4(47)
                    .build(),
                Some(v4),
            ),
            // A third tag is beyond what receivers look through.
            (
                base()
                    .vlan(0x88a8, 1)
                    .vlan(0x8100, 2)
                    .vlan(0x8100, 3)
                    .ipv4(V4_SRC, V4_DST)
                    .build(),
                None,
            ),
            (arp_request(SMAC, V4_SRC, V4_DST), None),
            (base().ethertype_raw(0x88b5).pad_to(60).build(), None),
            // Truncated inside the address, and inside the Ethernet header.
            (
                truncate(&base().ipv4(V4_SRC, V4_DST).udp(1, 2).build(), 14 + 15),
                None,
            ),
            (
                truncate(&base().ipv6(V6_SRC, V6_DST).udp(1, 2).build(), 14 + 39),
                None,
            ),
            (truncate(&base().ipv4(V4_SRC, V4_DST).build(), 13), None),
            (
                truncate(&base().vlan(0x8100, 1).ipv4(V4_SRC, V4_DST).build(), 17),
                None,
            ),
            // Ethertype says IPv4 but the version nibble says otherwise.
            (
                base().ethertype_raw(0x0800).payload(&[0x60; 40]).build(),
                None,
            ),
        ];
        for (i, (frame, want)) in cases.iter().enumerate() {
            assert_eq!(parse_src_ip(frame), *want, "case {i}");
        }
    }

    #[test]
    #[should_panic(expected = "ipv4(), ipv6() or ethertype_raw()")]
    fn build_without_l3_panics() {
        base().udp(1, 2).build();
    }

    #[test]
    #[should_panic(expected = "IPv4 settings on an IPv6 frame")]
    fn ipv4_settings_on_ipv6_panic() {
        base().ipv6(V6_SRC, V6_DST).ipv4_ttl(3).build();
    }
}
