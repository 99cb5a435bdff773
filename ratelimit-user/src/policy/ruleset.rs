//! `ratelimit rule set NAME ...`: field changes to a live rule, validated like the config.
//! The changes are kept by rule name as they were given ([`RuleChanges`]) and applied on top of
//! the config's rule, so that they can be applied again after a restart or a reload
//! ([`crate::policy::live`]).

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};

use crate::config::{Action, Counts, ExceedAction, Rule, Threshold};

/// The fields of a rule changed live, in their command-line spelling; `None` keeps the
/// config's value. On the control API (`rule set`) and in the saved live changes.
#[derive(Serialize, Deserialize, Debug, Clone, Default, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RuleChanges {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ban_threshold: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ban_duration: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exceed_action: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preview: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub soft_limit: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elastic: Option<f64>,
}

impl RuleChanges {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// These changes followed by `newer`: each field `newer` gives replaces this one's. A
    /// field given explicitly keeps its value; the ones derived from it (a default ban
    /// threshold or burst following the threshold) are derived again when applied.
    pub fn merged(&self, newer: &RuleChanges) -> RuleChanges {
        RuleChanges {
            threshold: newer.threshold.clone().or_else(|| self.threshold.clone()),
            ban_threshold: newer
                .ban_threshold
                .clone()
                .or_else(|| self.ban_threshold.clone()),
            ban_duration: newer
                .ban_duration
                .clone()
                .or_else(|| self.ban_duration.clone()),
            burst: newer.burst.or(self.burst),
            exceed_action: newer
                .exceed_action
                .clone()
                .or_else(|| self.exceed_action.clone()),
            preview: newer.preview.or(self.preview),
            soft_limit: newer.soft_limit.or(self.soft_limit),
            elastic: newer.elastic.or(self.elastic),
        }
    }

    /// As typed: `--threshold 150/1h --preview true`.
    pub fn describe(&self) -> String {
        let mut out = Vec::new();
        let mut flag = |name: &str, v: Option<String>| {
            if let Some(v) = v {
                out.push(format!("--{name} {v}"));
            }
        };
        flag("threshold", self.threshold.clone());
        flag("ban-threshold", self.ban_threshold.clone());
        flag("ban-duration", self.ban_duration.clone());
        flag("burst", self.burst.map(|b| b.to_string()));
        flag("exceed-action", self.exceed_action.clone());
        flag("preview", self.preview.map(|b| b.to_string()));
        flag("soft-limit", self.soft_limit.map(|b| b.to_string()));
        flag("elastic", self.elastic.map(|e| e.to_string()));
        out.join(" ")
    }
}

/// `COUNT/INTERVAL` (e.g. `2000/20m`) or `BYTES/INTERVAL` with a unit (e.g. `10MiB/1s`), with
/// the config file's rules (the same parser).
pub fn parse_threshold(s: &str) -> anyhow::Result<Threshold> {
    s.parse::<Threshold>()
        .map_err(|e| anyhow::anyhow!("{s:?}: {e}"))
}

pub fn apply_changes(rule: &mut Rule, set: &RuleChanges) -> anyhow::Result<()> {
    let was_default_ban = rule.ban_threshold == rule.threshold;
    let burst_was_default = rule.burst == rule.threshold.amount;
    if let Some(t) = &set.threshold {
        rule.threshold = parse_threshold(t).context("--threshold")?;
        if was_default_ban && set.ban_threshold.is_none() {
            rule.ban_threshold = rule.threshold;
        }
    }
    if let Some(t) = &set.ban_threshold {
        if rule.action != Action::RateBasedBan {
            bail!(
                "--ban-threshold needs a rate_based_ban rule; {:?} is a throttle",
                rule.name
            );
        }
        rule.ban_threshold = parse_threshold(t).context("--ban-threshold")?;
    }
    if rule.ban_threshold.unit != rule.threshold.unit {
        bail!("the ban threshold and the threshold must use the same unit (count or bytes)");
    }
    if let Some(d) = &set.ban_duration {
        if rule.action != Action::RateBasedBan {
            bail!("--ban-duration needs a rate_based_ban rule");
        }
        rule.ban_duration = crate::config::parse_ban_duration(d)
            .map_err(|e| anyhow::anyhow!(crate::config::labelled("--ban-duration", &e)))?;
    }
    if let Some(b) = set.burst {
        if b == 0 {
            bail!("--burst must be at least 1");
        }
        if rule.algorithm != crate::config::Algorithm::TokenBucket {
            bail!("--burst applies to token_bucket rules only");
        }
        rule.burst = b;
    } else if burst_was_default && set.threshold.is_some() {
        rule.burst = rule.threshold.amount;
    }
    if rule.algorithm == crate::config::Algorithm::TokenBucket
        && rule.threshold.unit == crate::config::Unit::Bytes
    {
        crate::config::check_byte_burst(rule.burst).map_err(|e| anyhow::anyhow!("--burst: {e}"))?;
    }
    for o in &rule.overrides {
        if o.threshold.unit != rule.threshold.unit {
            bail!(
                "override {} counts {}, the new threshold counts {}",
                o.target,
                o.threshold.unit,
                rule.threshold.unit
            );
        }
        // A global rule's clients are counted by the fleet in the rule's windows: its
        // overrides keep them (as the config requires), so a new interval must fit them.
        if rule.scope == crate::config::Scope::Global
            && (o.threshold.interval != rule.threshold.interval
                || o.ban_threshold
                    .is_some_and(|b| b.interval != rule.ban_threshold.interval))
        {
            bail!(
                "rule {:?} is global (scope = \"global\"): override {} keeps intervals of its \
                 own, which the new ones would not match (the fleet counts the rule's clients in \
                 the rule's windows); change the override first",
                rule.name,
                o.target
            );
        }
    }
    if let Some(a) = &set.exceed_action {
        rule.exceed_action = match a.as_str() {
            "drop" => ExceedAction::Drop,
            "pass" => ExceedAction::Pass,
            _ => bail!("--exceed-action must be drop or pass"),
        };
    }
    if let Some(p) = set.preview {
        rule.preview = p;
    }
    if let Some(s) = set.soft_limit {
        if !(s > 0.0 && s <= 1.0) {
            bail!("--soft-limit must be in (0, 1]");
        }
        rule.soft_limit = s;
    }
    if let Some(f) = set.elastic {
        rule.elastic =
            Some(crate::config::Elastic::new(f).map_err(|e| anyhow::anyhow!("--elastic {e}"))?);
    }
    check_elastic(rule)
}

