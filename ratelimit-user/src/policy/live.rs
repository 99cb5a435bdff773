//! Live changes: what `ratelimit rule set` and `ratelimit override add|del` change in a running
//! daemon, kept by rule name in `state_dir/live.json` and applied on top of the config file at
//! every start and after every reload.
//!
//! The config file stays what it says; the live changes are a layer over it ([`Changes`]): per
//! rule, the fields `rule set` gave ([`RuleChanges`]), and per (rule, CIDR or region), the
//! overrides `override add` gave ([`OverrideSpec`]), both in their command-line spelling and
//! checked by the config's own parsers. What the data plane holds is always the config with the
//! layer applied ([`resolve`]), written by the same plan as a config ([`crate::policy::apply`]): rules
//! keep their positions and per-client state is not touched, so no counter is reset. A live
//! override at the key of one of the config's replaces it while it exists; `override del`
//! brings the config's back, and `rule reset` the config's rule.
//!
//! A saved change that no longer fits after a reload or at a start (its rule is gone, or the
//! rule's key, unit, algorithm or action no longer takes it, or the override map is full) is
//! dropped with a warning naming it, counted in `status` (`live_changes`), and left out of the
//! file, of which a copy is kept first. A file that cannot be read as live changes is moved
//! aside, never overwritten (as `bans.json` is, see [`crate::policy::bans`]).

use std::path::PathBuf;

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};
use tracing::{error, info, warn};

use crate::{
    config::{self, Action, Algorithm, Config, Override},
    kernel::datapath::Maps,
    policy::apply,
    policy::ruleset::{self, RuleChanges},
};

mod overrides;
mod saved;

pub use overrides::{OverrideAt, OverrideSpec, check, threshold_now};
pub use saved::{Changes, Resolved, resolve};

use overrides::Slot;
use saved::read;

/// The live changes' file in `state_dir`.
pub const FILE: &str = "live.json";

/// How many dropped changes `status` lists one by one (the count covers them all).
const LISTED_DROPS: usize = 20;

/// Where the values in force come from: the config file, or a live change over it.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Config,
    Live,
}

/// What became of the live changes: in `status` (`live_changes`) and the log.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// The file they are saved in.
    pub file: String,
    /// Rules with `rule set` changes in force.
    pub rules_changed: usize,
    /// Live overrides in force.
    pub overrides: usize,
    /// Saved changes dropped since the start, because their rule is gone or no longer takes
    /// them (at the start or at a reload), or because the file held an entry that is not one.
    pub dropped: u64,
    /// The first of them, each with why.
    pub drops: Vec<String>,
    /// Where a file that could not be read as live changes was moved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub set_aside: Option<String>,
    /// A copy of the file as it was before dropped changes were left out of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_copy: Option<String>,
    /// Set while the file found at the start can neither be read nor moved aside: no live
    /// change is accepted (it could not be saved) until it is moved away.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub save_refused: Option<String>,
}

/// The live changes of a running daemon, with the config file they apply to.
#[derive(Debug)]
pub struct Live {
    /// The config file as loaded: what `override del` and `rule reset` return to.
    file: Config,
    changes: Changes,
    pub report: Report,
}

/// Answer to `rule set` and `rule reset`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RuleChanged {
    pub rule: String,
    /// The rule's position (evaluation order).
    pub index: usize,
    /// The rule's live changes now (absent: the rule is as the config says).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live: Option<RuleChanges>,
}

/// Answer to `override add`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct OverrideAdded {
    /// The override now in force, in its canonical spelling.
    #[serde(rename = "override")]
    pub added: OverrideSpec,
    /// What it replaced at the same key, if anything: a live override, or the config's (in
    /// force again after `override del`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaced: Option<Source>,
}

/// Answer to `override del`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct OverrideRemoved {
    /// The live override removed.
    pub removed: OverrideSpec,
    /// The config's override at the same key, in force again; absent: the rule's own values
    /// apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restored: Option<OverrideSpec>,
}

/// One override in force, for `ratelimit overrides`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct OverrideEntry {
    #[serde(flatten)]
    pub values: OverrideSpec,
    pub source: Source,
    /// A live override that replaces one of the config's (which `override del` brings back).
    #[serde(default)]
    pub replaces_config: bool,
}

