//! An override's target (a CIDR or a region of a rule) as the command line spells it, and its
//! check against its rule by the config's own parsers.

use serde::{Deserialize, Serialize};

use crate::{
    config::{self, Action, Algorithm, Override, OverrideTarget, Rule, Unit},
    policy::apply,
    policy::ruleset,
};

/// Which override: a rule by name, and a CIDR or a region (exactly one of them).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct OverrideAt {
    pub rule: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cidr: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
}

impl OverrideAt {
    /// The target, parsed as the config parses an override's `cidr` and `region`.
    pub fn target(&self) -> Result<OverrideTarget, String> {
        match (&self.cidr, &self.region) {
            (Some(c), None) => config::parse_net(c).map(OverrideTarget::Cidr),
            (None, Some(r)) => config::parse_region(r)
                .map(OverrideTarget::Region)
                .map_err(|e| format!("--region: {e}")),
            (Some(_), Some(_)) => Err(
                "give a CIDR or --region CC, not both: an override is for a network or a \
                     region"
                    .into(),
            ),
            (None, None) => Err("give a CIDR or --region CC".into()),
        }
    }
}

/// An override's values in their command-line spelling: `override add` on the control API,
/// and each live override in the saved file. Unset `burst` and `ban_threshold` are derived as
/// in the config (the threshold's amount; the rule's ban threshold or the override's
/// threshold).
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq, Default)]
pub struct OverrideSpec {
    #[serde(flatten)]
    pub at: OverrideAt,
    pub threshold: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ban_threshold: Option<String>,
    /// `elastic = F` of this override (default: the rule's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elastic: Option<String>,
}

impl OverrideSpec {
    /// The canonical spelling of an override of rule `rule` (what is saved and listed).
    pub(super) fn of(rule: &str, o: &Override) -> OverrideSpec {
        let (cidr, region) = match o.target {
            OverrideTarget::Cidr(n) => (Some(n.to_string()), None),
            OverrideTarget::Region(c) => (None, Some(region_name(c))),
        };
        OverrideSpec {
            at: OverrideAt {
                rule: rule.to_string(),
                cidr,
                region,
            },
            threshold: o.threshold.to_string(),
            burst: o.burst.map(|b| b.to_string()),
            ban_threshold: o.ban_threshold.map(|t| t.to_string()),
            elastic: o.elastic.map(|e| e.to_string()),
        }
    }

    /// `cidr 198.51.100.7/32 of rule "udp"`, for messages.
    pub(super) fn label(&self) -> String {
        let what = match (&self.at.cidr, &self.at.region) {
            (Some(c), _) => format!("cidr {c}"),
            (None, Some(r)) => format!("region {r}"),
            (None, None) => "(no target)".into(),
        };
        format!("{what} of rule {:?}", self.at.rule)
    }
}

pub(super) fn region_name(c: [u8; 2]) -> String {
    String::from_utf8_lossy(&c).into_owned()
}

/// Where an override lands in the maps: two spellings of one prefix (`192.0.2.1` and
/// `192.0.2.1/32`) are one override.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Slot {
    Cidr(apply::Prefix),
    Region([u8; 2]),
}

impl Slot {
    pub(super) fn of(t: &OverrideTarget) -> Slot {
        match t {
            OverrideTarget::Cidr(n) => Slot::Cidr(apply::prefix(&n.trunc())),
            OverrideTarget::Region(c) => Slot::Region(*c),
        }
    }
}

