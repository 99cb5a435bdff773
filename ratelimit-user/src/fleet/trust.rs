//! The fleet store as a bounded trust boundary.
//!
//! Whoever can write to the store (a host holding its password, another tenant of the same
//! database, a staging fleet) is not trusted further than this:
//!
//! - **Names.** Every key the daemon uses lives under the fleet's name (`fleet.name`): two
//!   fleets on one database never read each other's bans, peers or counts. The fleet named
//!   `default` keeps the names of the releases before names existed (`ratelimit:{bans}:...`,
//!   `ratelimit:{g3}:...`); any other name `N` is put after the `ratelimit:` of each
//!   (`ratelimit:N:{bans}:stream`), the hash tags untouched (a script's keys stay in one slot
//!   of a Redis Cluster).
//! - **Authentication** (with `fleet.key_file`): every stream record and snapshot entry this
//!   daemon writes carries an HMAC-SHA256 over its exact bytes, bound to the fleet's name and
//!   to what it is (a stream record; the snapshot entry of one prefix), and every count a
//!   host publishes for a global rule carries one over (fleet, the rule's hash: its id, meter,
//!   bucket and window, the key, the host, the count). What fails (no MAC, a wrong one) is
//!   dropped and counted ([`Rejects`]); a writer without the key can delete what is there
//!   (the hosts then count and ban less, never more) but adds nothing anyone believes.
//! - **Bounds**, key or not: every field of a received record is bounded ([`Bounds::check`]),
//!   a remote ban is never wider than the configured floor, and never ends later than
//!   `fleet.remote_ban_max_duration` from its receipt (a longer or permanent one is clamped to
//!   that).

use std::{
    collections::BTreeMap,
    path::Path,
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::bail;
use hmac::{Hmac, Mac as _};
use sha2::Sha256;
use tracing::warn;

use crate::fleet::{Op, Record};

/// `fleet.name`'s default and bound, and its check (the config's).
pub use crate::config::{
    FLEET_DEFAULT_NAME as DEFAULT_NAME, MAX_FLEET_NAME_LEN as MAX_NAME_LEN,
    check_fleet_name as check_name,
};
/// A key file holds at least this many bytes.
pub const MIN_KEY_LEN: usize = 16;
/// Received records' bounds: a rule's name, a reason, a prefix as text.
pub const MAX_RULE_LEN: usize = 128;
pub const MAX_REASON_LEN: usize = 256;
pub const MAX_NET_LEN: usize = 43;
/// A record issued further than this in the future (by the receiver's clock) is refused.
pub const MAX_FUTURE: Duration = Duration::from_secs(600);
/// Rejections are written to the log at most this often (with the counts since).
const WARN_EVERY: Duration = Duration::from_secs(10);
/// A count field (all the hosts' MAC'd counts of one key) longer than this is dropped by the
/// store's script and not read by the hosts.
pub const MAX_COUNT_FIELD: usize = 256 * 1024;

/// The store's name of key `logical` (a name as the fleet named `default` uses it,
/// `ratelimit:{tag}:...`) in fleet `fleet`.
pub fn store_name(fleet: &str, logical: &str) -> String {
    if fleet == DEFAULT_NAME {
        return logical.to_string();
    }
    match logical.strip_prefix("ratelimit:") {
        Some(rest) => format!("ratelimit:{fleet}:{rest}"),
        None => format!("ratelimit:{fleet}:{logical}"),
    }
}

/// The fleet key (`fleet.key_file`): refused if the file is missing, readable by its group
/// or by every user, or shorter than [`MIN_KEY_LEN`] bytes (a final newline aside).
pub fn read_key(path: &Path) -> anyhow::Result<Vec<u8>> {
    let field = "fleet.key_file";
    let mut key = crate::durable::read_secret(path, field, 0o044)?;
    while key.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        key.pop();
    }
    if key.len() < MIN_KEY_LEN {
        bail!(
            "{field} {} holds {} bytes; at least {MIN_KEY_LEN} are needed (e.g. `head -c 32 \
             /dev/urandom | base64 > {}`)",
            path.display(),
            key.len(),
            path.display()
        );
    }
    Ok(key)
}

