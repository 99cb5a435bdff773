//! The per-CPU fast-drop table (`RL_FAST`).

use super::client::ClientKey;

/// Entries per CPU in the fast-drop table (`RL_FAST`), indexed by a fold of the source.
pub const FAST_ENTRIES: u32 = 64;

/// `FastEntry::pkt_flags` bits: the parsed packet's booleans.
pub const FAST_V4: u8 = 1 << 0;
pub const FAST_L4: u8 = 1 << 1;
pub const FAST_FRAGMENT: u8 = 1 << 2;
pub const FAST_L4_CUT: u8 = 1 << 3;

/// A fast-drop entry, per CPU (`RL_FAST`). Within one timer tick the coarse clock stands
/// still, so a packet a throttle rule refused on the coarse clock would be refused again by
/// every later packet of the same kind (same source, protocol, port, flags, interface) in
/// that tick: nothing it is judged on can loosen until the clock moves or the policy changes.
/// The program records such a refusal here and drops the rest of the tick's like packets
/// without looking their client up; it counts them in the per-CPU counters as usual and in
/// `pending_*` for the client, added to the client's state when the entry goes stale (a later
/// tick, or another packet taking the slot) and by the daemon when it reports clients.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FastEntry {
    pub src: [u8; 16],
    pub dport: u16,
    pub proto: u8,
    pub tcp_flags: u8,
    /// `FAST_*` bits; 0 in an empty entry (a parsed packet always has one: V4 or not, so an
    /// empty entry is told apart by `jiffies == 0`).
    pub pkt_flags: u8,
    pub rule: u8,
    pub _pad: [u8; 2],
    pub slot: u32,
    pub generation: u32,
    /// The tick (jiffies) the entry is good for; 0: empty.
    pub jiffies: u64,
    /// The client whose state the pending counts belong to.
    pub key: ClientKey,
    pub pending_packets: u64,
    pub pending_bytes: u64,
    /// Coarse time of the tick.
    pub now_ns: u64,
    /// `RL_BAN_EPOCH` when the entry was made: a ban added since voids it.
    pub ban_epoch: u64,
}
