//! The schema: reads the position-keeping tree into a [`Config`], recording every problem.
//! Whatever fails is left at its default so checking can go on; the caller discards the
//! config when any error was recorded.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use ipnet::IpNet;
use ratelimit_common::caps;

use super::tree::{Checker, Field, Item, Node, Table};
use super::values::{check_amount, check_byte_burst, check_interval, check_port};
use super::{
    Action, Algorithm, Config, Counts, Daemon, ELASTIC_WITH_PASS, Elastic, EventsSink,
    ExceedAction, Fleet, GeoIp, KeyKind, Lists, Match, Override, OverrideTarget, Pressure,
    Protocol, Rule, Scope, Threshold, Tracking, Unit, override_fits, parse_ban_duration,
    parse_bytes, parse_duration, parse_net, parse_port_range, parse_region, parse_tcp_flags,
};

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

fn daemon(mut t: Table, ck: &mut Checker) -> Daemon {
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
        .and_then(|f| int_in(&f, ck, 1, super::EVENTS_PER_SEC_MAX.into()))
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
        } else if name.len() > super::MAX_IFACE_NAME_LEN {
            e.invalid(
                ck,
                format!(
                    "{name:?} is longer than {} bytes, the longest interface name Linux allows",
                    super::MAX_IFACE_NAME_LEN
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

fn tracking(mut t: Table, ck: &mut Checker) -> Tracking {
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

fn lists(mut t: Table, ck: &mut Checker) -> Lists {
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

fn geoip(mut t: Table, ck: &mut Checker) -> Option<GeoIp> {
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

fn pressure(mut t: Table, ck: &mut Checker) -> Pressure {
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
        if d > super::MAX_PRESSURE_HOLD {
            f.error(
                ck,
                format!(
                    "must be at most {}",
                    super::format_duration(super::MAX_PRESSURE_HOLD)
                ),
            );
        } else {
            p.hold = d;
        }
    }
    if let Some(f) = t.get("cpus") {
        let mut cpus: Vec<u32> = Vec::new();
        for e in f.array(ck).unwrap_or_default() {
            let Some(n) = int_in(&e, ck, 0, super::MAX_CPU.into()) else {
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

fn fleet(mut t: Table, ck: &mut Checker) -> Option<Fleet> {
    let redis = match t.get("redis") {
        Some(f) => f.str(ck).and_then(|s| {
            super::check_redis_url(s)
                .map_err(|e| f.invalid(ck, e))
                .ok()
                .map(|()| s.to_owned())
        }),
        None => {
            t.missing(
                ck,
                "redis",
                " (the store's address, e.g. \"redis://10.1.0.5:6379\")",
            );
            None
        }
    };
    let host_id = t.get("host_id").and_then(|f| {
        let s = f.str(ck)?;
        super::check_host_id(s)
            .map_err(|e| f.invalid(ck, e))
            .ok()
            .map(|()| s.to_owned())
    });
    let password_file = t.get("password_file").and_then(|f| path(&f, ck));
    let sentinel = redis.as_deref().map(super::is_sentinel_url);
    let sentinel_password_file = t.get("sentinel_password_file").and_then(|f| {
        let p = path(&f, ck)?;
        if sentinel == Some(false) {
            f.error(
                ck,
                "needs a Redis Sentinel address (fleet.redis = \"redis+sentinel://...\" or \
                 \"rediss+sentinel://...\")",
            );
            return None;
        }
        Some(p)
    });
    // TLS material: only with a TLS address; a client certificate goes with its key.
    let tls = redis.as_deref().map(super::is_tls_url);
    let mut tls_path = |key: &'static str| {
        let f = t.get(key)?;
        let p = path(&f, ck)?;
        if tls == Some(false) {
            f.error(
                ck,
                "needs a TLS store address (fleet.redis = \"rediss://HOST:PORT\", \
                 \"rediss+cluster://...\" or \"rediss+sentinel://...\")",
            );
            return None;
        }
        Some((p, f))
    };
    let tls_ca_file = tls_path("tls_ca_file").map(|(p, _)| p);
    let cert = tls_path("tls_cert_file");
    let key = tls_path("tls_key_file");
    let (tls_cert_file, tls_key_file) = match (cert, key) {
        (Some((c, _)), Some((k, _))) => (Some(c), Some(k)),
        (Some((_, f)), None) if tls != Some(false) => {
            f.error(
                ck,
                "needs fleet.tls_key_file (the certificate's private key)",
            );
            (None, None)
        }
        (None, Some((_, f))) if tls != Some(false) => {
            f.error(ck, "needs fleet.tls_cert_file (the key's certificate)");
            (None, None)
        }
        _ => (None, None),
    };
    let mut sync_interval = super::DEFAULT_SYNC_INTERVAL;
    if let Some(f) = t.get("sync_interval")
        && let Some(d) = duration(&f, ck)
    {
        if d < Duration::from_millis(10) || d > Duration::from_secs(60) {
            f.error(ck, "must be between 10ms and 1m");
        } else {
            sync_interval = d;
        }
    }
    let share_bans = t.get("share_bans").and_then(|f| f.bool(ck)).unwrap_or(true);
    let mut max_clock_skew = super::DEFAULT_MAX_CLOCK_SKEW;
    if let Some(f) = t.get("max_clock_skew")
        && let Some(d) = duration(&f, ck)
    {
        if d < super::MIN_MAX_CLOCK_SKEW || d > super::MAX_MAX_CLOCK_SKEW {
            f.error(
                ck,
                format!(
                    "must be between {} and {}",
                    super::format_duration(super::MIN_MAX_CLOCK_SKEW),
                    super::format_duration(super::MAX_MAX_CLOCK_SKEW)
                ),
            );
        } else {
            max_clock_skew = d;
        }
    }
    let name = match t.get("name") {
        Some(f) => f
            .str(ck)
            .and_then(|s| {
                super::check_fleet_name(s)
                    .map_err(|e| f.invalid(ck, e))
                    .ok()
                    .map(|()| s.to_owned())
            })
            .unwrap_or_else(|| super::FLEET_DEFAULT_NAME.to_string()),
        None => super::FLEET_DEFAULT_NAME.to_string(),
    };
    let key_file = t.get("key_file").and_then(|f| path(&f, ck));
    let remote_ban_min_prefix_v4 = t
        .get("remote_ban_min_prefix_v4")
        .and_then(|f| int_in(&f, ck, 0, 32))
        .map_or(super::DEFAULT_REMOTE_BAN_MIN_PREFIX_V4, |n| n as u8);
    let remote_ban_min_prefix_v6 = t
        .get("remote_ban_min_prefix_v6")
        .and_then(|f| int_in(&f, ck, 0, 128))
        .map_or(super::DEFAULT_REMOTE_BAN_MIN_PREFIX_V6, |n| n as u8);
    let mut remote_ban_max_duration = super::DEFAULT_REMOTE_BAN_MAX_DURATION;
    if let Some(f) = t.get("remote_ban_max_duration")
        && let Some(d) = duration(&f, ck)
    {
        if d < Duration::from_secs(1) || d > super::MAX_REMOTE_BAN_MAX_DURATION {
            f.error(
                ck,
                format!(
                    "must be between 1s and {}",
                    super::format_duration(super::MAX_REMOTE_BAN_MAX_DURATION)
                ),
            );
        } else {
            remote_ban_max_duration = d;
        }
    }
    t.finish(ck);
    Some(Fleet {
        redis: redis?,
        host_id,
        password_file,
        sentinel_password_file,
        tls_ca_file,
        tls_cert_file,
        tls_key_file,
        sync_interval,
        share_bans,
        max_clock_skew,
        name,
        key_file,
        remote_ban_min_prefix_v4,
        remote_ban_min_prefix_v6,
        remote_ban_max_duration,
    })
}

/// Counts across all rules, for the capacities the rules share.
#[derive(Default)]
struct Totals {
    /// Rule name → position of the rule.
    names: HashMap<String, usize>,
    cidr_overrides: usize,
    region_overrides: usize,
    /// Distinct source networks: the rule-source trie holds one entry per network.
    src: HashSet<IpNet>,
    src_reported: bool,
}

/// What an override's checks need to know about its rule. `None` where the rule's own value
/// was invalid, so that no follow-on error is reported.
struct RuleCtx {
    pre: String,
    key: Option<KeyKind>,
    action: Option<Action>,
    algorithm: Option<Algorithm>,
    unit: Option<Unit>,
    /// The rule's `exceed_action` and counts (with `elastic`), once read: what its overrides
    /// inherit.
    exceed: ExceedAction,
    counts: Option<Counts>,
}

fn rule(
    index: usize,
    mut t: Table,
    has_geoip: bool,
    has_fleet: bool,
    tot: &mut Totals,
    ck: &mut Checker,
) -> Rule {
    t.pre = format!("rule #{}: ", index + 1);
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
    if index == caps::MAX_RULES as usize {
        let msg = format!("too many rules; at most {} fit", caps::MAX_RULES);
        t.error(ck, msg);
    }

    let matcher = match t.get("match").and_then(|f| f.table(ck)) {
        Some(mt) => matcher(mt, tot, ck),
        None => Match::default(),
    };

    let key_field = t.get("key");
    let key = match &key_field {
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
        if let Some(k) = key.filter(|&k| k != KeyKind::Ip) {
            f.error_at_key(
                ck,
                format!("only applies to key = \"ip\" (this rule has key = \"{k}\")"),
            );
        }
        int_in(&f, ck, 1, max.into()).map_or(default, |n| n as u8)
    };
    let ipv4_prefix = prefix("ipv4_prefix", 32, 32, ck);
    let ipv6_prefix = prefix("ipv6_prefix", 128, 64, ck);

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

    let mut ctx = RuleCtx {
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

    let exceed_action = t
        .get("exceed_action")
        .and_then(|f| keyword(&f, ck))
        .unwrap_or(ExceedAction::Drop);
    let preview = t.get("preview").and_then(|f| f.bool(ck)).unwrap_or(false);
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
    let mut soft_limit = 0.8;
    if let Some(f) = t.get("soft_limit") {
        match f.number(ck) {
            Some(v) if v > 0.0 && v <= 1.0 => soft_limit = v,
            Some(_) => f.error(ck, "must be greater than 0 and at most 1"),
            None => {}
        }
    }
    // The rule's counts as `apply::plan` reads them, for its factor and its overrides'.
    let is_ban = action == Some(Action::RateBasedBan);
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

    let mut overrides = Vec::new();
    if let Some(tables) = t
        .get("override")
        .and_then(|f| f.tables(ck, "rule.override"))
    {
        let mut targets = HashMap::new();
        for (j, ot) in tables.into_iter().enumerate() {
            if let Some(o) = override_(j, ot, &ctx, &mut targets, tot, ck) {
                overrides.push(o);
            }
        }
    }
    let pre = t.pre.clone();
    t.finish(ck);
    // A global rule's clients are counted by the fleet in the rule's windows: an override may
    // change a client's counts, not the windows they are counted in.
    if let (Some(at), Some(th)) = (scope_at, threshold) {
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

/// `elastic` of a rule or an override: a number F, 1 < F <= 100 ([`Elastic::new`]).
fn elastic(f: &Field, ck: &mut Checker) -> Option<Elastic> {
    let v = f.number(ck)?;
    Elastic::new(v).map_err(|e| f.error(ck, e)).ok()
}

fn matcher(mut t: Table, tot: &mut Totals, ck: &mut Checker) -> Match {
    let mut m = Match::default();
    // Err: the protocol was given but is invalid; no follow-on errors then.
    let protocol = match t.get("protocol") {
        None => Ok(None),
        Some(f) => keyword::<Protocol>(&f, ck).map(Some).ok_or(()),
    };
    m.protocol = protocol.unwrap_or(None);

    if let Some(f) = t.get("tcp_flags") {
        if matches!(protocol, Ok(p) if p != Some(Protocol::Tcp)) {
            f.error_at_key(ck, "needs match.protocol = \"tcp\"");
        }
        if let Some(s) = f.str(ck) {
            m.tcp_flags = parse_tcp_flags(s).map_err(|e| f.invalid(ck, e)).ok();
        }
    }

    if let Some(f) = t.get("dst_ports") {
        if matches!(protocol, Ok(p) if !p.is_some_and(Protocol::has_ports)) {
            f.error_at_key(ck, "needs match.protocol = \"tcp\" or \"udp\"");
        }
        if let Some(items) = f.array(ck) {
            if items.is_empty() {
                f.error(ck, "must not be empty; leave it out to match any port");
            }
            for (i, e) in items.iter().enumerate() {
                let range = match e.node() {
                    Node::Int(n) => check_port(*n).map(|p| (p, p)),
                    Node::Str(s) => parse_port_range(s),
                    _ => {
                        e.expected(ck, "a port number or a string such as \"8000-8100\"");
                        continue;
                    }
                };
                match range {
                    Err(msg) => e.invalid(ck, msg),
                    Ok(_) if i == caps::MAX_PORT_RANGES => e.invalid(
                        ck,
                        format!(
                            "too many port ranges; at most {} fit",
                            caps::MAX_PORT_RANGES
                        ),
                    ),
                    Ok(r) if i < caps::MAX_PORT_RANGES => m.dst_ports.push(r),
                    Ok(_) => {}
                }
            }
        }
    }

    if let Some(f) = t.get("src")
        && let Some(items) = f.array(ck)
    {
        if items.is_empty() {
            f.error(ck, "must not be empty; leave it out to match any source");
        }
        for e in &items {
            let Some(net) = net(e, ck) else { continue };
            if m.src.contains(&net) {
                continue;
            }
            m.src.push(net);
            tot.src.insert(net);
            if tot.src.len() > caps::MAX_RULE_SRC_ENTRIES as usize && !tot.src_reported {
                tot.src_reported = true;
                e.invalid(
                    ck,
                    format!(
                        "too many source networks; at most {} fit across all rules",
                        caps::MAX_RULE_SRC_ENTRIES
                    ),
                );
            }
        }
    }
    t.finish(ck);
    m
}

/// `{ count = N, interval = D }` or `{ bytes = N, interval = D }`.
fn threshold(f: &Field, ck: &mut Checker) -> Option<Threshold> {
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
fn burst(f: &Field, ctx: &RuleCtx, ck: &mut Checker) -> Option<u64> {
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
fn ban_threshold(f: &Field, ctx: &RuleCtx, ck: &mut Checker) -> Option<Threshold> {
    if ctx.action == Some(Action::Throttle) {
        f.error_at_key(ck, "only applies to action = \"rate_based_ban\"");
    }
    let th = threshold(f, ck)?;
    same_unit(f, th, ctx, ck);
    Some(th)
}

fn same_unit(f: &Field, th: Threshold, ctx: &RuleCtx, ck: &mut Checker) {
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

fn override_(
    index: usize,
    mut t: Table,
    ctx: &RuleCtx,
    targets: &mut HashMap<OverrideTarget, usize>,
    tot: &mut Totals,
    ck: &mut Checker,
) -> Option<Override> {
    t.pre = format!("{}override #{}: ", ctx.pre, index + 1);
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

/// Two uppercase ASCII letters ([`parse_region`]).
fn region_code(f: &Field, ck: &mut Checker) -> Option<[u8; 2]> {
    let s = f.str(ck)?;
    parse_region(s).map_err(|e| f.invalid(ck, e)).ok()
}
