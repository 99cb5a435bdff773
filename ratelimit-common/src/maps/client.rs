//! Per-client state: its key, the limiter state (per source or shared) and what the fleet
//! adds to a shared key.

/// Per-client state key.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ClientKey {
    pub rule: u8,
    /// `KEY_*`.
    pub kind: u8,
    /// `KEY_TUPLE` with `KEY_FIELD_PROTOCOL`: the IP protocol number; else 0.
    pub proto: u8,
    /// `KEY_TUPLE`: the rule's `KEY_FIELD_*` (what the other fields hold); else 0.
    pub fields: u8,
    /// Prefix length of `addr` (0..=128) for `KEY_IP`; for `KEY_TUPLE`, the destination port
    /// (`KEY_FIELD_DST_PORT`) in bits 16..32 and the source port (`KEY_FIELD_SRC_PORT`) in
    /// bits 0..16; else 0.
    pub prefix_len: u32,
    /// Masked source address for `KEY_IP`, region code in bytes 0..2 for `KEY_REGION`, the
    /// destination address (IPv4 mapped, as `IpKey`) for `KEY_TUPLE` with `KEY_FIELD_DST`,
    /// zero otherwise.
    pub addr: [u8; 16],
    /// `KEY_TUPLE` with `KEY_FIELD_SRC`: the source address (IPv4 mapped) masked to the
    /// rule's `v4_prefix` / `v6_prefix`; else zero. (Its prefix length is the rule's, so the
    /// key does not repeat it: 16 bytes more on the BPF stack's every copy of a key.)
    pub src: [u8; 16],
}

impl ClientKey {
    /// The key of rule `rule`'s `KEY_TUPLE` bucket made of the fields `fields`
    /// (`KEY_FIELD_*`) of a packet from `src` (already masked to the rule's prefix) to `dst`, between ports `sport` and `dport` (0 for a packet without ports), of
    /// protocol `proto`.
    #[inline(always)]
    pub fn tuple(
        rule: u8,
        fields: u8,
        src: &[u8; 16],
        dst: &[u8; 16],
        dport: u16,
        sport: u16,
        proto: u8,
    ) -> Self {
        use super::rule::*;
        let has = |f: u8| fields & f != 0;
        ClientKey {
            src: if has(KEY_FIELD_SRC) { *src } else { [0; 16] },
            rule,
            kind: KEY_TUPLE,
            proto: if has(KEY_FIELD_PROTOCOL) { proto } else { 0 },
            fields,
            prefix_len: (if has(KEY_FIELD_DST_PORT) {
                dport as u32
            } else {
                0
            }) << 16
                | if has(KEY_FIELD_SRC_PORT) {
                    sport as u32
                } else {
                    0
                },
            addr: if has(KEY_FIELD_DST) { *dst } else { [0; 16] },
        }
    }
}
/// `ClientState::drops`: bit 63 is the soft-limit episode flag (a soft_limit event was sent
/// and usage has not fallen back below the soft limit since); the count is in bits 0..62.
/// One word instead of two: a packet count cannot reach 2^63, so no add carries into it.
pub const DROPS_SOFT_REPORTED: u64 = 1 << 63;

/// Per-client limiter state. Shared by all CPUs (not per-CPU): the program updates it with
/// atomic instructions so a client's limit is not multiplied by the number of CPUs.
///
/// 88 bytes: with the slot's 24-byte header it makes a per-source slot of 112 bytes
/// ([`Slot`]). Every packet of a throttle rule touches the first 56 bytes (the limiter's
/// word(s), the totals, the last-seen time and the drop count), which share the header's
/// cache lines; what ban rules touch comes after.
///
/// [`Slot`]: super::Slot
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientState {
    /// Window index (`now / interval`) for the window algorithms; the GCRA theoretical arrival
    /// time in ns for the token bucket.
    pub stamp: u64,
    /// Admitted cost in the current window. A global token bucket ([`RULE_GLOBAL`]): admitted
    /// cost in the wall-clock window `prev` of [`GLOBAL_TB_WINDOW_NS`].
    ///
    /// [`RULE_GLOBAL`]: super::RULE_GLOBAL
    /// [`GLOBAL_TB_WINDOW_NS`]: super::GLOBAL_TB_WINDOW_NS
    pub cur: u64,
    /// Admitted cost in the previous window. A global token bucket: the window of `cur`.
    pub prev: u64,
    /// Totals since the state was created, for `top`.
    pub packets: u64,
    pub bytes: u64,
    /// Last packet (CLOCK_MONOTONIC ns).
    pub last_ns: u64,
    /// Packets refused (a total, like `packets`) in bits 0..62, and
    /// [`DROPS_SOFT_REPORTED`]. Read it with [`ClientState::drop_count`].
    pub drops: u64,
    /// Last packet over the threshold, 0 when the client is not in a throttle episode: the
    /// refusal that swaps it away from 0 sends `throttle_start`, and the admitted packet that
    /// swaps it back to 0 (an interval after the last refusal) sends `throttle_end`.
    pub last_exceed_ns: u64,
    /// Window index of the offered-rate (ban) meter.
    pub ban_stamp: u64,
    /// Offered cost (every matched packet) in the current / previous ban window.
    pub seen_cur: u64,
    pub seen_prev: u64,
}

impl ClientState {
    /// Packets refused.
    #[inline(always)]
    pub const fn drop_count(&self) -> u64 {
        self.drops & !DROPS_SOFT_REPORTED
    }

    /// In a throttle episode whose last refusal is less than `interval_ns` before `now`.
    #[inline(always)]
    pub const fn throttled_at(&self, now: u64, interval_ns: u64) -> bool {
        self.last_exceed_ns != 0 && now.saturating_sub(self.last_exceed_ns) < interval_ns
    }
}

/// The state of a shared key (`KEY_ALL`, `KEY_REGION`) in `RL_SHARED`: a client's state and
/// the end of the key's ban (IP bans live in `RL_BANS`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharedState {
    pub state: ClientState,
    /// Ban end, 0 when not banned, `u64::MAX` until lifted.
    pub banned_until_ns: u64,
}

/// What the other hosts of the fleet counted for a shared key (`KEY_ALL`, `KEY_REGION`) of
/// a global rule (`RULE_GLOBAL`), in `RL_FLEET_ADD`: written by the daemon every sync round,
/// only read by the program, which adds it to the key's own counts when it judges (a shared
/// state lives in a hash map the daemon cannot add into atomically). Each meter's counts are
/// for wall-clock window `window` (`cur`) and the one before (`prev`); a meter whose state
/// is in another window finds nothing of its own there (or, one window on, `cur` as its
/// previous window's).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FleetAdd {
    pub window: u64,
    pub cur: u64,
    pub prev: u64,
    /// The ban meter's window and counts (offered), for `rate_based_ban`.
    pub ban_window: u64,
    pub seen_cur: u64,
    pub seen_prev: u64,
}

impl FleetAdd {
    /// The other hosts' counts `(cur, prev)` for a meter in window `w`, given what was
    /// written for window `window`.
    #[inline(always)]
    pub fn counts_in(window: u64, cur: u64, prev: u64, w: u64) -> (u64, u64) {
        if window == w {
            (cur, prev)
        } else if window.wrapping_add(1) == w {
            (0, cur)
        } else {
            (0, 0)
        }
    }
}
