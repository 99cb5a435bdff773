//! Bans on disk: every active ban (operator's and rule-issued, the aggregate bans of rules keyed
//! by `all` or `region` included) is saved to `state_dir/bans.json` with its wall-clock expiry
//! and its rule by name, written atomically and durably ([`crate::durable`]), so bans survive
//! a reboot, when the pinned maps are gone. On start, bans missing from the map are restored
//! with their remaining time, each on its own; expired ones and those of rules no longer in
//! the config are dropped.
//!
//! The kernel's ban entries name their rule by position; when the rules change (a reload, a
//! start with another config) [`follow_rules`] and [`put_back_aggregates`] keep every ban with
//! its rule by name.

use std::{
    collections::BTreeMap,
    path::Path,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use ratelimit_common::maps::*;
use serde::{Deserialize, Serialize};

use crate::{
    clock::{mono_ns, wall_of},
    config::MAX_BAN_DURATION,
    durable::Loaded,
    kernel::datapath::Maps,
    policy::apply::prefix,
};

pub const FILE: &str = "bans.json";

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct SavedBan {
    /// The banned prefix; empty for an aggregate ban (`key`).
    pub cidr: String,
    /// `all` or `region` for the aggregate ban of a rule with that key (its `rule` and
    /// `region` say which state); absent for a prefix ban.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// Unix time in ms; None = until removed.
    pub expires_unix_ms: Option<u64>,
    /// Issuing rule by name; None for an operator's ban.
    pub rule: Option<String>,
    pub manual: bool,
    pub preview: bool,
    /// Issued by a rule whose `exceed_action` is pass: counted, never dropping.
    #[serde(default)]
    pub exceed_pass: bool,
    #[serde(default)]
    pub reason: Option<String>,
    /// The fleet host that issued it, for a ban received from the fleet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

/// The entries of a ban file (`ban add --file`, `ban del --file`): one address or CIDR a
/// line, `#` starts a comment, blank lines are skipped. Checked by the daemon, whole.
pub fn file_entries(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

/// The kernel's CLOCK_MONOTONIC expiry of a ban saved as Unix time `expires_unix_ms`, read at
/// `now_wall_ms` (Unix time) and `now_mono_ns`: `None` if it has passed. The monotonic clock
/// restarts at every boot, so only wall-clock time can carry an expiry across a reboot. The
/// time left is held to [`MAX_BAN_DURATION`] (a file saved under a clock that ran ahead, or
/// edited by hand) and the sum saturates: a wrapped expiry would end the ban at a random time.
pub fn mono_expiry(expires_unix_ms: u64, now_wall_ms: u64, now_mono_ns: u64) -> Option<u64> {
    let left_ms = expires_unix_ms
        .checked_sub(now_wall_ms)
        .filter(|&ms| ms > 0)?;
    let left = Duration::from_millis(left_ms).min(MAX_BAN_DURATION);
    let left_ns = u64::try_from(left.as_nanos()).unwrap_or(u64::MAX);
    Some(now_mono_ns.saturating_add(left_ns).max(1))
}

pub fn save(
    dir: &Path,
    maps: &Maps,
    rules: &[(String, RuleConfig)],
    notes: &crate::policy::ban_notes::Notes,
) -> anyhow::Result<()> {
    let (reasons, origins) = (&notes.reasons, &notes.origins);
    let rule_names: Vec<String> = rules.iter().map(|(n, _)| n.clone()).collect();
    let mut list: Vec<SavedBan> = crate::policy::report::active_bans(maps)
        .into_iter()
        .map(|(net, b)| {
            let cidr = net.to_string();
            SavedBan {
                expires_unix_ms: (b.expires_ns != 0).then(|| unix_ms(wall_of(b.expires_ns))),
                rule: (b.rule != BAN_RULE_NONE)
                    .then(|| rule_names.get(b.rule as usize).cloned())
                    .flatten(),
                manual: b.flags & BAN_MANUAL != 0,
                preview: b.flags & BAN_PREVIEW != 0,
                exceed_pass: b.flags & BAN_EXCEED_PASS != 0,
                reason: reasons.get(&cidr).cloned(),
                origin: (b.flags & ratelimit_common::maps::BAN_REMOTE != 0)
                    .then(|| origins.get(&cidr).cloned())
                    .flatten(),
                cidr,
                key: None,
                region: None,
            }
        })
        .collect();
    // Aggregate bans (rules keyed by all or region) live in the rules' shared states.
    for b in crate::policy::report::aggregate_bans(maps, rules, mono_ns()) {
        let Some(expires) = b.expires_ns else {
            continue;
        };
        list.push(SavedBan {
            cidr: String::new(),
            key: Some(b.key.to_string()),
            region: b.region.clone(),
            expires_unix_ms: Some(unix_ms(wall_of(expires))),
            rule: b.rule.clone(),
            manual: false,
            preview: b.preview,
            exceed_pass: false,
            reason: None,
            origin: None,
        });
    }
    crate::durable::write_atomically(dir, FILE, &serde_json::to_vec_pretty(&list)?)
        .with_context(|| format!("saving bans to {}", dir.join(FILE).display()))
}

/// What became of the saved bans at start: in the log, in `status` (`bans_restore`) and in
/// `/metrics` (`ratelimit_saved_bans_total` by outcome, `ratelimit_bans_files_set_aside_total`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct RestoreReport {
    /// The file read.
    pub file: String,
    /// Put back into the maps.
    pub restored: u64,
    /// Still in the pinned maps (the kernel's copy is authoritative).
    pub pinned: u64,
    /// Ended while the daemon was down.
    pub expired: u64,
    /// Issued by a rule that is no longer in the config: a removed rule takes its bans with it.
    pub rule_gone: u64,
    /// Could not be restored (an entry that does not parse, a full ban table).
    pub failed: u64,
    /// The first failures, each with its ban and why.
    pub failures: Vec<String>,
    /// Where the file was moved because it could not be read as a list of bans.
    pub set_aside: Option<String>,
    /// A copy of the file, kept because some of its bans could not be restored (the next save
    /// writes the file without them).
    pub kept_copy: Option<String>,
    /// Set while saving would overwrite the only copy of a file that could neither be read nor
    /// moved aside: bans are not saved until it is moved away (then saving resumes).
    pub save_refused: Option<String>,
}

impl RestoreReport {
    /// Every outcome with its count, as `/metrics` labels them (one saved ban has one).
    pub fn outcomes(&self) -> [(&'static str, u64); 5] {
        [
            ("restored", self.restored),
            ("pinned", self.pinned),
            ("expired", self.expired),
            ("rule_gone", self.rule_gone),
            ("failed", self.failed),
        ]
    }
}

/// A ban dropped because its rule is gone, for its `unban` event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    pub rule: String,
    /// `ip`, `all` or `region`.
    pub key: &'static str,
    pub client: String,
}

pub struct Restored {
    pub report: RestoreReport,
    pub reasons: BTreeMap<String, String>,
    /// The origin host of each restored ban received from the fleet.
    pub origins: BTreeMap<String, String>,
    pub dropped: Vec<Dropped>,
}

/// How many failures the log and `status` list one by one (the counts cover them all).
const LISTED_FAILURES: usize = 20;

/// What became of one saved ban.
#[derive(Debug)]
enum Outcome {
    Restored,
    Pinned,
    Expired,
    RuleGone(Dropped),
    Failed(String),
}

/// Put back the bans saved in `dir`, each on its own: one that cannot be restored is reported
/// (log, [`RestoreReport`]) and the others are restored all the same. The daemon starts
/// whatever this finds:
/// - a file that is not a list of bans is moved aside (`bans.json.bad-<unix time>`), never
///   overwritten, and said in a warning naming both paths;
/// - a file that cannot be read at all (and so cannot be moved either) stops bans from being
///   saved over it until it is moved away ([`RestoreReport::save_refused`]);
/// - when some bans fail, a copy of the file is kept (`bans.json.unrestored-<unix time>`)
///   before the next save writes it without them.
pub fn restore(dir: &Path, maps: &mut Maps, rules: &[(String, RuleConfig)]) -> Restored {
    let path = dir.join(FILE);
    let mut out = Restored {
        report: RestoreReport {
            file: path.display().to_string(),
            ..RestoreReport::default()
        },
        reasons: BTreeMap::new(),
        origins: BTreeMap::new(),
        dropped: Vec::new(),
    };
    let entries = match crate::durable::load(&path, parse_entries) {
        Loaded::Read(l) => l,
        Loaded::Missing => return out,
        Loaded::Unreadable(e) => {
            let why = format!(
                "{} could not be read ({e}); no ban is saved over it until it is moved away",
                path.display()
            );
            tracing::error!("{why}");
            out.report.save_refused = Some(why);
            return out;
        }
        Loaded::Bad {
            error: e,
            aside: Ok(to),
        } => {
            tracing::warn!(
                "{} is not a list of bans ({e}): moved aside to {}; no ban is restored \
                 from it, and new bans are saved to {}",
                path.display(),
                to.display(),
                path.display()
            );
            out.report.set_aside = Some(to.display().to_string());
            return out;
        }
        Loaded::Bad {
            error: e,
            aside: Err(e2),
        } => {
            let why = format!(
                "{} is not a list of bans ({e}) and could not be moved aside ({e2}); \
                 no ban is saved over it until it is moved away",
                path.display()
            );
            tracing::error!("{why}");
            out.report.save_refused = Some(why);
            return out;
        }
    };
    let now_wall = unix_ms(SystemTime::now());
    let now = mono_ns();
    for entry in entries {
        let (label, outcome) = match entry {
            Ok(b) => {
                let o = restore_one(maps, rules, &b, now_wall, now);
                if let (Outcome::Restored | Outcome::Pinned, Some(r)) = (&o, &b.reason) {
                    out.reasons.insert(b.cidr.clone(), r.clone());
                }
                if let (Outcome::Restored | Outcome::Pinned, Some(h)) = (&o, &b.origin) {
                    out.origins.insert(b.cidr.clone(), h.clone());
                }
                let label = match &b.rule {
                    Some(r) if b.cidr.is_empty() => format!("the aggregate ban of rule {r:?}"),
                    _ => b.cidr,
                };
                (label, o)
            }
            Err((label, why)) => (label, Outcome::Failed(why)),
        };
        let r = &mut out.report;
        match outcome {
            Outcome::Restored => r.restored += 1,
            Outcome::Pinned => r.pinned += 1,
            Outcome::Expired => r.expired += 1,
            Outcome::RuleGone(d) => {
                r.rule_gone += 1;
                out.dropped.push(d);
            }
            Outcome::Failed(why) => {
                r.failed += 1;
                if r.failures.len() < LISTED_FAILURES {
                    tracing::warn!("saved ban {label} not restored: {why}");
                    r.failures.push(format!("{label}: {why}"));
                }
            }
        }
    }
    // Whatever was inserted: void the program's fast-drop entries (they skip the ban
    // lookup).
    if let Err(e) = maps.flush_ban_epoch() {
        tracing::error!("voiding the program's fast-drop entries after restoring bans: {e}");
    }
    let r = &mut out.report;
    if r.failed > 0 {
        let copy = match crate::durable::keep_copy(&path, "unrestored") {
            Ok(to) => {
                r.kept_copy = Some(to.display().to_string());
                format!("the file as it was is kept as {}", to.display())
            }
            Err(e) => format!("keeping a copy of the file failed: {e:#}"),
        };
        tracing::warn!(
            "{} of the bans saved in {} could not be restored ({} listed above); the others \
             were; {copy}",
            r.failed,
            path.display(),
            r.failures.len()
        );
    }
    if r.rule_gone > 0 {
        let mut gone: Vec<&str> = out.dropped.iter().map(|d| d.rule.as_str()).collect();
        gone.sort_unstable();
        gone.dedup();
        tracing::info!(
            bans = r.rule_gone,
            rules = ?gone,
            "saved bans of rules no longer in the config were dropped"
        );
    }
    out
}

/// A saved ban, or (a label for it, why it does not parse).
type Entry = Result<SavedBan, (String, String)>;

/// The entries of a bans file; `Err` if it is not a JSON list. Entry by entry: one that does
/// not parse (a hand edit) fails alone. The whole list is read as bans first (a file of a
/// million bans in one pass), and only a list with a bad entry is read again entry by entry.
fn parse_entries(text: &[u8]) -> serde_json::Result<Vec<Entry>> {
    if let Ok(list) = serde_json::from_slice::<Vec<SavedBan>>(text) {
        return Ok(list.into_iter().map(Ok).collect());
    }
    let values: Vec<serde_json::Value> = serde_json::from_slice(text)?;
    Ok(values
        .into_iter()
        .enumerate()
        .map(|(n, v)| {
            let label = match v.get("cidr").and_then(|c| c.as_str()) {
                Some(c) if !c.is_empty() => c.to_string(),
                _ => format!("entry {}", n + 1),
            };
            serde_json::from_value::<SavedBan>(v)
                .map_err(|e| (label, format!("not a saved ban: {e}")))
        })
        .collect())
}

/// Put one saved ban back into the maps.
fn restore_one(
    maps: &mut Maps,
    rules: &[(String, RuleConfig)],
    b: &SavedBan,
    now_wall: u64,
    now: u64,
) -> Outcome {
    if b.key.is_some() {
        return restore_aggregate(maps, rules, b, now_wall, now);
    }
    let net = match b.cidr.parse::<ipnet::IpNet>() {
        Ok(n) => n,
        Err(e) => return Outcome::Failed(format!("{:?} is not a CIDR: {e}", b.cidr)),
    };
    if let Some(why) = crate::config::aliases_ipv4(&net) {
        return Outcome::Failed(format!("{} {why}", b.cidr));
    }
    let expires_ns = match b.expires_unix_ms {
        None => 0,
        Some(ms) => match mono_expiry(ms, now_wall, now) {
            Some(ns) => ns,
            None => return Outcome::Expired,
        },
    };
    let rule = match &b.rule {
        // An operator's ban, or a rule ban saved without its rule's name.
        None => BAN_RULE_NONE,
        Some(name) => match rules.iter().position(|(n, _)| n == name) {
            Some(i) => i as u32,
            None if b.manual => BAN_RULE_NONE,
            None => {
                return Outcome::RuleGone(Dropped {
                    rule: name.clone(),
                    key: "ip",
                    client: net.to_string(),
                });
            }
        },
    };
    let (plen, key) = prefix(&net);
    let mut flags = 0;
    if b.manual {
        flags |= BAN_MANUAL;
        if b.origin.is_some() {
            flags |= ratelimit_common::maps::BAN_REMOTE;
        }
    }
    if b.preview {
        flags |= BAN_PREVIEW;
    }
    if b.exceed_pass {
        flags |= BAN_EXCEED_PASS;
    }
    if maps.ban_at(ban_table(flags), plen, &key).is_some() {
        return Outcome::Pinned;
    }
    let entry = BanEntry {
        expires_ns,
        since_ns: now,
        rule,
        flags,
        prefix_len: plen,
        _pad: 0,
        addr: key.addr,
    };
    match maps.insert_ban_deferred(entry) {
        Ok(()) => Outcome::Restored,
        Err(e) => Outcome::Failed(format!(
            "adding it to the {} ban table failed: {:#}",
            table_name(ban_table(flags)),
            anyhow::Error::from(e)
        )),
    }
}

fn table_name(table: u32) -> &'static str {
    match table {
        BAN_TABLE_OPERATOR => "operator's",
        BAN_TABLE_RULE => "rules'",
        BAN_TABLE_REMOTE => "fleet's",
        _ => "passing (preview and exceed_action = pass)",
    }
}

/// An aggregate ban back into its rule's shared state, if the rule (by name) still has that
/// key and bans, and the ban has time left.
fn restore_aggregate(
    maps: &mut Maps,
    rules: &[(String, RuleConfig)],
    b: &SavedBan,
    now_wall: u64,
    now: u64,
) -> Outcome {
    let kind = match b.key.as_deref() {
        Some("all") => KEY_ALL,
        Some("region") => KEY_REGION,
        other => return Outcome::Failed(format!("unknown key {other:?}")),
    };
    let Some(ms) = b.expires_unix_ms else {
        return Outcome::Failed("an aggregate ban without an expiry".into());
    };
    let Some(until) = mono_expiry(ms, now_wall, now) else {
        return Outcome::Expired;
    };
    let region = match (kind, b.region.as_deref().map(str::as_bytes)) {
        (KEY_ALL, _) => [0; 2],
        (_, Some(&[x, y])) if x.is_ascii_uppercase() && y.is_ascii_uppercase() => [x, y],
        (_, r) => {
            return Outcome::Failed(format!(
                "region {:?} is not a two-letter code",
                r.map(String::from_utf8_lossy)
            ));
        }
    };
    let Some(rule) = &b.rule else {
        return Outcome::Failed("an aggregate ban without its rule".into());
    };
    let held = HeldAggregate {
        rule: rule.clone(),
        old_index: u8::MAX,
        kind,
        region,
        until_ns: until,
    };
    match insert_aggregate(maps, rules, &held) {
        Ok(Some(true)) => Outcome::Restored,
        Ok(Some(false)) => Outcome::Pinned,
        Ok(None) => Outcome::RuleGone(held.dropped()),
        Err(e) => Outcome::Failed(format!("{e:#}")),
    }
}

/// An aggregate ban (of a rule keyed `all` or `region`) with its rule by name, as read from
/// the rules' shared states before the rules changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldAggregate {
    pub rule: String,
    /// The rule's position when it was read.
    pub old_index: u8,
    pub kind: u8,
    /// The region code (`key = "region"`), zero for `all`.
    pub region: [u8; 2],
    pub until_ns: u64,
}