/// One rule with its values in force, for `ratelimit rules`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct RuleEntry {
    pub name: String,
    /// What the rule matches, as the TOML inline table of its `match` (`{}`: every packet).
    #[serde(rename = "match", default)]
    pub matcher: String,
    /// The rule's `except`: source networks it never matches.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub except: Vec<String>,
    pub key: String,
    pub action: String,
    pub algorithm: String,
    pub threshold: String,
    /// A token bucket's capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ban_threshold: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ban_duration: Option<String>,
    /// `elastic = F`, if the rule has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elastic: Option<f64>,
    /// The threshold in force now: the threshold times `elastic` while the pressure level is
    /// low, the threshold itself while it is high (or without elastic).
    #[serde(default)]
    pub threshold_now: String,
    pub exceed_action: String,
    pub preview: bool,
    pub soft_limit: f64,
    /// Overrides in force (`ratelimit overrides` lists them).
    pub overrides: usize,
    /// `live` when `rule set` changed it (`rule reset` returns it to the config's values).
    pub source: Source,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live: Option<RuleChanges>,
}

impl Live {
    /// At the start: the changes saved in the config's `state_dir`, applied to `file`. Returns
    /// them with the config the data plane is to hold. Whatever the file holds, the daemon
    /// starts: see [`Report`] for what becomes of changes that cannot be applied.
    pub fn load(file: Config) -> (Live, Config) {
        let path = file.daemon.state_dir.join(FILE);
        let mut report = Report {
            file: path.display().to_string(),
            ..Report::default()
        };
        let (changes, unreadable) = read(&path, &mut report);
        let mut live = Live {
            file: file.clone(),
            changes: Changes::default(),
            report,
        };
        let resolved = resolve(file, &changes);
        let n = resolved.kept.rules.len() + resolved.kept.overrides.len();
        let config = live.commit(resolved, unreadable);
        if n > 0 {
            info!(
                rules = live.report.rules_changed,
                overrides = live.report.overrides,
                "live changes restored from {}",
                path.display()
            );
        }
        (live, config)
    }

    /// For a reload: the new config file with the live changes that still fit it. Nothing is
    /// written; [`Live::commit`] takes the result once the maps hold it.
    pub fn resolve(&self, file: Config) -> Resolved {
        resolve(file, &self.changes)
    }

    /// Make `resolved` current (the maps hold its config): the changes that no longer fit are
    /// dropped, each in a warning, and left out of the saved file (a copy of which is kept
    /// first). `unreadable` names entries of the file that were not changes. Returns the
    /// config in force.
    pub fn commit(&mut self, resolved: Resolved, unreadable: Vec<String>) -> Config {
        let Resolved {
            file,
            config,
            kept,
            dropped,
        } = resolved;
        let dropped: Vec<String> = unreadable.into_iter().chain(dropped).collect();
        self.file = file;
        self.changes = kept;
        self.counts();
        if dropped.is_empty() {
            return config;
        }
        for d in &dropped {
            warn!("{d}; it was dropped");
            if self.report.drops.len() < LISTED_DROPS {
                self.report.drops.push(d.clone());
            }
        }
        self.report.dropped += dropped.len() as u64;
        let path = self.path();
        if self.report.save_refused.is_none() && path.exists() {
            match crate::durable::keep_copy(&path, "dropped") {
                Ok(to) => {
                    warn!(
                        "{} live change(s) dropped; {} as it was is kept as {}",
                        dropped.len(),
                        path.display(),
                        to.display()
                    );
                    self.report.kept_copy = Some(to.display().to_string());
                }
                Err(e) => warn!("keeping a copy of {}: {e:#}", path.display()),
            }
            let changes = self.changes.clone();
            if let Err(e) = self.save(&changes) {
                error!("{e:#}");
            }
        }
        config
    }

    fn path(&self) -> PathBuf {
        self.file.daemon.state_dir.join(FILE)
    }

    fn counts(&mut self) {
        self.report.rules_changed = self.changes.rules.len();
        self.report.overrides = self.changes.overrides.len();
    }

    /// Write `changes` as the saved live changes, durably. Refused while the file found at the
    /// start can neither be read nor moved aside, as long as it is there.
    fn save(&mut self, changes: &Changes) -> anyhow::Result<()> {
        let path = self.path();
        if let Some(why) = &self.report.save_refused {
            if path.exists() {
                bail!("live changes cannot be saved: {why}");
            }
            info!(
                "{} was moved away: saving live changes again",
                path.display()
            );
            self.report.save_refused = None;
        }
        let dir = &self.file.daemon.state_dir;
        if changes.is_empty() && !path.exists() {
            return Ok(());
        }
        crate::durable::write_atomically(dir, FILE, &serde_json::to_vec_pretty(changes)?)
            .with_context(|| format!("saving live changes to {}", path.display()))
    }

