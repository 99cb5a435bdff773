//! `[[rule]]`: its name, what it matches, its key, its limits, how it acts on what exceeds
//! them, and its overrides.

use std::collections::HashMap;
use std::time::Duration;

use ratelimit_common::caps;

use super::counts::{RuleCtx, Totals, ban_threshold, burst, elastic, threshold};
use super::matching::{except, matcher};
use super::overrides::override_;
use super::{duration_by, int_in, keyword};
use crate::config::tree::{Checker, Field, Node, Table};
use crate::config::{
    Action, Algorithm, Counts, Elastic, ExceedAction, KeyField, KeyFields, KeyKind, Match,
    Override, Rule, Scope, Threshold, Unit, parse_ban_duration,
};

/// One `[[rule]]`, in steps: its name, what it matches, its key, its limits, how it acts on
/// what exceeds them, its overrides, and what a global scope asks of them.
pub(super) fn rule(
    index: usize,
    mut t: Table,
    has_geoip: bool,
    has_fleet: bool,
    tot: &mut Totals,
    ck: &mut Checker,
) -> Rule {
    t.pre = format!("rule #{}: ", index + 1);
    let name = name(&mut t, tot, ck);
    if index == caps::MAX_RULES as usize {
        let msg = format!("too many rules; at most {} fit", caps::MAX_RULES);
        t.error(ck, msg);
    }

    let mut matcher = match t.get("match").and_then(|f| f.table(ck)) {
        Some(mt) => matcher(mt, tot, ck),
        None => Match::default(),
    };
    if let Some(f) = t.get("except") {
        matcher.except = except(&f, tot, ck);
    }

    let (key, ipv4_prefix, ipv6_prefix) = key(&mut t, has_geoip, ck);
    let (mut ctx, limits) = limits(&mut t, key, ck);
    let (action, algorithm) = (ctx.action, ctx.algorithm);
    let Limits {
        threshold,
        burst,
        ban_threshold,
        ban_duration,
    } = limits;

    let exceed_action = t
        .get("exceed_action")
        .and_then(|f| keyword(&f, ck))
        .unwrap_or(ExceedAction::Drop);
    let preview = t.get("preview").and_then(|f| f.bool(ck)).unwrap_or(false);
    let (scope, scope_at) = scope(&mut t, has_fleet, key, algorithm, ck);
    let soft_limit = soft_limit(&mut t, ck);
    let elastic = counts_and_elastic(&mut t, &limits, exceed_action, &mut ctx, ck);

    let overrides = overrides(&mut t, &ctx, tot, ck);
    let pre = t.pre.clone();
    t.finish(ck);
    if let (Some(at), Some(th)) = (scope_at, threshold) {
        global_overrides(at, th, ban_threshold, algorithm, &overrides, &pre, ck);
    }

    // Placeholder where the threshold is missing or bad: an error is recorded, so this rule is
    // never used.
    let threshold = threshold.unwrap_or(Threshold {
        amount: 1,
        unit: Unit::Packets,
        interval: Duration::from_secs(1),
    });
    Rule {
        name,
        matcher,
        key: key.unwrap_or(KeyKind::Ip),
        ipv4_prefix,
        ipv6_prefix,
        action: action.unwrap_or(Action::Throttle),
        threshold,
        algorithm: algorithm.unwrap_or(Algorithm::SlidingWindow),
        burst: burst.unwrap_or(threshold.amount),
        ban_threshold: ban_threshold.unwrap_or(threshold),
        ban_duration,
        exceed_action,
        preview,
        soft_limit,
        elastic,
        scope,
        overrides,
    }
}

/// `name`: not empty, no control characters, unique among the rules. Once read, the rule's
/// errors are prefixed with it.
fn name(t: &mut Table, tot: &mut Totals, ck: &mut Checker) -> String {
    let mut name = String::new();
    match t.get("name") {
        None => t.missing(ck, "name", ""),
        Some(f) => {
            if let Some(s) = f.str(ck) {
                if s.trim().is_empty() {
                    f.error(ck, "must not be empty");
                } else if s.chars().any(char::is_control) {
                    f.error(ck, "must not contain control characters");
                } else {
                    name = s.to_owned();
                    t.pre = format!("rule {s:?}: ");
                    if let Some(&first) = tot.names.get(s) {
                        let line = ck.line(first);
                        ck.error(
                            f.at(),
                            format!(
                                "rule {s:?}: duplicate rule name; the rule at line {line} \
                                 has the same name"
                            ),
                        );
                    } else {
                        tot.names.insert(s.to_owned(), t.at());
                    }
                }
            }
        }
    }
    name
}

