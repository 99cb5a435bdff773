//! The store's side of `fleet key` (`ratelimit fleet key`, `/v1/fleet/key`): however often
//! and however many clients ask, the store every host shares sees a bounded load from it.
//!
//! - **One connection**, made when first needed, kept for the next reads, and made again after
//!   an error (at most one attempt per [`RECONNECT_AFTER`]; meanwhile the answers say why).
//! - **A cache** of the counts read, per hash and client: an answer within [`FRESH`] of a
//!   read of the same counts is served from it. At most [`CACHE_MAX`] entries.
//! - **A rate bound**: at most [`READS_PER_SEC`] reads of the store a second (a burst of as
//!   many), one at a time. Each read is one `HMGET` per hash asked (a rule's window), of the
//!   client's total and of its count on each known host (this one, then the peers of the
//!   heartbeat, at most [`HOSTS_MAX`]): never a whole hash, whatever its size. An answer
//!   that finds the bound reached gets the cached counts if they are at most [`STALE_MAX`]
//!   old (saying how old), or is refused as busy (HTTP 429, `Retry-After: 1`).

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context as _;

use crate::fleet::{Conn, Settings};

/// Counts read this recently are served from the cache.
pub const FRESH: Duration = Duration::from_secs(1);
/// Counts this old at most are served from the cache when the rate bound is reached.
pub const STALE_MAX: Duration = Duration::from_secs(10);
/// Entries (hash and client) the cache holds at most.
pub const CACHE_MAX: usize = 4096;
/// Reads of the store a second at most (and the burst).
pub const READS_PER_SEC: u32 = 10;
/// Hosts whose own counts are read (this one first); the others are in the total only.
pub const HOSTS_MAX: usize = 64;
/// After a failed connection, the next attempt waits this long.
pub const RECONNECT_AFTER: Duration = Duration::from_secs(1);
/// How long an answer waits for its turn to read the store.
pub const TURN_WAIT: Duration = Duration::from_secs(2);

/// One hash's counts of one client: the total and each known host's own.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Counts {
    pub total: u64,
    pub hosts: BTreeMap<String, u64>,
}

/// The counts wanted: the client `name` in `hash`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Want {
    pub hash: String,
    pub name: String,
}

/// What a read gave.
#[derive(Debug, Clone, PartialEq)]
pub enum Read {
    /// The counts of each wanted entry, in order, and how old the oldest of them is
    /// (`Duration::ZERO`: read for this answer).
    Counts(Vec<Counts>, Duration),
    /// The rate bound is reached and the cache holds nothing recent enough: the message.
    Busy(String),
    /// The store could not be read: why.
    Failed(String),
}

/// The counters of `/metrics` (`ratelimit_fleet_key_*`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Reads of the store (each one `HMGET` per hash).
    pub store_reads: u64,
    /// Answers served from the cache.
    pub cache_hits: u64,
    /// Answers refused as busy.
    pub busy: u64,
    /// Failed connections and reads.
    pub errors: u64,
}

/// The shared connection and the rate bound's tokens: one read at a time holds it.
struct Turn {
    conn: Option<Conn>,
    retry_at: Option<Instant>,
    last_error: Option<String>,
    tokens: f64,
    refilled: Instant,
}

/// The store's side of `fleet key` (one per daemon, in the reports).
pub struct KeyReads {
    turn: tokio::sync::Mutex<Turn>,
    cache: Mutex<HashMap<Want, (Instant, Counts)>>,
    store_reads: AtomicU64,
    cache_hits: AtomicU64,
    busy: AtomicU64,
    errors: AtomicU64,
}

impl Default for KeyReads {
    fn default() -> Self {
        Self {
            turn: tokio::sync::Mutex::new(Turn {
                conn: None,
                retry_at: None,
                last_error: None,
                tokens: f64::from(READS_PER_SEC),
                refilled: Instant::now(),
            }),
            cache: Mutex::new(HashMap::new()),
            store_reads: AtomicU64::new(0),
            cache_hits: AtomicU64::new(0),
            busy: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        }
    }
}

