//! The events reader: the ring buffer drained into the events writer's queue, and what the
//! bans' bookkeeping needs left in the owner's mailbox.

use std::sync::Arc;

use aya::maps::{MapData, RingBuf};
use ratelimit_common::{
    event::{EV_BAN, EV_UNBAN, Event},
    maps::*,
};
use tokio::{
    io::unix::AsyncFd,
    sync::{Mutex, Notify},
};

use super::State;
use crate::events::Events;

/// The events ring buffer, registered with the runtime once: a restarted reader takes it up
/// where the last one failed.
pub(super) type EventsRing = Arc<Mutex<AsyncFd<RingBuf<MapData>>>>;

/// Drain the events ring buffer into the events writer's queue, and leave what the bans
/// bookkeeping needs (the expiry sweep's next deadline, bans to save) in the owner's mailbox.
/// It waits for no one: a long report or a slow job of the owner's does not leave the ring
/// buffer to fill.
/// `share_bans`: rule-issued bans are noted for the fleet (in fleet mode, with `share_bans`).
pub(super) async fn read_events(
    ring: EventsRing,
    news: Arc<NewsBox>,
    events: Events,
    share_bans: bool,
) -> anyhow::Result<()> {
    let mut fd = ring.lock().await;
    loop {
        let mut guard = fd.readable_mut().await?;
        let rb = guard.get_inner_mut();
        let mut batch = Vec::new();
        while let Some(item) = rb.next() {
            if item.len() >= std::mem::size_of::<Event>() {
                // SAFETY: the program writes whole `Event`s; read unaligned to be safe.
                let e: Event = unsafe { std::ptr::read_unaligned(item.as_ptr() as *const Event) };
                batch.push(e);
            }
        }
        guard.clear_ready();
        let n = BanNews::of(&batch, share_bans);
        events.data_plane(batch);
        if n.changed {
            news.put(n);
        }
    }
}

/// What events tell the ban bookkeeping: that bans changed (to be saved), and the earliest
/// expiry among new bans (for the expiry sweep).
#[derive(Debug, Clone)]
pub(super) struct BanNews {
    pub(super) changed: bool,
    pub(super) earliest_expiry: u64,
    /// Rule-issued bans, (prefix length, address, rule), for the fleet; at most
    /// [`RULE_BANS_NOTED`] between two turns of the owner's.
    pub(super) rule_bans: Vec<(u32, [u8; 16], u32)>,
}

/// Rule-issued bans noted for the fleet while the owner is busy, at most.
pub(super) const RULE_BANS_NOTED: usize = 100_000;

impl Default for BanNews {
    fn default() -> Self {
        Self {
            changed: false,
            earliest_expiry: u64::MAX,
            rule_bans: Vec::new(),
        }
    }
}

impl BanNews {
    pub(super) fn of(batch: &[Event], share_bans: bool) -> Self {
        let mut n = Self::default();
        for e in batch {
            if e.kind == EV_BAN || e.kind == EV_UNBAN {
                n.changed = true;
            }
            if e.kind == EV_BAN && e.expires_ns != 0 {
                n.earliest_expiry = n.earliest_expiry.min(e.expires_ns);
            }
            if share_bans && e.kind == EV_BAN && e.key_kind == u32::from(KEY_IP) {
                n.rule_bans.push((e.prefix_len, e.addr, e.rule));
            }
        }
        n
    }

    pub(super) fn merge(&mut self, o: BanNews) {
        self.changed |= o.changed;
        self.earliest_expiry = self.earliest_expiry.min(o.earliest_expiry);
        let room = RULE_BANS_NOTED.saturating_sub(self.rule_bans.len());
        self.rule_bans.extend(o.rule_bans.into_iter().take(room));
    }

    pub(super) fn apply_to(self, s: &mut State) {
        if !self.rule_bans.is_empty() {
            s.publish_rule_bans(&self.rule_bans);
        }
        s.next_ban_expiry = s.next_ban_expiry.min(self.earliest_expiry);
        if self.changed {
            s.bans_changed();
        }
    }
}

/// The events reader's news for the owner task: merged while the owner is busy, so the
/// reader never waits and nothing queues up.
#[derive(Default)]
pub(super) struct NewsBox {
    pub(super) news: std::sync::Mutex<BanNews>,
    pub(super) ready: Notify,
}

impl NewsBox {
    pub(super) fn put(&self, n: BanNews) {
        self.news.lock().unwrap_or_else(|e| e.into_inner()).merge(n);
        self.ready.notify_one();
    }

    pub(super) fn take(&self) -> BanNews {
        std::mem::take(&mut *self.news.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    pub(super) fn rule_bans_are_noted_for_the_fleet_only_when_bans_are_shared() {
        let ban = Event {
            kind: EV_BAN,
            key_kind: u32::from(KEY_IP),
            prefix_len: 128,
            expires_ns: 5,
            ..Event::default()
        };
        let n = BanNews::of(&[ban], false);
        assert!(n.changed && n.rule_bans.is_empty(), "{n:?}");
        assert_eq!(n.earliest_expiry, 5);
        assert_eq!(BanNews::of(&[ban], true).rule_bans.len(), 1);
    }
}
