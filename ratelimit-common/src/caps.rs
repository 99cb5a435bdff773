//! Capacities of the kernel maps. One number for each, used by the program's map definitions,
//! by config validation (which rejects configs that would not fit) and by the daemon's reports.

/// Rules evaluated per packet, in file order. Bounded so the verifier can unroll the rule loop.
pub const MAX_RULES: u32 = 16;
/// Entries in each of the allow and deny LPM tries.
pub const MAX_LIST_ENTRIES: u32 = 65_536;
/// Source-CIDR match entries shared by all rules (after prefix closure, see `maps::ListValue`).
pub const MAX_RULE_SRC_ENTRIES: u32 = 16_384;
/// The sources trie holds the allow list, the deny list and every rule's `src` list.
pub const MAX_SOURCES_ENTRIES: u32 = 2 * MAX_LIST_ENTRIES + MAX_RULE_SRC_ENTRIES;
/// Active rule-issued bans that drop. Bans have their own maps so that churn in per-client
/// state cannot evict them. A rule ban that finds this table full is held in the client's
/// own state instead (`maps::BAN_HELD_MARK`).
pub const MAX_BANS: u32 = 262_144;
/// The operator's bans (`ratelimit ban add`): a table of their own, kept for the operator,
/// so that rules filling theirs can never stop `ban add`.
pub const MAX_OPERATOR_BANS: u32 = 262_144;
/// Bans received from the fleet (`RL_BANS_REMOTE`): a table of their own, so that no number
/// of them can fill the operator's. One that finds it full goes into the rules' table of bans
/// that drop (`maps::BAN_SPILLED`), where rule bans that find it full are held in state.
pub const MAX_REMOTE_BANS: u32 = 262_144;
/// Active rule-issued bans that let packets through (preview, `exceed_action = "pass"`).
pub const MAX_PASSING_BANS: u32 = 65_536;
/// Per-CIDR threshold overrides, all rules together.
pub const MAX_OVERRIDES: u32 = 65_536;
/// Per-region threshold overrides, all rules together.
pub const MAX_REGION_OVERRIDES: u32 = 4_096;
/// CIDR → region entries loaded from the GeoIP database.
pub const MAX_REGION_PREFIXES: u32 = 1_048_576;
/// Destination port ranges one rule may match.
pub const MAX_PORT_RANGES: usize = 8;
/// Source port ranges one rule may match (a reflection rule names many services).
pub const MAX_SRC_PORT_RANGES: usize = 16;
/// Length ranges, and TTL ranges, of one rule.
pub const MAX_LENGTH_RANGES: usize = 4;
/// Payload conditions of one rule.
pub const MAX_PAYLOAD_MATCHES: usize = 2;
/// Distinct payload reads of all rules together (`GlobalConfig::fetches`).
pub const MAX_PAYLOAD_FETCHES: usize = 4;
/// The furthest byte a payload read starts at, after its `from`.
pub const MAX_PAYLOAD_OFFSET: u16 = 1500;
/// Destination CIDRs across all rules (`RL_DESTS`).
pub const MAX_RULE_DST_ENTRIES: u32 = 16_384;
/// Counter slots of the `STATS` array: [`UNLISTED_SLOT`], one slot per interface for up to
/// `MAX_IFACES - 2` interfaces, and [`RETIRED_SLOT`].
pub const MAX_IFACES: u32 = 16;
/// The slot of the interfaces beyond the per-interface slots: the frames they receive.
pub const UNLISTED_SLOT: u32 = 0;
/// The slot that keeps the counts of interfaces no longer attached, so that totals never go
/// backwards when a slot is freed. No frame is counted here: it is a slot apart from
/// [`UNLISTED_SLOT`] so that a series of the frames received (`/metrics`) never jumps by the
/// counts of an interface gone.
pub const RETIRED_SLOT: u32 = MAX_IFACES - 1;
/// Interfaces with an ifindex below this find their counter slot in an array (one indexed
/// load); higher ones in a hash map.
pub const IFSLOT_ARRAY_LEN: u32 = 4096;
/// States of shared keys (`key = "all"`: one per rule; `"region"`: one per rule and region).
pub const MAX_SHARED_STATES: u32 = MAX_RULES * 512;
/// States of `KEY_TUPLE` keys (`key = "dst"`, `key = ["dst", "dst_port"]`, ...), all rules
/// together (`RL_KEYED`, allocated as used).
pub const MAX_KEYED_STATES: u32 = 65_536;
/// Sources that completed a TCP handshake with a SYN cookie the program sent (`RL_PROVEN`, an
/// LRU map): while cookies are being sent, they get state without the admission budget.
pub const MAX_PROVEN_SOURCES: u32 = 65_536;
/// Addresses of this host's interfaces the program knows (`RL_LOCAL_ADDRS`, kept by the
/// daemon): on a host that forwards nothing, the only destinations a SYN is answered for.
pub const MAX_LOCAL_ADDRS: u32 = 4096;
/// Default bound on per-client state when the config does not set `tracking.max_sources`.
pub const DEFAULT_MAX_SOURCES: u32 = 1_000_000;
/// Events ring buffer size in bytes (a power of two, a multiple of the page size).
pub const EVENTS_RING_BYTES: u32 = 1 << 20;
/// VLAN tags a valid frame carries (802.1ad outer + 802.1Q inner).
pub const MAX_VLAN_DEPTH: usize = 2;
/// VLAN tags the parser walks to find the source of a frame with more than `MAX_VLAN_DEPTH`
/// (judged by its source and counted as malformed); a frame with more is unreadable.
pub const MAX_VLAN_WALK: usize = 3;
/// IPv6 extension headers the parser walks before giving up and keying by L3 alone.
pub const MAX_IPV6_EXT_HEADERS: usize = 6;
/// Longest interval a threshold may use: keeps the sliding-window weight arithmetic in u64.
pub const MAX_INTERVAL_NS: u64 = 86_400 * 1_000_000_000;