    /// Make `changes` the live changes, all or nothing: applied to the config file whole (a
    /// change that does not fit is an error), written into the maps, saved. If the maps or the
    /// file cannot be written, the maps are put back as they were (`running`).
    fn change(
        &mut self,
        maps: &mut Maps,
        running: &mut Config,
        preview_all: bool,
        changes: Changes,
    ) -> anyhow::Result<()> {
        let resolved = resolve(self.file.clone(), &changes);
        if !resolved.dropped.is_empty() {
            bail!("{}; nothing was changed", resolved.dropped.join("; "));
        }
        if let Some(why) = &self.report.save_refused
            && self.path().exists()
        {
            bail!("live changes cannot be saved: {why}; nothing was changed");
        }
        let put_back = |maps: &mut Maps| {
            if let Err(e) = apply::apply(maps, &apply::plan(running, preview_all)) {
                error!("putting the maps back after a failed live change: {e:#}");
            }
        };
        if let Err(e) = apply::apply(maps, &apply::plan(&resolved.config, preview_all)) {
            put_back(maps);
            return Err(e.context("writing the maps; nothing was changed"));
        }
        if let Err(e) = self.save(&changes) {
            put_back(maps);
            return Err(e.context("nothing was changed"));
        }
        self.changes = changes;
        self.counts();
        *running = resolved.config;
        Ok(())
    }

    /// The position of rule `name` in `running`, or an error listing the rules.
    fn rule_index(running: &Config, name: &str) -> anyhow::Result<usize> {
        running
            .rules
            .iter()
            .position(|r| r.name == name)
            .with_context(|| {
                let names: Vec<&str> = running.rules.iter().map(|r| r.name.as_str()).collect();
                format!("no rule named {name:?} (rules: {})", names.join(", "))
            })
    }

    /// `rule set NAME`: `set`'s fields on top of the rule's earlier live changes, checked as
    /// the config checks them, applied without resetting a counter, and saved.
    pub fn rule_set(
        &mut self,
        maps: &mut Maps,
        running: &mut Config,
        preview_all: bool,
        name: &str,
        set: &RuleChanges,
    ) -> anyhow::Result<RuleChanged> {
        let index = Self::rule_index(running, name)?;
        let merged = self
            .changes
            .rules
            .get(name)
            .cloned()
            .unwrap_or_default()
            .merged(set);
        // Checked here first for its own message (`resolve` would prefix it): the rule as
        // changed, its overrides in the config (which `override del` brings back where a live
        // one replaces them), and its live overrides, each against the rule as changed.
        if let Some(rule) = self.file.rules.iter().find(|r| r.name == name) {
            let mut changed = rule.clone();
            ruleset::apply_changes(&mut changed, &merged)?;
            for spec in self.changes.overrides.iter().filter(|s| s.at.rule == name) {
                check(spec, &changed).map_err(|e| {
                    anyhow::anyhow!(
                        "live override {} would not fit the rule as changed: {e}; remove it \
                         first (`ratelimit override del`); nothing was changed",
                        spec.label()
                    )
                })?;
            }
        }
        let mut changes = self.changes.clone();
        if !merged.is_empty() {
            changes.rules.insert(name.to_string(), merged.clone());
        }
        self.change(maps, running, preview_all, changes)?;
        info!(rule = name, changes = %merged.describe(), "rule changed live");
        Ok(RuleChanged {
            rule: name.to_string(),
            index,
            live: (!merged.is_empty()).then_some(merged),
        })
    }

    /// `rule reset NAME`: the rule returns to the config's values (its live overrides stay).
    pub fn rule_reset(
        &mut self,
        maps: &mut Maps,
        running: &mut Config,
        preview_all: bool,
        name: &str,
    ) -> anyhow::Result<RuleChanged> {
        let index = Self::rule_index(running, name)?;
        let mut changes = self.changes.clone();
        if changes.rules.remove(name).is_none() {
            bail!("rule {name:?} has no live changes: it runs with the config's values");
        }
        self.change(maps, running, preview_all, changes)?;
        info!(rule = name, "rule returned to the config's values");
        Ok(RuleChanged {
            rule: name.to_string(),
            index,
            live: None,
        })
    }

    /// `override add`: a live override, checked as the config checks `[[rule.override]]`,
    /// replacing whatever is at its key (a live one, or the config's while it exists),
    /// applied without resetting a counter, and saved.
    pub fn override_add(
        &mut self,
        maps: &mut Maps,
        running: &mut Config,
        preview_all: bool,
        spec: &OverrideSpec,
    ) -> anyhow::Result<OverrideAdded> {
        let i = Self::rule_index(running, &spec.at.rule)?;
        let o = check(spec, &running.rules[i]).map_err(anyhow::Error::msg)?;
        let added = OverrideSpec::of(&spec.at.rule, &o);
        let slot = Slot::of(&o.target);
        let mut changes = self.changes.clone();
        let before = changes.overrides.len();
        changes
            .overrides
            .retain(|s| !self.is_at(s, &spec.at.rule, slot));
        let replaced = if changes.overrides.len() < before {
            Some(Source::Live)
        } else {
            self.file_override(&spec.at.rule, slot)
                .map(|_| Source::Config)
        };
        changes.overrides.push(added.clone());
        self.change(maps, running, preview_all, changes)?;
        info!("override {} set live: {}", added.label(), added.threshold);
        Ok(OverrideAdded { added, replaced })
    }

