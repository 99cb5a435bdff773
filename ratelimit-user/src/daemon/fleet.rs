//! The owner's side of fleet mode: fleet bans applied, rule bans published, and the prefixes
//! lifted here remembered so that the fleet's records do not bring them back.

use std::{collections::BTreeMap, time::Duration};

use anyhow::Context as _;
use ratelimit_common::{
    addr::IpKey,
    event::{EV_BAN, EV_UNBAN},
    maps::*,
};
use tracing::{error, warn};

use super::{State, ban_event};
use crate::{
    config,
    durable::{self, Loaded, aside_words},
    events,
    policy::apply::prefix,
};

/// How many `ban del` times the daemon keeps for the fleet's records (see
/// [`State::fleet_lifts`]).
pub const FLEET_LIFTS_MAX: usize = 100_000;

/// [`State::fleet_lifts`] in `state_dir`, written at every `ban del` in fleet mode: a restart
/// that resyncs from the store's snapshot does not bring back a ban lifted here.
pub const FLEET_LIFTS_FILE: &str = "fleet-lifts.json";

/// The saved [`State::fleet_lifts`]: none if there is no file. A file that cannot be read is
/// moved aside, as for the other saved state.
pub(super) fn load_fleet_lifts(dir: &std::path::Path) -> BTreeMap<String, u64> {
    let path = dir.join(FLEET_LIFTS_FILE);
    match durable::load(&path, |b: &[u8]| {
        serde_json::from_slice::<BTreeMap<String, u64>>(b)
    }) {
        Loaded::Read(lifts) => lifts,
        Loaded::Missing => BTreeMap::new(),
        Loaded::Unreadable(e) => {
            error!(
                "reading {}: {e}; bans lifted here before may return",
                path.display()
            );
            BTreeMap::new()
        }
        Loaded::Bad { error: e, aside } => {
            error!(
                "{} is not a list of lifted bans ({e}); it was {}; bans lifted here before \
                 may return",
                path.display(),
                aside_words(&aside)
            );
            BTreeMap::new()
        }
    }
}

impl State {
    /// Publish the rule-issued bans the events reader saw (at these prefixes), each as the
    /// ban table holds it now: only bans that drop (a rule in preview, or with `exceed_action
    /// = pass`, bans nobody elsewhere).
    pub(super) fn publish_rule_bans(&mut self, seen: &[(u32, [u8; 16], u32)]) {
        let Some(f) = self.fleet.as_ref().filter(|f| f.settings.share_bans) else {
            return;
        };
        let names = self.rule_names();
        let now = crate::clock::mono_ns();
        let mut records = Vec::new();
        for &(plen, addr, rule) in seen {
            let key = IpKey { addr };
            let Some(b) = self.maps.ban_at(BAN_TABLE_RULE, plen, &key) else {
                continue;
            };
            if b.rule != rule || !ratelimit_common::limiter::ban_active(b.expires_ns, now) {
                continue;
            }
            let net = crate::policy::apply::net_of(plen, &key);
            records.push(f.record(
                crate::fleet::Op::Ban,
                net.to_string(),
                crate::fleet::unix_ms_of_mono(b.expires_ns),
                names.get(rule as usize).cloned(),
            ));
        }
        f.publish(records);
    }

