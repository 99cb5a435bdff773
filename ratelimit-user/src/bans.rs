//! Bans on disk: every active ban (operator's and rule-issued, the aggregate bans of rules keyed
//! by `all` or `region` included) is saved to
//! `state_dir/bans.json` with its wall-clock expiry, written atomically (temp file + rename),
//! so bans survive a reboot, when the pinned maps are gone. On start, bans missing from the
//! map are restored with their remaining time; expired ones are dropped.

use std::{
    collections::BTreeMap,
    io::Write as _,
    path::Path,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use ratelimit_common::maps::*;
use serde::{Deserialize, Serialize};

use crate::{
    apply::prefix,
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
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(format!(".{FILE}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&serde_json::to_vec_pretty(&list)?)?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join(FILE))?;
    Ok(())
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
            Some(ms) if ms <= now_wall => continue,
            Some(ms) => now + Duration::from_millis(ms - now_wall).as_nanos() as u64,
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
    let Some(ms) = b.expires_unix_ms.filter(|&ms| ms > now_wall) else {
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
        banned_until_ns: now + Duration::from_millis(ms - now_wall).as_nanos() as u64,
        ..SharedState::default()
    };
    maps.clients
        .shared
        .insert(key, state, 0)
        .with_context(|| format!("restoring the aggregate ban of rule {}", rules[i].0))?;
    Ok(true)
}
