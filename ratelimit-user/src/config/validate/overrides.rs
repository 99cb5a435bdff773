//! `[[rule.override]]`: an override's target (a network or a region) and its counts.

use std::collections::HashMap;

use ratelimit_common::caps;

use super::counts::{RuleCtx, Totals, ban_threshold, burst, elastic, same_unit, threshold};
use super::net;
use crate::config::tree::{Checker, Field, Table};
use crate::config::{
    ELASTIC_WITH_PASS, ExceedAction, Override, OverrideTarget, override_fits, parse_region,
};

/// One `[[rule.override]]` of the rule `ctx` describes: its target, then its counts.
pub(super) fn override_(
    index: usize,
    mut t: Table,
    ctx: &RuleCtx,
    targets: &mut HashMap<OverrideTarget, usize>,
    tot: &mut Totals,
    ck: &mut Checker,
) -> Option<Override> {
    t.pre = format!("{}override #{}: ", ctx.pre, index + 1);
    let target = target(&mut t, ctx, targets, tot, ck);

    let threshold = match t.get("threshold") {
        Some(f) => threshold(&f, ck).inspect(|&th| same_unit(&f, th, ctx, ck)),
        None => {
            t.missing(ck, "threshold", "");
            None
        }
    };
    let burst = t.get("burst").map(|f| burst(&f, ctx, ck));
    let ban_threshold = t.get("ban_threshold").map(|f| ban_threshold(&f, ctx, ck));
    let own_elastic = t.get("elastic").map(|f| {
        let e = elastic(&f, ck)?;
        if ctx.exceed == ExceedAction::Pass {
            f.error_at_key(ck, ELASTIC_WITH_PASS);
            return None;
        }
        Some((e, f))
    });
    let (t_at, t_pre) = (t.at(), t.pre.clone());
    t.finish(ck);
    let o = Override {
        target: target?,
        threshold: threshold?,
        burst: burst.map(|b| b.ok_or(())).transpose().ok()?,
        ban_threshold: ban_threshold.map(|b| b.ok_or(())).transpose().ok()?,
        elastic: match &own_elastic {
            None => None,
            Some(Some((e, _))) => Some(*e),
            Some(None) => return None,
        },
    };
    // The override's counts as `apply::plan` reads them (its rule's ban threshold where it
    // inherits it), under its own factor or the rule's, must stay meterable.
    if let Some(rule) = &ctx.counts
        && let Err(why) = rule.for_override(&o).check_elastic(ctx.exceed)
    {
        match &own_elastic {
            Some(Some((_, f))) => f.error_at_key(ck, why),
            _ => ck.error(t_at, format!("{t_pre}elastic (the rule's) {why}")),
        }
    }
    Some(o)
}

/// `cidr` or `region`: the override's target, checked against its rule's key, the rule's
/// other overrides (`targets`) and the capacities shared across rules.
fn target(
    t: &mut Table,
    ctx: &RuleCtx,
    targets: &mut HashMap<OverrideTarget, usize>,
    tot: &mut Totals,
    ck: &mut Checker,
) -> Option<OverrideTarget> {
    let cidr = t.get("cidr");
    let region = t.get("region");
    let (target, field) = match (cidr, region) {
        (Some(_), Some(r)) => {
            r.error_at_key(
                ck,
                "cannot be combined with cidr: an override is for a network or a region",
            );
            (None, None)
        }
        (None, None) => {
            t.error(ck, "needs cidr or region");
            (None, None)
        }
        (Some(c), None) => {
            if let Some(Err(e)) = ctx.key.map(|k| override_fits(k, false)) {
                c.error_at_key(ck, e);
            }
            (net(&c, ck).map(OverrideTarget::Cidr), Some(c))
        }
        (None, Some(r)) => {
            if let Some(Err(e)) = ctx.key.map(|k| override_fits(k, true)) {
                r.error_at_key(ck, e);
            }
            (region_code(&r, ck).map(OverrideTarget::Region), Some(r))
        }
    };
    if let (Some(target), Some(f)) = (target, &field) {
        if let Some(&first) = targets.get(&target) {
            let line = ck.line(first);
            let value = match target {
                OverrideTarget::Cidr(net) => net.to_string(),
                OverrideTarget::Region(code) => String::from_utf8_lossy(&code).into_owned(),
            };
            f.error(
                ck,
                format!("{value} already has an override in this rule (line {line})"),
            );
        } else {
            targets.insert(target, f.at());
        }
        let (count, cap, what) = match target {
            OverrideTarget::Cidr(_) => (&mut tot.cidr_overrides, caps::MAX_OVERRIDES, "cidr"),
            OverrideTarget::Region(_) => (
                &mut tot.region_overrides,
                caps::MAX_REGION_OVERRIDES,
                "region",
            ),
        };
        *count += 1;
        if *count == cap as usize + 1 {
            f.invalid(
                ck,
                format!("too many {what} overrides; at most {cap} fit across all rules"),
            );
        }
    }
    target
}

/// Two uppercase ASCII letters ([`parse_region`]).
fn region_code(f: &Field, ck: &mut Checker) -> Option<[u8; 2]> {
    let s = f.str(ck)?;
    parse_region(s).map_err(|e| f.invalid(ck, e)).ok()
}
