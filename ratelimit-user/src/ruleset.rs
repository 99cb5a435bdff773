//! `ratelimit rule set NAME ...`: field changes to a live rule, validated like the config.

use anyhow::{Context as _, bail};

use crate::{
    cli::RuleSetArgs,
    config::{Action, ExceedAction, Rule, Threshold, Unit},
};

/// `COUNT/INTERVAL` (e.g. `2000/20m`) or `BYTES/INTERVAL` with a unit (e.g. `10MiB/1s`).
pub fn parse_threshold(s: &str) -> anyhow::Result<Threshold> {
    let (amount, interval) = s
        .split_once('/')
        .with_context(|| format!("{s:?}: expected COUNT/INTERVAL, e.g. 2000/20m"))?;
    let interval = humantime::parse_duration(interval.trim()).with_context(|| {
        format!("{interval:?} is not a duration (e.g. 500ms, 30s, 20m, 1h, 1d)")
    })?;
    if interval.is_zero() {
        bail!("the interval must be greater than 0");
    }
    if interval.as_nanos() > ratelimit_common::caps::MAX_INTERVAL_NS as u128 {
        bail!("the interval must be at most 1d");
    }
    let amount = amount.trim();
    let (amount, unit) = match amount.parse::<u64>() {
        Ok(n) => (n, Unit::Packets),
        Err(_) => (parse_bytes(amount)?, Unit::Bytes),
    };
    if amount == 0 {
        bail!("the threshold must be at least 1");
    }
    Ok(Threshold {
        amount,
        unit,
        interval,
    })
}

/// `10MiB`, `500KB`, `1500B`.
pub fn parse_bytes(s: &str) -> anyhow::Result<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .with_context(|| format!("{s:?} is not a count or a byte size"))?;
    let mult: u64 = match unit.trim() {
        "B" => 1,
        "KB" => 1_000,
        "KiB" => 1 << 10,
        "MB" => 1_000_000,
        "MiB" => 1 << 20,
        "GB" => 1_000_000_000,
        "GiB" => 1 << 30,
        other => bail!("unknown byte unit {other:?} (B, KB, KiB, MB, MiB, GB, GiB)"),
    };
    n.checked_mul(mult).context("byte size overflows")
}

pub fn apply_changes(rule: &mut Rule, set: &RuleSetArgs) -> anyhow::Result<()> {
    let was_default_ban = rule.ban_threshold == rule.threshold;
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
        let d = humantime::parse_duration(d).with_context(|| format!("--ban-duration {d:?}"))?;
        if d.is_zero() {
            bail!("--ban-duration must be greater than 0");
        }
        rule.ban_duration = d;
    }
    if let Some(b) = set.burst {
        if b == 0 {
            bail!("--burst must be at least 1");
        }
        rule.burst = b;
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
