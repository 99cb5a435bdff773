//! What a rule and its overrides share: the totals across all rules, what an override's checks
//! know of its rule, and the counts both take (`threshold`, `burst`, `ban_threshold`,
//! `elastic`).

use std::collections::{HashMap, HashSet};

use ipnet::IpNet;

use super::{byte_size, duration, int_in};
use crate::config::tree::{Checker, Field, Node};
use crate::config::values::{check_amount, check_byte_burst, check_interval};
use crate::config::{Action, Algorithm, Counts, Elastic, ExceedAction, KeyKind, Threshold, Unit};

/// Counts across all rules, for the capacities the rules share.
#[derive(Default)]
pub(super) struct Totals {
    /// Rule name → position of the rule.
    pub(super) names: HashMap<String, usize>,
    pub(super) cidr_overrides: usize,
    pub(super) region_overrides: usize,
    /// Distinct source networks: the rule-source trie holds one entry per network.
    pub(super) src: HashSet<IpNet>,
    pub(super) src_reported: bool,
    /// Distinct destination networks (`RL_DESTS` holds one entry per network).
    pub(super) dst: HashSet<IpNet>,
    pub(super) dst_reported: bool,
    /// Distinct payload reads (from, offset, length) across all rules.
    pub(super) reads: Vec<(crate::config::PayloadFrom, u16, u8)>,
    pub(super) reads_reported: bool,
}

/// What an override's checks need to know about its rule. `None` where the rule's own value
/// was invalid, so that no follow-on error is reported.
pub(super) struct RuleCtx {
    pub(super) pre: String,
    pub(super) key: Option<KeyKind>,
    pub(super) action: Option<Action>,
    pub(super) algorithm: Option<Algorithm>,
    pub(super) unit: Option<Unit>,
    /// The rule's `exceed_action` and counts (with `elastic`), once read: what its overrides
    /// inherit.
    pub(super) exceed: ExceedAction,
    pub(super) counts: Option<Counts>,
}

/// `elastic` of a rule or an override: a number F, 1 < F <= 100 ([`Elastic::new`]).
pub(super) fn elastic(f: &Field, ck: &mut Checker) -> Option<Elastic> {
    let v = f.number(ck)?;
    Elastic::new(v).map_err(|e| f.error(ck, e)).ok()
}

/// `{ count = N, interval = D }` or `{ bytes = N, interval = D }`.
pub(super) fn threshold(f: &Field, ck: &mut Checker) -> Option<Threshold> {
    let mut t = f.table(ck)?;
    let count = t.get("count");
    let bytes = t.get("bytes");
    let interval = t.get("interval");
    let amount = match (&count, &bytes) {
        (Some(_), Some(b)) => {
            let msg = format!(
                "cannot be combined with {}.count: a threshold counts packets or bytes",
                f.name
            );
            b.error_at_key(ck, msg);
            None
        }
        (None, None) => {
            f.error(ck, "needs count (packets) or bytes");
            None
        }
        (Some(c), None) => int_in(c, ck, 1, i64::MAX).map(|n| (n as u64, Unit::Packets)),
        (None, Some(b)) => match byte_size(b, ck) {
            Some(0) => {
                b.error(ck, "must be at least 1");
                None
            }
            n => n.map(|n| (n, Unit::Bytes)),
        },
    };
    let interval = match &interval {
        None => {
            t.missing(ck, "interval", "");
            None
        }
        Some(i) => duration(i, ck).and_then(|d| match check_interval(d) {
            Ok(()) => Some(d),
            Err(e) => {
                i.error(ck, e);
                None
            }
        }),
    };
    t.finish(ck);
    let (amount, unit) = amount?;
    let interval = interval?;
    if let Err(e) = check_amount(amount, unit, interval) {
        let field = match unit {
            Unit::Packets => count.as_ref(),
            Unit::Bytes => bytes.as_ref(),
        };
        match field {
            Some(a) => a.invalid(ck, e),
            None => f.invalid(ck, e),
        }
        return None;
    }
    Some(Threshold {
        amount,
        unit,
        interval,
    })
}

/// `burst` of a rule or an override: in the threshold's unit, at least 1.
pub(super) fn burst(f: &Field, ctx: &RuleCtx, ck: &mut Checker) -> Option<u64> {
    if let Some(a) = ctx.algorithm.filter(|&a| a != Algorithm::TokenBucket) {
        f.error_at_key(
            ck,
            format!("only applies to algorithm = \"token_bucket\" (this rule uses \"{a}\")"),
        );
    }
    let n = match f.node() {
        Node::Str(_) if ctx.unit == Some(Unit::Packets) => {
            f.error(ck, "must be an integer: the threshold counts packets");
            None
        }
        Node::Str(_) => byte_size(f, ck),
        _ => f.int(ck).and_then(|n| u64::try_from(n).ok().or(Some(0))),
    }?;
    if n == 0 {
        f.error(ck, "must be at least 1");
        return None;
    }
    if ctx.unit == Some(Unit::Bytes)
        && let Err(e) = check_byte_burst(n)
    {
        f.invalid(ck, e);
        return None;
    }
    Some(n)
}

/// `ban_threshold` of a rule or an override.
pub(super) fn ban_threshold(f: &Field, ctx: &RuleCtx, ck: &mut Checker) -> Option<Threshold> {
    if ctx.action == Some(Action::Throttle) {
        f.error_at_key(ck, "only applies to action = \"rate_based_ban\"");
    }
    let th = threshold(f, ck)?;
    same_unit(f, th, ctx, ck);
    Some(th)
}

pub(super) fn same_unit(f: &Field, th: Threshold, ctx: &RuleCtx, ck: &mut Checker) {
    if let Some(unit) = ctx.unit.filter(|&u| u != th.unit) {
        f.error(
            ck,
            format!(
                "counts {} but the rule's threshold counts {unit}; both must count the same",
                th.unit
            ),
        );
    }
}
