//! Bans on disk: every active ban (operator's and rule-issued, the aggregate bans of rules keyed
//! by `all` or `region` included) is saved to `state_dir/bans.json` with its wall-clock expiry,
//! written atomically and durably ([`crate::durable`]), so bans survive a reboot, when the
//! pinned maps are gone. On start, bans missing from the
//! map are restored with their remaining time; expired ones are dropped.

use std::{
    collections::BTreeMap,
    path::Path,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use ratelimit_common::maps::*;
use serde::{Deserialize, Serialize};

use crate::{
    apply::prefix,
    config::MAX_BAN_DURATION,
    datapath::Maps,
    report::{mono_ns, wall_of},
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
    reasons: &BTreeMap<String, String>,
) -> anyhow::Result<()> {
    let rule_names: Vec<String> = rules.iter().map(|(n, _)| n.clone()).collect();
    let mut list: Vec<SavedBan> = crate::report::active_bans(maps)
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
                cidr,
                key: None,
                region: None,
            }
        })
        .collect();
    // Aggregate bans (rules keyed by all or region) live in the rules' shared states.
    for b in crate::report::aggregate_bans(maps, rules, mono_ns()) {
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
        });
    }
    crate::durable::write_atomically(dir, FILE, &serde_json::to_vec_pretty(&list)?)
        .with_context(|| format!("saving bans to {}", dir.join(FILE).display()))
}

pub struct Restored {
    pub restored: usize,
    pub reasons: BTreeMap<String, String>,
}

pub fn restore(
    dir: &Path,
    maps: &mut Maps,
    rules: &[(String, RuleConfig)],
) -> anyhow::Result<Restored> {
    let restored = restore_all(dir, maps, rules);
    // Whatever was inserted, before any error is reported.
    maps.flush_ban_epoch()
        .context("voiding the program's fast-drop entries")?;
    restored
}

fn restore_all(
    dir: &Path,
    maps: &mut Maps,
    rules: &[(String, RuleConfig)],
) -> anyhow::Result<Restored> {
    let rule_names: Vec<String> = rules.iter().map(|(n, _)| n.clone()).collect();
    let path = dir.join(FILE);
    let mut out = Restored {
        restored: 0,
        reasons: BTreeMap::new(),
    };
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let list: Vec<SavedBan> = match serde_json::from_slice(&text) {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!("ignoring unreadable {}: {e}", path.display());
            return Ok(out);
        }
    };
    let now_wall = unix_ms(SystemTime::now());
    let now = mono_ns();
    for b in list {
        if b.key.is_some() {
            if restore_aggregate(maps, rules, &b, now_wall, now)? {
                out.restored += 1;
            }
            continue;
        }
        let Ok(net) = b.cidr.parse::<ipnet::IpNet>() else {
            continue;
        };
        if let Some(r) = &b.reason {
            out.reasons.insert(b.cidr.clone(), r.clone());
        }
        let expires_ns = match b.expires_unix_ms {
            None => 0,
            Some(ms) => match mono_expiry(ms, now_wall, now) {
                Some(ns) => ns,
                None => continue,
            },
        };
        let (plen, key) = prefix(&net);
        let rule = b
            .rule
            .as_ref()
            .and_then(|n| rule_names.iter().position(|r| r == n))
            .map(|i| i as u32)
            .unwrap_or(BAN_RULE_NONE);
        let mut flags = 0;
        if b.manual {
            flags |= BAN_MANUAL;
        }
        if b.preview {
            flags |= BAN_PREVIEW;
        }
        if b.exceed_pass {
            flags |= BAN_EXCEED_PASS;
        }
        if maps.ban_at(ban_table(flags), plen, &key).is_some() {
            continue; // still pinned: the kernel's copy is authoritative
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
        maps.insert_ban_deferred(entry)
            .with_context(|| format!("restoring ban {net}"))?;
        out.restored += 1;
    }
    Ok(out)
}

/// An aggregate ban back into its rule's shared state, if the rule (by name) still has that
/// key and bans, the ban has time left and the state is not already there (still pinned: the
/// kernel's copy is authoritative). True if restored.
fn restore_aggregate(
    maps: &mut Maps,
    rules: &[(String, RuleConfig)],
    b: &SavedBan,
    now_wall: u64,
    now: u64,
) -> anyhow::Result<bool> {
    let kind = match b.key.as_deref() {
        Some("all") => KEY_ALL,
        Some("region") => KEY_REGION,
        _ => return Ok(false),
    };
    let Some(banned_until_ns) = b
        .expires_unix_ms
        .and_then(|ms| mono_expiry(ms, now_wall, now))
    else {
        return Ok(false);
    };
    let Some(i) = rules
        .iter()
        .position(|(n, r)| Some(n) == b.rule.as_ref() && r.key == kind && r.action == ACTION_BAN)
    else {
        return Ok(false);
    };
    let mut key = ClientKey {
        rule: i as u8,
        kind,
        ..ClientKey::default()
    };
    if kind == KEY_REGION {
        match b.region.as_deref().map(str::as_bytes) {
            Some(&[x, y]) if x.is_ascii_uppercase() && y.is_ascii_uppercase() => {
                key.addr[0] = x;
                key.addr[1] = y;
            }
            _ => return Ok(false),
        }
    }
    if maps.clients.shared.get(&key, 0).is_ok() {
        return Ok(false);
    }
    let state = SharedState {
        banned_until_ns,
        ..SharedState::default()
    };
    maps.clients
        .shared
        .insert(key, state, 0)
        .with_context(|| format!("restoring the aggregate ban of rule {}", rules[i].0))?;
    Ok(true)
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
                if let Ok(net) = crate::daemon::parse_cidr(&e) {
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
