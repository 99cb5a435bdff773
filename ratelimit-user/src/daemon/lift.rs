//! `ban del --rule`: the bans a rule holds in its keys' own states rather than in the ban
//! tables, lifted: the one ban of a rule keyed `all`, a region's of a rule keyed `region`,
//! every ban of a rule keyed by packet fields.

use anyhow::{Context as _, bail};
use ratelimit_common::{
    event::{EV_UNBAN, Event},
    maps::*,
};
use tracing::info;

use super::State;
use crate::{api::BanLifted, policy::report};

impl State {
    /// Lift the ban of a rule keyed `all` or `region` (one region's), or every ban of a rule
    /// keyed by packet fields (IP bans are removed by prefix). The meters start clean, as
    /// when a ban ends on its own; the totals stay. An `unban` event line says so for each,
    /// and the saved bans drop them.
    pub(super) fn ban_lift(
        &mut self,
        rule: &str,
        region: Option<&str>,
    ) -> anyhow::Result<BanLifted> {
        let rules = self.live_rules();
        let Some(i) = rules.iter().position(|(n, _)| n == rule) else {
            bail!(
                "no rule named {rule:?} (rules: {})",
                self.rule_names().join(", ")
            );
        };
        let r = rules[i].1;
        if r.key == KEY_IP {
            bail!(
                "rule {rule:?} is keyed ip: its bans are per client; remove one with `ratelimit ban del CIDR`"
            );
        }
        if r.action != ACTION_BAN {
            bail!("rule {rule:?} does not ban (its action is not rate_based_ban)");
        }
        if r.key == KEY_TUPLE {
            if region.is_some() {
                bail!(
                    "rule {rule:?} is keyed by packet fields: --region is for a rule keyed region"
                );
            }
            return self.lift_keyed(i as u8, rule);
        }
        let mut key = ClientKey {
            rule: i as u8,
            kind: r.key,
            ..ClientKey::default()
        };
        match (r.key, region) {
            (KEY_REGION, Some(cc)) => {
                let cc = cc.to_ascii_uppercase();
                match cc.as_bytes() {
                    &[x, y] if x.is_ascii_uppercase() && y.is_ascii_uppercase() => {
                        key.addr[0] = x;
                        key.addr[1] = y;
                    }
                    _ => bail!("--region {cc:?}: expected a two-letter region code, e.g. NL"),
                }
            }
            (KEY_REGION, None) => {
                bail!("rule {rule:?} is keyed region: say which region's ban with --region CC")
            }
            (_, Some(_)) => bail!("rule {rule:?} is keyed all: it has one ban, no --region"),
            (_, None) => {}
        }
        let now = crate::clock::mono_ns();
        let what = match region {
            Some(cc) => format!("rule {rule:?} in region {}", cc.to_ascii_uppercase()),
            None => format!("rule {rule:?}"),
        };
        let st = match self.maps.clients.shared.get(&key, 0) {
            Ok(st) if st.banned_until_ns > now => st,
            _ => bail!("no ban in force for {what}"),
        };
        let event = lift(&mut self.maps.clients.shared, key, st, now)
            .with_context(|| format!("lifting the ban of {what}"))?;
        self.events.operator(vec![event]);
        info!(%what, "aggregate ban lifted");
        self.bans_changed();
        Ok(BanLifted {
            lifted: 1,
            rule: rule.to_string(),
            key: report::Key::of(key.kind),
            region: region.map(|c| c.to_ascii_uppercase()),
        })
    }

    /// Lift every ban in force of rule `i` (named `rule`), keyed by packet fields.
    fn lift_keyed(&mut self, i: u8, rule: &str) -> anyhow::Result<BanLifted> {
        let now = crate::clock::mono_ns();
        let keyed = &mut self.maps.clients.keyed;
        let banned: Vec<(ClientKey, SharedState)> = keyed
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, s)| k.rule == i && s.banned_until_ns > now)
            .collect();
        if banned.is_empty() {
            bail!("no ban in force for rule {rule:?}");
        }
        let events: Vec<Event> = banned
            .into_iter()
            .filter_map(|(key, st)| lift(keyed, key, st, now).ok())
            .collect();
        let lifted = events.len() as u32;
        self.events.operator(events);
        info!(rule, lifted, "bans of a rule keyed by packet fields lifted");
        self.bans_changed();
        Ok(BanLifted {
            lifted,
            rule: rule.to_string(),
            key: report::Key::Fields,
            region: None,
        })
    }
}

/// Lift the ban held in `key`'s state `st` (as read from `map`) at `now`: its `unban` event.
/// The meters are clean already (the program clears them when it issues a ban, and a banned
/// key's packets are not metered). BPF_EXIST: a state removed in between (an expiry lifts a
/// ban too, a removal as idle holds none) is not written back.
fn lift(
    map: &mut aya::maps::HashMap<aya::maps::MapData, ClientKey, SharedState>,
    key: ClientKey,
    st: SharedState,
    now: u64,
) -> anyhow::Result<Event> {
    let lifted = SharedState {
        banned_until_ns: 0,
        ..st
    };
    map.insert(key, lifted, 2)?;
    Ok(unban_event(&key, now))
}

/// The `unban` event of a ban of `key`'s state that ended at `now` (lifted by the operator, or
/// found ended in a state removed as idle).
pub(super) fn unban_event(key: &ClientKey, now: u64) -> Event {
    Event {
        kind: EV_UNBAN,
        rule: u32::from(key.rule),
        key_kind: Event::key_kind_of(key),
        prefix_len: key.prefix_len,
        addr: key.addr,
        src: key.src,
        ts_ns: now,
        count: 0,
        threshold: 0,
        expires_ns: 0,
    }
}
