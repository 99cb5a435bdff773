//! `[daemon]`, `[tracking]`, `[lists]`, `[geoip]` and `[pressure]`.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;

use ipnet::IpNet;
use ratelimit_common::caps;

use super::{duration, int_in, keyword, net, path};
use crate::config::tree::{Checker, Field, Node, Table};
use crate::config::{self, Daemon, EventsSink, GeoIp, Lists, Pressure, Tracking};

pub(super) fn daemon(mut t: Table, ck: &mut Checker) -> Daemon {
    let mut d = Daemon::default();
    if let Some(f) = t.get("interfaces") {
        d.interfaces = interfaces(&f, ck);
    }
    if let Some(mode) = t.get("xdp_mode").and_then(|f| keyword(&f, ck)) {
        d.xdp_mode = mode;
    }
    if let Some(p) = t.get("control_socket").and_then(|f| path(&f, ck)) {
        d.control_socket = p;
    }
    if let Some(f) = t.get("http_listen") {
        match f.str(ck).map(str::trim) {
            Some("" | "off") => d.http_listen = None,
            Some(s) => match s.parse::<SocketAddr>() {
                Ok(addr) => d.http_listen = Some(addr),
                Err(_) => f.invalid(
                    ck,
                    format!(
                        "{s:?} is not an address and port such as \"127.0.0.1:9477\" or \
                         \"[::1]:9477\"; \"off\" disables the listener"
                    ),
                ),
            },
            None => {}
        }
    }
    if let Some(p) = t.get("state_dir").and_then(|f| path(&f, ck)) {
        d.state_dir = p;
    }
    if let Some(f) = t.get("events") {
        match f.str(ck) {
            Some("") => f.error(
                ck,
                "must not be empty; \"-\" is stdout, and leaving it out disables events",
            ),
            Some("-") => d.events = Some(EventsSink::Stdout),
            Some(s) => d.events = Some(EventsSink::File(PathBuf::from(s))),
            None => {}
        }
    }
    if let Some(n) = t
        .get("events_per_sec")
        .and_then(|f| int_in(&f, ck, 1, config::EVENTS_PER_SEC_MAX.into()))
    {
        d.events_per_sec = n as u32;
    }
    if let Some(p) = t.get("bpffs_dir").and_then(|f| path(&f, ck)) {
        d.bpffs_dir = p;
    }
    t.finish(ck);
    d
}

fn interfaces(f: &Field, ck: &mut Checker) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for e in f.array(ck).unwrap_or_default() {
        let Some(name) = e.str(ck) else { continue };
        if name.is_empty() {
            e.invalid(ck, "an interface name must not be empty");
        } else if name.len() > config::MAX_IFACE_NAME_LEN {
            e.invalid(
                ck,
                format!(
                    "{name:?} is longer than {} bytes, the longest interface name Linux allows",
                    config::MAX_IFACE_NAME_LEN
                ),
            );
        } else if name == "."
            || name == ".."
            || name
                .chars()
                .any(|c| c == '/' || c == ':' || c.is_whitespace())
        {
            e.invalid(
                ck,
                format!("{name:?} is not a valid interface name (no '/', ':' or whitespace)"),
            );
        } else if names.iter().any(|n| n == name) {
            e.invalid(ck, format!("{name:?} is listed twice"));
        } else {
            names.push(name.to_owned());
        }
    }
    names
}

pub(super) fn tracking(mut t: Table, ck: &mut Checker) -> Tracking {
    let mut max_sources = caps::DEFAULT_MAX_SOURCES;
    if let Some(n) = t
        .get("max_sources")
        .and_then(|f| int_in(&f, ck, 1, u32::MAX.into()))
    {
        max_sources = n as u32;
    }
    let mut tr = Tracking::auto(max_sources);
    let rate_field = t.get("new_sources_per_sec");
    // `None`: absent or "auto"; `Some(None)`: invalid; `Some(Some(n))`: a number.
    let rate = rate_field.as_ref().and_then(|f| match f.node() {
        Node::Str(s) if s == "auto" => None,
        Node::Str(_) => {
            f.error(
                ck,
                "must be \"auto\" or a number of new sources per second (0 turns admission off)",
            );
            Some(None)
        }
        // At most one new source per ns: the budget is a token bucket metered in whole ns.
        _ => Some(int_in(f, ck, 0, 1_000_000_000)),
    });
    if let Some(Some(n)) = rate {
        tr.new_sources_per_sec = n as u64;
        tr.new_sources_auto = false;
    }
    tr.new_sources_burst = tr.new_sources_per_sec.max(1);
    if let Some(f) = t.get("new_sources_burst") {
        if let Some(n) = int_in(&f, ck, 1, i64::MAX) {
            tr.new_sources_burst = n as u64;
        }
        // Only when the budget is known to be off (a valid 0).
        if matches!(rate, Some(Some(0))) {
            f.error_at_key(
                ck,
                "only applies when tracking.new_sources_per_sec is not 0 (0 turns admission off)",
            );
        }
    }
    if let Some(b) = t.get("syn_cookies").and_then(|f| f.bool(ck)) {
        tr.syn_cookies = b;
    }
    t.finish(ck);
    tr
}

