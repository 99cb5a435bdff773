//! Counter indices of the per-CPU `STATS` array. Every packet lands in exactly one *verdict*
//! counter of its interface slot; reason and rule counters add detail beside it.
//!
//! Index = `iface_slot * PER_IFACE + counter`, with rule counters after the global ones:
//! `GLOBAL_COUNT + rule * RULE_COUNT + rule_counter`.

use crate::caps::{MAX_IFACES, MAX_RULES};

/// Packets and bytes, per CPU; the daemon sums the CPUs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}

/// Global counters. The first block (`PASS` .. `DROP_RULE`) are the verdicts: each packet is
/// counted in exactly one of them, so their sum is the number of frames the program saw.
pub mod global {
    /// Passed: matched no rule that dropped it.
    pub const PASS: u32 = 0;
    /// Passed: not IPv4/IPv6 (ARP, LLDP, ...).
    pub const PASS_NON_IP: u32 = 1;
    /// Passed: an IP frame too short or malformed to parse (see the `MALFORMED_*` reasons).
    pub const PASS_MALFORMED: u32 = 2;
    /// Passed: source on the allow list.
    pub const PASS_ALLOW: u32 = 3;
    /// Dropped: source on the deny list.
    pub const DROP_DENY: u32 = 4;
    /// Dropped: source banned.
    pub const DROP_BAN: u32 = 5;
    /// Dropped by a rule's throttle.
    pub const DROP_RULE: u32 = 6;
    /// Dropped: an IPv6 source no real client has (unspecified, loopback, multicast,
    /// IPv4-mapped, IPv4-compatible: `addr::is_v6_bogon`). Never given state or a ban.
    pub const DROP_BOGON: u32 = 7;
    /// Number of verdict counters.
    pub const VERDICTS: u32 = 8;

    // Detail counters (a packet may be in several, or none).
    /// Would have been dropped by a preview rule or a preview ban; passed.
    pub const PREVIEW_WOULD_DROP: u32 = 8;
    /// Exceeded a rule whose `exceed_action` is `pass`; passed.
    pub const EXCEED_PASS: u32 = 9;
    /// Banned source whose ban has `exceed_action = pass` or preview; passed on to the rules.
    pub const BAN_PASS: u32 = 10;
    /// New per-client state created.
    pub const STATE_CREATED: u32 = 11;
    /// New source refused per-client state by the admission budget; limited in aggregate.
    pub const ADMISSION_REFUSED: u32 = 12;
    /// Per-client state could not be created (map error); limited in aggregate.
    pub const STATE_INSERT_FAILED: u32 = 13;
    /// Bans issued by the kernel program.
    pub const BANS_ISSUED: u32 = 14;
    /// Ban could not be recorded because the ban map is full.
    pub const BAN_INSERT_FAILED: u32 = 15;
    /// Expired bans removed by the kernel program.
    pub const BANS_EXPIRED: u32 = 16;
    /// Events dropped because the ring buffer was full.
    pub const EVENTS_LOST: u32 = 17;
    /// Non-first fragments (keyed by L3 alone).
    pub const FRAGMENTS: u32 = 18;
    /// Malformed: truncated Ethernet or VLAN header, or more VLAN tags than the parser walks.
    pub const MALFORMED_L2: u32 = 19;
    /// Malformed: truncated IPv4 header, IHL < 5, or total length shorter than the header.
    pub const MALFORMED_IPV4: u32 = 20;
    /// Malformed: truncated IPv6 header or extension header.
    pub const MALFORMED_IPV6: u32 = 21;
    /// Malformed: truncated TCP/UDP/ICMP header on a first fragment.
    pub const MALFORMED_L4: u32 = 22;
    /// IPv6 extension chain longer than the parser walks: keyed by L3 alone.
    pub const IPV6_EXT_LIMIT: u32 = 23;
    /// Lock-free update lost its race too many times; counted as exceeding (never over-admits).
    pub const CONTENDED: u32 = 24;
    /// New sources whose per-client lookup the known-sources filter skipped (no state).
    pub const LOOKUP_SKIPPED: u32 = 25;
    /// A new per-client state took the slot of another (the one idle longest in its set).
    pub const STATE_EVICTED: u32 = 26;
    /// A rule ban found the rules' ban table full (`caps::MAX_BANS`): the ban is held in the
    /// client's own state instead, and still drops it for its duration.
    pub const BAN_HELD_IN_STATE: u32 = 27;
    /// A new source got no state because every state in its two sets was protected from
    /// eviction (throttled or metered toward a ban, and recent); limited in aggregate.
    pub const STATE_PROTECTED: u32 = 28;
    /// A TCP SYN from a source refused state, to a listener whose SYN queue is full, answered
    /// from XDP with a SYN cookie of that listener (its verdict stays `DROP_RULE`: the stack
    /// never saw it).
    pub const SYN_COOKIES_SENT: u32 = 29;
    /// A TCP SYN from a source refused state, handed to its listener, whose SYN queue had room
    /// (verdict `PASS`).
    pub const SYN_TO_LISTENER: u32 = 30;
    /// A source proven by the ACK of a valid cookie or by a packet of an established
    /// connection (that packet's verdict is `PASS`; its rule counted it as dropped, before the
    /// check).
    pub const SOURCES_PROVEN: u32 = 31;
    /// A new state given to a proven source without the admission budget.
    pub const PROVEN_ADMITTED: u32 = 32;
    /// A TCP packet from a source refused state, of a connection the kernel holds (half-open
    /// or established), passed (verdict `PASS`).
    pub const CONNECTION_PASSED: u32 = 33;
    pub const COUNT: u32 = 34;

