//! Two hosts with one host id (a cloned image keeps the hostname) would ignore each other's
//! bans (a host skips its own records) and overwrite each other's counts (a count is kept
//! per host id). Each daemon puts a random nonce of its own process in its heartbeat, and
//! reads what its field of the peers hash held before it wrote its own ([`super::peers`]).
//!
//! Another value there, with another nonce, means someone else wrote this host id since this
//! process last did. Once is normal: the first beat of a process finds its previous
//! instance's heartbeat (a restart), and is not judged; and a single late write is not
//! enough either. Found on [`DUP_SEEN`] of the last [`DUP_WINDOW`] beats, it is a
//! duplicate: the host takes no part in global counting (as with its clock off the store's),
//! says so (`fleet_duplicate_id` event, `fleet status`, `/v1/fleet`,
//! `ratelimit_fleet_duplicate_id`), and keeps sharing bans. Not found on any of the last
//! [`DUP_WINDOW`] beats (the other one stopped, or was given its own id), it is cleared
//! (`fleet_duplicate_id_cleared`) and global counting resumes.

use std::{
    collections::VecDeque,
    sync::atomic::{AtomicBool, Ordering},
    time::SystemTime,
};

use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use super::{Settings, Shared, fleet_line};

/// Beats looked back over.
pub const DUP_WINDOW: usize = 10;
/// Beats of the window on which another writer of this host id was found, for a duplicate.
pub const DUP_SEEN: usize = 2;

/// This process's nonce, and whether its host id is in use by another process now (read by
/// global counting before every round).
#[derive(Debug)]
pub struct IdGuard {
    nonce: String,
    duplicate: AtomicBool,
}

impl Default for IdGuard {
    fn default() -> Self {
        Self::new(random_nonce())
    }
}

impl IdGuard {
    pub fn new(nonce: String) -> Self {
        Self {
            nonce,
            duplicate: AtomicBool::new(false),
        }
    }

    pub fn nonce(&self) -> &str {
        &self.nonce
    }

    /// Another process uses this host id now.
    pub fn duplicate(&self) -> bool {
        self.duplicate.load(Ordering::Relaxed)
    }
}

/// 16 hex digits from the kernel's random source (the time and process id if it fails).
fn random_nonce() -> String {
    let mut b = [0u8; 8];
    // SAFETY: writes at most `b.len()` bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n != b.len() as isize {
        let t = crate::clock::wall_ns() ^ (u64::from(std::process::id()) << 32);
        b = t.to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The duplicate-id watch, as `fleet status` and `/v1/fleet` show it.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct DuplicateReport {
    /// Another process writes this host id's heartbeat now: this host takes no part in
    /// global counting.
    pub active: bool,
    /// This process's nonce (in its heartbeat).
    pub nonce: String,
    /// The other writer's nonce, as last found.
    pub other_nonce: Option<String>,
    /// RFC 3339: since when.
    pub since: Option<String>,
    /// Times a duplicate was found since the daemon started.
    pub found: u64,
}

/// The beats' verdicts.
#[derive(Debug, Default)]
pub struct Watch {
    /// This process wrote its heartbeat at least once.
    wrote: bool,
    /// The value it last wrote.
    last: Option<String>,
    /// Per beat of the window: another writer found.
    recent: VecDeque<bool>,
    active: bool,
}

/// A change of the verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    Found,
    Cleared,
}

/// The nonce in a stored heartbeat, if any.
fn nonce_of(value: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct N {
        nonce: Option<String>,
    }
    serde_json::from_str::<N>(value).ok()?.nonce
}

impl Watch {
    /// One beat: `before`, what this host id's field held before `written` was written over
    /// it. Returns the other writer's nonce when one was found, and the change, if any.
    pub fn beat(
        &mut self,
        mine: &str,
        before: Option<&str>,
        written: String,
    ) -> (Option<String>, Option<Change>) {
        let other = match before {
            Some(v) if self.wrote && self.last.as_deref() != Some(v) => {
                let n = nonce_of(v);
                (n.as_deref() != Some(mine)).then(|| n.unwrap_or_else(|| "none".into()))
            }
            _ => None,
        };
        self.wrote = true;
        self.last = Some(written);
        self.recent.push_back(other.is_some());
        if self.recent.len() > DUP_WINDOW {
            self.recent.pop_front();
        }
        let seen = self.recent.iter().filter(|f| **f).count();
        let change = if !self.active && seen >= DUP_SEEN {
            self.active = true;
            Some(Change::Found)
        } else if self.active && seen == 0 {
            self.active = false;
            Some(Change::Cleared)
        } else {
            None
        };
        (other, change)
    }
}