/// `spec` as an override of `rule`, with the checks the config makes on `[[rule.override]]`:
/// a CIDR for a rule keyed `ip` or `all`, a region for a rule keyed `region`; thresholds
/// counting what the rule counts; `burst` for a token bucket only, `ban_threshold` for a
/// rate_based_ban rule only. The error says what to fix.
pub fn check(spec: &OverrideSpec, rule: &Rule) -> Result<Override, String> {
    let target = spec.at.target()?;
    let region = matches!(target, OverrideTarget::Region(_));
    config::override_fits(rule.key, region).map_err(|e| {
        let what = match target {
            OverrideTarget::Cidr(n) => n.to_string(),
            OverrideTarget::Region(_) => "--region".into(),
        };
        format!("rule {:?}: {what}: {e}", rule.name)
    })?;
    let unit = rule.threshold.unit;
    let threshold = parse_threshold("--threshold", &spec.threshold, unit)?;
    let burst = match &spec.burst {
        None => None,
        Some(b) => Some(burst(b, rule)?),
    };
    let ban_threshold = match &spec.ban_threshold {
        None => None,
        Some(_) if rule.action != Action::RateBasedBan => {
            return Err(format!(
                "--ban-threshold only applies to action = \"rate_based_ban\" (rule {:?} has \
                 action = \"{}\")",
                rule.name, rule.action
            ));
        }
        Some(t) => Some(parse_threshold("--ban-threshold", t, unit)?),
    };
    // A global rule's clients are counted by the fleet in the rule's windows.
    if rule.scope == config::Scope::Global
        && (threshold.interval != rule.threshold.interval
            || ban_threshold.is_some_and(|b| b.interval != rule.ban_threshold.interval))
    {
        return Err(format!(
            "rule {:?} is global (scope = \"global\"): an override keeps its intervals ({:?}{}); \
             the fleet counts its clients in the rule's windows",
            rule.name,
            rule.threshold.interval,
            if rule.action == Action::RateBasedBan {
                format!(", ban {:?}", rule.ban_threshold.interval)
            } else {
                String::new()
            }
        ));
    }
    let own_elastic = match &spec.elastic {
        None => None,
        Some(e) => Some(
            e.parse::<config::Elastic>()
                .map_err(|why| format!("--elastic {why}"))?,
        ),
    };
    let o = Override {
        target,
        threshold,
        burst,
        ban_threshold,
        elastic: own_elastic,
    };
    // The counts `apply::plan` will write for it (what it inherits from the rule included).
    config::Counts::of_override(rule, &o)
        .check_elastic(rule.exceed_action)
        .map_err(|why| {
            let whose = if own_elastic.is_some() {
                ""
            } else {
                " (the rule's)"
            };
            format!("rule {:?}: --elastic{whose} {why}", rule.name)
        })?;
    Ok(o)
}

/// The threshold of `r` in force: times its `elastic` while the host has room (`relaxed`).
pub fn threshold_now(r: &Rule, relaxed: bool) -> config::Threshold {
    let counts = config::Counts::of_rule(r);
    match counts.relaxed() {
        Some(c) if relaxed => c.threshold,
        _ => counts.threshold,
    }
}

/// A threshold in the command line's form (the config's parser), counting `unit`.
pub(super) fn parse_threshold(
    flag: &str,
    s: &str,
    unit: Unit,
) -> Result<config::Threshold, String> {
    let t = ruleset::parse_threshold(s).map_err(|e| format!("{flag}: {e}"))?;
    if t.unit != unit {
        return Err(format!(
            "{flag}: {s} counts {} but the rule's threshold counts {unit}; both must count the \
             same",
            t.unit
        ));
    }
    Ok(t)
}

/// An override's `burst`, as the config reads it: an integer for a rule counting packets, a
/// byte size (at least 64 KiB) for one counting bytes; at least 1; token buckets only.
pub(super) fn burst(s: &str, rule: &Rule) -> Result<u64, String> {
    if rule.algorithm != Algorithm::TokenBucket {
        return Err(format!(
            "--burst only applies to algorithm = \"token_bucket\" (rule {:?} uses \"{}\")",
            rule.name, rule.algorithm
        ));
    }
    let n = match rule.threshold.unit {
        Unit::Packets => s.trim().parse::<u64>().map_err(|_| {
            format!("--burst: {s:?} must be an integer: the rule's threshold counts packets")
        })?,
        Unit::Bytes => config::parse_bytes(s).map_err(|e| format!("--burst: {e}"))?,
    };
    if n == 0 {
        return Err("--burst: must be at least 1".into());
    }
    if rule.threshold.unit == Unit::Bytes {
        config::check_byte_burst(n).map_err(|e| format!("--burst: {e}"))?;
    }
    Ok(n)
}
