//! Whether a rule matches a packet (`rules::matches`, `matching.rs`), the payload reads made
//! before the rules (`matching::fetch`), and whether a prefix covers an address (the LPM
//! tries' lookups).

use crate::{
    addr::IpKey,
    caps::{MAX_LENGTH_RANGES, MAX_PAYLOAD_FETCHES, MAX_PORT_RANGES, MAX_SRC_PORT_RANGES},
    maps::*,
};

use super::parse::Parsed;

/// What the payload reads of `GlobalConfig::fetches` found in a frame (`Parsed::fetched`):
/// the values, and a bit per read that found all its bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fetched {
    pub vals: [u32; MAX_PAYLOAD_FETCHES],
    pub ok: u8,
}

/// The payload reads of `g` for the packet `pkt` of `frame` (`matching::fetch`): none for a
/// packet whose L4 header was not read.
pub fn fetch(g: &GlobalConfig, frame: &[u8], pkt: &Parsed) -> Fetched {
    let mut out = Fetched::default();
    if !pkt.l4 {
        return out;
    }
    for (j, f) in g.fetches.iter().enumerate().take(g.fetch_count as usize) {
        let base = pkt.l4_off
            + if f.from == FROM_L4_PAYLOAD {
                pkt.l4_hdr
            } else {
                0
            };
        let at = base + f.offset as usize;
        let len = f.len.clamp(1, 4) as usize;
        if at + len <= frame.len() {
            out.vals[j] = frame[at..at + len]
                .iter()
                .fold(0u32, |v, b| (v << 8) | *b as u32);
            out.ok |= 1 << j;
        }
    }
    out
}

/// The conditions of `RuleConfig::more` (`matching::more_matches`). L4 conditions (source
/// ports, ICMP types and codes, payload) count as met by a non-first fragment or a packet
/// whose L4 header could not be read, as destination ports do.
pub fn more_matches(rule: &RuleConfig, pkt: &Parsed, fetched: &Fetched) -> bool {
    let m = &rule.more;
    let in_ranges = |ranges: &[PortRange], n: u8, v: u16| {
        ranges[..(n as usize).min(MAX_LENGTH_RANGES)]
            .iter()
            .any(|r| r.holds(v))
    };
    if m.length_count != 0 && !in_ranges(&m.lengths, m.length_count, pkt.ip_len) {
        return false;
    }
    if m.ttl_count != 0 && !in_ranges(&m.ttls, m.ttl_count, pkt.ttl as u16) {
        return false;
    }
    let frag_ok = match m.fragment {
        FRAGMENT_ANY => pkt.fragmented,
        FRAGMENT_LATER => pkt.fragment,
        FRAGMENT_NONE => !pkt.fragmented,
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
        let n = (m.src_port_count as usize).min(MAX_SRC_PORT_RANGES);
        if !m.src_ports[..n].iter().any(|r| r.holds(pkt.sport)) {
            return false;
        }
    }
    if rule.flags & (RULE_ICMP_TYPES | RULE_ICMP_CODES) != 0 {
        let icmp = pkt.proto == PROTO_ICMP || pkt.proto == PROTO_ICMPV6;
        if !pkt.l4 || !icmp {
            return false;
        }
        if rule.flags & RULE_ICMP_TYPES != 0 && !bit_set(&m.icmp_types, pkt.icmp_type) {
            return false;
        }
        if rule.flags & RULE_ICMP_CODES != 0 && !bit_set(&m.icmp_codes, pkt.icmp_code) {
            return false;
        }
    }
    m.payload.iter().all(|p| {
        let j = p.fetch as usize;
        j == 0
            || (j <= MAX_PAYLOAD_FETCHES
                && fetched.ok & (1 << (j - 1)) != 0
                && fetched.vals[j - 1] & p.mask == p.value)
    })
}

/// Protocol, destination ports and TCP flags (`rules::matches`), then
/// [`more_matches`].
pub fn rule_matches(rule: &RuleConfig, pkt: &Parsed, fetched: &Fetched) -> bool {
    if rule.flags & RULE_MORE_MATCH != 0 && !more_matches(rule, pkt, fetched) {
        return false;
    }
    rule_matches_l4(rule, pkt)
}

fn rule_matches_l4(rule: &RuleConfig, pkt: &Parsed) -> bool {
    if rule.protocol != PROTO_ANY && rule.protocol != pkt.proto {
        return false;
    }
    if rule.flags & RULE_TCP_FLAGS != 0 {
        if pkt.proto != PROTO_TCP {
            return false;
        }
        if pkt.l4 {
            if pkt.tcp_flags & rule.tcp_flags_mask != rule.tcp_flags_value {
                return false;
            }
        } else if !pkt.l4_cut {
            return false;
        }
    }
    if rule.port_count == 0 || pkt.fragment || pkt.l4_cut {
        return true;
    }
    if !pkt.l4 || (pkt.proto != PROTO_TCP && pkt.proto != PROTO_UDP) {
        return false;
    }
    let n = (rule.port_count as usize).min(MAX_PORT_RANGES);
    rule.ports[..n]
        .iter()
        .any(|r| pkt.dport >= r.lo && pkt.dport <= r.hi)
}

/// Whether `addr` lies in `prefix/plen` (16-byte keys, as in the LPM tries, where each
/// family is apart: an IPv6 prefix never covers an IPv4 address).
pub fn covers(prefix: &[u8; 16], plen: u32, addr: &[u8; 16]) -> bool {
    let (p, a) = (IpKey { addr: *prefix }, IpKey { addr: *addr });
    p.is_v4() == a.is_v4() && a.masked(plen) == p.masked(plen)
}