impl Shared {
    /// A beat's look at this host id's field: `before`, what it held before this beat's
    /// heartbeat was written.
    pub(super) fn id_beat(&self, settings: &Settings, before: Option<&str>, written: String) {
        let guard = &settings.id_guard;
        let mut i = self.lock();
        let (other, change) = i.id_watch.beat(guard.nonce(), before, written);
        let now = SystemTime::now();
        let d = &mut i.report.duplicate_id;
        d.nonce = guard.nonce().to_string();
        if other.is_some() {
            d.other_nonce = other;
        }
        let Some(change) = change else { return };
        let (store, host_id) = (i.report.store.clone(), i.report.host_id.clone());
        let d = &mut i.report.duplicate_id;
        match change {
            Change::Found => {
                guard.duplicate.store(true, Ordering::Relaxed);
                d.active = true;
                d.found += 1;
                d.since = Some(crate::clock::rfc3339(now));
                let why = format!(
                    "another process writes this host id's heartbeat (nonce {}, this one's {}): \
                     two hosts share host id {host_id} (a cloned image?); global rules are \
                     enforced locally until one of them is given its own fleet.host_id",
                    d.other_nonce.as_deref().unwrap_or("-"),
                    guard.nonce()
                );
                warn!("{why}");
                let since = d.since.clone();
                self.events.fleet(fleet_line(
                    now,
                    "fleet_duplicate_id",
                    (store, host_id),
                    Some(why),
                    since,
                ));
            }
            Change::Cleared => {
                guard.duplicate.store(false, Ordering::Relaxed);
                d.active = false;
                let since = d.since.take();
                info!(
                    "no other process wrote this host id's heartbeat for {DUP_WINDOW} beats: \
                     global counting resumes"
                );
                self.events.fleet(fleet_line(
                    now,
                    "fleet_duplicate_id_cleared",
                    (store, host_id),
                    None,
                    since,
                ));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat_json(nonce: Option<&str>, seen: u64) -> String {
        match nonce {
            Some(n) => format!(r#"{{"host_id":"h","version":"1","seen_ms":{seen},"nonce":"{n}"}}"#),
            None => format!(r#"{{"host_id":"h","version":"1","seen_ms":{seen}}}"#),
        }
    }

    #[test]
    fn a_restart_finds_its_old_instance_once_and_that_is_no_duplicate() {
        let mut w = Watch::default();
        // The first beat finds the previous instance's heartbeat: not judged.
        let old = beat_json(Some("old"), 1);
        let (other, change) = w.beat("new", Some(&old), beat_json(Some("new"), 2));
        assert_eq!((other, change), (None, None));
        // Then only its own.
        for s in 3..30 {
            let last = beat_json(Some("new"), s - 1);
            let (other, change) = w.beat("new", Some(&last), beat_json(Some("new"), s));
            assert_eq!((other, change), (None, None));
        }
        // One late write of another is not enough.
        let (other, change) = w.beat("new", Some(&old), beat_json(Some("new"), 40));
        assert_eq!((other.as_deref(), change), (Some("old"), None));
        assert!(!w.active);
    }

    #[test]
    fn two_nonces_alternating_are_a_duplicate_until_one_stops() {
        let mut w = Watch::default();
        let mut changes = Vec::new();
        let mut last_mine = None;
        for s in 0..6u64 {
            // The twin wrote between each two of this one's beats (an old version: no nonce
            // at all, the second time).
            let twin = beat_json((s != 2).then_some("twin"), s);
            let before = if s == 0 { None } else { Some(twin.as_str()) };
            let mine = beat_json(Some("me"), s);
            let (_, c) = w.beat("me", before, mine.clone());
            changes.extend(c.map(|c| (s, c)));
            last_mine = Some(mine);
        }
        assert_eq!(changes, [(2, Change::Found)]);
        // The twin stopped: cleared after a window of beats finding only this one's.
        let mut last = last_mine.unwrap();
        for s in 6..6 + DUP_WINDOW as u64 {
            let mine = beat_json(Some("me"), s);
            let (_, c) = w.beat("me", Some(&last), mine.clone());
            changes.extend(c.map(|c| (s, c)));
            last = mine;
        }
        assert_eq!(changes, [(2, Change::Found), (15, Change::Cleared)]);
    }

    #[test]
    fn nonces_differ_between_processes() {
        let (a, b) = (IdGuard::default(), IdGuard::default());
        assert_eq!(a.nonce().len(), 16);
        assert_ne!(a.nonce(), b.nonce());
    }
}