impl HeldAggregate {
    fn key(&self, index: u8) -> ClientKey {
        let mut key = ClientKey {
            rule: index,
            kind: self.kind,
            ..ClientKey::default()
        };
        key.addr[..2].copy_from_slice(&self.region);
        key
    }

    fn dropped(&self) -> Dropped {
        Dropped {
            rule: self.rule.clone(),
            key: crate::policy::report::key_name(self.kind),
            client: crate::policy::report::client_label(&self.key(0)),
        }
    }
}

/// Put `b` into the shared state of its rule (by name) in `rules`: `Some(true)` if put,
/// `Some(false)` if that state is already there (the kernel's copy is authoritative), `None`
/// if no rule of that name keyed that way bans any more.
fn insert_aggregate(
    maps: &mut Maps,
    rules: &[(String, RuleConfig)],
    b: &HeldAggregate,
) -> anyhow::Result<Option<bool>> {
    let Some(i) = rules
        .iter()
        .position(|(n, r)| *n == b.rule && r.key == b.kind && r.action == ACTION_BAN)
    else {
        return Ok(None);
    };
    let key = b.key(i as u8);
    if maps.clients.shared.get(&key, 0).is_ok() {
        return Ok(Some(false));
    }
    let state = SharedState {
        banned_until_ns: b.until_ns,
        ..SharedState::default()
    };
    maps.clients
        .shared
        .insert(key, state, 0)
        .with_context(|| format!("restoring the aggregate ban of rule {}", b.rule))?;
    Ok(Some(true))
}

