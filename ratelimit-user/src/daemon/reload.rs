//! `ratelimit reload` and SIGHUP: the config read again and applied, the rules' slots
//! retired by name, the interfaces attached, detached or re-created.

use std::{sync::Arc, time::Duration};

use anyhow::{Context as _, bail};
use ratelimit_common::maps::*;
use tracing::{error, info, warn};

use super::{Handle, State};
use crate::{
    api::Reloaded,
    config::{self, Config},
    events,
    kernel::datapath::{Attached, Maps},
    policy::apply,
    policy::bans,
    policy::pressure,
};

impl State {
    pub(super) fn ifaces(&self) -> Vec<(u32, String)> {
        self.dp.counter_slots()
    }

    pub(super) fn interfaces_wanted(&self) -> Vec<String> {
        interfaces_wanted(&self.cfg, &self.opts_ifaces)
    }

    /// Re-read the config file and apply it whole, or not at all. Everything that can fail
    /// is prepared first (the config read and checked, the GeoIP database read, each new
    /// interface found and its entry point chosen, a new events file opened); then the new
    /// interfaces are attached and the maps written. If an attach or a map write still fails,
    /// what this reload did is undone (the interfaces it attached detached, the old config's
    /// maps written again) and the old config keeps running; the error names what failed.
    pub fn reload(&mut self) -> anyhow::Result<Reloaded> {
        let Some(path) = self.config_path.clone() else {
            bail!("the daemon was started without --config; nothing to reload");
        };
        const REJECTED: &str = "reload rejected, the running config is unchanged";
        let file = config::load(&path).map_err(|e| anyhow::anyhow!("{REJECTED}:\n{e}"))?;
        // The live changes that still fit the new file, applied on top of it.
        let resolved = self.live.resolve(file);
        let cfg = resolved.config.clone();
        if cfg.tracking.max_sources != self.cfg.tracking.max_sources {
            warn!(
                "tracking.max_sources changes take effect after `ratelimit detach` and a restart"
            );
        }
        if cfg.fleet != self.cfg.fleet {
            warn!("[fleet] changes take effect after a restart of the daemon");
        }
        // Prepare: nothing below touches a map or an interface.
        let regions = match &cfg.geoip {
            Some(g) => Some(crate::policy::geoip::load(&g.database).context(REJECTED)?),
            None => None,
        };
        let wanted = interfaces_wanted(&cfg, &self.opts_ifaces);
        let mut to_attach = Vec::new();
        for iface in &wanted {
            // Not attached yet, or re-created since (a new ifindex under the same name).
            let current = crate::kernel::datapath::ifindex(iface)
                .with_context(|| format!("{REJECTED}: interface {iface}"))?;
            crate::kernel::datapath::Entry::for_iface(iface)
                .with_context(|| format!("{REJECTED}: interface {iface}"))?;
            if !self
                .dp
                .attached
                .iter()
                .any(|a| &a.iface == iface && a.ifindex == current)
            {
                to_attach.push(iface.clone());
            }
        }
        let new_output = if cfg.daemon.events != self.cfg.daemon.events {
            Some(
                events::Output::open(cfg.daemon.events.as_ref())
                    .with_context(|| format!("{REJECTED}: the events sink"))?,
            )
        } else {
            None
        };
        let plan = apply::plan(&cfg, self.preview_all);
        let mode = self.xdp_mode_override.unwrap_or(cfg.daemon.xdp_mode);

        // Attach: the interfaces new to this config, judged by the running config's maps until
        // the maps are written below. One that fails undoes the others.
        let mut attached_now = Vec::new();
        for iface in &to_attach {
            let was = self.dp.attached.iter().find(|a| &a.iface == iface).cloned();
            match self.dp.attach(iface, mode, &mut self.maps) {
                Ok(_) => attached_now.push((iface.clone(), was)),
                Err(e) => {
                    self.undo_attach(attached_now);
                    return Err(e.context(format!("{REJECTED}: attaching to {iface}")));
                }
            }
        }

        // Commit the maps. A write that fails midway is undone by writing the old config's
        // maps again.
        let old_names = self.rule_names();
        let held = bans::aggregates_by_name(&self.maps, &old_names, crate::clock::mono_ns());
        // Bans issued from here on name the new rules' positions.
        let cut = crate::clock::mono_ns();
        let applied = apply::apply(&mut self.maps, &plan).and_then(|()| match &regions {
            Some(table) => crate::policy::geoip::apply(&mut self.maps.regions, table).map(drop),
            None => Ok(()),
        });
        if let Err(e) = applied {
            let old_plan = apply::plan(&self.cfg, self.preview_all);
            if let Err(undo) = apply::apply(&mut self.maps, &old_plan) {
                error!("writing the running config's maps again failed: {undo:#}");
            }
            self.undo_attach(attached_now);
            return Err(e.context(format!("{REJECTED}: writing the maps")));
        }
        let new_names: Vec<String> = cfg.rules.iter().map(|r| r.name.clone()).collect();
        let new_rules = config_rules(&cfg);
        let lifted = rules_changed(
            &mut self.maps,
            &old_names,
            &new_names,
            &new_rules,
            &held,
            cut,
        );
        save_rule_names(&cfg.daemon.state_dir, &new_names);
        self.events.set_rule_names(new_names);
        let dropped = resolved.dropped.clone();
        self.cfg = self.live.commit(resolved, Vec::new());
        self.pressure
            .set_marks(pressure::Marks::of(&self.cfg.pressure));
        match new_output {
            Some(out) => self.events.replace(out),
            None => self.events.reopen(),
        }
        self.events.set_per_sec(self.cfg.daemon.events_per_sec);
        self.write_dropped(&lifted);
        info!(config = %path.display(), "config reloaded");
        Ok(Reloaded {
            reloaded: path.display().to_string(),
            rules: self.rule_names(),
            live_changes_dropped: dropped,
        })
    }