/// What a MAC is of (bound into it, so one kind's value is never taken for another's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A stream record's JSON.
    Record,
    /// A snapshot entry: its field (the prefix) and its value before the MAC.
    Snapshot,
    /// A host's count of one key: the hash's name, the key, the host, the count.
    Count,
}

impl Kind {
    fn tag(self) -> &'static [u8] {
        match self {
            Kind::Record => b"record",
            Kind::Snapshot => b"snapshot",
            Kind::Count => b"count",
        }
    }
}

/// Why something read from the store was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reject {
    /// No MAC, with a key configured.
    Unauthenticated,
    /// A MAC that does not verify.
    BadMac,
    /// Not a record (JSON, fields).
    Malformed,
    /// A field beyond its bound (host id, rule, reason, prefix text, times).
    OutOfBounds,
    /// A ban wider than `fleet.remote_ban_min_prefix_v4` / `_v6`.
    TooWide,
}

impl Reject {
    pub const ALL: [Reject; 5] = [
        Reject::Unauthenticated,
        Reject::BadMac,
        Reject::Malformed,
        Reject::OutOfBounds,
        Reject::TooWide,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reject::Unauthenticated => "unauthenticated",
            Reject::BadMac => "bad_mac",
            Reject::Malformed => "malformed",
            Reject::OutOfBounds => "out_of_bounds",
            Reject::TooWide => "too_wide",
        }
    }
}

/// Received remote bans' bounds (`[fleet]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// The shortest prefix a remote ban may have (IPv4, IPv6).
    pub min_prefix_v4: u8,
    pub min_prefix_v6: u8,
    /// The longest a remote ban may last from its receipt.
    pub max_duration: Duration,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            min_prefix_v4: crate::config::DEFAULT_REMOTE_BAN_MIN_PREFIX_V4,
            min_prefix_v6: crate::config::DEFAULT_REMOTE_BAN_MIN_PREFIX_V6,
            max_duration: crate::config::DEFAULT_REMOTE_BAN_MAX_DURATION,
        }
    }
}

/// What [`Bounds::check`] made of a record that passes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checked {
    pub record: Record,
    /// Its end was later than the maximum (or never): clamped.
    pub clamped: bool,
}

impl Bounds {
    /// A received record within every bound (its end clamped to `now_ms` + the maximum), or
    /// why it is refused.
    pub fn check(&self, mut r: Record, now_ms: u64) -> Result<Checked, Reject> {
        crate::config::check_host_id(&r.host).map_err(|_| Reject::OutOfBounds)?;
        if r.rule.as_ref().is_some_and(|s| s.len() > MAX_RULE_LEN)
            || r.reason.as_ref().is_some_and(|s| s.len() > MAX_REASON_LEN)
            || r.net.len() > MAX_NET_LEN
        {
            return Err(Reject::OutOfBounds);
        }
        let future = now_ms.saturating_add(MAX_FUTURE.as_millis() as u64);
        if r.at_ms == 0 || r.at_ms > future {
            return Err(Reject::OutOfBounds);
        }
        let net = crate::config::parse_net(&r.net).map_err(|_| Reject::OutOfBounds)?;
        let floor = match net {
            ipnet::IpNet::V4(_) => self.min_prefix_v4,
            ipnet::IpNet::V6(_) => self.min_prefix_v6,
        };
        if net.prefix_len() < floor {
            return Err(Reject::TooWide);
        }
        let mut clamped = false;
        match r.op {
            Op::Ban => {
                let max = now_ms.saturating_add(self.max_duration.as_millis() as u64);
                if r.exp_ms == 0 || r.exp_ms > max {
                    r.exp_ms = max;
                    clamped = true;
                }
            }
            Op::Unban => {
                if r.exp_ms != 0 {
                    return Err(Reject::OutOfBounds);
                }
            }
        }
        Ok(Checked { record: r, clamped })
    }
}

/// Rejections by reason, of records and snapshot entries and of counts; and a warning at most
/// every [`WARN_EVERY`].
#[derive(Debug, Default)]
pub struct Rejects {
    records: [AtomicU64; 5],
    counts: [AtomicU64; 5],
    clamped: AtomicU64,
    warned: Mutex<Option<Instant>>,
}