    /// Apply what the fleet's reader received: other hosts' bans installed (in the
    /// remote bans' table, marked [`crate::fleet::BAN_REMOTE`], with their absolute end; where
    /// a ban is in force here already, the later end wins), their `unban`s lifting the bans at
    /// their prefix in the operator's table (never a ban this host's rules issued). The
    /// records come bounded and, with the fleet key, authenticated (`crate::fleet::trust`).
    /// Nothing applied here is published again.
    pub fn apply_fleet(
        &mut self,
        rx: crate::fleet::Received,
    ) -> anyhow::Result<crate::fleet::Applied> {
        use crate::fleet::{BAN_REMOTE, Op, Received};
        // A snapshot's tombstones lift only the fleet's bans (see `Received::Snapshot`).
        let (records, snapshot) = match rx {
            Received::Records(r) => (r, false),
            Received::Snapshot(r) => (r, true),
        };
        let mut applied = crate::fleet::Applied::default();
        let now = crate::clock::mono_ns();
        // The event lines of what was applied, with the issuing host as `origin`, so whoever
        // follows this host's events sees every ban of the fleet.
        let mut lines = Vec::new();
        let mut time = |ns: u64| {
            crate::clock::rfc3339(
                std::time::UNIX_EPOCH
                    + Duration::from_millis(crate::fleet::unix_ms_of_mono(ns.max(1))),
            )
        };
        let mut line = |kind: u32, entry: &BanEntry, r: &crate::fleet::Record| {
            let mut l = events::line_with(&ban_event(kind, entry, now), &[], &mut time);
            l.rule = r.rule.clone().unwrap_or_default();
            l.origin = Some(r.host.clone());
            l
        };
        for r in &records {
            let Ok(net) = config::parse_net(&r.net) else {
                warn!(net = %r.net, host = %r.host, "a fleet record with a bad prefix was skipped");
                applied.skipped += 1;
                continue;
            };
            let (plen, key) = prefix(&net);
            let cidr = net.to_string();
            match r.op {
                Op::Ban => {
                    let Some(exp) = crate::fleet::mono_of_unix_ms(r.exp_ms) else {
                        applied.skipped += 1;
                        continue;
                    };
                    // Lifted here after it was issued: the later word stands.
                    if self.fleet_lifts.get(&cidr).is_some_and(|&at| at >= r.at_ms) {
                        applied.skipped += 1;
                        continue;
                    }
                    if let Some(e) = self.maps.remote_ban_at(plen, &key)
                        && ratelimit_common::limiter::ban_active(e.expires_ns, now)
                        && (e.expires_ns == 0 || (exp != 0 && e.expires_ns >= exp))
                    {
                        applied.skipped += 1;
                        continue;
                    }
                    let entry = BanEntry {
                        flags: BAN_MANUAL | BAN_REMOTE,
                        ..BanEntry::manual(plen, key.addr, now, exp)
                    };
                    if let Err(e) = self.maps.replace_ban_deferred(entry) {
                        warn!(%net, host = %r.host, "installing a fleet ban failed: {e}");
                        applied.skipped += 1;
                        continue;
                    }
                    if exp != 0 {
                        self.next_ban_expiry = self.next_ban_expiry.min(exp);
                    }
                    lines.push(line(EV_BAN, &entry, r));
                    let mut notes = self.ban_notes.write();
                    notes.origins.insert(cidr.clone(), r.host.clone());
                    notes.set_reason(&cidr, r.reason.as_deref());
                    applied.bans += 1;
                }
                Op::Unban => {
                    for entry in self.maps.bans_at(plen, &key) {
                        // Never a ban this host's rules issued (SPEC, "Trust boundaries"):
                        // only the fleet's copies (in the remote bans' table, or spilled into
                        // the rules' when it was full) and this host's operator bans (`ban
                        // del` lifts everywhere); a snapshot's tombstone, only the fleet's
                        // copies.
                        let fleet_copy = entry.flags & BAN_REMOTE != 0;
                        let operators = ban_table(entry.flags) == BAN_TABLE_OPERATOR;
                        if !(fleet_copy || (operators && !snapshot)) {
                            continue;
                        }
                        if let Ok(true) = self.maps.remove_ban(ban_table(entry.flags), plen, &key) {
                            applied.unbans += 1;
                            lines.push(line(EV_UNBAN, &entry, r));
                        }
                    }
                    self.forget_ban_notes(&cidr);
                }
            }
        }
        self.maps
            .flush_ban_epoch()
            .context("voiding the program's fast-drop entries")?;
        self.events.fleet_lines(lines);
        if applied.bans + applied.unbans > 0 {
            self.bans_changed();
            self.reports.changed();
        }
        Ok(applied)
    }
}