    /// `override del`: removes a live override; the config's at the same key, if any, is in
    /// force again. An override of the config itself is changed in the file (or replaced live
    /// with `override add`); a key with no override is an error.
    pub fn override_del(
        &mut self,
        maps: &mut Maps,
        running: &mut Config,
        preview_all: bool,
        at: &OverrideAt,
    ) -> anyhow::Result<OverrideRemoved> {
        Self::rule_index(running, &at.rule)?;
        let target = at.target().map_err(anyhow::Error::msg)?;
        let slot = Slot::of(&target);
        let Some(pos) = self
            .changes
            .overrides
            .iter()
            .position(|s| self.is_at(s, &at.rule, slot))
        else {
            if self.file_override(&at.rule, slot).is_some() {
                bail!(
                    "the override for {target} in rule {:?} is the config file's, not a live \
                     one: change it in the file and reload, or replace it live with `ratelimit \
                     override add`",
                    at.rule
                );
            }
            bail!("no override for {target} in rule {:?}", at.rule);
        };
        let mut changes = self.changes.clone();
        let removed = changes.overrides.remove(pos);
        self.change(maps, running, preview_all, changes)?;
        let restored = self
            .file_override(&at.rule, slot)
            .map(|o| OverrideSpec::of(&at.rule, o));
        info!(
            "live override {} removed{}",
            removed.label(),
            if restored.is_some() {
                "; the config's is in force again"
            } else {
                ""
            }
        );
        Ok(OverrideRemoved { removed, restored })
    }

    /// Whether the live override `s` is rule `rule`'s at `slot`.
    fn is_at(&self, s: &OverrideSpec, rule: &str, slot: Slot) -> bool {
        s.at.rule == rule && s.at.target().is_ok_and(|t| Slot::of(&t) == slot)
    }

    /// The config file's override of rule `rule` at `slot`.
    fn file_override(&self, rule: &str, slot: Slot) -> Option<&Override> {
        self.file
            .rules
            .iter()
            .find(|r| r.name == rule)?
            .overrides
            .iter()
            .find(|o| Slot::of(&o.target) == slot)
    }

    /// Every override in force (`running`), rule by rule in evaluation order, each with where
    /// it comes from.
    pub fn overrides(&self, running: &Config) -> Vec<OverrideEntry> {
        let live: std::collections::HashSet<(&str, Slot)> = self
            .changes
            .overrides
            .iter()
            .filter_map(|s| Some((s.at.rule.as_str(), Slot::of(&s.at.target().ok()?))))
            .collect();
        let mut out = Vec::new();
        for r in &running.rules {
            let file: std::collections::HashSet<Slot> = self
                .file
                .rules
                .iter()
                .find(|f| f.name == r.name)
                .map(|f| f.overrides.iter().map(|o| Slot::of(&o.target)).collect())
                .unwrap_or_default();
            for o in &r.overrides {
                let slot = Slot::of(&o.target);
                let is_live = live.contains(&(r.name.as_str(), slot));
                out.push(OverrideEntry {
                    values: OverrideSpec::of(&r.name, o),
                    source: if is_live {
                        Source::Live
                    } else {
                        Source::Config
                    },
                    replaces_config: is_live && file.contains(&slot),
                });
            }
        }
        out
    }

    /// Every rule with its values in force (`running`) and its live changes.
    pub fn rules(&self, running: &Config, relaxed: bool) -> Vec<RuleEntry> {
        running
            .rules
            .iter()
            .map(|r| {
                let live = self.changes.rules.get(&r.name).cloned();
                let ban = r.action == Action::RateBasedBan;
                RuleEntry {
                    name: r.name.clone(),
                    matcher: r.matcher.to_string(),
                    except: r.matcher.except.iter().map(ToString::to_string).collect(),
                    key: r.key.to_string(),
                    action: r.action.to_string(),
                    algorithm: r.algorithm.to_string(),
                    threshold: r.threshold.to_string(),
                    burst: (r.algorithm == Algorithm::TokenBucket).then_some(r.burst),
                    ban_threshold: ban.then(|| r.ban_threshold.to_string()),
                    ban_duration: ban.then(|| config::format_duration(r.ban_duration)),
                    elastic: r.elastic.map(config::Elastic::factor),
                    threshold_now: threshold_now(r, relaxed).to_string(),
                    exceed_action: r.exceed_action.to_string(),
                    preview: r.preview,
                    soft_limit: r.soft_limit,
                    overrides: r.overrides.len(),
                    source: if live.is_some() {
                        Source::Live
                    } else {
                        Source::Config
                    },
                    live,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
