//! What a rule matches beyond protocol, TCP flags and destination ports (`RuleConfig::more`):
//! source ports, the IP packet's length and TTL, fragments, ICMP types and codes, and bytes
//! of the L4 header or its payload. Destination CIDRs, `except` and `tcp_state` are flags of
//! the rule (`RULE_DST_MATCH`, `RULE_EXCEPT`, `RULE_TCP_STATE`), answered by the
//! destinations trie, the sources trie and a socket lookup.

use crate::caps::{
    MAX_LENGTH_RANGES, MAX_PAYLOAD_FETCHES, MAX_PAYLOAD_MATCHES, MAX_SRC_PORT_RANGES,
};

/// An inclusive range of a 16-bit field: ports, lengths, TTLs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortRange {
    pub lo: u16,
    pub hi: u16,
}

impl PortRange {
    #[inline(always)]
    pub const fn holds(&self, v: u16) -> bool {
        v >= self.lo && v <= self.hi
    }
}

// `MoreMatch::fragment`.
/// Every packet, fragment or not.
pub const FRAGMENT_ANY_PACKET: u8 = 0;
/// Every fragment: the first (IPv4 MF set, or an IPv6 fragment header at offset 0) and later.
pub const FRAGMENT_ANY: u8 = 1;
/// Non-first fragments only (a fragment offset above 0).
pub const FRAGMENT_LATER: u8 = 2;
/// Packets that are not fragments.
pub const FRAGMENT_NONE: u8 = 3;

/// `PayloadFetch::from`: bytes counted from the L4 header's first byte.
pub const FROM_L4: u8 = 0;
/// `PayloadFetch::from`: bytes counted from the L4 payload's first byte (after the TCP
/// header with its options, the UDP header, or the ICMP header's 8 bytes).
pub const FROM_L4_PAYLOAD: u8 = 1;

/// One read of 1-4 bytes of a packet that a rule's payload match compares: the daemon
/// gathers the distinct reads of all rules in `GlobalConfig::fetches`, and the program reads
/// each once per packet, before the rules, into `Parsed::fetched` (big-endian, right-aligned).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PayloadFetch {
    /// [`FROM_L4`] or [`FROM_L4_PAYLOAD`].
    pub from: u8,
    /// 1..=4 bytes.
    pub len: u8,
    /// Bytes after `from`, at most [`MAX_PAYLOAD_OFFSET`](crate::caps::MAX_PAYLOAD_OFFSET).
    pub offset: u16,
}

/// One payload condition of a rule: `(fetched & mask) == value` for the read
/// `GlobalConfig::fetches[fetch - 1]`; `fetch == 0`: no condition.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PayloadMatch {
    pub fetch: u8,
    pub _pad: [u8; 3],
    pub mask: u32,
    pub value: u32,
}

/// A rule's match fields beyond protocol, TCP flags and destination ports. Only read when
/// the rule has `RULE_MORE_MATCH`; a count of 0 (or `fragment` 0) is no condition.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoreMatch {
    pub src_port_count: u8,
    pub length_count: u8,
    pub ttl_count: u8,
    /// `FRAGMENT_*`.
    pub fragment: u8,
    pub src_ports: [PortRange; MAX_SRC_PORT_RANGES],
    /// Of the IP packet's length in bytes (IPv4 total length; IPv6 payload length + 40).
    pub lengths: [PortRange; MAX_LENGTH_RANGES],
    /// Of the IPv4 TTL / IPv6 hop limit.
    pub ttls: [PortRange; MAX_LENGTH_RANGES],
    /// A bit per ICMP / ICMPv6 type (`types[t / 32] >> (t % 32) & 1`), with
    /// `RULE_ICMP_TYPES`.
    pub icmp_types: [u32; 8],
    /// A bit per code, with `RULE_ICMP_CODES`.
    pub icmp_codes: [u32; 8],
    pub payload: [PayloadMatch; MAX_PAYLOAD_MATCHES],
}

/// Whether bit `v` of a 256-bit set is set.
#[inline(always)]
pub const fn bit_set(set: &[u32; 8], v: u8) -> bool {
    set[(v >> 5) as usize] >> (v & 31) & 1 != 0
}

/// The fetches of `GlobalConfig::fetches`, `count` of them used.
pub type Fetches = [PayloadFetch; MAX_PAYLOAD_FETCHES];