/// The message of an answer refused as busy.
pub fn busy_message() -> String {
    format!(
        "the fleet store is read at most {READS_PER_SEC} times a second for fleet key, and \
         that many reads were made this second for other clients; try again in a second"
    )
}

impl KeyReads {
    pub fn stats(&self) -> Stats {
        Stats {
            store_reads: self.store_reads.load(Ordering::Relaxed),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
            busy: self.busy.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }

    /// Every wanted entry from the cache, if each was read within `max_age`: the counts and
    /// the oldest one's age.
    fn cached(&self, want: &[Want], max_age: Duration) -> Option<(Vec<Counts>, Duration)> {
        let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let mut oldest = Duration::ZERO;
        let mut out = Vec::with_capacity(want.len());
        for w in want {
            let (at, c) = cache.get(w)?;
            let age = at.elapsed();
            if age > max_age {
                return None;
            }
            oldest = oldest.max(age);
            out.push(c.clone());
        }
        Some((out, oldest))
    }

    fn remember(&self, want: &[Want], counts: &[Counts]) {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() + want.len() > CACHE_MAX {
            cache.retain(|_, (at, _)| at.elapsed() <= STALE_MAX);
            if cache.len() + want.len() > CACHE_MAX {
                cache.clear();
            }
        }
        let now = Instant::now();
        for (w, c) in want.iter().zip(counts) {
            cache.insert(w.clone(), (now, c.clone()));
        }
    }

    /// The counts of each wanted entry: from the cache if fresh, else from the store within
    /// the rate bound, else from the cache if not too old, else busy. `hosts`: the hosts whose
    /// own counts are read (at most [`HOSTS_MAX`] are).
    pub async fn read(&self, settings: &Settings, want: &[Want], hosts: &[String]) -> Read {
        if let Some((c, age)) = self.cached(want, FRESH) {
            self.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Read::Counts(c, age);
        }
        let Ok(mut turn) = tokio::time::timeout(TURN_WAIT, self.turn.lock()).await else {
            return self.stale_or_busy(want);
        };
        // Another answer may have read the same counts while this one waited.
        if let Some((c, age)) = self.cached(want, FRESH) {
            self.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Read::Counts(c, age);
        }
        let rate = f64::from(READS_PER_SEC);
        turn.tokens = (turn.tokens + turn.refilled.elapsed().as_secs_f64() * rate).min(rate);
        turn.refilled = Instant::now();
        if turn.tokens < 1.0 {
            return self.stale_or_busy(want);
        }
        turn.tokens -= 1.0;
        if turn.conn.is_none() {
            if turn.retry_at.is_some_and(|t| Instant::now() < t) {
                let why = turn.last_error.clone().unwrap_or_default();
                return Read::Failed(why);
            }
            match settings.connect_for_counts().await {
                Ok(c) => turn.conn = Some(c),
                Err(e) => {
                    self.errors.fetch_add(1, Ordering::Relaxed);
                    let why = format!("{e:#}");
                    turn.retry_at = Some(Instant::now() + RECONNECT_AFTER);
                    turn.last_error = Some(why.clone());
                    return Read::Failed(why);
                }
            }
        }
        self.store_reads.fetch_add(1, Ordering::Relaxed);
        let conn = turn.conn.as_mut().expect("connected above");
        let hosts = &hosts[..hosts.len().min(HOSTS_MAX)];
        match read_counts(settings, conn, want, hosts).await {
            Ok(counts) => {
                self.remember(want, &counts);
                Read::Counts(counts, Duration::ZERO)
            }
            Err(e) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                turn.conn = None;
                let why = format!("{e:#} (from {})", settings.store);
                turn.last_error = Some(why.clone());
                Read::Failed(why)
            }
        }
    }

    fn stale_or_busy(&self, want: &[Want]) -> Read {
        match self.cached(want, STALE_MAX) {
            Some((c, age)) => {
                self.cache_hits.fetch_add(1, Ordering::Relaxed);
                Read::Counts(c, age)
            }
            None => {
                self.busy.fetch_add(1, Ordering::Relaxed);
                Read::Busy(busy_message())
            }
        }
    }
}

