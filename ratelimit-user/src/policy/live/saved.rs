//! The live changes' file: read (entry by entry; a file that is not one is set aside), and
//! resolved over the config file.

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
};

use ratelimit_common::caps;
use serde::{Deserialize, Serialize};
use tracing::{error, warn};

use super::{
    Report,
    overrides::{OverrideSpec, Slot, check},
};
use crate::{
    config::{Config, OverrideTarget},
    durable::Loaded,
    policy::ruleset::{self, RuleChanges},
};

/// Everything changed live, by rule name: the layer over the config file, and the saved file's
/// content.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
pub struct Changes {
    /// `rule set`, the fields given so far for each rule.
    #[serde(default)]
    pub rules: BTreeMap<String, RuleChanges>,
    /// `override add`, in the order given; one for each (rule, CIDR or region).
    #[serde(default)]
    pub overrides: Vec<OverrideSpec>,
}

impl Changes {
    pub(super) fn is_empty(&self) -> bool {
        self.rules.is_empty() && self.overrides.is_empty()
    }
}

/// A config file with live changes applied.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The config file's.
    pub(super) file: Config,
    /// What the data plane is to hold: `file` with `kept` applied.
    pub config: Config,
    /// The changes that fit.
    pub(super) kept: Changes,
    /// The ones that do not, each named, with why.
    pub dropped: Vec<String>,
}

/// `file` with `changes` applied: each rule's `rule set` fields to the config's rule, then the
/// live overrides, each replacing the config's at its key. A change that does not fit (its
/// rule is gone, or the rule no longer takes it, or the override map is full) is left out and
/// named in `dropped`. Pure: nothing is written.
pub fn resolve(file: Config, changes: &Changes) -> Resolved {
    let mut config = file.clone();
    let mut kept = Changes::default();
    let mut dropped = Vec::new();
    for (name, set) in &changes.rules {
        let what = || format!("live changes to rule {name:?} ({})", set.describe());
        let Some(rule) = config.rules.iter_mut().find(|r| &r.name == name) else {
            dropped.push(format!("{}: the config has no rule named {name:?}", what()));
            continue;
        };
        let mut changed = rule.clone();
        match ruleset::apply_changes(&mut changed, set) {
            Ok(()) => {
                *rule = changed;
                kept.rules.insert(name.clone(), set.clone());
            }
            Err(e) => dropped.push(format!("{}: {e:#}", what())),
        }
    }
    // Where each override is, to replace it, and how many of each kind the maps would hold.
    let mut at: HashMap<(usize, Slot), usize> = HashMap::new();
    let (mut cidrs, mut regions) = (0usize, 0usize);
    for (i, r) in config.rules.iter().enumerate() {
        for (j, o) in r.overrides.iter().enumerate() {
            at.insert((i, Slot::of(&o.target)), j);
            match o.target {
                OverrideTarget::Cidr(_) => cidrs += 1,
                OverrideTarget::Region(_) => regions += 1,
            }
        }
    }
    // Which kept override is at a key (a file edited by hand may give one twice: the last
    // one stands).
    let mut live_at: HashMap<(usize, Slot), usize> = HashMap::new();
    for spec in &changes.overrides {
        let what = || format!("live override {}", spec.label());
        let Some(i) = config.rules.iter().position(|r| r.name == spec.at.rule) else {
            dropped.push(format!(
                "{}: the config has no rule named {:?}",
                what(),
                spec.at.rule
            ));
            continue;
        };
        let o = match check(spec, &config.rules[i]) {
            Ok(o) => o,
            Err(e) => {
                dropped.push(format!("{}: {e}", what()));
                continue;
            }
        };
        let key = (i, Slot::of(&o.target));
        let canonical = OverrideSpec::of(&spec.at.rule, &o);
        if let Some(&j) = at.get(&key) {
            config.rules[i].overrides[j] = o;
        } else {
            let (n, cap, kind) = match o.target {
                OverrideTarget::Cidr(_) => (&mut cidrs, caps::MAX_OVERRIDES, "CIDR"),
                OverrideTarget::Region(_) => (&mut regions, caps::MAX_REGION_OVERRIDES, "region"),
            };
            if *n >= cap as usize {
                dropped.push(format!(
                    "{}: the override map is full: at most {cap} {kind} overrides fit across \
                     all rules, the config's and the live ones; remove one with `ratelimit \
                     override del`",
                    what()
                ));
                continue;
            }
            *n += 1;
            at.insert(key, config.rules[i].overrides.len());
            config.rules[i].overrides.push(o);
        }
        match live_at.get(&key) {
            Some(&k) => kept.overrides[k] = canonical,
            None => {
                live_at.insert(key, kept.overrides.len());
                kept.overrides.push(canonical);
            }
        }
    }
    Resolved {
        file,
        config,
        kept,
        dropped,
    }
}

/// The saved changes at `path`, entry by entry: entries that are not changes are named in the
/// second list (and dropped). A file that is not a set of changes at all is moved aside; one
/// that cannot be read refuses saving over it (`report`).
pub(super) fn read(path: &Path, report: &mut Report) -> (Changes, Vec<String>) {
    /// The file's shape, its entries still unread.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Raw {
        #[serde(default)]
        rules: BTreeMap<String, serde_json::Value>,
        #[serde(default)]
        overrides: Vec<serde_json::Value>,
    }
    let raw: Raw = match crate::durable::load(path, |b: &[u8]| serde_json::from_slice::<Raw>(b)) {
        Loaded::Read(r) => r,
        Loaded::Missing => return Default::default(),
        Loaded::Unreadable(e) => {
            let why = format!(
                "{} could not be read ({e}); no live change is applied from it or saved over it \
                 until it is moved away",
                path.display()
            );
            error!("{why}");
            report.save_refused = Some(why);
            return Default::default();
        }
        Loaded::Bad {
            error: e,
            aside: Ok(to),
        } => {
            warn!(
                "{} is not a set of live changes ({e}): moved aside to {}; no live \
                 change is applied from it, and new ones are saved to {}",
                path.display(),
                to.display(),
                path.display()
            );
            report.set_aside = Some(to.display().to_string());
            return Default::default();
        }
        Loaded::Bad {
            error: e,
            aside: Err(e2),
        } => {
            let why = format!(
                "{} is not a set of live changes ({e}) and could not be moved aside \
                 ({e2}); no live change is saved over it until it is moved away",
                path.display()
            );
            error!("{why}");
            report.save_refused = Some(why);
            return Default::default();
        }
    };
    let mut changes = Changes::default();
    let mut bad = Vec::new();
    for (name, v) in raw.rules {
        match serde_json::from_value::<RuleChanges>(v) {
            Ok(set) if set.is_empty() => {}
            Ok(set) => {
                changes.rules.insert(name, set);
            }
            Err(e) => bad.push(format!(
                "saved live changes to rule {name:?}: not a set of rule changes: {e}"
            )),
        }
    }
    for (n, v) in raw.overrides.into_iter().enumerate() {
        match serde_json::from_value::<OverrideSpec>(v) {
            Ok(spec) => changes.overrides.push(spec),
            Err(e) => bad.push(format!(
                "saved live override #{}: not an override: {e}",
                n + 1
            )),
        }
    }
    (changes, bad)
}