    /// Detach what a failed reload attached (and take back over what it replaced).
    pub(super) fn undo_attach(&mut self, attached_now: Vec<(String, Option<Attached>)>) {
        for (iface, was) in attached_now.into_iter().rev() {
            if let Err(e) = self.dp.detach_iface(&iface) {
                error!("undoing the attach to {iface}: {e:#}");
            }
            if let Some(was) = was {
                self.dp.attached.push(was);
            }
        }
    }
}

/// Per-client state and per-rule counters are kept by rule *position*. When the rule at a
/// position changes (a reload reordered, removed or renamed rules, or a restart brought a
/// different config), that position's state and counters are cleared, so a rule never
/// inherits another's counts or bans. Unchanged positions keep theirs.
pub fn retire_rule_slots(maps: &mut Maps, old: &[String], new: &[String]) -> usize {
    let stale: Vec<u8> = (0..old.len().max(new.len()))
        .filter(|&i| old.get(i) != new.get(i) && i < ratelimit_common::caps::MAX_RULES as usize)
        .map(|i| i as u8)
        .collect();
    if stale.is_empty() {
        return 0;
    }
    let retired = match maps.clients.retire_rules(&stale) {
        Ok(n) => n as usize,
        Err(e) => {
            warn!("retiring the states of changed rule positions: {e:#}");
            0
        }
    };
    for &r in &stale {
        let _ = maps.overflow.set(r as u32, ClientState::default(), 0);
        // Its pending totals and closed tick go with it.
        if let Ok(ncpu) = aya::util::nr_cpus()
            && let Ok(zero) = aya::maps::PerCpuValues::try_from(vec![FastEntry::default(); ncpu])
        {
            let _ = maps.ovf_tick.set(r as u32, zero, 0);
        }
    }
    // Fast-drop entries of those rules: their pending per-client counts go with the clients.
    // (A read-modify-write of each CPU's entry: a packet the program counts into another
    // entry of the same slot between the read and the write may lose up to one tick's
    // pending count, only at this rare moment.)
    for i in 0..FAST_ENTRIES {
        let Ok(per_cpu) = maps.fast.get(&i, 0) else {
            continue;
        };
        if !per_cpu
            .iter()
            .any(|e| e.jiffies != 0 && stale.contains(&e.rule))
        {
            continue;
        }
        let cleared: Vec<FastEntry> = per_cpu
            .iter()
            .map(|e| {
                if stale.contains(&e.rule) {
                    FastEntry::default()
                } else {
                    *e
                }
            })
            .collect();
        if let Ok(values) = aya::maps::PerCpuValues::try_from(cleared) {
            let _ = maps.fast.set(i, values, 0);
        }
    }
    if let Ok(ncpu) = aya::util::nr_cpus() {
        for &r in &stale {
            for slot in 0..ratelimit_common::caps::MAX_IFACES {
                for c in 0..ratelimit_common::stats::rule::COUNT {
                    let idx = ratelimit_common::stats::rule_index(slot, r as u32, c);
                    if let Ok(zero) = aya::maps::PerCpuValues::try_from(
                        vec![ratelimit_common::stats::Counter::default(); ncpu],
                    ) {
                        let _ = maps.stats.set(idx, zero, 0);
                    }
                }
            }
        }
    }
    info!(positions = ?stale, states = retired, "rules changed position: their per-client state and counters were cleared");
    retired
}

