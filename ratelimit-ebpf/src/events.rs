//! The events ring buffer: ban, unban, soft_limit, throttle_start, throttle_end. Reserving
//! never blocks; when the ring is full the event is counted as lost and the packet goes on.

use aya_ebpf::{macros::map, maps::RingBuf};
use ratelimit_common::{caps::EVENTS_RING_BYTES, event::Event, maps::ClientKey, stats::global};

use crate::{
    rare,
    stats::{self, Slot},
};

#[map(name = "RL_EVENTS")]
static EVENTS: RingBuf = RingBuf::pinned(EVENTS_RING_BYTES, 0);

#[inline(always)]
pub fn emit(
    slot: Slot,
    kind: u32,
    key: &ClientKey,
    now: u64,
    count: u64,
    threshold: u64,
    expires_ns: u64,
) {
    match EVENTS.reserve::<Event>(0) {
        Some(mut entry) => {
            // Field by field with volatile stores: a struct literal with zero fields would be
            // lowered to a byte-wise memset call that the verifier walks byte by byte.
            let e = entry.as_mut_ptr();
            // SAFETY: `e` is the reserved ring-buffer slot, sized for an `Event`.
            unsafe {
                core::ptr::write_volatile(&raw mut (*e).kind, kind);
                core::ptr::write_volatile(&raw mut (*e).rule, key.rule as u32);
                core::ptr::write_volatile(&raw mut (*e).key_kind, Event::key_kind_of(key));
                core::ptr::write_volatile(&raw mut (*e).prefix_len, key.prefix_len);
                crate::state::copy_addr(&mut (*e).addr, &key.addr);
                crate::state::copy_addr(&mut (*e).src, &key.src);
                core::ptr::write_volatile(&raw mut (*e).ts_ns, now);
                core::ptr::write_volatile(&raw mut (*e).count, count);
                core::ptr::write_volatile(&raw mut (*e).threshold, threshold);
                core::ptr::write_volatile(&raw mut (*e).expires_ns, expires_ns);
            }
            entry.submit(0);
        }
        None => {
            stats::add(slot, global::EVENTS_LOST, 0);
            rare::note(rare::EVENTS_LOST, key.rule as u32, 0, now);
        }
    }
}
