//! `ratelimit override add|del`: live per-client overrides; `ratelimit overrides`: every
//! override in force.

use clap::{Args, Subcommand};

use crate::{api::Request, policy::live};

#[derive(Subcommand, Debug)]
pub enum OverrideCommand {
    /// Set a rule's thresholds for one network (rules keyed `ip` or `all`) or one region
    /// (rules keyed `region`), replacing any override at the same key while it exists. Kept
    /// across restarts and reloads until `override del`.
    Add(OverrideAddArgs),
    /// Remove a live override; the config's override at the same key, if any, applies again.
    Del {
        /// Rule name.
        rule: String,
        #[command(flatten)]
        target: OverrideTargetArgs,
        #[arg(long)]
        json: bool,
    },
}

/// Whom an override is for: a network, or a region.
#[derive(Args, Debug, Clone, Default)]
pub struct OverrideTargetArgs {
    /// Address or CIDR, IPv4 or IPv6 (the most specific override wins).
    #[arg(required_unless_present = "region", conflicts_with = "region")]
    pub cidr: Option<String>,
    /// ISO 3166-1 alpha-2 country code (ZZ = unknown), for a rule keyed `region`.
    #[arg(long, value_name = "CC")]
    pub region: Option<String>,
}

#[derive(Args, Debug, Clone, Default)]
pub struct OverrideAddArgs {
    /// Rule name.
    pub rule: String,
    #[command(flatten)]
    pub target: OverrideTargetArgs,
    /// COUNT/INTERVAL or BYTES/INTERVAL, counting what the rule counts, e.g. 5000/20m.
    #[arg(long)]
    pub threshold: String,
    /// Token bucket capacity (token_bucket rules): packets, or bytes with a unit (e.g. 1MiB).
    /// Default: the threshold's amount.
    #[arg(long)]
    pub burst: Option<String>,
    /// Ban threshold (rate_based_ban rules), same form as --threshold. Default: the rule's ban
    /// threshold, or this threshold where it is higher.
    #[arg(long)]
    pub ban_threshold: Option<String>,
    /// Elastic factor F > 1 (e.g. 1.5): up to F times every count of this override while the
    /// host has room, the override as given under pressure. Default: the rule's.
    #[arg(long)]
    pub elastic: Option<String>,
    #[arg(long)]
    pub json: bool,
}

impl OverrideTargetArgs {
    /// The override's key on the control API.
    pub fn at(&self, rule: &str) -> crate::policy::live::OverrideAt {
        crate::policy::live::OverrideAt {
            rule: rule.to_string(),
            cidr: self.cidr.clone(),
            region: self.region.clone(),
        }
    }
}

impl OverrideAddArgs {
    /// The override as the control API carries it.
    pub fn spec(&self) -> crate::policy::live::OverrideSpec {
        crate::policy::live::OverrideSpec {
            at: self.target.at(&self.rule),
            threshold: self.threshold.clone(),
            burst: self.burst.clone(),
            ban_threshold: self.ban_threshold.clone(),
            elastic: self.elastic.clone(),
        }
    }
}

/// The request of an `override` command, and whether to print JSON.
pub(super) fn request(action: &OverrideCommand) -> (Request, bool) {
    match action {
        OverrideCommand::Add(add) => (Request::OverrideAdd { spec: add.spec() }, add.json),
        OverrideCommand::Del { rule, target, json } => (
            Request::OverrideDel {
                at: target.at(rule),
            },
            *json,
        ),
    }
}

pub(super) fn print_overrides(entries: &[live::OverrideEntry]) {
    println!(
        "{:<20} {:<40} {:>14} {:>10} {:>14} {:>7}  source",
        "rule", "cidr/region", "threshold", "burst", "ban_threshold", "elastic"
    );
    for e in entries {
        let v = &e.values;
        let source = match (e.source, e.replaces_config) {
            (live::Source::Live, true) => "live (replaces the config's)",
            (live::Source::Live, false) => "live",
            (live::Source::Config, _) => "config",
        };
        println!(
            "{:<20} {:<40} {:>14} {:>10} {:>14} {:>7}  {source}",
            v.at.rule,
            target_label(&v.at),
            v.threshold,
            v.burst.as_deref().unwrap_or("-"),
            v.ban_threshold.as_deref().unwrap_or("-"),
            v.elastic
                .as_deref()
                .map_or_else(|| "-".to_string(), |e| format!("x{e}")),
        );
    }
}

pub(super) fn target_label(at: &live::OverrideAt) -> String {
    match (&at.cidr, &at.region) {
        (Some(c), _) => c.clone(),
        (None, Some(r)) => format!("region {r}"),
        (None, None) => String::new(),
    }
}