/// Elastic against the rule as it now stands, and against each of its overrides under the
/// rule as it now stands: a new threshold, ban threshold (which overrides may inherit), factor
/// (which they inherit) or exceed_action may no longer fit a factor given before. The counts
/// checked are the ones `apply::plan` writes ([`Counts`]).
fn check_elastic(rule: &Rule) -> anyhow::Result<()> {
    let counts = Counts::of_rule(rule);
    counts
        .check_elastic(rule.exceed_action)
        .map_err(|why| anyhow::anyhow!("elastic {why}"))?;
    for o in &rule.overrides {
        counts
            .for_override(o)
            .check_elastic(rule.exceed_action)
            .map_err(|why| {
                let whose = if o.elastic.is_some() {
                    ""
                } else {
                    " (the rule's)"
                };
                anyhow::anyhow!("override {}: elastic{whose} {why}", o.target)
            })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Unit;

    #[test]
    fn thresholds() {
        let t = parse_threshold("2000/20m").unwrap();
        assert_eq!(
            (t.amount, t.unit, t.interval.as_secs()),
            (2000, Unit::Packets, 1200)
        );
        let t = parse_threshold("10MiB/1s").unwrap();
        assert_eq!((t.amount, t.unit), (10 << 20, Unit::Bytes));
        assert!(parse_threshold("0/1s").is_err());
        assert!(parse_threshold("10/0s").is_err());
        assert!(parse_threshold("10").is_err());
        assert!(parse_threshold("10/2d").is_err());
        assert!(parse_threshold("10 parsecs/1s").is_err());
        assert_eq!(parse_threshold("500kB/1s").unwrap().amount, 500_000);
    }

    fn bytes_rule() -> Rule {
        let text = "[[rule]]\nname = \"b\"\nthreshold = { bytes = \"1MiB\", interval = \"1s\" }\n\
                    algorithm = \"token_bucket\"\naction = \"rate_based_ban\"\nban_duration = \"1h\"\n";
        crate::config::parse("t.toml", text)
            .unwrap()
            .rules
            .remove(0)
    }

    #[test]
    fn a_byte_burst_below_the_largest_packet_is_rejected() {
        let mut rule = bytes_rule();
        let set = RuleChanges {
            burst: Some(1500),
            ..Default::default()
        };
        let e = apply_changes(&mut rule, &set).unwrap_err().to_string();
        assert!(
            e.starts_with("--burst: 1500 B is below the minimum of 64KiB"),
            "{e}"
        );
        let e = apply_changes(
            &mut rule,
            &RuleChanges {
                threshold: Some("1500B/1s".into()),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("below the minimum of 64KiB"),
            "{e:#}"
        );
    }

    #[test]
    fn ban_durations_are_bounded() {
        let mut rule = bytes_rule();
        for (d, want) in [
            ("0s", "--ban-duration must be greater than 0"),
            (
                "11y",
                "--ban-duration: 96426h is longer than 10 years (3650d), the longest ban",
            ),
            (
                "1000y",
                "--ban-duration: 365250d is longer than 10 years (3650d)",
            ),
        ] {
            let set = RuleChanges {
                ban_duration: Some(d.into()),
                ..Default::default()
            };
            let e = apply_changes(&mut rule, &set).unwrap_err().to_string();
            assert!(e.starts_with(want), "{d}: {e}");
        }
        let set = RuleChanges {
            ban_duration: Some("3650d".into()),
            ..Default::default()
        };
        apply_changes(&mut rule, &set).unwrap();
        assert_eq!(rule.ban_duration, crate::config::MAX_BAN_DURATION);
    }

    /// `--elastic` is checked against the rule as it stands after the change.
    #[test]
    fn elastic_is_set_live_and_checked_against_the_rule() {
        let mut rule = crate::config::parse(
            "t.toml",
            "[[rule]]\nname = \"r\"\nthreshold = { count = 10, interval = \"1s\" }\n",
        )
        .unwrap()
        .rules
        .remove(0);
        let set = |e: Option<f64>, exceed: Option<&str>| RuleChanges {
            elastic: e,
            exceed_action: exceed.map(Into::into),
            ..Default::default()
        };
        let e = apply_changes(&mut rule.clone(), &set(Some(0.9), None)).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("--elastic must be greater than 1"),
            "{e}"
        );
        apply_changes(&mut rule, &set(Some(2.0), None)).unwrap();
        assert_eq!(rule.elastic.unwrap().milli(), 2000);
        let e = apply_changes(&mut rule.clone(), &set(None, Some("pass"))).unwrap_err();
        assert!(
            e.to_string()
                .contains("elastic has no effect with exceed_action"),
            "{e}"
        );
        assert_eq!(set(Some(2.0), None).describe(), "--elastic 2");
    }
    /// A global rule's new interval must be its overrides' too (the fleet counts its clients
    /// in the rule's windows, which the config makes its overrides keep).
    #[test]
    fn a_global_rules_interval_change_must_fit_its_overrides() {
        let cfg = crate::config::parse(
            "t.toml",
            "[fleet]\nredis = \"redis://127.0.0.1:6379\"\n\
             [[rule]]\nname = \"g\"\nscope = \"global\"\nalgorithm = \"sliding_window\"\n\
             threshold = { count = 10, interval = \"10s\" }\n\
             [[rule.override]]\ncidr = \"192.0.2.0/24\"\n\
             threshold = { count = 50, interval = \"10s\" }\n",
        )
        .unwrap();
        let rule = &cfg.rules[0];
        let set = |t: &str| RuleChanges {
            threshold: Some(t.into()),
            ..Default::default()
        };
        let e = apply_changes(&mut rule.clone(), &set("10/20s"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("override cidr 192.0.2.0/24 keeps intervals of its own"),
            "{e}"
        );
        // The same interval with another count is fine.
        let mut r = rule.clone();
        apply_changes(&mut r, &set("20/10s")).unwrap();
        assert_eq!(r.threshold.amount, 20);
    }

    /// A rule's overrides are checked against the rule as it stands after the change: a new
    /// factor (which they inherit), a new ban threshold (which they may inherit) or
    /// exceed_action = "pass" can make one of them refused, and then so is the change.
    #[test]
    fn a_change_that_does_not_fit_the_rules_overrides_is_refused() {
        let rule_of = |body: &str| {
            crate::config::parse(
                "t.toml",
                &format!(
                    "[[rule]]\nname = \"r\"\nthreshold = {{ count = 10, interval = \"1s\" }}\n{body}"
                ),
            )
            .unwrap()
            .rules
            .remove(0)
        };
        let refused = |rule: &Rule, set: &RuleChanges| {
            apply_changes(&mut rule.clone(), set)
                .unwrap_err()
                .to_string()
        };
        // The rule's new factor on an override's threshold.
        let rule = rule_of(
            "[[rule.override]]\ncidr = \"192.0.2.0/24\"\n\
             threshold = { count = 600000000, interval = \"1s\" }\n",
        );
        let set = RuleChanges {
            elastic: Some(2.0),
            ..Default::default()
        };
        let e = refused(&rule, &set);
        assert!(
            e.contains("override cidr 192.0.2.0/24: elastic (the rule's) = 2 makes the threshold 1200000000/1s"),
            "{e}"
        );
        // A new ban threshold an override inherits, under the override's own factor.
        let rule = rule_of(
            "action = \"rate_based_ban\"\nban_duration = \"1m\"\n\
             [[rule.override]]\ncidr = \"192.0.2.0/24\"\n\
             threshold = { count = 100, interval = \"1s\" }\nelastic = 2\n",
        );
        let set = RuleChanges {
            ban_threshold: Some("600000000/1s".into()),
            ..Default::default()
        };
        let e = refused(&rule, &set);
        assert!(
            e.contains(
                "override cidr 192.0.2.0/24: elastic = 2 makes the ban_threshold 1200000000/1s"
            ),
            "{e}"
        );
        // exceed_action = "pass" on a rule whose override has a factor.
        let set = RuleChanges {
            exceed_action: Some("pass".into()),
            ..Default::default()
        };
        let e = refused(&rule, &set);
        assert!(
            e.contains("override cidr 192.0.2.0/24: elastic has no effect with exceed_action"),
            "{e}"
        );
    }
}