/// `key` (`"region"` needs a `[geoip]` database), then `ipv4_prefix` and `ipv6_prefix` (only
/// with a key of the source: `"ip"`, or a list with `"ip"`).
fn key(t: &mut Table, has_geoip: bool, ck: &mut Checker) -> (Option<KeyKind>, u8, u8) {
    let key_field = t.get("key");
    let key = match &key_field {
        Some(f) if matches!(f.node(), Node::Array(_)) => key_fields(f, ck),
        Some(f) => keyword(f, ck),
        None => Some(KeyKind::Ip),
    };
    if let (Some(KeyKind::Region), Some(f), false) = (key, &key_field, has_geoip) {
        f.error_at_key(ck, "= \"region\" needs a [geoip] database");
    }
    let mut prefix = |name: &'static str, max: u8, default: u8, ck: &mut Checker| {
        let Some(f) = t.get(name) else {
            return default;
        };
        if let Some(k) = key.filter(|&k| !k.has_source()) {
            f.error_at_key(
                ck,
                format!(
                    "only applies to a key with \"ip\" (this rule has key = {})",
                    k.toml()
                ),
            );
        }
        int_in(&f, ck, 1, max.into()).map_or(default, |n| n as u8)
    };
    let ipv4_prefix = prefix("ipv4_prefix", 32, 32, ck);
    let ipv6_prefix = prefix("ipv6_prefix", 128, 64, ck);
    (key, ipv4_prefix, ipv6_prefix)
}

/// `key = [..]`: one to three distinct fields of the packet. `["ip"]` is `"ip"`.
fn key_fields(f: &Field, ck: &mut Checker) -> Option<KeyKind> {
    let items = f.array(ck)?;
    if items.is_empty() || items.len() > 3 {
        f.error(
            ck,
            "must list one to three of \"ip\", \"dst\", \"dst_port\", \"src_port\", \"protocol\"",
        );
        return None;
    }
    let mut bits = 0u8;
    let mut ok = true;
    for e in &items {
        let Some(field) = keyword::<KeyField>(e, ck) else {
            ok = false;
            continue;
        };
        let bit = KeyFields::bit(field);
        if bits & bit != 0 {
            e.error(ck, format!("\"{field}\" is listed twice"));
            ok = false;
        }
        bits |= bit;
    }
    if !ok {
        return None;
    }
    if bits == KeyFields::bit(KeyField::Ip) {
        return Some(KeyKind::Ip);
    }
    Some(KeyKind::Fields(KeyFields(bits)))
}

/// A rule's limits as read; `None` where absent or invalid.
#[derive(Clone, Copy)]
struct Limits {
    threshold: Option<Threshold>,
    burst: Option<u64>,
    ban_threshold: Option<Threshold>,
    ban_duration: Duration,
}

/// `action`, `threshold`, `algorithm`, `burst`, `ban_threshold` and `ban_duration`, and what
/// the checks of the rule's overrides need to know of them.
fn limits(t: &mut Table, key: Option<KeyKind>, ck: &mut Checker) -> (RuleCtx, Limits) {
    let action_field = t.get("action");
    let action = match &action_field {
        Some(f) => keyword(f, ck),
        None => Some(Action::Throttle),
    };

    let threshold = match t.get("threshold") {
        Some(f) => threshold(&f, ck),
        None => {
            t.missing(ck, "threshold", "");
            None
        }
    };
    let unit = threshold.map(|th| th.unit);

    let algorithm = match t.get("algorithm") {
        Some(f) => keyword(&f, ck),
        None => Some(Algorithm::SlidingWindow),
    };

    let ctx = RuleCtx {
        pre: t.pre.clone(),
        key,
        action,
        algorithm,
        unit,
        exceed: ExceedAction::Drop,
        counts: None,
    };

    let burst = t.get("burst").and_then(|f| burst(&f, &ctx, ck));
    let ban_threshold = t
        .get("ban_threshold")
        .and_then(|f| ban_threshold(&f, &ctx, ck));

    let mut ban_duration = Duration::ZERO;
    match (action, t.get("ban_duration")) {
        (Some(Action::RateBasedBan), None) => {
            let at = action_field.as_ref().map_or(t.at(), |f| f.key_at());
            ck.error(
                at,
                format!(
                    "{}ban_duration is required with action = \"rate_based_ban\"",
                    t.pre
                ),
            );
        }
        (action, Some(f)) => {
            if action == Some(Action::Throttle) {
                f.error_at_key(ck, "only applies to action = \"rate_based_ban\"");
            }
            if let Some(d) = duration_by(&f, ck, parse_ban_duration) {
                ban_duration = d;
            }
        }
        _ => {}
    }
    let limits = Limits {
        threshold,
        burst,
        ban_threshold,
        ban_duration,
    };
    (ctx, limits)
}