impl Rejects {
    fn ix(r: Reject) -> usize {
        Reject::ALL.iter().position(|x| *x == r).expect("a reason")
    }

    /// A record or snapshot entry dropped; `what` says which (for the log).
    pub fn record(&self, why: Reject, what: &str) {
        self.records[Self::ix(why)].fetch_add(1, Ordering::Relaxed);
        self.warn(why, what);
    }

    /// Counts of another host dropped (`n` of them).
    pub fn counts(&self, why: Reject, n: u64, what: &str) {
        if n == 0 {
            return;
        }
        self.counts[Self::ix(why)].fetch_add(n, Ordering::Relaxed);
        self.warn(why, what);
    }

    pub fn clamped(&self) {
        self.clamped.fetch_add(1, Ordering::Relaxed);
    }

    fn warn(&self, why: Reject, what: &str) {
        let mut w = self.warned.lock().unwrap_or_else(|e| e.into_inner());
        if w.is_some_and(|t| t.elapsed() < WARN_EVERY) {
            return;
        }
        *w = Some(Instant::now());
        warn!(
            reason = why.as_str(),
            records_rejected = ?self.records_by_reason(),
            counts_rejected = ?self.counts_by_reason(),
            "the fleet store holds what this host does not accept ({what}): dropped (this \
             warning at most every {}s)",
            WARN_EVERY.as_secs()
        );
    }

    fn by_reason(a: &[AtomicU64; 5]) -> BTreeMap<String, u64> {
        Reject::ALL
            .iter()
            .zip(a)
            .map(|(r, n)| (r.as_str().to_string(), n.load(Ordering::Relaxed)))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    pub fn records_by_reason(&self) -> BTreeMap<String, u64> {
        Self::by_reason(&self.records)
    }

    pub fn counts_by_reason(&self) -> BTreeMap<String, u64> {
        Self::by_reason(&self.counts)
    }

    pub fn clamped_total(&self) -> u64 {
        self.clamped.load(Ordering::Relaxed)
    }
}

/// The fleet's name, its key if any, the bounds of remote bans, and what was rejected.
#[derive(Debug)]
pub struct Trust {
    pub name: String,
    key: Option<Vec<u8>>,
    pub bounds: Bounds,
    pub rejects: Rejects,
}

impl Trust {
    pub fn new(name: &str, key: Option<Vec<u8>>, bounds: Bounds) -> Self {
        Self {
            name: name.to_string(),
            key,
            bounds,
            rejects: Rejects::default(),
        }
    }

    /// Records and counts are authenticated (a key file is configured).
    pub fn authenticated(&self) -> bool {
        self.key.is_some()
    }

    /// The store's name of `logical` in this fleet ([`store_name`]).
    pub fn store_name(&self, logical: &str) -> String {
        store_name(&self.name, logical)
    }

    fn mac_of(&self, kind: Kind, parts: &[&[u8]]) -> Option<Hmac<Sha256>> {
        let key = self.key.as_ref()?;
        let mut m = <Hmac<Sha256>>::new_from_slice(key).expect("HMAC takes any key length");
        // Each part with its length: no two different lists feed the same bytes.
        let mut feed = |b: &[u8]| {
            m.update(&(b.len() as u64).to_be_bytes());
            m.update(b);
        };
        feed(b"ratelimit-fleet-v1");
        feed(self.name.as_bytes());
        feed(kind.tag());
        for p in parts {
            feed(p);
        }
        Some(m)
    }

    /// The MAC (hex) of `parts` as `kind`; empty without a key.
    pub fn sign(&self, kind: Kind, parts: &[&[u8]]) -> String {
        match self.mac_of(kind, parts) {
            Some(m) => hex(&m.finalize().into_bytes()),
            None => String::new(),
        }
    }

    /// Whether `mac` (hex) is the MAC of `parts` as `kind` (in constant time). Without a key,
    /// everything verifies.
    pub fn verify(&self, kind: Kind, parts: &[&[u8]], mac: Option<&str>) -> Result<(), Reject> {
        let Some(m) = self.mac_of(kind, parts) else {
            return Ok(());
        };
        let mac = mac.ok_or(Reject::Unauthenticated)?;
        let bytes = unhex(mac).ok_or(Reject::BadMac)?;
        m.verify_slice(&bytes).map_err(|_| Reject::BadMac)
    }

