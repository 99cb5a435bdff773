//! The peers hash (`Keys::peers`, [`super::PEERS_KEY`] in the fleet `default`) read within a bound, every [`HEARTBEAT`]: whatever its size
//! (anyone who can write to the store can add fields), a host parses at most
//! [`PEERS_PAGE`] + 2 × [`PEERS_MAX`] heartbeats a beat, and keeps and shows at most
//! [`PEERS_MAX`] peers: itself, and the most recently seen of the others.
//!
//! Each beat, in one round trip: the value in this host's own field before it is written
//! (the duplicate-id watch, [`super::dup`]), this host's heartbeat written, its time written
//! into the recency index (`Keys::peers_seen`, a sorted set kept to [`SEEN_KEEP`] members,
//! none later than [`SEEN_SKEW_MS`] ahead of this host's clock), the [`PEERS_MAX`] ids most
//! recently seen in that index, the hash's length (`HLEN`: how many peers there are in all,
//! shown as "N more"), and the next page of the hash from a cursor kept across beats
//! (`HSCAN ... COUNT PEERS_PAGE`: peers missing from the index are found a page a beat).
//! Then the peers already kept and those the index names are read by name (`HMGET`), so a
//! live host is seen within a beat or two however many fields the hash holds. A heartbeat
//! longer than [`HEARTBEAT_BYTES_MAX`], one that does not parse or names another host, and
//! one not seen for a day is taken off the hash and the index (the page's, a bounded number
//! per beat).
//!
//! [`HEARTBEAT`]: super::HEARTBEAT

use std::collections::BTreeMap;

use anyhow::Context as _;

use super::{Conn, Heartbeat, Settings, Shared};

/// Peers kept and shown at most (this host included).
pub const PEERS_MAX: usize = 256;
/// Fields of the peers hash looked at per beat (`HSCAN COUNT`).
pub const PEERS_PAGE: usize = 500;
/// A heartbeat longer than this is not parsed (and is taken off the hash).
pub const HEARTBEAT_BYTES_MAX: usize = 4096;
/// Members the recency index keeps (the most recent; each beat trims the rest).
pub const SEEN_KEEP: usize = 4 * PEERS_MAX;
/// A time in the recency index further ahead of this host's clock than this is taken off
/// (so nobody holds the top of the index by writing a time to come).
pub const SEEN_SKEW_MS: u64 = 60_000;

/// The peers kept, and where the walk of the hash is.
#[derive(Debug, Default)]
pub struct Peers {
    known: BTreeMap<String, Heartbeat>,
    /// The `HSCAN` cursor (0: a new pass).
    scan: u64,
    /// The hash's length as last read.
    total: u64,
}

/// An `HSCAN` answer: the cursor to go on from, and the fields and values.
type ScanPage = (u64, Vec<(String, String)>);

/// What one beat read of the peers hash.
#[derive(Debug, Default)]
pub struct BeatRead {
    /// `HLEN`.
    pub total: u64,
    /// The peers kept, read again by name: their heartbeat, or none if gone.
    pub refreshed: Vec<(String, Option<String>)>,
    /// A page of the hash, and the cursor to go on from.
    pub page: Vec<(String, String)>,
    pub next: u64,
}

/// A heartbeat as stored, if it is one of host `id` (and not oversized).
fn parse(id: &str, value: &str) -> Option<Heartbeat> {
    if value.len() > HEARTBEAT_BYTES_MAX {
        return None;
    }
    serde_json::from_str::<Heartbeat>(value)
        .ok()
        .filter(|h| h.host_id == id)
}

impl Peers {
    /// The peers to read again by name (this host aside).
    pub fn known_ids(&self, me: &str) -> Vec<String> {
        self.known.keys().filter(|k| *k != me).cloned().collect()
    }

