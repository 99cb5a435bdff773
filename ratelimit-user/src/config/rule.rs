//! `[[rule]]`: a rule (what it matches is `matching`'s), its overrides, and the counts in
//! force for it and each override.

use std::fmt;
use std::time::Duration;

use ipnet::IpNet;

use super::values;
use super::{
    Action, Algorithm, ELASTIC_WITH_PASS, Elastic, ExceedAction, KeyKind, Match, Threshold,
};

/// One `[[rule]]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// Unique, non-empty.
    pub name: String,
    /// TOML key `match`; absent = all traffic.
    pub matcher: Match,
    pub key: KeyKind,
    /// 1..=32; may only be set with `key = "ip"`.
    pub ipv4_prefix: u8,
    /// 1..=128; may only be set with `key = "ip"`.
    pub ipv6_prefix: u8,
    pub action: Action,
    pub threshold: Threshold,
    pub algorithm: Algorithm,
    /// Token bucket capacity in threshold units; defaults to `threshold.amount`, and may only be
    /// set with `algorithm = "token_bucket"`.
    pub burst: u64,
    /// Defaults to `threshold`; may only be set with `action = "rate_based_ban"`; same unit as
    /// `threshold`.
    pub ban_threshold: Threshold,
    /// Greater than zero for `rate_based_ban`, zero for `throttle`.
    pub ban_duration: Duration,
    pub exceed_action: ExceedAction,
    pub preview: bool,
    /// In (0, 1].
    pub soft_limit: f64,
    /// `elastic = F`: while the host has room (pressure low), every count of the rule
    /// (threshold, token bucket burst, ban threshold) times F; under pressure, the rule as
    /// written. `None`: the rule holds whatever the level.
    pub elastic: Option<Elastic>,
    /// `scope`: where the threshold holds.
    pub scope: Scope,
    /// TOML `[[rule.override]]`, in file order.
    pub overrides: Vec<Override>,
}

/// A rule's `scope`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scope {
    /// Each host holds the threshold on its own (the default).
    #[default]
    Local,
    /// The threshold holds across the fleet: each host adds the other hosts' counts of a
    /// client, shared through the `[fleet]` store, into its own (the fleet's global counts).
    Global,
}

/// Override of a rule's thresholds for some clients. `burst`, `ban_threshold` and `elastic`
/// fall back to the rule's when `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Override {
    pub target: OverrideTarget,
    pub threshold: Threshold,
    pub burst: Option<u64>,
    pub ban_threshold: Option<Threshold>,
    pub elastic: Option<Elastic>,
}

/// The counts in force for a rule, or for one of its overrides: threshold, token bucket
/// burst, ban threshold (after what an override inherits from its rule), ban duration, and
/// the elastic factor. What `apply::plan` writes and what every check of `elastic`
/// (the config's, `override add`'s, `rule set`'s) checks are both read from this, so they
/// cannot disagree.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Counts {
    pub threshold: Threshold,
    /// The token bucket's capacity (the threshold's amount for the window algorithms).
    pub burst: u64,
    /// `Some` for a `rate_based_ban` rule only.
    pub ban: Option<Threshold>,
    /// `Some` for a `rate_based_ban` rule only.
    pub ban_duration: Option<Duration>,
    /// The rule's factor; an override's own, or its rule's.
    pub elastic: Option<Elastic>,
}

impl Counts {
    /// A rule's counts.
    pub fn of_rule(r: &Rule) -> Counts {
        let is_ban = r.action == Action::RateBasedBan;
        Counts {
            threshold: r.threshold,
            burst: r.burst,
            ban: is_ban.then_some(r.ban_threshold),
            ban_duration: is_ban.then_some(r.ban_duration),
            elastic: r.elastic,
        }
    }

    /// The counts of override `o` of rule `r`.
    pub fn of_override(r: &Rule, o: &Override) -> Counts {
        Counts::of_rule(r).for_override(o)
    }

    /// The counts of override `o` of the rule whose counts these are. Its own threshold; its
    /// own burst, else its threshold's amount; its own ban threshold, else: if the rule's ban
    /// threshold is the default (its threshold), the override's threshold; otherwise the
    /// larger of the two, so a client is never banned below its own allowance. Its own
    /// factor, else the rule's.
    pub fn for_override(&self, o: &Override) -> Counts {
        let ban = self.ban.map(|rule_ban| {
            o.ban_threshold.unwrap_or(
                if rule_ban == self.threshold || o.threshold.amount > rule_ban.amount {
                    o.threshold
                } else {
                    rule_ban
                },
            )
        });
        Counts {
            threshold: o.threshold,
            burst: o.burst.unwrap_or(o.threshold.amount),
            ban,
            ban_duration: self.ban_duration,
            elastic: o.elastic.or(self.elastic),
        }
    }

    /// The counts while the host has room: every count times the factor, intervals and ban
    /// duration as they are. `None` without a factor.
    pub fn relaxed(&self) -> Option<Counts> {
        let e = self.elastic?;
        Some(Counts {
            threshold: e.scale_threshold(&self.threshold),
            burst: e.scale(self.burst),
            ban: self.ban.map(|b| e.scale_threshold(&b)),
            ..*self
        })
    }

    /// Whether the factor (if any) fits a rule whose `exceed_action` is `exceed`: the rule
    /// must drop (elastic decides only which packets are dropped), and the scaled counts
    /// ([`Counts::relaxed`]) must stay rates the limiter meters. The error follows
    /// `elastic`, e.g. "= 2 makes the threshold ...".
    pub fn check_elastic(&self, exceed: ExceedAction) -> Result<(), String> {
        let (Some(e), Some(relaxed)) = (self.elastic, self.relaxed()) else {
            return Ok(());
        };
        if exceed == ExceedAction::Pass {
            return Err(ELASTIC_WITH_PASS.into());
        }
        for (what, scaled) in std::iter::once(("threshold", relaxed.threshold))
            .chain(relaxed.ban.map(|b| ("ban_threshold", b)))
        {
            values::check_amount(scaled.amount, scaled.unit, scaled.interval).map_err(|why| {
                format!("= {e} makes the {what} {scaled} while the host has room, and {why}")
            })?;
        }
        Ok(())
    }
}

/// Who an override applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OverrideTarget {
    /// Only for `key = "ip"` or `"all"`; the most specific prefix wins.
    Cidr(IpNet),
    /// Only for `key = "region"`: ISO 3166 alpha-2 as two uppercase ASCII letters, `ZZ` for
    /// unknown.
    Region([u8; 2]),
}

impl fmt::Display for OverrideTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OverrideTarget::Cidr(net) => write!(f, "cidr {net}"),
            OverrideTarget::Region([a, b]) => write!(f, "region {}{}", *a as char, *b as char),
        }
    }
}

/// Whether a rule keyed `key` takes an override by CIDR (`region = false`) or by region: a
/// CIDR override needs key = "ip" or "all" (the shared bucket's threshold for those sources),
/// a region override key = "region"; a key of packet fields takes none. The error follows the
/// field's name.
pub fn override_fits(key: KeyKind, region: bool) -> Result<(), String> {
    match (key, region) {
        (KeyKind::Fields(_), _) => Err(format!(
            "overrides need key = \"ip\", \"all\" or \"region\" (this rule has key = {})",
            key.toml()
        )),
        (KeyKind::Region, false) => {
            Err("overrides need key = \"ip\" or \"all\" (this rule has key = \"region\")".into())
        }
        (KeyKind::Ip | KeyKind::All, true) => Err(format!(
            "overrides need key = \"region\" (this rule has key = {})",
            key.toml()
        )),
        _ => Ok(()),
    }
}
