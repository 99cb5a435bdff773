//! What the daemon keeps beside the bans the maps hold, by prefix (`192.0.2.0/24`): the
//! operator's reason, and the host each fleet ban came from. One copy, shared by the owner
//! task (the only writer) and the reports (readers) behind a lock: a write never copies the
//! whole of it, so a resync of 300,000 fleet bans costs each page its own entries, not a copy
//! of all those before it.

use std::{
    collections::BTreeMap,
    sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard},
};

/// The notes, by prefix.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Notes {
    /// The reason given with `ban add --reason` (or the fleet record's).
    pub reasons: BTreeMap<String, String>,
    /// The host each ban received from the fleet came from.
    pub origins: BTreeMap<String, String>,
}

impl Notes {
    /// Drop both notes of `cidr` (its ban is gone).
    pub fn forget(&mut self, cidr: &str) {
        self.reasons.remove(cidr);
        self.origins.remove(cidr);
    }

    /// Set `cidr`'s reason, or drop it.
    pub fn set_reason(&mut self, cidr: &str, reason: Option<&str>) {
        match reason {
            Some(r) => {
                self.reasons.insert(cidr.to_string(), r.to_string());
            }
            None => {
                self.reasons.remove(cidr);
            }
        }
    }
}

/// A handle on the shared [`Notes`]; clones share them.
#[derive(Debug, Clone, Default)]
pub struct BanNotes(Arc<RwLock<Notes>>);

impl BanNotes {
    pub fn new(notes: Notes) -> BanNotes {
        BanNotes(Arc::new(RwLock::new(notes)))
    }

    /// For reading (a panic elsewhere while writing leaves notes that are still whole maps).
    pub fn read(&self) -> RwLockReadGuard<'_, Notes> {
        self.0.read().unwrap_or_else(|e| e.into_inner())
    }

    pub fn write(&self) -> RwLockWriteGuard<'_, Notes> {
        self.0.write().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_one_copy_and_forget_drops_both_notes() {
        let notes = BanNotes::default();
        let reports = notes.clone();
        {
            let mut n = notes.write();
            n.set_reason("192.0.2.0/24", Some("scanner"));
            n.origins.insert("192.0.2.0/24".into(), "h1".into());
            n.set_reason("198.51.100.7/32", Some("brute force"));
        }
        assert_eq!(reports.read().reasons.len(), 2);
        notes.write().forget("192.0.2.0/24");
        notes.write().set_reason("198.51.100.7/32", None);
        assert_eq!(*reports.read(), Notes::default());
    }
}
