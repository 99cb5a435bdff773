//! The schema: reads the position-keeping tree into a [`Config`], recording every problem.
//! Whatever fails is left at its default so checking can go on; the caller discards the
//! config when any error was recorded.

mod counts;
mod fleet;
mod host;
mod matching;
mod overrides;
mod rule;

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use ipnet::IpNet;

use super::tree::{Checker, Field, Item, Node, Table};
use super::{Config, parse_bytes, parse_duration, parse_net};
use counts::Totals;
use fleet::fleet;
use host::{daemon, geoip, lists, pressure, tracking};
use rule::rule;

pub(super) fn build(root: &Item, ck: &mut Checker) -> Config {
    let mut config = Config::default();
    let Some(mut top) = Table::root(root) else {
        ck.error(0, "the config must be a TOML table");
        return config;
    };
    if let Some(t) = top.get("daemon").and_then(|f| f.table(ck)) {
        config.daemon = daemon(t, ck);
    }
    if let Some(t) = top.get("tracking").and_then(|f| f.table(ck)) {
        config.tracking = tracking(t, ck);
    }
    if let Some(t) = top.get("lists").and_then(|f| f.table(ck)) {
        config.lists = lists(t, ck);
    }
    let geoip_field = top.get("geoip");
    if let Some(t) = geoip_field.as_ref().and_then(|f| f.table(ck)) {
        config.geoip = geoip(t, ck);
    }
    if let Some(t) = top.get("pressure").and_then(|f| f.table(ck)) {
        config.pressure = pressure(t, ck);
    }
    if let Some(t) = top.get("fleet").and_then(|f| f.table(ck)) {
        config.fleet = fleet(t, ck);
    }
    if let Some(tables) = top.get("rule").and_then(|f| f.tables(ck, "rule")) {
        let mut totals = Totals::default();
        for (index, t) in tables.into_iter().enumerate() {
            let rule = rule(
                index,
                t,
                geoip_field.is_some(),
                config.fleet.is_some(),
                &mut totals,
                ck,
            );
            config.rules.push(rule);
        }
    }
    top.finish(ck);
    config
}

/// A keyword (enum) value.
fn keyword<T: FromStr<Err = String>>(f: &Field, ck: &mut Checker) -> Option<T> {
    let s = f.str(ck)?;
    s.parse().map_err(|e| f.error(ck, e)).ok()
}

/// An integer in `lo..=hi`.
fn int_in(f: &Field, ck: &mut Checker, lo: i64, hi: i64) -> Option<i64> {
    let n = f.int(ck)?;
    if (lo..=hi).contains(&n) {
        return Some(n);
    }
    match (lo, hi) {
        (0, i64::MAX) => f.error(ck, "must not be negative"),
        (_, i64::MAX) => f.error(ck, format!("must be at least {lo}")),
        _ => f.error(ck, format!("must be between {lo} and {hi}")),
    }
    None
}

fn path(f: &Field, ck: &mut Checker) -> Option<PathBuf> {
    let s = f.str(ck)?;
    if s.is_empty() {
        f.error(ck, "must not be empty");
        return None;
    }
    Some(PathBuf::from(s))
}

fn duration(f: &Field, ck: &mut Checker) -> Option<Duration> {
    duration_by(f, ck, parse_duration)
}

/// A duration read by `parse`, a parser the command line uses too (`ban add --for` and
/// `ban_duration` both read [`parse_ban_duration`]), its error worded alike.
fn duration_by(
    f: &Field,
    ck: &mut Checker,
    parse: impl FnOnce(&str) -> Result<Duration, String>,
) -> Option<Duration> {
    match f.node() {
        Node::Str(s) => parse(s).map_err(|e| f.rejected(ck, &e)).ok(),
        _ => {
            f.expected(ck, "a duration string such as \"30s\"");
            None
        }
    }
}

/// A byte size: a non-negative integer or a string with a unit.
fn byte_size(f: &Field, ck: &mut Checker) -> Option<u64> {
    match f.node() {
        Node::Int(n) if *n >= 0 => Some(*n as u64),
        Node::Int(_) => {
            f.error(ck, "must not be negative");
            None
        }
        Node::Str(s) => parse_bytes(s).map_err(|e| f.invalid(ck, e)).ok(),
        _ => {
            f.expected(
                ck,
                "a byte size (an integer, or a string such as \"10MiB\")",
            );
            None
        }
    }
}

fn net(f: &Field, ck: &mut Checker) -> Option<IpNet> {
    let s = f.str(ck)?;
    parse_net(s).map_err(|e| f.rejected(ck, &e)).ok()
}