    /// A stream entry's fields (`r`, the record; `m`, its MAC) made into a record this host
    /// accepts, or `None` (counted). `now_ms`: the time of receipt.
    pub fn stream_record(&self, r: Option<&str>, m: Option<&str>, now_ms: u64) -> Option<Record> {
        let Some(json) = r else {
            self.rejects.record(Reject::Malformed, "a stream entry");
            return None;
        };
        if let Err(why) = self.verify(Kind::Record, &[json.as_bytes()], m) {
            self.rejects.record(why, "a stream record");
            return None;
        }
        let Ok(rec) = serde_json::from_str::<Record>(json) else {
            self.rejects.record(Reject::Malformed, "a stream record");
            return None;
        };
        self.bounded(rec, now_ms, "a stream record")
    }

    fn bounded(&self, rec: Record, now_ms: u64, what: &str) -> Option<Record> {
        match self.bounds.check(rec, now_ms) {
            Ok(c) => {
                if c.clamped {
                    self.rejects.clamped();
                }
                Some(c.record)
            }
            Err(why) => {
                self.rejects.record(why, what);
                None
            }
        }
    }

    /// The snapshot value of `r` (its field is `r.net`): `<end ms>|<json>` for a ban,
    /// `t<unban ms>|<json>` for an unban's tombstone, then `|<MAC>` with a key. Returns
    /// (value, MAC) as the publish script takes them: its head and JSON are the script's to
    /// join, so the MAC goes apart.
    pub fn snapshot_mac(&self, r: &Record, json: &str) -> String {
        let body = match r.op {
            Op::Ban => format!("{}|{json}", r.exp_ms),
            Op::Unban => format!("t{}|{json}", r.at_ms),
        };
        self.sign(Kind::Snapshot, &[r.net.as_bytes(), body.as_bytes()])
    }

    /// A snapshot entry (`field` → `value`) made into a record this host accepts, or `None`
    /// (counted).
    pub fn snapshot_record(&self, field: &str, value: &str, now_ms: u64) -> Option<Record> {
        let body = if self.authenticated() {
            let (body, mac) = match value.rsplit_once('|') {
                Some((b, m)) if m.len() == 64 && !m.starts_with('{') => (b, Some(m)),
                _ => (value, None),
            };
            if let Err(why) = self.verify(Kind::Snapshot, &[field.as_bytes(), body.as_bytes()], mac)
            {
                self.rejects.record(why, "a snapshot entry");
                return None;
            }
            body
        } else {
            value
        };
        let rec = body
            .split_once('|')
            .and_then(|(_, json)| serde_json::from_str::<Record>(json).ok());
        let Some(rec) = rec.filter(|r| r.net == field) else {
            self.rejects.record(Reject::Malformed, "a snapshot entry");
            return None;
        };
        self.bounded(rec, now_ms, "a snapshot entry")
    }

    /// The MAC of `host`'s count `count` of `key` in hash `hash` (its logical name: the rule's
    /// id, meter, bucket and window).
    pub fn count_mac(&self, hash: &str, key: &str, host: &str, count: u64) -> String {
        self.sign(
            Kind::Count,
            &[
                hash.as_bytes(),
                key.as_bytes(),
                host.as_bytes(),
                count.to_string().as_bytes(),
            ],
        )
    }

    /// The fleet's total of `key` in `hash` from the value of its authenticated count field
    /// (`host,count,mac` entries joined by `;`): the sum of the counts that verify. The rest
    /// are counted as rejected.
    pub fn count_total(&self, hash: &str, key: &str, field: &str) -> u64 {
        if field.len() > MAX_COUNT_FIELD {
            self.rejects
                .counts(Reject::OutOfBounds, 1, "a global count field");
            return 0;
        }
        let (mut total, mut bad, mut unauth) = (0u64, 0u64, 0u64);
        for e in field.split(';').filter(|e| !e.is_empty()) {
            let mut it = e.splitn(3, ',');
            let (Some(host), Some(count), mac) = (it.next(), it.next(), it.next()) else {
                unauth += 1;
                continue;
            };
            let Ok(n) = count.parse::<u64>() else {
                bad += 1;
                continue;
            };
            match self.verify(
                Kind::Count,
                &[
                    hash.as_bytes(),
                    key.as_bytes(),
                    host.as_bytes(),
                    count.as_bytes(),
                ],
                mac.filter(|m| !m.is_empty()),
            ) {
                Ok(()) => total = total.saturating_add(n),
                Err(Reject::Unauthenticated) => unauth += 1,
                Err(_) => bad += 1,
            }
        }
        self.rejects
            .counts(Reject::Unauthenticated, unauth, "a global count");
        self.rejects.counts(Reject::BadMac, bad, "a global count");
        total
    }