/// Where each rule of `old` is in `new`, by name (rule names are unique): `None` if it is
/// gone.
pub fn rule_moves(old: &[String], new: &[String]) -> Vec<Option<u32>> {
    old.iter()
        .map(|n| new.iter().position(|m| m == n).map(|i| i as u32))
        .collect()
}

/// The aggregate bans in force in the rules' shared states, each with its rule's name in
/// `names` (the rules as the states were made).
pub fn aggregates_by_name(maps: &Maps, names: &[String], now: u64) -> Vec<HeldAggregate> {
    maps.clients
        .shared
        .iter()
        .filter_map(|r| r.ok())
        .filter(|(k, st)| (k.kind == KEY_ALL || k.kind == KEY_REGION) && st.banned_until_ns > now)
        .filter_map(|(k, st)| {
            Some(HeldAggregate {
                rule: names.get(k.rule as usize)?.clone(),
                old_index: k.rule,
                kind: k.kind,
                region: [k.addr[0], k.addr[1]],
                until_ns: st.banned_until_ns,
            })
        })
        .collect()
}

/// After the rules changed from `old` to `new` (by name) and the states of the positions that
/// changed were retired: the aggregate bans of `held` whose rule moved are put back at its
/// new position. Returns those whose rule is gone (or no longer bans by that key), lifted.
pub fn put_back_aggregates(
    maps: &mut Maps,
    rules: &[(String, RuleConfig)],
    held: &[HeldAggregate],
) -> Vec<Dropped> {
    let mut lifted = Vec::new();
    for h in held {
        if rules
            .get(h.old_index as usize)
            .is_some_and(|(n, _)| *n == h.rule)
        {
            continue; // the rule kept its position: its state was not retired
        }
        match insert_aggregate(maps, rules, h) {
            Ok(Some(_)) => {}
            Ok(None) => lifted.push(h.dropped()),
            Err(e) => tracing::warn!("{e:#}"),
        }
    }
    lifted
}

