//! Events the kernel program sends to the daemon through the `EVENTS` ring buffer. The daemon
//! turns them into JSON lines for L7 systems. Reserving ring space never blocks: when the ring
//! is full the event is counted in `stats::global::EVENTS_LOST` and the packet goes on.

/// A client crossed its ban threshold; `expires_ns` is when the ban ends.
pub const EV_BAN: u32 = 1;
/// A ban ended (the kernel saw a packet after expiry and removed it).
pub const EV_UNBAN: u32 = 2;
/// A client went above its soft limit (once per episode).
pub const EV_SOFT_LIMIT: u32 = 3;
/// A client's first packet over the threshold.
pub const EV_THROTTLE_START: u32 = 4;
/// A client admitted again a full interval after its last packet over the threshold.
pub const EV_THROTTLE_END: u32 = 5;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Event {
    pub kind: u32,
    pub rule: u32,
    /// `maps::KEY_*` of the client key in bits 0..8; for `KEY_TUPLE`, its `proto` in bits
    /// 8..16 and `fields` in bits 16..24.
    pub key_kind: u32,
    /// Prefix length of `addr` as a 16-byte address (IPv4 keys are 96 + prefix).
    pub prefix_len: u32,
    /// Client key: the masked address, the region code in the first two bytes, or zero.
    pub addr: [u8; 16],
    /// `KEY_TUPLE` with `KEY_FIELD_SRC`: the key's masked source address, else zero.
    pub src: [u8; 16],
    /// CLOCK_MONOTONIC (bpf_ktime_get_ns) when the event happened.
    pub ts_ns: u64,
    /// The limiter's estimate of the client's cost in the current interval.
    pub count: u64,
    /// The threshold in force for that client.
    pub threshold: u64,
    /// Ban expiry (CLOCK_MONOTONIC) for `EV_BAN`, else 0.
    pub expires_ns: u64,
}

impl Event {
    /// `key_kind` of an event about `key`.
    #[inline(always)]
    pub fn key_kind_of(key: &crate::maps::ClientKey) -> u32 {
        key.kind as u32 | (key.proto as u32) << 8 | (key.fields as u32) << 16
    }

    /// The client key the event is about.
    pub fn key(&self) -> crate::maps::ClientKey {
        crate::maps::ClientKey {
            rule: self.rule as u8,
            kind: self.key_kind as u8,
            proto: (self.key_kind >> 8) as u8,
            fields: (self.key_kind >> 16) as u8,
            prefix_len: self.prefix_len,
            addr: self.addr,
            src: self.src,
        }
    }
}
