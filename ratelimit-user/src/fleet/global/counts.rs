//! The store's side of a round: the count scripts on Redis ([`RedisCounts`]), or their
//! semantics in memory ([`MemoryCounts`], for simulations and tests), and the announcement sets.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use super::{ANNOUNCED_READ_MAX, CALL_KEYS};
use crate::fleet::Conn;

/// The store's side: for each `(key, own absolute count)`, raise this host's count to it
/// (never lower: a count only grows within a window), add the change into the key's total,
/// and answer the totals in order. KEYS[1] is the hash of one rule, meter, bucket and window;
/// ARGV: host, expiry (unix ms), then key and count pairs.
const SYNC_SCRIPT: &str = r#"
local host = ARGV[1]
local out = {}
for i = 3, #ARGV, 2 do
  local k = ARGV[i]
  local abs = tonumber(ARGV[i + 1])
  local f = k .. '|' .. host
  local old = tonumber(redis.call('HGET', KEYS[1], f) or '0')
  local total
  if abs > old then
    redis.call('HSET', KEYS[1], f, abs)
    total = redis.call('HINCRBY', KEYS[1], k, abs - old)
  else
    total = tonumber(redis.call('HGET', KEYS[1], k) or '0')
  end
  out[#out + 1] = total
end
redis.call('PEXPIREAT', KEYS[1], ARGV[2])
return out
"#;

/// [`SYNC_SCRIPT`] with the fleet key (`crate::fleet::trust`): each host's count of a key goes
/// with its MAC into one field per key, `<key>#m`, as `host,count,mac` entries joined by `;`
/// (this host's entry raised to its count, never lowered), and the script answers each
/// field whole: the hosts sum the entries that verify. A field longer than ARGV[3] (bytes)
/// is started anew. ARGV: host, expiry (unix ms), the longest field, then key, count and MAC
/// triples. The fields are not those of [`SYNC_SCRIPT`]: hosts with and without the key
/// never add into each other's counts.
const SYNC_AUTH_SCRIPT: &str = r#"
local host = ARGV[1]
local maxlen = tonumber(ARGV[3])
local mine = host .. ','
local out = {}
for i = 4, #ARGV, 3 do
  local f = ARGV[i] .. '#m'
  local abs = tonumber(ARGV[i + 1])
  local cur = redis.call('HGET', KEYS[1], f) or ''
  if #cur > maxlen then
    cur = ''
  end
  local old = 0
  local rest = {}
  for e in string.gmatch(cur, '[^;]+') do
    if string.sub(e, 1, #mine) == mine then
      local c = tonumber(string.match(e, '^[^,]*,(%d+)')) or 0
      if c > old then
        old = c
      end
    else
      rest[#rest + 1] = e
    end
  end
  if abs > old then
    rest[#rest + 1] = mine .. ARGV[i + 1] .. ',' .. ARGV[i + 2]
    cur = table.concat(rest, ';')
    redis.call('HSET', KEYS[1], f, cur)
  end
  out[#out + 1] = cur
end
redis.call('PEXPIREAT', KEYS[1], ARGV[2])
return out
"#;

/// The store's side of a round: [`SYNC_SCRIPT`] on one hash.
pub trait CountStore {
    /// Raise `host`'s count of each `(key, own)` of `hash` to `own`, have `hash` expire at
    /// `expire_ms` (unix ms), and answer the keys' fleet totals in order.
    fn sync(
        &mut self,
        hash: &str,
        host: &str,
        expire_ms: u64,
        pairs: &[(&str, u64)],
    ) -> impl std::future::Future<Output = anyhow::Result<Vec<u64>>> + Send;

    /// Every call of a round: each call's own answer (one failing costs only its own keys).
    /// One after another by default; a store that can runs them at once.
    fn sync_all(
        &mut self,
        host: &str,
        calls: &[Call],
    ) -> impl std::future::Future<Output = Vec<anyhow::Result<Vec<u64>>>> {
        async move {
            let mut out = Vec::with_capacity(calls.len());
            for c in calls {
                let pairs: Vec<(&str, u64)> =
                    c.pairs.iter().map(|(k, n)| (k.as_str(), *n)).collect();
                out.push(self.sync(&c.hash, host, c.expire_ms, &pairs).await);
            }
            out
        }
    }
}

/// Announcing near-limit clients: a set per rule, meter, bucket and window
/// ([`announce_set`]).
pub trait Announce {
    /// Add `keys` to `set`, which expires at `expire_ms` (unix ms).
    fn announce(
        &mut self,
        set: &str,
        expire_ms: u64,
        keys: &[String],
    ) -> impl std::future::Future<Output = anyhow::Result<()>>;

    /// The members of each of `sets`, at most [`ANNOUNCED_READ_MAX`] of each (an empty list
    /// for a set that cannot be read).
    fn announced(&mut self, sets: &[String])
    -> impl std::future::Future<Output = Vec<Vec<String>>>;
}

/// One script call of a round: a hash, its expiry, and its `(key, own count)` pairs.
#[derive(Clone, Debug)]
pub struct Call {
    pub hash: String,
    pub expire_ms: u64,
    pub pairs: Vec<(String, u64)>,
}

/// A round's entries grouped by the hash they go to: hash -> (expiry, entries).
pub(super) type Groups<E> = BTreeMap<String, (u64, Vec<E>)>;

/// The calls for a round's entries grouped by hash (`hash -> (expiry, entries)`), at most
/// [`CALL_KEYS`] entries a call, `pair` giving an entry's key and own count; and each call's
/// entries, in order.
pub(super) fn calls_of<E>(
    groups: Groups<E>,
    pair: impl Fn(&E) -> (String, u64),
) -> (Vec<Call>, Vec<Vec<E>>) {
    let mut calls = Vec::new();
    let mut chunks: Vec<Vec<E>> = Vec::new();
    for (hash, (expire_ms, entries)) in groups {
        let mut entries = entries.into_iter().peekable();
        while entries.peek().is_some() {
            let chunk: Vec<E> = entries.by_ref().take(CALL_KEYS).collect();
            calls.push(Call {
                hash: hash.clone(),
                expire_ms,
                pairs: chunk.iter().map(&pair).collect(),
            });
            chunks.push(chunk);
        }
    }
    (calls, chunks)
}

/// The answers to a round's calls: each call's totals (`None` for a call that failed), how
/// many failed, and the last failure.
pub(super) fn answered(
    answers: Vec<anyhow::Result<Vec<u64>>>,
) -> (Vec<Option<Vec<u64>>>, u64, Option<anyhow::Error>) {
    let (mut failed, mut last_error) = (0u64, None);
    let totals = answers
        .into_iter()
        .map(|totals| match totals {
            Ok(t) => Some(t),
            Err(e) => {
                failed += 1;
                last_error = Some(e);
                None
            }
        })
        .collect();
    (totals, failed, last_error)
}

/// [`CountStore`] on Redis: the script on a connection ([`SYNC_SCRIPT`], or
/// [`SYNC_AUTH_SCRIPT`] with the fleet key), the hashes' names in the fleet's namespace.
pub struct RedisCounts<'a> {
    pub conn: &'a mut Conn,
    pub scripts: &'a Scripts,
    pub trust: &'a Arc<crate::fleet::trust::Trust>,
}

/// The count scripts.
#[derive(Clone)]
pub struct Scripts {
    plain: redis::Script,
    auth: redis::Script,
}

impl Default for Scripts {
    fn default() -> Self {
        Self {
            plain: redis::Script::new(SYNC_SCRIPT),
            auth: redis::Script::new(SYNC_AUTH_SCRIPT),
        }
    }
}

impl CountStore for RedisCounts<'_> {
    fn sync(
        &mut self,
        hash: &str,
        host: &str,
        expire_ms: u64,
        pairs: &[(&str, u64)],
    ) -> impl std::future::Future<Output = anyhow::Result<Vec<u64>>> + Send {
        let trust = self.trust.clone();
        let store_hash = trust.store_name(hash);
        let authenticated = trust.authenticated();
        let inv = if authenticated {
            let mut inv = self.scripts.auth.key(&store_hash);
            inv.arg(host)
                .arg(expire_ms)
                .arg(crate::fleet::trust::MAX_COUNT_FIELD);
            for &(key, own) in pairs {
                inv.arg(key)
                    .arg(own)
                    .arg(trust.count_mac(hash, key, host, own));
            }
            inv
        } else {
            let mut inv = self.scripts.plain.key(&store_hash);
            inv.arg(host).arg(expire_ms);
            for &(key, own) in pairs {
                inv.arg(key).arg(own);
            }
            inv
        };
        let keys: Vec<String> = pairs.iter().map(|(k, _)| k.to_string()).collect();
        let hash = hash.to_string();
        let conn = &mut *self.conn;
        async move {
            if !authenticated {
                return Ok(inv.invoke_async(conn).await?);
            }
            let fields: Vec<String> = inv.invoke_async(conn).await?;
            Ok(fields
                .iter()
                .zip(&keys)
                .map(|(f, k)| trust.count_total(&hash, k, f))
                .collect())
        }
    }

    /// Every call at once: one round trip for all (a multiplexed connection pipelines them; a
    /// Cluster's goes to each slot's master).
    async fn sync_all(&mut self, host: &str, calls: &[Call]) -> Vec<anyhow::Result<Vec<u64>>> {
        let mut set = tokio::task::JoinSet::new();
        for (ix, c) in calls.iter().enumerate() {
            let (scripts, trust, mut conn, c, host) = (
                self.scripts.clone(),
                self.trust.clone(),
                self.conn.clone(),
                c.clone(),
                host.to_string(),
            );
            set.spawn(async move {
                let pairs: Vec<(&str, u64)> =
                    c.pairs.iter().map(|(k, n)| (k.as_str(), *n)).collect();
                let mut one = RedisCounts {
                    conn: &mut conn,
                    scripts: &scripts,
                    trust: &trust,
                };
                (ix, one.sync(&c.hash, &host, c.expire_ms, &pairs).await)
            });
        }
        let mut out: Vec<anyhow::Result<Vec<u64>>> = (0..calls.len())
            .map(|_| Err(anyhow::anyhow!("the call's task ended")))
            .collect();
        while let Some(done) = set.join_next().await {
            if let Ok((ix, r)) = done {
                out[ix] = r;
            }
        }
        out
    }
}

impl Announce for RedisCounts<'_> {
    async fn announce(&mut self, set: &str, expire_ms: u64, keys: &[String]) -> anyhow::Result<()> {
        let set = self.trust.store_name(set);
        let mut p = redis::pipe();
        p.cmd("SADD").arg(&set).arg(keys).ignore();
        p.cmd("PEXPIREAT").arg(&set).arg(expire_ms).ignore();
        let () = p.query_async(&mut *self.conn).await?;
        Ok(())
    }

    async fn announced(&mut self, sets: &[String]) -> Vec<Vec<String>> {
        let mut set = tokio::task::JoinSet::new();
        for (ix, name) in sets.iter().enumerate() {
            let (mut conn, name) = (self.conn.clone(), self.trust.store_name(name));
            set.spawn(async move {
                let r: redis::RedisResult<Vec<String>> = redis::cmd("SRANDMEMBER")
                    .arg(&name)
                    .arg(ANNOUNCED_READ_MAX)
                    .query_async(&mut conn)
                    .await;
                (ix, r.unwrap_or_default())
            });
        }
        let mut out = vec![Vec::new(); sets.len()];
        while let Some(Ok((ix, m))) = set.join_next().await {
            out[ix] = m;
        }
        out
    }
}

/// [`CountStore`] in memory, with [`SYNC_SCRIPT`]'s semantics (hashes of fields, expiry by
/// the caller's clock `now_ms`, as Redis expires keys): for simulations and tests.
#[derive(Debug, Default)]
pub struct MemoryCounts {
    /// The store's clock (unix ms).
    pub now_ms: u64,
    pub(super) hashes: HashMap<String, (u64, HashMap<String, u64>)>,
    /// Announcement sets: expiry (unix ms) and members.
    pub(super) sets: HashMap<String, (u64, std::collections::BTreeSet<String>)>,
}

impl MemoryCounts {
    /// The script on `hash` at `now_ms`.
    pub fn run(
        &mut self,
        hash: &str,
        host: &str,
        expire_ms: u64,
        pairs: &[(&str, u64)],
    ) -> Vec<u64> {
        let now = self.now_ms;
        if self.hashes.get(hash).is_some_and(|(at, _)| *at <= now) {
            self.hashes.remove(hash);
        }
        let mut out = Vec::with_capacity(pairs.len());
        for &(k, abs) in pairs {
            let f = format!("{k}|{host}");
            let fields = self.hashes.get(hash).map(|(_, f)| f);
            let old = fields.and_then(|h| h.get(&f)).copied().unwrap_or(0);
            let total = if abs > old {
                let (_, h) = self
                    .hashes
                    .entry(hash.to_string())
                    .or_insert((u64::MAX, HashMap::new()));
                h.insert(f, abs);
                let t = h.entry(k.to_string()).or_insert(0);
                *t += abs - old;
                *t
            } else {
                fields.and_then(|h| h.get(k)).copied().unwrap_or(0)
            };
            out.push(total);
        }
        // PEXPIREAT: a hash that does not exist stays so.
        if let Some((at, _)) = self.hashes.get_mut(hash) {
            *at = expire_ms;
        }
        out
    }

    /// Drop the hashes expired at `now_ms` (Redis's own expiry cycle).
    pub fn expire(&mut self) {
        let now = self.now_ms;
        self.hashes.retain(|_, (at, _)| *at > now);
        self.sets.retain(|_, (at, _)| *at > now);
    }

    /// SADD and PEXPIREAT.
    pub fn add_to_set(&mut self, set: &str, expire_ms: u64, keys: &[String]) {
        let e = self
            .sets
            .entry(set.to_string())
            .or_insert((expire_ms, Default::default()));
        e.0 = expire_ms;
        e.1.extend(keys.iter().cloned());
    }

    /// SRANDMEMBER (up to [`ANNOUNCED_READ_MAX`]; the first ones here) at `now_ms`.
    pub fn members(&self, set: &str) -> Vec<String> {
        match self.sets.get(set) {
            Some((at, m)) if *at > self.now_ms => {
                m.iter().take(ANNOUNCED_READ_MAX).cloned().collect()
            }
            _ => Vec::new(),
        }
    }

    /// Hashes held.
    pub fn len(&self) -> usize {
        self.hashes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hashes.is_empty()
    }
}

impl CountStore for MemoryCounts {
    fn sync(
        &mut self,
        hash: &str,
        host: &str,
        expire_ms: u64,
        pairs: &[(&str, u64)],
    ) -> impl std::future::Future<Output = anyhow::Result<Vec<u64>>> + Send {
        std::future::ready(Ok(self.run(hash, host, expire_ms, pairs)))
    }
}

impl Announce for MemoryCounts {
    async fn announce(&mut self, set: &str, expire_ms: u64, keys: &[String]) -> anyhow::Result<()> {
        self.add_to_set(set, expire_ms, keys);
        Ok(())
    }

    async fn announced(&mut self, sets: &[String]) -> Vec<Vec<String>> {
        sets.iter().map(|s| self.members(s)).collect()
    }
}