    /// Names used in reports and metric labels, by index.
    pub const NAMES: [&str; COUNT as usize] = [
        "pass",
        "pass_non_ip",
        "pass_malformed",
        "pass_allow",
        "drop_deny",
        "drop_ban",
        "drop_rule",
        "drop_bogon",
        "preview_would_drop",
        "exceed_pass",
        "ban_pass",
        "state_created",
        "admission_refused",
        "state_insert_failed",
        "bans_issued",
        "ban_insert_failed",
        "bans_expired",
        "events_lost",
        "fragments",
        "malformed_l2",
        "malformed_ipv4",
        "malformed_ipv6",
        "malformed_l4",
        "ipv6_ext_limit",
        "contended",
        "lookup_skipped",
        "state_evicted",
        "ban_held_in_state",
        "state_protected",
        "syn_cookies_sent",
        "syn_to_listener",
        "sources_proven",
        "proven_admitted",
        "connection_passed",
    ];
}

/// Per-rule counters.
pub mod rule {
    /// Packets the rule matched (and therefore counted).
    pub const MATCHED: u32 = 0;
    /// Matched and within the threshold.
    pub const ADMITTED: u32 = 1;
    /// Matched, over the threshold, dropped.
    pub const DROPPED: u32 = 2;
    /// Matched, over the threshold, passed because of preview.
    pub const WOULD_DROP: u32 = 3;
    /// Matched, over the threshold, passed because `exceed_action = pass`.
    pub const EXCEED_PASSED: u32 = 4;
    /// Bans this rule issued.
    pub const BANS: u32 = 5;
    /// Packets dropped because the client was banned by this rule (key all/region bans).
    pub const BANNED_DROPPED: u32 = 6;
    pub const COUNT: u32 = 7;

    /// Names used in reports and metric labels, by index.
    pub const NAMES: [&str; COUNT as usize] = [
        "matched",
        "admitted",
        "dropped",
        "would_drop",
        "exceed_passed",
        "bans",
        "banned_dropped",
    ];
}

/// Counters per interface slot.
pub const PER_IFACE: u32 = global::COUNT + MAX_RULES * rule::COUNT;
/// Length of the `STATS` array.
pub const STATS_LEN: u32 = MAX_IFACES * PER_IFACE;

#[inline(always)]
pub const fn global_index(slot: u32, counter: u32) -> u32 {
    slot * PER_IFACE + counter
}

#[inline(always)]
pub const fn rule_index(slot: u32, rule: u32, counter: u32) -> u32 {
    slot * PER_IFACE + global::COUNT + rule * rule::COUNT + counter
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_are_disjoint_and_in_range() {
        let last = rule_index(MAX_IFACES - 1, MAX_RULES - 1, rule::COUNT - 1);
        assert_eq!(last, STATS_LEN - 1);
        assert_eq!(rule_index(0, 0, 0), global::COUNT);
        assert_eq!(global_index(1, 0), PER_IFACE);
    }
}