    /// Take in what a beat read (with `me`, this host's heartbeat as written). Returns the
    /// ids to take off the hash and the recency index: heartbeats that are not, those seen
    /// before `forget_before` (unix ms), and ids read by name that the hash no longer holds.
    pub fn take(&mut self, me: &Heartbeat, read: BeatRead, forget_before: u64) -> Vec<String> {
        self.total = read.total;
        self.scan = read.next;
        let mut forget = Vec::new();
        let values = read
            .refreshed
            .into_iter()
            .chain(read.page.into_iter().map(|(k, v)| (k, Some(v))));
        for (id, value) in values {
            if id == me.host_id {
                continue;
            }
            let Some(value) = value else {
                // Gone from the hash: off the recency index too.
                self.known.remove(&id);
                forget.push(id);
                continue;
            };
            match parse(&id, &value) {
                Some(h) if h.seen_ms >= forget_before => {
                    self.known.insert(id, h);
                }
                _ => {
                    self.known.remove(&id);
                    forget.push(id);
                }
            }
        }
        self.known.insert(me.host_id.clone(), me.clone());
        if self.known.len() > PEERS_MAX {
            // Keep this host and the most recently seen.
            let mut by_age: Vec<(u64, String)> = self
                .known
                .iter()
                .filter(|(k, _)| **k != me.host_id)
                .map(|(k, h)| (h.seen_ms, k.clone()))
                .collect();
            by_age.sort_unstable();
            let excess = self.known.len() - PEERS_MAX;
            for (_, id) in by_age.into_iter().take(excess) {
                self.known.remove(&id);
            }
        }
        forget.sort_unstable();
        forget.dedup();
        forget
    }

    /// The peers kept, by host id.
    pub fn list(&self) -> Vec<Heartbeat> {
        self.known.values().cloned().collect()
    }

    /// The hash's length as last read (every peer in the store, this host included).
    pub fn total(&self) -> u64 {
        self.total
    }
}