    /// The fields of a count hash as `fleet key` reads them (`<key>` the total, `<key>|<host>`
    /// each host's count): as they are without the fleet key; with it, made of `key`'s
    /// authenticated field, only the counts that verify.
    pub fn plain_counts(
        &self,
        hash: &str,
        key: &str,
        fields: std::collections::HashMap<String, String>,
    ) -> std::collections::HashMap<String, String> {
        if !self.authenticated() {
            return fields;
        }
        let mut out = std::collections::HashMap::new();
        let Some(field) = fields.get(&format!("{key}#m")) else {
            return out;
        };
        let mut total = 0u64;
        for e in field.split(';').take(4096) {
            let mut it = e.splitn(3, ',');
            let (Some(host), Some(count), Some(mac)) = (it.next(), it.next(), it.next()) else {
                continue;
            };
            let parts: [&[u8]; 4] = [
                hash.as_bytes(),
                key.as_bytes(),
                host.as_bytes(),
                count.as_bytes(),
            ];
            if let (Ok(n), Ok(())) = (
                count.parse::<u64>(),
                self.verify(Kind::Count, &parts, Some(mac)),
            ) {
                total = total.saturating_add(n);
                out.insert(format!("{key}|{host}"), n.to_string());
            }
        }
        out.insert(key.to_string(), total.to_string());
        out
    }
}

fn hex(b: &[u8]) -> String {
    use std::fmt::Write as _;
    b.iter()
        .fold(String::with_capacity(b.len() * 2), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_800_000_000_000;

    fn rec(op: Op, net: &str, exp_ms: u64) -> Record {
        Record {
            op,
            net: net.into(),
            exp_ms,
            at_ms: NOW - 1000,
            host: "h1".into(),
            rule: Some("udp-ban".into()),
            reason: None,
        }
    }

    fn keyed(name: &str, key: &[u8]) -> Trust {
        Trust::new(name, Some(key.to_vec()), Bounds::default())
    }

    #[test]
    fn a_record_verifies_only_with_its_fleet_s_key_and_name_and_kind() {
        let t = keyed("prod", b"0123456789abcdef0123");
        let json = serde_json::to_string(&rec(Op::Ban, "203.0.113.0/24", NOW + 60_000)).unwrap();
        let mac = t.sign(Kind::Record, &[json.as_bytes()]);
        assert_eq!(mac.len(), 64);
        assert!(t.stream_record(Some(&json), Some(&mac), NOW).is_some());
        // Missing, wrong, from another fleet, another key, another kind, another body.
        assert_eq!(t.stream_record(Some(&json), None, NOW), None);
        assert_eq!(
            t.stream_record(Some(&json), Some(&"0".repeat(64)), NOW),
            None
        );
        let other_fleet = keyed("staging", b"0123456789abcdef0123");
        let m2 = other_fleet.sign(Kind::Record, &[json.as_bytes()]);
        assert_eq!(t.stream_record(Some(&json), Some(&m2), NOW), None);
        let other_key = keyed("prod", b"0123456789abcdef0124");
        let m3 = other_key.sign(Kind::Record, &[json.as_bytes()]);
        assert_eq!(t.stream_record(Some(&json), Some(&m3), NOW), None);
        let m4 = t.sign(Kind::Snapshot, &[json.as_bytes()]);
        assert_eq!(t.stream_record(Some(&json), Some(&m4), NOW), None);
        let forged = json.replace("203.0.113.0/24", "198.51.100.0/24");
        assert_eq!(t.stream_record(Some(&forged), Some(&mac), NOW), None);
        let r = t.rejects.records_by_reason();
        assert_eq!(r.get("unauthenticated"), Some(&1), "{r:?}");
        assert_eq!(r.get("bad_mac"), Some(&5), "{r:?}");
        // Without a key, the MAC is not looked at.
        let open = Trust::new("default", None, Bounds::default());
        assert!(open.stream_record(Some(&json), None, NOW).is_some());
        assert_eq!(open.sign(Kind::Record, &[b"x"]), "");
    }

    #[test]
    fn a_snapshot_entry_is_bound_to_its_prefix() {
        let t = keyed("prod", b"0123456789abcdef0123");
        let r = rec(Op::Ban, "203.0.113.0/24", NOW + 60_000);
        let json = serde_json::to_string(&r).unwrap();
        let mac = t.snapshot_mac(&r, &json);
        let value = format!("{}|{json}|{mac}", r.exp_ms);
        assert_eq!(
            t.snapshot_record("203.0.113.0/24", &value, NOW),
            Some(r.clone())
        );
        // Replayed as another prefix's, or unauthenticated, or its end changed.
        assert_eq!(t.snapshot_record("198.51.100.0/24", &value, NOW), None);
        assert_eq!(
            t.snapshot_record("203.0.113.0/24", &format!("{}|{json}", r.exp_ms), NOW),
            None
        );
        let later = format!("0|{json}|{mac}");
        assert_eq!(t.snapshot_record("203.0.113.0/24", &later, NOW), None);
        // A tombstone.
        let u = rec(Op::Unban, "203.0.113.0/24", 0);
        let ju = serde_json::to_string(&u).unwrap();
        let mu = t.snapshot_mac(&u, &ju);
        let tomb = format!("t{}|{ju}|{mu}", u.at_ms);
        assert_eq!(t.snapshot_record("203.0.113.0/24", &tomb, NOW), Some(u));
        // Without a key: today's values.
        let open = Trust::new("default", None, Bounds::default());
        assert_eq!(
            open.snapshot_record("203.0.113.0/24", &format!("{}|{json}", r.exp_ms), NOW),
            Some(r)
        );
    }

    #[test]
    fn remote_bans_are_bounded_in_width_length_and_every_field() {
        let b = Bounds {
            min_prefix_v4: 16,
            min_prefix_v6: 32,
            max_duration: Duration::from_secs(86_400),
        };
        let day = 86_400_000;
        let ok = |r: Record| b.check(r, NOW);
        assert_eq!(ok(rec(Op::Ban, "0.0.0.0/0", NOW + 1)), Err(Reject::TooWide));
        assert_eq!(ok(rec(Op::Ban, "::/0", NOW + 1)), Err(Reject::TooWide));
        assert_eq!(
            ok(rec(Op::Ban, "10.0.0.0/15", NOW + 1)),
            Err(Reject::TooWide)
        );
        assert_eq!(ok(rec(Op::Unban, "10.0.0.0/8", 0)), Err(Reject::TooWide));
        assert_eq!(
            ok(rec(Op::Ban, "2001:db8::/31", NOW + 1)),
            Err(Reject::TooWide)
        );
        assert!(ok(rec(Op::Ban, "10.1.0.0/16", NOW + 1)).is_ok());
        assert!(ok(rec(Op::Ban, "2001:db8::/32", NOW + 1)).is_ok());
        // Permanent or longer than the maximum: clamped to now + the maximum.
        let c = ok(rec(Op::Ban, "10.1.2.3/32", 0)).unwrap();
        assert!(c.clamped && c.record.exp_ms == NOW + day, "{c:?}");
        let c = ok(rec(Op::Ban, "10.1.2.3/32", NOW + 2 * day)).unwrap();
        assert!(c.clamped && c.record.exp_ms == NOW + day, "{c:?}");
        let c = ok(rec(Op::Ban, "10.1.2.3/32", NOW + day)).unwrap();
        assert!(!c.clamped && c.record.exp_ms == NOW + day);
        // Fields.
        let mut r = rec(Op::Ban, "10.1.2.3/32", NOW + 1);
        r.host = "h".repeat(65);
        assert_eq!(ok(r.clone()), Err(Reject::OutOfBounds));
        r.host = "h 1".into();
        assert_eq!(ok(r.clone()), Err(Reject::OutOfBounds));
        r.host = "h1".into();
        r.reason = Some("x".repeat(MAX_REASON_LEN + 1));
        assert_eq!(ok(r.clone()), Err(Reject::OutOfBounds));
        r.reason = None;
        r.rule = Some("x".repeat(MAX_RULE_LEN + 1));
        assert_eq!(ok(r.clone()), Err(Reject::OutOfBounds));
        r.rule = None;
        r.at_ms = NOW + MAX_FUTURE.as_millis() as u64 + 1;
        assert_eq!(ok(r.clone()), Err(Reject::OutOfBounds));
        r.at_ms = 0;
        assert_eq!(ok(r.clone()), Err(Reject::OutOfBounds));
        r.at_ms = NOW;
        r.net = format!("10.1.2.3/32{}", " ".repeat(40));
        assert_eq!(ok(r.clone()), Err(Reject::OutOfBounds));
        r.net = "not-a-net".into();
        assert_eq!(ok(r), Err(Reject::OutOfBounds));
        assert_eq!(
            ok(rec(Op::Unban, "10.1.2.3/32", 5)),
            Err(Reject::OutOfBounds)
        );
    }

    #[test]
    fn a_count_counts_only_when_its_mac_verifies() {
        let t = keyed("prod", b"0123456789abcdef0123");
        let h = "ratelimit:{g3}:a:r#1:42";
        let e = |host: &str, n: u64| format!("{host},{n},{}", t.count_mac(h, "all", host, n));
        let field = format!("{};{}", e("h0", 10), e("h1", 7));
        assert_eq!(t.count_total(h, "all", &field), 17);
        // Forged: no MAC, a wrong one, one of another key, another window, another count.
        let forged = format!(
            "{field};h9,1000000;h8,1000000,{};{}",
            "0".repeat(64),
            e("h7", 5).replace(",5,", ",500000,")
        );
        assert_eq!(t.count_total(h, "all", &forged), 17);
        assert_eq!(t.count_total("ratelimit:{g3}:a:r#1:43", "all", &field), 0);
        assert_eq!(t.count_total(h, "region:DE", &field), 0);
        let c = t.rejects.counts_by_reason();
        assert_eq!(c.get("unauthenticated"), Some(&1), "{c:?}");
        assert_eq!(c.get("bad_mac"), Some(&6), "{c:?}");
    }

    #[test]
    fn names_keep_the_default_fleet_s_keys_and_tags() {
        assert_eq!(
            store_name("default", "ratelimit:{bans}:stream"),
            "ratelimit:{bans}:stream"
        );
        assert_eq!(
            store_name("prod-eu", "ratelimit:{bans}:stream"),
            "ratelimit:prod-eu:{bans}:stream"
        );
        assert_eq!(
            store_name("b", "ratelimit:{g3}:a:r#1:42"),
            "ratelimit:b:{g3}:a:r#1:42"
        );
        assert!(check_name("prod.eu_1-a").is_ok());
        assert!(check_name("").is_err());
        assert!(check_name(&"a".repeat(65)).is_err());
        assert!(check_name("a{b}").is_err());
        assert!(check_name("a:b").is_err());
    }

    #[test]
    fn the_key_file_is_refused_when_others_can_read_it_or_it_is_short() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("rl-fleet-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("key");
        std::fs::write(&p, "0123456789abcdefXYZ\n").unwrap();
        for (mode, ok) in [(0o600, true), (0o400, true), (0o640, false), (0o604, false)] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            let r = read_key(&p);
            assert_eq!(r.is_ok(), ok, "mode {mode:o}: {r:?}");
            if !ok {
                let e = format!("{:#}", r.unwrap_err());
                assert!(e.contains("readable by other users"), "{e}");
            }
        }
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_key(&p).unwrap(), b"0123456789abcdefXYZ");
        std::fs::write(&p, "short\n").unwrap();
        let e = format!("{:#}", read_key(&p).unwrap_err());
        assert!(e.contains("at least 16"), "{e}");
        assert!(read_key(&dir.join("missing")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