/// The bans of the ban tables after the rules changed from `old` to `new`: each rule ban is
/// made to name its rule's new position, and the bans of rules that are gone are lifted
/// (returned, for their `unban` events). Bans issued after `cut_ns` (when the new rules were
/// written) already name new positions and are left alone, as are the operator's.
pub fn follow_rules(maps: &mut Maps, old: &[String], new: &[String], cut_ns: u64) -> Vec<Dropped> {
    let moves = rule_moves(old, new);
    if moves.iter().enumerate().all(|(i, m)| *m == Some(i as u32)) {
        return Vec::new();
    }
    let mut lifted = Vec::new();
    let mut moved = 0usize;
    for b in maps.all_bans() {
        if b.rule == BAN_RULE_NONE || b.since_ns > cut_ns {
            continue;
        }
        let Some(&to) = moves.get(b.rule as usize) else {
            continue;
        };
        if to == Some(b.rule) {
            continue;
        }
        let table = ban_table(b.flags);
        let addr = ratelimit_common::addr::IpKey { addr: b.addr };
        // The program may have lifted it, and issued another at the same key, since the walk:
        // change only the entry seen.
        match maps.ban_at(table, b.prefix_len, &addr) {
            Some(now) if now.since_ns == b.since_ns && now.rule == b.rule => {}
            _ => continue,
        }
        let net = crate::policy::apply::net_of(b.prefix_len, &addr);
        let res = match to {
            Some(j) => maps
                .replace_ban_deferred(BanEntry { rule: j, ..b })
                .map(|_| moved += 1),
            None => maps.remove_ban(table, b.prefix_len, &addr).map(|gone| {
                if gone {
                    lifted.push(Dropped {
                        rule: old[b.rule as usize].clone(),
                        key: "ip",
                        client: net.to_string(),
                    });
                }
            }),
        };
        if let Err(e) = res {
            tracing::warn!("moving the ban of {net} to its rule's new position: {e}");
        }
    }
    if moved > 0 {
        tracing::info!(
            bans = moved,
            "rule bans follow their rules to their new positions"
        );
    }
    lifted
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// No ban file panics the reader or the daemon's check of its entries, and every
        /// entry accepted is a network without host bits.
        #[test]
        fn ban_files_never_panic(text in "([0-9a-fA-F.:/# \t\r]{0,45}\n){0,8}") {
            for e in file_entries(&text) {
                prop_assert!(!e.is_empty() && !e.contains('#') && !e.contains('\n'));
                if let Ok(net) = crate::config::parse_net(&e) {
                    prop_assert_eq!(net.trunc(), net);
                }
            }
        }

        /// Saved bans (a file from an older version, a clock that moved, a hand edit) never
        /// panic the reader or the conversion, and no expiry lands more than 10 years ahead.
        #[test]
        fn saved_bans_never_panic(ms in any::<u64>(), wall in any::<u64>(), mono in any::<u64>(), junk in ".{0,40}") {
            if let Some(ns) = mono_expiry(ms, wall, mono) {
                prop_assert!(ns >= mono.max(1));
                prop_assert!(ns - mono <= MAX_BAN_DURATION.as_nanos() as u64);
            }
            let text = format!(r#"[{{"cidr":"{}","expires_unix_ms":{ms},"manual":true,"preview":false}}]"#, junk.replace(['"', '\\'], ""));
            let _ = serde_json::from_str::<Vec<SavedBan>>(&text);
        }
    }

    /// A bans file is read entry by entry: a bad entry fails alone, with a label and the
    /// reason; only what is not a list at all is refused whole.
    #[test]
    fn a_bad_entry_fails_alone() {
        let good = r#"{"cidr": "198.19.1.0/24", "expires_unix_ms": null, "rule": null, "manual": true, "preview": false}"#;
        let all = parse_entries(format!("[{good}, {good}]").as_bytes()).unwrap();
        assert!(all.iter().all(Result::is_ok));
        let text = format!(r#"[{good}, {{"cidr": "198.19.2.0/24", "manual": "yes"}}, 7, {good}]"#);
        let mixed = parse_entries(text.as_bytes()).unwrap();
        assert_eq!(mixed.len(), 4);
        assert!(mixed[0].is_ok() && mixed[3].is_ok());
        let (label, why) = mixed[1].as_ref().unwrap_err();
        assert_eq!(label, "198.19.2.0/24");
        assert!(why.contains("expected a boolean"), "{why}");
        assert_eq!(mixed[2].as_ref().unwrap_err().0, "entry 3");
        for bad in [
            &b"[{\"cidr\":\"198.19.70.1/32\",\"expires_unix_ms\":17"[..],
            b"{}",
            b"",
        ] {
            assert!(parse_entries(bad).is_err());
        }
    }

    /// Rules are followed by name: a reordering moves each to its new position, a removed
    /// one has none.
    #[test]
    fn rules_are_followed_by_name() {
        let v = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            rule_moves(&v(&["a", "b", "all"]), &v(&["all", "b", "a"])),
            [Some(2), Some(1), Some(0)]
        );
        assert_eq!(
            rule_moves(&v(&["a", "b"]), &v(&["b", "c"])),
            [None, Some(0)]
        );
        assert_eq!(rule_moves(&v(&[]), &v(&["a"])), []);
    }

    /// A file written by the first versions (no `key`, `region` or `exceed_pass`; the rule by
    /// name already) still reads, and its bans mean what they meant.
    #[test]
    fn files_of_earlier_versions_still_load() {
        let text = r#"[
          {"cidr": "198.19.1.0/24", "expires_unix_ms": 1700000000000, "rule": "syn", "manual": false, "preview": false, "reason": null},
          {"cidr": "2001:db8::/48", "expires_unix_ms": null, "rule": null, "manual": true, "preview": false}
        ]"#;
        let list: Vec<SavedBan> = serde_json::from_str(text).unwrap();
        assert_eq!(list.len(), 2);
        assert_eq!(list[0].rule.as_deref(), Some("syn"));
        assert_eq!((list[0].key.as_deref(), list[0].exceed_pass), (None, false));
        assert!(list[1].manual && list[1].expires_unix_ms.is_none());
    }

    #[test]
    fn saved_expiries_convert_to_the_monotonic_clock_without_wrapping() {
        let hour_ms = 3_600_000;
        // An hour left after a reboot: an hour from the new boot's clock, whatever the old one.
        assert_eq!(
            mono_expiry(10 * hour_ms + hour_ms, 10 * hour_ms, 5_000),
            Some(5_000 + 3_600_000_000_000)
        );
        // Passed, or passing now: dropped.
        assert_eq!(mono_expiry(1_000, 2_000, 5_000), None);
        assert_eq!(mono_expiry(2_000, 2_000, 5_000), None);
        // The year 3000, and u64::MAX ms: held to 10 years (both wrapped before: 2^64 ns is
        // 584 years).
        let ten_years = MAX_BAN_DURATION.as_nanos() as u64;
        assert_eq!(
            mono_expiry(32_503_680_000_000, 1_700_000_000_000, 5_000),
            Some(5_000 + ten_years)
        );
        assert_eq!(mono_expiry(u64::MAX, 0, u64::MAX - 1), Some(u64::MAX));
    }
}