/// One `HMGET` per wanted entry: the client's total and its count on each of `hosts`, or,
/// with the fleet key, the entry's authenticated field, of which only the counts that verify
/// are taken (`crate::fleet::trust::Trust::plain_counts`).
async fn read_counts(
    settings: &Settings,
    conn: &mut Conn,
    want: &[Want],
    hosts: &[String],
) -> anyhow::Result<Vec<Counts>> {
    let trust = &settings.trust;
    let mut out = Vec::with_capacity(want.len());
    for w in want {
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(trust.store_name(&w.hash));
        if trust.authenticated() {
            cmd.arg(format!("{}#m", w.name));
        } else {
            cmd.arg(&w.name);
            for h in hosts {
                cmd.arg(format!("{}|{h}", w.name));
            }
        }
        let values: Vec<Option<String>> = cmd
            .query_async(conn)
            .await
            .with_context(|| format!("reading {}", w.hash))?;
        let values = if trust.authenticated() {
            let fields = values
                .into_iter()
                .next()
                .flatten()
                .map(|v| (format!("{}#m", w.name), v))
                .into_iter()
                .collect();
            let plain = trust.plain_counts(&w.hash, &w.name, fields);
            std::iter::once(&w.name)
                .cloned()
                .chain(hosts.iter().map(|h| format!("{}|{h}", w.name)))
                .map(|f| plain.get(&f).cloned())
                .collect()
        } else {
            values
        };
        out.push(counts_of(&values, hosts));
    }
    Ok(out)
}

/// The counts an `HMGET` answered: the total first, then each host's (absent: none).
pub fn counts_of(values: &[Option<String>], hosts: &[String]) -> Counts {
    let num = |v: &Option<String>| v.as_deref().and_then(|s| s.trim().parse::<u64>().ok());
    Counts {
        total: values.first().and_then(num).unwrap_or(0),
        hosts: hosts
            .iter()
            .zip(values.iter().skip(1))
            .filter_map(|(h, v)| Some((h.clone(), num(v)?)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmget_answers_are_the_total_then_each_host_s_count() {
        let hosts = vec!["h0".to_string(), "h1".to_string(), "h2".to_string()];
        let v = |s: &str| Some(s.to_string());
        let c = counts_of(&[v("150"), v("100"), None, v("50")], &hosts);
        assert_eq!(c.total, 150);
        assert_eq!(
            c.hosts,
            BTreeMap::from([("h0".to_string(), 100), ("h2".to_string(), 50)])
        );
        assert_eq!(
            counts_of(&[None, None, None, None], &hosts),
            Counts::default()
        );
        // A forged value that is not a count counts as none.
        let c = counts_of(&[v("lots"), v("-1")], &hosts[..1]);
        assert_eq!(c, Counts::default());
    }

    #[test]
    fn the_cache_serves_fresh_counts_and_stays_bounded() {
        let r = KeyReads::default();
        let want = |i: usize| Want {
            hash: format!("h{}", i % 7),
            name: format!("k{i}"),
        };
        let c = Counts {
            total: 5,
            hosts: BTreeMap::new(),
        };
        r.remember(&[want(1)], std::slice::from_ref(&c));
        let (got, age) = r.cached(&[want(1)], FRESH).expect("cached");
        assert_eq!((got, age < FRESH), (vec![c.clone()], true));
        assert!(r.cached(&[want(1), want(2)], FRESH).is_none());
        for i in 0..3 * CACHE_MAX {
            r.remember(&[want(i)], std::slice::from_ref(&c));
            assert!(r.cache.lock().unwrap().len() <= CACHE_MAX);
        }
    }

    #[test]
    fn beyond_the_rate_an_answer_is_stale_or_busy() {
        let r = KeyReads::default();
        let w = vec![Want {
            hash: "h".into(),
            name: "k".into(),
        }];
        match r.stale_or_busy(&w) {
            Read::Busy(m) => assert!(m.contains("at most 10 times a second"), "{m}"),
            other => panic!("{other:?}"),
        }
        r.remember(&w, &[Counts::default()]);
        assert!(matches!(r.stale_or_busy(&w), Read::Counts(..)));
        assert_eq!((r.stats().busy, r.stats().cache_hits), (1, 1));
    }
}