/// A list of networks: deduplicated, capped at `cap` distinct entries; with positions.
fn net_list(f: &Field, cap: u32, ck: &mut Checker) -> Vec<(IpNet, usize)> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    let mut reported = false;
    for e in f.array(ck).unwrap_or_default() {
        let Some(net) = net(&e, ck) else { continue };
        if !seen.insert(net) {
            continue;
        }
        if seen.len() > cap as usize {
            if !reported {
                e.invalid(ck, format!("too many entries; at most {cap} fit"));
                reported = true;
            }
            continue;
        }
        out.push((net, e.at()));
    }
    out
}

pub(super) fn lists(mut t: Table, ck: &mut Checker) -> Lists {
    let cap = caps::MAX_LIST_ENTRIES;
    let allow = t
        .get("allow")
        .map(|f| net_list(&f, cap, ck))
        .unwrap_or_default();
    let deny = t
        .get("deny")
        .map(|f| net_list(&f, cap, ck))
        .unwrap_or_default();
    t.finish(ck);
    let allowed: HashMap<IpNet, usize> = allow.iter().copied().collect();
    for (net, at) in &deny {
        if let Some(&allow_at) = allowed.get(net) {
            let line = ck.line(allow_at);
            ck.error(
                *at,
                format!(
                    "lists.deny: {net} is also in lists.allow (line {line}); \
                     an address cannot be both allowed and denied"
                ),
            );
        }
    }
    Lists {
        allow: allow.into_iter().map(|(n, _)| n).collect(),
        deny: deny.into_iter().map(|(n, _)| n).collect(),
    }
}

pub(super) fn geoip(mut t: Table, ck: &mut Checker) -> Option<GeoIp> {
    let database = match t.get("database") {
        Some(f) => path(&f, ck),
        None => {
            t.missing(ck, "database", "");
            None
        }
    };
    t.finish(ck);
    database.map(|database| GeoIp { database })
}

pub(super) fn pressure(mut t: Table, ck: &mut Checker) -> Pressure {
    let mut p = Pressure::default();
    if let Some(f) = t.get("cpu_busy") {
        match f.number(ck) {
            Some(v) if v > 0.0 && v <= 1.0 => p.cpu_busy = v,
            Some(_) => f.error(ck, "must be greater than 0 and at most 1"),
            None => {}
        }
    }
    if let Some(f) = t.get("listen_overflows_per_sec") {
        match f.number(ck) {
            Some(v) if v >= 0.0 && v.is_finite() => p.listen_overflows_per_sec = v,
            Some(_) => f.error(ck, "must not be negative"),
            None => {}
        }
    }
    if let Some(f) = t.get("hold")
        && let Some(d) = duration(&f, ck)
    {
        if d > config::MAX_PRESSURE_HOLD {
            f.error(
                ck,
                format!(
                    "must be at most {}",
                    config::format_duration(config::MAX_PRESSURE_HOLD)
                ),
            );
        } else {
            p.hold = d;
        }
    }
    if let Some(f) = t.get("cpus") {
        let mut cpus: Vec<u32> = Vec::new();
        for e in f.array(ck).unwrap_or_default() {
            let Some(n) = int_in(&e, ck, 0, config::MAX_CPU.into()) else {
                continue;
            };
            if cpus.contains(&(n as u32)) {
                e.invalid(ck, format!("CPU {n} is listed twice"));
            } else {
                cpus.push(n as u32);
            }
        }
        cpus.sort_unstable();
        p.cpus = cpus;
    }
    t.finish(ck);
    p
}
