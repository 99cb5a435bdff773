//! Whether a rule matches a packet (`rules::matches`), and whether a prefix covers an
//! address (the LPM tries' lookups).

use crate::{addr::IpKey, caps::MAX_PORT_RANGES, maps::*};

use super::parse::Parsed;

/// Protocol, destination ports and TCP flags (`rules::matches`).
pub fn rule_matches(rule: &RuleConfig, pkt: &Parsed) -> bool {
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