/// `scope`, and where it says `"global"`.
fn scope(
    t: &mut Table,
    has_fleet: bool,
    key: Option<KeyKind>,
    algorithm: Option<Algorithm>,
    ck: &mut Checker,
) -> (Scope, Option<usize>) {
    let mut scope = Scope::Local;
    let mut scope_at = None;
    if let Some(f) = t.get("scope")
        && let Some(s) = f.str(ck)
    {
        match s {
            "local" => {}
            "global" if !has_fleet => f.invalid(
                ck,
                "\"global\" needs a [fleet] section (the store the hosts count in)",
            ),
            "global" if matches!(key, Some(KeyKind::Fields(_))) => f.invalid(
                ck,
                format!(
                    "\"global\" needs key = \"ip\", \"all\" or \"region\" (this rule has key = {}: \
                     its states are counted by each host alone)",
                    key.map(KeyKind::toml).unwrap_or_default()
                ),
            ),
            "global"
                if key.is_some_and(|k| k != KeyKind::Ip)
                    && algorithm == Some(Algorithm::TokenBucket) =>
            {
                f.invalid(
                    ck,
                    "\"global\" with key = \"all\" or \"region\" needs a window algorithm \
                     (\"sliding_window\" or \"fixed_window\"; a token bucket is global with \
                     key = \"ip\")",
                )
            }
            "global" => {
                scope = Scope::Global;
                scope_at = Some(f.at());
            }
            "split" => f.invalid(
                ck,
                "\"split\" is not yet supported (use \"global\", or a threshold per host)",
            ),
            other => f.invalid(
                ck,
                format!("{other:?} is not a scope (expected \"local\" or \"global\")"),
            ),
        }
    }
    (scope, scope_at)
}

/// `soft_limit`: in (0, 1], 0.8 when absent.
fn soft_limit(t: &mut Table, ck: &mut Checker) -> f64 {
    let mut soft_limit = 0.8;
    if let Some(f) = t.get("soft_limit") {
        match f.number(ck) {
            Some(v) if v > 0.0 && v <= 1.0 => soft_limit = v,
            Some(_) => f.error(ck, "must be greater than 0 and at most 1"),
            None => {}
        }
    }
    soft_limit
}

/// `elastic`, checked against the rule's counts; the rule's `exceed_action` and counts (with
/// the factor) are recorded in `ctx`, for its overrides.
fn counts_and_elastic(
    t: &mut Table,
    limits: &Limits,
    exceed_action: ExceedAction,
    ctx: &mut RuleCtx,
    ck: &mut Checker,
) -> Option<Elastic> {
    let Limits {
        threshold,
        burst,
        ban_threshold,
        ban_duration,
    } = *limits;
    // The rule's counts as `apply::plan` reads them, for its factor and its overrides'.
    let is_ban = ctx.action == Some(Action::RateBasedBan);
    let counts = threshold.map(|th| Counts {
        threshold: th,
        burst: burst.unwrap_or(th.amount),
        ban: is_ban.then_some(ban_threshold.unwrap_or(th)),
        ban_duration: is_ban.then_some(ban_duration),
        elastic: None,
    });
    let elastic = t.get("elastic").and_then(|f| {
        let e = elastic(&f, ck)?;
        if let Some(c) = counts
            && let Err(why) = (Counts {
                elastic: Some(e),
                ..c
            })
            .check_elastic(exceed_action)
        {
            f.error_at_key(ck, why);
            return None;
        }
        Some(e)
    });
    ctx.exceed = exceed_action;
    ctx.counts = counts.map(|c| Counts { elastic, ..c });
    elastic
}

/// The rule's `[[rule.override]]` tables, in file order, each checked against the rule.
fn overrides(t: &mut Table, ctx: &RuleCtx, tot: &mut Totals, ck: &mut Checker) -> Vec<Override> {
    let mut overrides = Vec::new();
    if let Some(tables) = t
        .get("override")
        .and_then(|f| f.tables(ck, "rule.override"))
    {
        let mut targets = HashMap::new();
        for (j, ot) in tables.into_iter().enumerate() {
            if let Some(o) = override_(j, ot, ctx, &mut targets, tot, ck) {
                overrides.push(o);
            }
        }
    }
    overrides
}

/// A global rule's clients are counted by the fleet in the rule's windows: an override may
/// change a client's counts, not the windows they are counted in. `at` is the rule's `scope`.
fn global_overrides(
    at: usize,
    th: Threshold,
    ban_threshold: Option<Threshold>,
    algorithm: Option<Algorithm>,
    overrides: &[Override],
    pre: &str,
    ck: &mut Checker,
) {
    let ban_interval = ban_threshold.map(|b| b.interval);
    if overrides.iter().any(|o: &Override| {
        o.threshold.interval != th.interval
            || o.ban_threshold
                .is_some_and(|b| Some(b.interval) != ban_interval.or(Some(th.interval)))
    }) {
        ck.error(
            at,
            format!(
                "{pre}scope: \"global\" needs every override to keep the rule's intervals \
                 (the fleet counts the rule's clients in the rule's windows)"
            ),
        );
    } else if algorithm == Some(Algorithm::TokenBucket)
        && overrides
            .iter()
            .any(|o: &Override| o.threshold.amount != th.amount)
    {
        ck.error(
            at,
            format!(
                "{pre}scope: \"global\" with algorithm = \"token_bucket\" needs every \
                 override to keep the rule's threshold (the fleet takes the other hosts' \
                 admissions out of each bucket at the rule's rate)"
            ),
        );
    }
}
