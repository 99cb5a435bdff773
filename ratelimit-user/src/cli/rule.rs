//! `ratelimit rule set|reset`: live changes to a rule; `ratelimit rules`: every rule in force.

use clap::{Args, Subcommand};

use crate::{api::Request, policy::live};

#[derive(Subcommand, Debug)]
pub enum RuleCommand {
    /// Change fields of a live rule; unspecified fields keep their values. Kept across
    /// restarts and reloads until `rule reset`.
    Set(RuleSetArgs),
    /// Return a rule to the config's values (undo its `rule set` changes), counters kept.
    Reset {
        /// Rule name.
        name: String,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Debug, Clone, Default)]
pub struct RuleSetArgs {
    /// Rule name.
    pub name: String,
    /// COUNT/INTERVAL or BYTES/INTERVAL, e.g. 2000/20m or 10MiB/1s.
    #[arg(long)]
    pub threshold: Option<String>,
    /// Ban threshold, same form as --threshold.
    #[arg(long)]
    pub ban_threshold: Option<String>,
    /// Ban duration, e.g. 1h.
    #[arg(long)]
    pub ban_duration: Option<String>,
    /// Token bucket capacity.
    #[arg(long)]
    pub burst: Option<u64>,
    /// drop | pass
    #[arg(long)]
    pub exceed_action: Option<String>,
    /// true | false
    #[arg(long)]
    pub preview: Option<bool>,
    /// Share of the threshold (0..1] above which clients are reported as offenders.
    #[arg(long)]
    pub soft_limit: Option<f64>,
    /// Elastic factor F > 1 (e.g. 2): up to F times every count of the rule while the host
    /// has room, the rule as written under pressure.
    #[arg(long)]
    pub elastic: Option<f64>,
    #[arg(long)]
    pub json: bool,
}

impl RuleSetArgs {
    /// The fields given, as the control API carries them.
    pub fn changes(&self) -> crate::policy::ruleset::RuleChanges {
        crate::policy::ruleset::RuleChanges {
            threshold: self.threshold.clone(),
            ban_threshold: self.ban_threshold.clone(),
            ban_duration: self.ban_duration.clone(),
            burst: self.burst,
            exceed_action: self.exceed_action.clone(),
            preview: self.preview,
            soft_limit: self.soft_limit,
            elastic: self.elastic,
        }
    }
}

/// The request of a `rule` command, and whether to print JSON.
pub(super) fn request(action: &RuleCommand) -> (Request, bool) {
    match action {
        RuleCommand::Set(set) => (
            Request::RuleSet {
                name: set.name.clone(),
                changes: set.changes(),
            },
            set.json,
        ),
        RuleCommand::Reset { name, json } => (Request::RuleReset { name: name.clone() }, *json),
    }
}

pub(super) fn print_rules(rules: &[live::RuleEntry]) {
    println!(
        "{:<20} {:<7} {:<15} {:<15} {:>14} {:>10} {:>7} {:>14} {:>9}  source",
        "rule", "key", "action", "algorithm", "threshold", "burst", "elastic", "now", "overrides"
    );
    for r in rules {
        let source = match &r.live {
            Some(c) => format!("live: {}", c.describe()),
            None => "config".into(),
        };
        println!(
            "{:<20} {:<7} {:<15} {:<15} {:>14} {:>10} {:>7} {:>14} {:>9}  {source}",
            r.name,
            r.key,
            r.action,
            r.algorithm,
            r.threshold,
            r.burst.map_or_else(|| "-".to_string(), |b| b.to_string()),
            r.elastic
                .map_or_else(|| "-".to_string(), |e| format!("x{e}")),
            r.threshold_now,
            r.overrides
        );
        println!("{:<20} match = {}", "", r.matcher);
        if !r.except.is_empty() {
            println!("{:<20} except = {:?}", "", r.except);
        }
    }
}