/// One beat: this host's heartbeat written, the peers read within the bound, the duplicate
/// watch told what was in this host's field.
pub(super) async fn beat(
    settings: &Settings,
    shared: &Shared,
    conn: &mut Option<Conn>,
    peers: &mut Peers,
) -> anyhow::Result<()> {
    if conn.is_none() {
        *conn = Some(settings.connect(super::REQUEST_TIMEOUT).await?);
    }
    let c = conn.as_mut().expect("connected above");
    let me = shared.heartbeat(settings.id_guard.nonce());
    let written = serde_json::to_string(&me)?;
    let keys = &settings.keys;
    let ahead = me.seen_ms.saturating_add(SEEN_SKEW_MS);
    let (before, recent, total, (next, page)): (Option<String>, Vec<String>, u64, ScanPage) =
        redis::pipe()
            .cmd("HGET")
            .arg(&keys.peers)
            .arg(&me.host_id)
            .cmd("HSET")
            .arg(&keys.peers)
            .arg(&me.host_id)
            .arg(&written)
            .ignore()
            .cmd("ZADD")
            .arg(&keys.peers_seen)
            .arg(me.seen_ms)
            .arg(&me.host_id)
            .ignore()
            .cmd("ZREMRANGEBYSCORE")
            .arg(&keys.peers_seen)
            .arg(format!("({ahead}"))
            .arg("+inf")
            .ignore()
            .cmd("ZREMRANGEBYRANK")
            .arg(&keys.peers_seen)
            .arg(0)
            .arg(-(SEEN_KEEP as i64) - 1)
            .ignore()
            .cmd("ZREVRANGE")
            .arg(&keys.peers_seen)
            .arg(0)
            .arg(PEERS_MAX - 1)
            .cmd("HLEN")
            .arg(&keys.peers)
            .cmd("HSCAN")
            .arg(&keys.peers)
            .arg(peers.scan)
            .arg("COUNT")
            .arg(PEERS_PAGE)
            .query_async(c)
            .await
            .context("writing the heartbeat")?;
    shared.id_beat(settings, before.as_deref(), written);
    let mut by_name = peers.known_ids(&me.host_id);
    by_name.extend(
        recent
            .into_iter()
            .filter(|id| *id != me.host_id && crate::config::check_host_id(id).is_ok()),
    );
    by_name.sort_unstable();
    by_name.dedup();
    let refreshed = if by_name.is_empty() {
        Vec::new()
    } else {
        let values: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(&keys.peers)
            .arg(&by_name)
            .query_async(c)
            .await
            .context("reading the peers")?;
        by_name.into_iter().zip(values).collect()
    };
    let forget_before = me
        .seen_ms
        .saturating_sub(super::PEER_FORGET.as_millis() as u64);
    let read = BeatRead {
        total,
        refreshed,
        page,
        next,
    };
    let forget = peers.take(&me, read, forget_before);
    if !forget.is_empty() {
        redis::pipe()
            .cmd("HDEL")
            .arg(&keys.peers)
            .arg(&forget)
            .ignore()
            .cmd("ZREM")
            .arg(&keys.peers_seen)
            .arg(&forget)
            .ignore()
            .query_async::<()>(c)
            .await
            .context("forgetting old peers")?;
    }
    let mut i = shared.lock();
    i.peers = peers.list();
    i.report.peers_total = peers.total();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hb(id: &str, seen_ms: u64) -> Heartbeat {
        Heartbeat {
            host_id: id.into(),
            version: "1".into(),
            seen_ms,
            ..Heartbeat::default()
        }
    }

    fn json(id: &str, seen_ms: u64) -> String {
        serde_json::to_string(&hb(id, seen_ms)).unwrap()
    }

    #[test]
    fn a_flood_of_peers_is_kept_to_the_bound_with_this_host_and_the_most_recent() {
        let mut p = Peers::default();
        let me = hb("me", 10_000);
        // A page of many fakes seen long ago, and one real peer seen now.
        let mut page: Vec<(String, String)> = (0..PEERS_PAGE)
            .map(|i| (format!("fake-{i}"), json(&format!("fake-{i}"), 5_000)))
            .collect();
        page.push(("real".into(), json("real", 9_999)));
        let forget = p.take(
            &me,
            BeatRead {
                total: 1_000_000,
                page,
                next: 77,
                ..BeatRead::default()
            },
            1_000,
        );
        assert!(forget.is_empty(), "{forget:?}");
        let list = p.list();
        assert_eq!(list.len(), PEERS_MAX);
        assert!(list.iter().any(|h| h.host_id == "me"));
        assert!(list.iter().any(|h| h.host_id == "real"));
        assert_eq!((p.total(), p.scan), (1_000_000, 77));
        // The kept ones are read again by name, this host aside.
        let ids = p.known_ids("me");
        assert_eq!(ids.len(), PEERS_MAX - 1);
        assert!(!ids.contains(&"me".to_string()));
    }

    #[test]
    fn gone_forged_oversized_and_old_heartbeats_are_dropped() {
        let mut p = Peers::default();
        let me = hb("me", 100_000);
        let page = vec![
            ("a".to_string(), json("a", 99_000)),
            ("b".to_string(), json("b", 99_000)),
            ("old".to_string(), json("old", 10)),
            ("liar".to_string(), json("someone-else", 99_000)),
            ("junk".to_string(), "{".to_string()),
            (
                "big".to_string(),
                format!(
                    "{:width$}",
                    json("big", 99_000),
                    width = HEARTBEAT_BYTES_MAX + 1
                ),
            ),
        ];
        let forget = p.take(
            &me,
            BeatRead {
                total: 7,
                page,
                ..BeatRead::default()
            },
            50_000,
        );
        assert_eq!(forget, ["big", "junk", "liar", "old"]);
        let ids: Vec<String> = p.list().into_iter().map(|h| h.host_id).collect();
        assert_eq!(ids, ["a", "b", "me"]);
        // "a" is gone from the hash; "b" beat again.
        let forget = p.take(
            &me,
            BeatRead {
                total: 2,
                refreshed: vec![("a".into(), None), ("b".into(), Some(json("b", 100_001)))],
                ..BeatRead::default()
            },
            50_000,
        );
        assert_eq!(forget, ["a"]);
        let list = p.list();
        assert_eq!(list.len(), 2);
        assert_eq!(list[0].seen_ms, 100_001);
    }
}
