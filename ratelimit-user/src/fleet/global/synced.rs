//! A synced client: what this host added into each of its meters and published of its own,
//! and the per-source states a round reads and adds into.

use std::time::Instant;

use ratelimit_common::maps::ClientState;

use super::{
    keys::{bucket_of, key_name},
    rule::GlobalRule,
};
use crate::kernel::clients::{ClientStore, Meter, SlotRef};

/// What this host added into one meter of one client, and what it published of its own.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Added {
    /// The meter's window when last read (its `stamp`).
    pub(super) window: u64,
    /// Added into `cur` in `window`, and into `prev` (window - 1).
    pub(super) cur: u64,
    pub(super) prev: u64,
    /// Rounds since the meter moved to `window`: the previous window is shared for
    /// [`PREV_ROUNDS`] of them (the other hosts' last counts of it come in late), then no more.
    pub(super) rounds: u32,
    /// This host announced the client near its limit in `window`.
    pub(super) announced: bool,
    /// Found with counts this task may have added before it (re)started, which it cannot tell
    /// from the host's own: nothing is published or added for it until its meter's next
    /// window (publishing them as its own would count the other hosts' twice).
    pub(super) wait_window: bool,
    /// The previous window's counts may hold what a previous run added: not shared.
    pub(super) prev_unknown: bool,
    /// A token bucket found at the first walk after this task (re)started: what the other
    /// hosts admitted in this window may already be taken out of it by the previous run, so
    /// the first answer's count of them is taken as charged.
    pub(super) charged_unknown: bool,
    /// This window: this host's own count last published, the fleet total last answered,
    /// and rounds since the last publish.
    pub(super) published: u64,
    pub(super) total: u64,
    pub(super) quiet_rounds: u32,
    /// This host's own count of the previous window last published (a token bucket's
    /// previous window is not kept in its state: this is what it shares of it).
    pub(super) published_prev: u64,
    /// The last window in which another host was seen counting the client (its fleet total
    /// above this host's own count), kept across windows.
    pub(super) others_window: Option<u64>,
}

/// A client far from its limit (its fleet total under [`NEAR_LIMIT_PERMILLE`]) whose own
/// count moved less than [`PUBLISH_ABOVE_PERMILLE`] of it is shared every this many rounds
/// (about a second at the default interval), not every round.
pub(super) const WARM_ROUNDS: u32 = 10;

/// Rounds after a window ends during which its counts are still shared.
pub(super) const PREV_ROUNDS: u32 = 20;

impl Added {
    /// No other host was seen counting the client in this window or the one before: this
    /// host's counts are all the fleet has of it, so it is shared at the warm pace however
    /// near its limit it is (the program holds it to the threshold here on its own), and its
    /// previous window once. Another host that starts counting it publishes every round as
    /// soon as it sees this host's count in the total; this host sees that host's at its next
    /// publish, within [`WARM_ROUNDS`], and shares it every round from then on.
    pub(super) fn solo(&self) -> bool {
        self.others_window
            .is_none_or(|w| self.window.saturating_sub(w) > 1)
    }

    /// The meter moved to `stamp`: what was added to the current window is now the previous
    /// window's (the program moved `cur` into `prev`), or nothing if it skipped windows.
    pub(super) fn roll(&mut self, stamp: u64) {
        if stamp == self.window {
            return;
        }
        let next = stamp == self.window.wrapping_add(1);
        self.prev = if next { self.cur } else { 0 };
        self.published_prev = if next { self.published } else { 0 };
        self.cur = 0;
        self.window = stamp;
        self.rounds = 0;
        self.announced = false;
        self.prev_unknown = self.wait_window;
        self.wait_window = false;
        self.charged_unknown = false;
        self.published = 0;
        self.total = 0;
        self.quiet_rounds = 0;
    }
}

/// A synced client.
#[derive(Clone, Debug)]
pub struct Synced {
    pub(super) rule: usize,
    pub(super) at: SlotRef,
    pub(super) name: String,
    pub(super) bucket: u64,
    pub(super) added: [Added; 2],
    /// Last time it counted anything of its own here.
    pub(super) active: Instant,
}

impl Synced {
    /// Client `at` (its prefix `prefix_len` bits long) of `rules[rule]`, synced from now on.
    pub fn new(rules: &[GlobalRule], rule: usize, at: SlotRef, prefix_len: u32) -> Synced {
        let name = key_name(&at.addr, prefix_len);
        let bucket = bucket_of(&rules[rule].rid, &name);
        Synced {
            rule,
            at,
            name,
            bucket,
            added: [Added::default(); 2],
            active: Instant::now(),
        }
    }

    /// A client found at the first walk after this task (re)started: its state may hold
    /// counts the previous run added, so its current windows are left alone. A token
    /// bucket's own count holds nothing added (its count is shared at once), but the previous
    /// run may have charged it the other hosts' admissions of this window.
    pub(super) fn cautious(mut self, g: &GlobalRule, st: &ClientState) -> Synced {
        for (a, m) in self.added.iter_mut().zip([Meter::Admitted, Meter::Offered]) {
            a.window = g.stamp_of(st, m);
            if g.is_bucket(m) {
                a.charged_unknown = true;
                a.prev_unknown = true;
            } else {
                a.wait_window = true;
            }
            a.others_window = Some(a.window.wrapping_sub(1));
        }
        self
    }
}

/// The per-source states a round reads and adds into: the program's ([`ClientStore`]).
pub trait SlotStates {
    /// The state in `at`, if the slot still holds that client.
    fn slot_state(&self, at: &SlotRef) -> Option<ClientState>;
    /// Add `delta` into `cur` (or `prev`) of `meter` of `at` if the meter is still in
    /// `window`, atomically; false if the slot or the window moved on.
    fn add_in_window(
        &self,
        at: &SlotRef,
        meter: Meter,
        window: u64,
        to_prev: bool,
        delta: u64,
    ) -> bool;
    /// Take `ns` of bucket time out of the token bucket in `at`: move its TAT on from
    /// CLOCK_MONOTONIC now at the earliest, never past now + `cap_ns`
    /// ([`GlobalRule::charge_cap_ns`]); false if the slot moved on.
    fn charge_bucket(&self, at: &SlotRef, ns: u64, cap_ns: u64) -> bool {
        let _ = (at, ns, cap_ns);
        false
    }
}

impl SlotStates for ClientStore {
    fn slot_state(&self, at: &SlotRef) -> Option<ClientState> {
        ClientStore::slot_state(self, at)
    }

    fn add_in_window(
        &self,
        at: &SlotRef,
        meter: Meter,
        window: u64,
        to_prev: bool,
        delta: u64,
    ) -> bool {
        ClientStore::add_in_window(self, at, meter, window, to_prev, delta)
    }

    fn charge_bucket(&self, at: &SlotRef, ns: u64, cap_ns: u64) -> bool {
        ClientStore::charge_bucket(self, at, ns, cap_ns, crate::clock::mono_ns())
    }
}