/// After the rule list changed from `old` to `new` (a reload, or a start that adopted the
/// maps of a daemon that ran other rules), with the new rules written at `cut`: the state of
/// the positions that changed is retired, every ban keeps its rule by name (`held`: the
/// aggregate bans read before, put back at their rule's new position), and the bans of rules
/// that are gone are lifted, as their counters are. Returns the lifted bans, for their
/// `unban` events.
pub(super) fn rules_changed(
    maps: &mut Maps,
    old: &[String],
    new: &[String],
    rules: &[(String, RuleConfig)],
    held: &[bans::HeldAggregate],
    cut: u64,
) -> Vec<bans::Dropped> {
    retire_rule_slots(maps, old, new);
    let mut lifted = bans::follow_rules(maps, old, new, cut);
    lifted.extend(bans::put_back_aggregates(maps, rules, held));
    if let Err(e) = maps.flush_ban_epoch() {
        warn!("voiding the program's fast-drop entries: {e}");
    }
    if !lifted.is_empty() {
        let mut gone: Vec<&str> = lifted.iter().map(|d| d.rule.as_str()).collect();
        gone.sort_unstable();
        gone.dedup();
        info!(bans = lifted.len(), rules = ?gone, "rules removed: their bans were lifted");
    }
    lifted
}

/// The rules as a config (live changes applied) writes them into the data plane.
pub(super) fn config_rules(cfg: &Config) -> Vec<(String, RuleConfig)> {
    let reads = crate::policy::matching::payload_reads(&cfg.rules);
    cfg.rules
        .iter()
        .map(|r| (r.name.clone(), apply::rule_config(r, &reads)))
        .collect()
}

pub(super) const RULES_FILE: &str = "rules.json";

pub(super) fn load_rule_names(dir: &std::path::Path) -> Option<Vec<String>> {
    serde_json::from_slice(&std::fs::read(dir.join(RULES_FILE)).ok()?).ok()
}

/// Record the rule names by position, so a later start that adopts the pinned maps knows
/// which rule each position held. A failure is logged: that start would then keep every
/// position's state, as if no rule had moved.
pub(super) fn save_rule_names(dir: &std::path::Path, names: &[String]) {
    let bytes = serde_json::to_vec(names).unwrap_or_default();
    if let Err(e) = crate::durable::write_atomically(dir, RULES_FILE, &bytes) {
        warn!("recording the rule names: {e:#}");
    }
}

/// Fill the region map from the config's GeoIP database, if any.
pub(super) fn load_regions(cfg: &Config, maps: &mut Maps) -> anyhow::Result<()> {
    if let Some(g) = &cfg.geoip {
        let table = crate::policy::geoip::load(&g.database)?;
        let n = crate::policy::geoip::apply(&mut maps.regions, &table)?;
        info!(prefixes = n, database = %g.database.display(), kind = %table.database_type, "GeoIP regions loaded");
    }
    Ok(())
}

/// The config's interfaces, then those of `--iface` it does not name.
pub(super) fn interfaces_wanted(cfg: &Config, extra: &[String]) -> Vec<String> {
    let mut v = cfg.daemon.interfaces.clone();
    for i in extra {
        if !v.contains(i) {
            v.push(i.clone());
        }
    }
    v
}

/// How often the daemon looks for a protected interface re-created under its name.
pub const IFACE_WATCH_PERIOD: Duration = Duration::from_secs(2);

/// Interfaces come and go (a wireguard or VPN interface restarted, a tunnel re-created, a
/// container's veth): when the name of an interface the daemon protects now belongs to another
/// device, attach to it, without waiting for a reload. Until then the new device is
/// unprotected; at most one period. An attach that fails is logged once per device, not once
/// per period.
pub(super) async fn watch_interfaces(handle: Handle) -> anyhow::Result<()> {
    let mut tick = tokio::time::interval(IFACE_WATCH_PERIOD);
    let failed: Arc<std::sync::Mutex<Vec<(String, u32)>>> = Arc::default();
    loop {
        tick.tick().await;
        let failed = failed.clone();
        handle
            .with(move |s| {
                let mut failed = failed.lock().unwrap_or_else(|e| e.into_inner());
                let wanted = s.interfaces_wanted();
                let recreated: Vec<(String, u32)> =
                    s.dp.attached
                        .iter()
                        .filter(|a| wanted.contains(&a.iface))
                        .filter_map(|a| match crate::kernel::datapath::ifindex(&a.iface) {
                            Ok(i) if i != a.ifindex => Some((a.iface.clone(), i)),
                            _ => None,
                        })
                        .filter(|k| !failed.contains(k))
                        .collect();
                let mode = s.xdp_mode_override.unwrap_or(s.cfg.daemon.xdp_mode);
                for (iface, ifindex) in recreated {
                    match s.dp.attach(&iface, mode, &mut s.maps) {
                        Ok(_) => info!(
                            iface,
                            ifindex, "{iface} was re-created: attached to the new device"
                        ),
                        Err(e) => {
                            error!(
                                "{iface} was re-created (ifindex {ifindex}) and attaching to it \
                                 failed, so it is unprotected: {e:#}; fix it and run `ratelimit \
                                 reload`"
                            );
                            failed.push((iface, ifindex));
                        }
                    }
                }
            })
            .await?;
    }
}
